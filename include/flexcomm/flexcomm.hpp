// flexcomm: communication patterns for training ensembles of deep neural networks.
// Include this one header; CUDA parts join in when the build has CUDA (FLEXCOMM_HAVE_CUDA).
#pragma once

// The pkg-config file carries no -std flag (it would lower a consumer's -std=c++20): say it here.
#if __cplusplus < 201703L
#error "flexcomm needs C++17 or later (-std=c++17; g++ 11 and later default to it)"
#endif

#include "core/batching.hpp"
#include "core/datatype.hpp"
#include "core/error.hpp"
#include "core/gaps.hpp"
#include "core/hosts.hpp"
#include "core/layout.hpp"
#include "core/member_plan.hpp"
#include "core/progress.hpp"
#include "core/reduce.hpp"
#include "core/span.hpp"
#include "core/trace.hpp"
#include "core/wait.hpp"
#include "core/watchdog.hpp"

#include "backend/mpi.hpp"
#include "backend/mpi/environment.hpp"
#include "backend/mpi/trace.hpp"

#include "patterns/feed/vocabulary.hpp"
#include "patterns/feed/local_feed.hpp"
#include "patterns/feed/one_to_many.hpp"
#include "patterns/feed/adaptive.hpp"
#include "patterns/feed/all_shared.hpp"
#include "patterns/feed/dataset.hpp"
#include "patterns/feed/typed_feed.hpp"
#include "patterns/sync/subgroup_allreduce.hpp"
#include "patterns/sync/overlapped_ring.hpp"
#include "patterns/collect/many_to_one.hpp"
#include "pipeline/ensemble_pipeline.hpp"
#include "pipeline/presets.hpp"
#include "pipeline/preset_layout.hpp"
#include "pipeline/member_costs.hpp"

// CUDA parts: the host-side helpers wherever the build has CUDA; the device backends, whose
// reduction kernels need nvcc, in translation units nvcc compiles (.cu). On the host stand-in of
// the device layer (FLEXCOMM_DEVICE_STANDIN, tests only) all of it, compiled as plain C++.
#if defined(FLEXCOMM_HAVE_CUDA) || defined(FLEXCOMM_DEVICE_STANDIN)
#include "backend/cuda/device_batch.hpp"
#include "backend/cuda/error.hpp"
#include "backend/cuda/local_device.hpp"
#if defined(__CUDACC__) || defined(FLEXCOMM_DEVICE_STANDIN)
#include "backend/nccl.hpp"
#include "backend/staged.hpp"
#endif
#endif
