// How flexcomm's element types and reductions map onto MPI's, and MPI's return codes onto
// flexcomm::error: the vocabulary every backend over MPI ranks speaks (mpi, nccl's control
// communicator, staged's transport, the device stand-in), which include it from here.
#pragma once

#include <mpi.h>

#include <climits>
#include <cstddef>
#include <string>
#include <utility>

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/reduce.hpp"

namespace flexcomm {

namespace detail {
inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return cat("MPI error code ", code);
  return std::string(text, static_cast<std::size_t>(len));
}
}  // namespace detail

// Turns an MPI return code into a flexcomm::error naming the operation.
inline void check_mpi(int code, const std::string& operation) {
  if (code != MPI_SUCCESS) fail(operation, detail::mpi_error_text(code));
}

namespace detail {
inline int mpi_count(std::size_t n, const std::string& operation) {
  check(n <= static_cast<std::size_t>(INT_MAX), operation,
        cat("count ", n, " exceeds what one MPI call carries (", INT_MAX, ")"));
  return static_cast<int>(n);
}

inline MPI_Datatype mpi_type(dtype t) {
  switch (t) {
    case dtype::f32: return MPI_FLOAT;
    case dtype::f64: return MPI_DOUBLE;
    case dtype::i32: return MPI_INT32_T;
    case dtype::i64: return MPI_INT64_T;
    case dtype::u8: return MPI_UINT8_T;
    case dtype::f16: case dtype::bf16: return MPI_UINT16_T;  // reduced by flexcomm's own MPI_Ops
  }
  return MPI_DATATYPE_NULL;
}

// Floating reductions use flexcomm's own operators (core/reduce_rule.hpp: canonical NaN, min and
// max that propagate NaN and order -0 below +0 whatever the operand order), so MPI's results equal
// the device kernels' and the shared-memory path's bit for bit; MPI's built-in MPI_SUM, MPI_MIN on
// floats keep the hardware's NaN bits and order-dependent ties. MPI has no 16-bit floats at all.
// Made once and freed when MPI_Finalize deletes MPI_COMM_SELF's attributes.
template <class T, op O>
void mpi_user_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  combine(O, static_cast<T*>(inout), static_cast<const T*>(in), static_cast<std::size_t>(*len));
}

struct mpi_float_ops {
  MPI_Op ops[4][4] = {};  // [float, double, half, bfloat16][sum, prod, min, max]
};

inline int free_float_ops(MPI_Comm, int, void* ops, void*) {
  auto* table = static_cast<mpi_float_ops*>(ops);
  for (auto& row : table->ops)
    for (auto& o : row)
      if (o != MPI_OP_NULL) MPI_Op_free(&o);
  delete table;
  return MPI_SUCCESS;
}

template <class T>
void create_float_ops(MPI_Op* row) {
  MPI_Op_create(&mpi_user_reduce<T, op::sum>, 1, &row[0]);
  MPI_Op_create(&mpi_user_reduce<T, op::prod>, 1, &row[1]);
  MPI_Op_create(&mpi_user_reduce<T, op::min>, 1, &row[2]);
  MPI_Op_create(&mpi_user_reduce<T, op::max>, 1, &row[3]);
}

inline mpi_float_ops& float_ops() {
  static mpi_float_ops* table = [] {
    auto* t = new mpi_float_ops;
    create_float_ops<float>(t->ops[0]);
    create_float_ops<double>(t->ops[1]);
    create_float_ops<half>(t->ops[2]);
    create_float_ops<bfloat16>(t->ops[3]);
    int key = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &free_float_ops, &key, nullptr);
    MPI_Comm_set_attr(MPI_COMM_SELF, key, t);
    return t;
  }();
  return *table;
}

inline MPI_Op mpi_op(op o, dtype t) {
  const int index = o == op::avg ? 0 : static_cast<int>(o);  // avg = sum, divided afterwards
  switch (t) {
    case dtype::f32: return float_ops().ops[0][index];
    case dtype::f64: return float_ops().ops[1][index];
    case dtype::f16: return float_ops().ops[2][index];
    case dtype::bf16: return float_ops().ops[3][index];
    default: break;
  }
  static const MPI_Op native[] = {MPI_SUM, MPI_PROD, MPI_MIN, MPI_MAX};  // integers wrap alike
  return native[index];
}
}  // namespace detail

}  // namespace flexcomm
