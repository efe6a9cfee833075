// How flexcomm's element types and reductions map onto NCCL's, and NCCL's return codes onto
// flexcomm::error.
#pragma once

#include <nccl.h>

#include <string>

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"

namespace flexcomm {

// Turns an NCCL return code into a flexcomm::error; ncclInProgress is not a failure (nonblocking
// communicators return it while work is still being enqueued).
inline void check_nccl(ncclResult_t code, const std::string& operation) {
  if (code == ncclSuccess || code == ncclInProgress) return;
  const char* last = ncclGetLastError(nullptr);
  fail(operation, cat(ncclGetErrorString(code), last && *last ? cat(" (", last, ")") : std::string()));
}

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

constexpr bool is_floating(dtype t) {
  return t == dtype::f32 || t == dtype::f64 || t == dtype::f16 || t == dtype::bf16;
}

// ncclAvg for floating types; integers sum and are divided by a kernel afterwards, truncating
// as op::avg does everywhere in flexcomm.
inline ncclRedOp_t nccl_op(op o, dtype t) {
  switch (o) {
    case op::sum: return ncclSum;
    case op::prod: return ncclProd;
    case op::min: return ncclMin;
    case op::max: return ncclMax;
    case op::avg: return is_floating(t) ? ncclAvg : ncclSum;
  }
  return ncclSum;
}

inline bool needs_divide(op o, dtype t) { return o == op::avg && !is_floating(t); }
}  // namespace detail

}  // namespace flexcomm
