// overlapped_ring keeps several buckets and segments in flight to each neighbour and tells them
// apart by tag; a backend that pairs messages in issue order (NCCL) cannot carry it.
#include <flexcomm/backend/mpi.hpp>
#include <flexcomm/patterns/sync/overlapped_ring.hpp>
namespace fc = flexcomm;
struct order_matched : fc::mpi {
#ifdef FLEXCOMM_CONTROL
  static constexpr bool tag_matched_p2p = true;
#else
  static constexpr bool tag_matched_p2p = false;
#endif
};
fc::overlapped_ring<order_matched>* instantiate(const fc::mpi::communicator& member) {
  return new fc::overlapped_ring<order_matched>(member);
}
