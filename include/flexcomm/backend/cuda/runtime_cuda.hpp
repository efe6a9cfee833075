// flexcomm's device layer on the CUDA runtime and NCCL (see runtime.hpp for the interface):
// thin inline forwards, so the backends pay nothing for the layer. Include runtime.hpp, not this.
#pragma once

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <mpi.h>
#include <nccl.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "../../core/datatype.hpp"
#include "reduce_kernels.cuh"

namespace flexcomm::device {

inline constexpr const char* implementation = "CUDA runtime and NCCL";

using stream_t = cudaStream_t;
using event_t = cudaEvent_t;
using error_t = cudaError_t;
inline constexpr error_t success = cudaSuccess;
inline constexpr error_t not_ready = cudaErrorNotReady;

// Device-layer calls are counted on the host stand-in only.
inline constexpr bool counts_calls = false;
inline std::uint64_t calls() noexcept { return 0; }

inline error_t get_device(int* device) { return cudaGetDevice(device); }
inline error_t set_device(int device) { return cudaSetDevice(device); }
inline error_t device_count(int* devices) { return cudaGetDeviceCount(devices); }
// Whether this process holds `device`'s primary context, asked of the driver (the runtime has no
// such query, and its calls would open the context they ask about); loaded at first use, as
// PyTorch does, so that linking needs no libcuda.
inline error_t has_context(int device, bool* active) {
  using get_state = int (*)(int, unsigned*, int*);
  // Not loaded yet: no context can be open, and the next call looks again.
  static std::atomic<get_state> loaded{nullptr};
  get_state query = loaded.load(std::memory_order_acquire);
  if (!query) {
    if (void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD)) {
      query = reinterpret_cast<get_state>(dlsym(driver, "cuDevicePrimaryCtxGetState"));
      loaded.store(query, std::memory_order_release);
    }
  }
  unsigned flags = 0;
  int on = 0;
  *active = query && query(device, &flags, &on) == 0 && on != 0;  // CUdevice is the ordinal
  return cudaSuccess;
}
inline error_t last_error() { return cudaGetLastError(); }
inline const char* error_name(error_t e) { return cudaGetErrorName(e); }
inline const char* error_string(error_t e) { return cudaGetErrorString(e); }
inline error_t pci_bus_id(char* out, int length, int device) { return cudaDeviceGetPCIBusId(out, length, device); }
inline error_t device_synchronize() { return cudaDeviceSynchronize(); }

inline error_t malloc_device(void** p, std::size_t bytes) { return cudaMalloc(p, bytes); }
inline error_t free_device(void* p) { return cudaFree(p); }
inline error_t malloc_pinned(void** p, std::size_t bytes) { return cudaMallocHost(p, bytes); }
inline error_t free_pinned(void* p) { return cudaFreeHost(p); }
// Device (or managed) memory, as opposed to host memory, pinned or not.
inline error_t is_device_memory(const void* p, bool* on_device) {
  cudaPointerAttributes attr{};
  const error_t rc = cudaPointerGetAttributes(&attr, p);
  *on_device = rc == cudaSuccess && (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged);
  return rc;
}
inline error_t copy_async(void* dst, const void* src, std::size_t bytes, stream_t s) {
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s);
}
inline error_t copy_sync(void* dst, const void* src, std::size_t bytes) {
  return cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
}
inline error_t fill(void* dst, int value, std::size_t bytes) { return cudaMemset(dst, value, bytes); }

inline error_t stream_create(stream_t* s, bool non_blocking) {
  return cudaStreamCreateWithFlags(s, non_blocking ? cudaStreamNonBlocking : cudaStreamDefault);
}
inline error_t stream_destroy(stream_t s) { return cudaStreamDestroy(s); }
inline error_t stream_synchronize(stream_t s) { return cudaStreamSynchronize(s); }
inline error_t stream_wait(stream_t s, event_t e) { return cudaStreamWaitEvent(s, e, 0); }

inline error_t event_create(event_t* e) { return cudaEventCreateWithFlags(e, cudaEventDisableTiming); }
inline error_t event_destroy(event_t e) { return cudaEventDestroy(e); }
inline error_t event_record(event_t e, stream_t s) { return cudaEventRecord(e, s); }
inline error_t event_query(event_t e) { return cudaEventQuery(e); }
inline error_t event_synchronize(event_t e) { return cudaEventSynchronize(e); }

// CUDA graphs by stream capture (the interface in runtime.hpp).
using graph_t = cudaGraph_t;
using graph_exec_t = cudaGraphExec_t;
using capture_mode_t = cudaStreamCaptureMode;
inline constexpr capture_mode_t capture_global = cudaStreamCaptureModeGlobal;
inline constexpr capture_mode_t capture_thread_local = cudaStreamCaptureModeThreadLocal;
inline constexpr capture_mode_t capture_relaxed = cudaStreamCaptureModeRelaxed;
using capture_status_t = cudaStreamCaptureStatus;
inline constexpr capture_status_t capture_none = cudaStreamCaptureStatusNone;
inline constexpr capture_status_t capture_active = cudaStreamCaptureStatusActive;
inline constexpr capture_status_t capture_was_invalidated = cudaStreamCaptureStatusInvalidated;
inline constexpr error_t capture_unsupported = cudaErrorStreamCaptureUnsupported;
inline constexpr error_t capture_invalidated = cudaErrorStreamCaptureInvalidated;
inline constexpr error_t capture_unmatched = cudaErrorStreamCaptureUnmatched;
inline constexpr error_t capture_unjoined = cudaErrorStreamCaptureUnjoined;
inline constexpr error_t capture_isolation = cudaErrorStreamCaptureIsolation;
inline constexpr error_t capture_implicit = cudaErrorStreamCaptureImplicit;
inline constexpr error_t captured_event = cudaErrorCapturedEvent;
inline constexpr error_t capture_wrong_thread = cudaErrorStreamCaptureWrongThread;

inline error_t stream_begin_capture(stream_t s, capture_mode_t mode) { return cudaStreamBeginCapture(s, mode); }
inline error_t stream_end_capture(stream_t s, graph_t* graph) { return cudaStreamEndCapture(s, graph); }
inline error_t stream_is_capturing(stream_t s, capture_status_t* status) { return cudaStreamIsCapturing(s, status); }
inline error_t graph_instantiate(graph_exec_t* exec, graph_t graph) { return cudaGraphInstantiate(exec, graph, 0); }
inline error_t graph_launch(graph_exec_t exec, stream_t s) { return cudaGraphLaunch(exec, s); }
inline error_t graph_destroy(graph_t graph) { return cudaGraphDestroy(graph); }
inline error_t graph_exec_destroy(graph_exec_t exec) { return cudaGraphExecDestroy(exec); }

template <class T>
error_t combine(op o, T* inout, const T* in, std::size_t n, stream_t s) {
  return cuda::kernels::combine(o, inout, in, n, s);
}
template <class T>
error_t divide(T* buf, std::size_t n, int ranks, stream_t s) {
  return cuda::kernels::divide(buf, n, ranks, s);
}

// NCCL.
using nccl_comm_t = ncclComm_t;
using nccl_id_t = ncclUniqueId;
using nccl_result_t = ncclResult_t;
inline constexpr nccl_result_t nccl_success = ncclSuccess;
inline constexpr nccl_result_t nccl_in_progress = ncclInProgress;
inline constexpr nccl_result_t nccl_unhandled_cuda_error = ncclUnhandledCudaError;

namespace detail {
inline ncclDataType_t nccl_type(dtype t) {
  switch (t) {
    case dtype::f32: return ncclFloat32;
    case dtype::f64: return ncclFloat64;
    case dtype::i32: return ncclInt32;
    case dtype::i64: return ncclInt64;
    case dtype::u8: return ncclUint8;
    case dtype::f16: return ncclFloat16;
    case dtype::bf16: return ncclBfloat16;
  }
  return ncclFloat32;
}
inline ncclRedOp_t nccl_op(op o) {
  switch (o) {
    case op::sum: return ncclSum;
    case op::prod: return ncclProd;
    case op::min: return ncclMin;
    case op::max: return ncclMax;
    case op::avg: return ncclAvg;
  }
  return ncclSum;
}
}  // namespace detail

inline nccl_result_t nccl_get_unique_id(nccl_id_t* id) { return ncclGetUniqueId(id); }
// Nonblocking (config.blocking = 0): poll nccl_comm_get_async_error until it leaves in-progress.
inline nccl_result_t nccl_comm_init(nccl_comm_t* comm, int ranks, const nccl_id_t& id, int rank, MPI_Comm) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return ncclCommInitRankConfig(comm, ranks, id, rank, &config);
}
// A negative color takes part and gets no communicator. `blocking`: the new communicator's calls
// return once done (config.blocking = 1), the split's too.
inline nccl_result_t nccl_comm_split(nccl_comm_t comm, int color, int key, nccl_comm_t* out, bool blocking = false) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = blocking ? 1 : 0;
  return ncclCommSplit(comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, out, &config);
}
inline nccl_result_t nccl_comm_count(nccl_comm_t comm, int* size) { return ncclCommCount(comm, size); }
inline nccl_result_t nccl_comm_user_rank(nccl_comm_t comm, int* rank) { return ncclCommUserRank(comm, rank); }
inline nccl_result_t nccl_comm_get_async_error(nccl_comm_t comm, nccl_result_t* state) {
  return ncclCommGetAsyncError(comm, state);
}
inline nccl_result_t nccl_comm_finalize(nccl_comm_t comm) { return ncclCommFinalize(comm); }
inline nccl_result_t nccl_comm_destroy(nccl_comm_t comm) { return ncclCommDestroy(comm); }
inline nccl_result_t nccl_comm_abort(nccl_comm_t comm) { return ncclCommAbort(comm); }
inline nccl_result_t nccl_group_start() { return ncclGroupStart(); }
inline nccl_result_t nccl_group_end() { return ncclGroupEnd(); }

inline nccl_result_t nccl_allreduce(const void* send, void* recv, std::size_t count, dtype t, op o, nccl_comm_t comm,
                                    stream_t s) {
  return ncclAllReduce(send, recv, count, detail::nccl_type(t), detail::nccl_op(o), comm, s);
}
inline nccl_result_t nccl_broadcast(const void* send, void* recv, std::size_t count, dtype t, int root,
                                    nccl_comm_t comm, stream_t s) {
  return ncclBroadcast(send, recv, count, detail::nccl_type(t), root, comm, s);
}
inline nccl_result_t nccl_reduce(const void* send, void* recv, std::size_t count, dtype t, op o, int root,
                                 nccl_comm_t comm, stream_t s) {
  return ncclReduce(send, recv, count, detail::nccl_type(t), detail::nccl_op(o), root, comm, s);
}
inline nccl_result_t nccl_allgather(const void* send, void* recv, std::size_t count, dtype t, nccl_comm_t comm,
                                    stream_t s) {
  return ncclAllGather(send, recv, count, detail::nccl_type(t), comm, s);
}
inline nccl_result_t nccl_reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, op o,
                                         nccl_comm_t comm, stream_t s) {
  return ncclReduceScatter(send, recv, count, detail::nccl_type(t), detail::nccl_op(o), comm, s);
}
inline nccl_result_t nccl_send(const void* buf, std::size_t count, dtype t, int peer, nccl_comm_t comm, stream_t s) {
  return ncclSend(buf, count, detail::nccl_type(t), peer, comm, s);
}
inline nccl_result_t nccl_recv(void* buf, std::size_t count, dtype t, int peer, nccl_comm_t comm, stream_t s) {
  return ncclRecv(buf, count, detail::nccl_type(t), peer, comm, s);
}
inline const char* nccl_error_string(nccl_result_t r) { return ncclGetErrorString(r); }
// The code's name, as errors print it beside NCCL's text (NCCL has no call for it).
inline const char* nccl_error_name(nccl_result_t r) {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "ncclResult?";
  }
}
inline const char* nccl_last_error() { return ncclGetLastError(nullptr); }

}  // namespace flexcomm::device
