// Something that is no adapter at all in the feed slot.
#include <flexcomm/pipeline/presets.hpp>
namespace fc = flexcomm;
#ifdef FLEXCOMM_CONTROL
using feed = fc::local_feed;
#else
using feed = int;
#endif
using pipeline = fc::ensemble_pipeline<feed, fc::subgroup_allreduce<fc::mpi>, fc::many_to_one<fc::mpi>>;
pipeline* instantiate(const fc::mpi::communicator& world, const fc::ensemble_layout& layout) {
  return new pipeline(world, layout, {});
}
