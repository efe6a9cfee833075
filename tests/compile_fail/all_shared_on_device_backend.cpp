// A loader writes each batch into host memory: a feed on a backend whose buffers live on the
// device (as NCCL's do) cannot fill that slot, and that is known at compile time.
#include <flexcomm/patterns/feed/all_shared.hpp>
#include "device_backend.hpp"
namespace fc = flexcomm;
fc::all_shared<device_backend>* instantiate(const fc::mpi::communicator& world, const fc::ensemble_layout& layout,
    fc::loader load) {
  return new fc::all_shared<device_backend>(world, layout, load, fc::feed_options{});
}
