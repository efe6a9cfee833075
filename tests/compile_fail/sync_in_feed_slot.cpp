// The feed and the sync swapped.
#include <flexcomm/pipeline/presets.hpp>
namespace fc = flexcomm;
#ifdef FLEXCOMM_CONTROL
using pipeline = fc::ensemble_pipeline<fc::one_to_many<fc::mpi>, fc::overlapped_ring<fc::mpi>, fc::many_to_one<fc::mpi>>;
#else
using pipeline = fc::ensemble_pipeline<fc::overlapped_ring<fc::mpi>, fc::one_to_many<fc::mpi>, fc::many_to_one<fc::mpi>>;
#endif
pipeline* instantiate(const fc::mpi::communicator& world, const fc::ensemble_layout& layout) {
  return new pipeline(world, layout, {});
}
