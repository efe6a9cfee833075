// A program outside flexcomm's build that uses it as a trainer would: MPI brought up by
// flexcomm::environment, two gradients averaged over the world by subgroup_allreduce. Built three
// ways by tests/consumers/run.sh (CMake package, pkg-config, Meson subproject), each from this
// one file, and run with mpiexec; a wrong average exits with status 1.
//   mpiexec -n N consumer [N]   (N: the world size it must find, 1 otherwise)
#include <flexcomm/flexcomm.hpp>

#include <cstdio>
#include <cstdlib>
#include <vector>

namespace fc = flexcomm;

int main(int argc, char** argv) {
  fc::environment env{argc, argv};
  const auto& world = env.world();
  const int rank = world.rank(), n = world.size();
  // A launcher of another MPI starts N singletons instead of one world of N: each would pass.
  if (argc > 1 && n != std::atoi(argv[1])) {
    std::fprintf(stderr, "consumer: rank %d: world has %d ranks, expected %s (mpiexec of another MPI?)\n", rank, n,
                 argv[1]);
    return 1;
  }

  // One member spanning the world: gradients are averaged over every rank.
  fc::subgroup_allreduce<fc::mpi> sync{world};
  std::vector<float> weights{1.0f + static_cast<float>(rank), 2.0f * static_cast<float>(rank), -3.0f};
  std::vector<float> bias{0.5f * static_cast<float>(rank)};
  sync.ready(0, fc::span<float>(weights));
  sync.ready(1, fc::span<float>(bias));
  sync.finish();

  // Means of 1 + r, 2r, -3 and r/2 over r = 0..n-1; all exact in float for small n.
  const float mean_rank = static_cast<float>(n - 1) / 2.0f;
  const std::vector<float> expected_weights{1.0f + mean_rank, 2.0f * mean_rank, -3.0f};
  const std::vector<float> expected_bias{0.5f * mean_rank};
  if (weights != expected_weights || bias != expected_bias) {
    std::fprintf(stderr, "consumer: rank %d of %d: wrong average: weights %g %g %g (expected %g %g %g), bias %g "
                 "(expected %g)\n", rank, n, static_cast<double>(weights[0]), static_cast<double>(weights[1]),
                 static_cast<double>(weights[2]), static_cast<double>(expected_weights[0]),
                 static_cast<double>(expected_weights[1]), static_cast<double>(expected_weights[2]),
                 static_cast<double>(bias[0]), static_cast<double>(expected_bias[0]));
    return 1;
  }
  if (rank == 0) std::printf("consumer: %d ranks, gradients averaged correctly\n", n);
  return 0;
}
