// The lowest layer of the device backends: the few CUDA runtime and NCCL calls that nccl, staged
// and cuda_aware_mpi make, behind one small interface in namespace flexcomm::device, so that the
// backends' logic (chunking, staging, events, deferred groups, aborts) is the same code on a GPU
// and on a machine without one. It is the bottom of cuda/: it, runtime_cuda.hpp and the kernels
// (reduce_kernels.cuh) include no other file of the folder, and the rest of cuda/ stands on them.
// Two implementations, chosen here and nowhere else:
//   runtime_cuda.hpp    the CUDA runtime and NCCL (the default; needs nvcc for the kernels);
//   a host stand-in for tests (build with FLEXCOMM_DEVICE_STANDIN and tests/standin on the include
//                       path; never installed, tests/standin/flexcomm_standin/device.hpp): memory in
//                       host RAM, streams as ordered queues run by worker threads, events that
//                       complete when their queue reaches them, kernels run on the host, and
//                       NCCL's calls over MPI. Asynchronous the way a GPU is, so a result read
//                       before its stream got there is stale on the CPU too (docs/cuda.md).
//
// The interface, in both:
//   types      stream_t, event_t, error_t (success, not_ready), nccl_comm_t, nccl_id_t,
//              nccl_result_t (nccl_success, nccl_in_progress, nccl_unhandled_cuda_error)
//   device     get_device, set_device, device_count, has_context (the device's primary context is
//              open in this process), last_error, error_name, error_string, pci_bus_id,
//              device_synchronize
//   memory     malloc_device, free_device, malloc_pinned, free_pinned, is_device_memory,
//              copy_async (any direction, on a stream), copy_sync (cudaMemcpy), fill (cudaMemset)
//   streams    stream_create(non_blocking), stream_destroy, stream_synchronize, stream_wait
//   events     event_create (no timing), event_destroy, event_record, event_query, event_synchronize
//   kernels    combine<T>(op, inout, in, n, stream), divide<T>(buf, n, ranks, stream)
//   graphs     graph_t, graph_exec_t, capture_mode_t (capture_global, capture_thread_local,
//              capture_relaxed), capture_status_t (capture_none, capture_active,
//              capture_was_invalidated), stream_begin_capture, stream_end_capture,
//              stream_is_capturing, graph_instantiate, graph_launch, graph_destroy,
//              graph_exec_destroy, and the capture errors (capture_unsupported, capture_invalidated,
//              capture_unmatched, capture_unjoined, capture_isolation, capture_implicit,
//              captured_event, capture_wrong_thread)
//   NCCL       nccl_get_unique_id, nccl_comm_init (nonblocking; `over` is the MPI communicator
//              whose ranks take part), nccl_comm_split (nonblocking, or blocking: the
//              new communicator's calls return once done), nccl_comm_count, nccl_comm_user_rank,
//              nccl_comm_get_async_error, nccl_comm_finalize, nccl_comm_destroy, nccl_comm_abort,
//              nccl_group_start, nccl_group_end, nccl_allreduce, nccl_broadcast, nccl_reduce,
//              nccl_allgather, nccl_reduce_scatter, nccl_send, nccl_recv (element types as
//              flexcomm dtypes, reductions as flexcomm ops with avg = ncclAvg),
//              nccl_error_string, nccl_error_name (ncclRemoteError, ...), nccl_last_error
//   counting   calls(): how many of these calls this process made (the stand-in counts; the
//              CUDA build returns 0), for tests of the per-operation cost
#pragma once

#if defined(FLEXCOMM_DEVICE_STANDIN)
#include <flexcomm_standin/device.hpp>  // tests/standin: a test double, not part of the library
#else
#include "runtime_cuda.hpp"
#endif
