// How flexcomm's reductions map onto NCCL's, and NCCL's return codes onto flexcomm::error.
#pragma once


#include <string>

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../cuda/runtime.hpp"

namespace flexcomm {

// An unhandled CUDA error in NCCL is most often the context poisoned by a kernel that faulted
// (sticky: every later call fails with it): the CUDA runtime's own error names it. Failure path only
// (cudaGetLastError would clear an error that is not sticky).
inline std::string cuda_cause(device::nccl_result_t code) {
  if (code != device::nccl_unhandled_cuda_error) return {};
  const device::error_t cuda = device::last_error();
  if (cuda == device::success) return {};
  return cat("; CUDA: ", device::error_name(cuda), ": ", device::error_string(cuda));
}

// Turns an NCCL return code into a flexcomm::error; device::nccl_in_progress is not a failure (nonblocking
// communicators return it while work is still being enqueued). The operation's name is one piece
// or several, joined only on failure (see check_cuda).
template <class... Operation>
void check_nccl(device::nccl_result_t code, const Operation&... operation) {
  if (code == device::nccl_success || code == device::nccl_in_progress) return;
  const char* last = device::nccl_last_error();
  fail(cat(operation...), cat(device::nccl_error_name(code), ": ", device::nccl_error_string(code),
                              last && *last ? cat(" (", last, ")") : std::string(), cuda_cause(code)));
}

// check_nccl, giving the code back: ncclInProgress tells a nonblocking communicator's caller to
// wait until the work is enqueued (nccl_state::settle_locked).
template <class... Operation>
device::nccl_result_t checked_nccl(device::nccl_result_t code, const Operation&... operation) {
  check_nccl(code, operation...);
  return code;
}

namespace detail {
constexpr bool is_floating(dtype t) {
  return t == dtype::f32 || t == dtype::f64 || t == dtype::f16 || t == dtype::bf16;
}

// The reduction NCCL runs: avg (ncclAvg) for floating types; integers sum and are divided by a
// kernel afterwards, truncating as op::avg does everywhere in flexcomm.
inline op nccl_op(op o, dtype t) { return o == op::avg && !is_floating(t) ? op::sum : o; }

inline bool needs_divide(op o, dtype t) { return o == op::avg && !is_floating(t); }
}  // namespace detail

}  // namespace flexcomm
