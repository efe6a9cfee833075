// flexcomm: communication patterns for training ensembles of deep neural networks.
// Include this one header; CUDA parts join in when the build has CUDA (FLEXCOMM_HAVE_CUDA).
#pragma once

#include "core/datatype.hpp"
#include "core/error.hpp"
#include "core/gaps.hpp"
#include "core/layout.hpp"
#include "core/progress.hpp"
#include "core/reduce.hpp"
#include "core/span.hpp"
#include "core/trace.hpp"
#include "core/wait.hpp"

#include "backend/mpi.hpp"
#include "core/environment.hpp"
#include "core/trace_mpi.hpp"

#include "patterns/feed.hpp"
#include "patterns/local_feed.hpp"
#include "patterns/one_to_many.hpp"
#include "patterns/all_shared.hpp"
#include "patterns/sync.hpp"
#include "patterns/subgroup_allreduce.hpp"
#include "patterns/overlapped_ring.hpp"
