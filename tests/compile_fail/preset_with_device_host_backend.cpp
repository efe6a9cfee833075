// A preset's third argument is the host backend its feed and collect run on; a device backend
// there is refused by the preset, before the adapters would say the same less directly.
#include <flexcomm/pipeline/presets.hpp>
#include "device_backend.hpp"
namespace fc = flexcomm;
using Preset = fc::presets::single_broadcast<fc::subgroup_allreduce, fc::mpi, device_backend>;
Preset::pipeline* instantiate(const fc::mpi::communicator& world, const fc::ensemble_layout& layout) {
  return new Preset::pipeline(world, layout, Preset::options{});
}
