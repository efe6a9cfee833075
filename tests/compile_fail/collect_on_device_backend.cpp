// many_to_one hands the aggregator host vectors: a backend whose buffers live on the device
// (as NCCL's do) cannot fill that slot, and that is known at compile time.
#include <flexcomm/patterns/collect/many_to_one.hpp>
#include "device_backend.hpp"
namespace fc = flexcomm;
fc::many_to_one<device_backend>* instantiate(const fc::mpi::communicator& world, const fc::ensemble_layout& layout) {
  return new fc::many_to_one<device_backend>(world, layout);
}
