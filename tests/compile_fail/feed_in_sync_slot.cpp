// A feed where the sync belongs.
#include <flexcomm/pipeline/presets.hpp>
namespace fc = flexcomm;
#ifdef FLEXCOMM_CONTROL
using pipeline = fc::ensemble_pipeline<fc::local_feed, fc::subgroup_allreduce<fc::mpi>, fc::many_to_one<fc::mpi>>;
#else
using pipeline = fc::ensemble_pipeline<fc::local_feed, fc::one_to_many<fc::mpi>, fc::many_to_one<fc::mpi>>;
#endif
pipeline* instantiate(const fc::mpi::communicator& world, const fc::ensemble_layout& layout) {
  return new pipeline(world, layout, {});
}
