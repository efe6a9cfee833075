// README.md's "Using it": a whole program, compiled as it is printed (tests/snippets/check.py).
#include <flexcomm/flexcomm.hpp>
namespace fc = flexcomm;

int main(int argc, char** argv) {
  fc::environment env{argc, argv};            // MPI up, wait policy chosen for this node
  auto layout = fc::ensemble_layout::from_env("producers=1 members=4x2");
  layout.validate(env.world().size());        // "layout needs 9 ranks, world has 8"
  using Preset = fc::presets::single_broadcast<fc::overlapped_ring>;
  Preset::pipeline pipe{env.world(), layout, Preset::configure({})};
  // pipe.run(loader, train, aggregate), as in "From the baseline to the streamlined pipeline"
}
