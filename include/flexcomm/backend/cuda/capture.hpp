// Whether a stream is being captured into a CUDA graph, asked where flexcomm must behave
// differently: captured work runs at each replay, not now, so host waits and event queries on it
// would break the capture (CUDA refuses them and invalidates it), and work that moves bytes
// through the host (staged's MPI) cannot be replayed at all.
#pragma once

#include <string>

#include "../../core/error.hpp"
#include "error.hpp"
#include "runtime.hpp"

namespace flexcomm::cuda {

// True while `s` is capturing. nullptr, the legacy default stream, cannot capture, but CUDA
// reports a blocking stream of the device that does (cudaErrorStreamCaptureImplicit): true then.
// A capture an earlier call invalidated is an error: the trainer must end it and capture again.
inline bool capturing(device::stream_t s, const std::string& what) {
  device::capture_status_t status = device::capture_none;
  const device::error_t rc = device::stream_is_capturing(s, &status);
  if (!s && rc == device::capture_implicit) {
    device::last_error();  // the answer, not a failure: leave no error behind for later calls
    return true;
  }
  check_cuda(rc, what, ": cudaStreamIsCapturing");
  check(status != device::capture_was_invalidated, what,
        "its stream's capture into a CUDA graph was invalidated by an earlier call; end it "
        "(cudaStreamEndCapture) and capture again");
  return status == device::capture_active;
}

// Refuses an operation whose stream `s` is capturing: `why` says what a graph could not replay.
inline void refuse_capture(device::stream_t s, const std::string& what, const char* why) {
  if (s && capturing(s, what)) fail(what, cat("cannot be captured into a CUDA graph: ", why));
}

}  // namespace flexcomm::cuda
