// Operations carry the element types flexcomm names a dtype for; a gradient of `short` is
// refused at compile time with the list, not deep inside the backend.
#include <cstdint>
#include <flexcomm/backend/mpi.hpp>
namespace fc = flexcomm;
#ifdef FLEXCOMM_CONTROL
using element = std::int32_t;
#else
using element = short;
#endif
fc::mpi::request average(const fc::mpi::communicator& member, fc::span<element> gradient) {
  return fc::mpi::iallreduce(member, gradient, fc::op::avg);
}
