// A small allreduce (4 bytes by default) with the MPI library's blocking MPI_Allreduce against
// flexcomm's nonblocking call under each wait policy, in one run, with ratios against the blocking
// call. On a node with more ranks than cores, MPICH's busy polling steals the CPU from the very
// ranks it waits for; this benchmark shows what a wait policy buys back (and, on Open MPI, what its
// own yielding when oversubscribed already does).
//
//   mpiexec -n 8 build/benchmarks/wait_policy -n 200 -w 20 -j wait_policy.json
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include <flexcomm/flexcomm.hpp>

#include "../examples/common/counts.hpp"
#include "flags.hpp"

namespace fc = flexcomm;
namespace po = boost::program_options;

namespace {

struct result {
  std::string variant;
  double seconds_per_op;  // the slowest rank's mean
  int wrong;
};

// Mean seconds per operation on the slowest rank, so a rank that finished early cannot flatter it.
template <class Op>
double time_it(const fc::mpi::communicator& comm, int warmup, int iterations, Op&& op) {
  for (int i = 0; i < warmup; ++i) op();
  fc::mpi::iallreduce(comm, fc::span<int>(nullptr, 0), fc::op::sum).wait(fc::wait_policy::backoff());
  const double start = MPI_Wtime();
  for (int i = 0; i < iterations; ++i) op();
  double mine = (MPI_Wtime() - start) / iterations, slowest = 0;
  auto r = fc::mpi::iallreduce<double>(comm, fc::span<const double>(&mine, 1), fc::span<double>(&slowest, 1), fc::op::max);
  r.wait(fc::wait_policy::backoff());
  return slowest;
}

}  // namespace

int main(int argc, char** argv) {
  fc::environment env{argc, argv};
  const auto& world = env.world();
  int iterations = 200, warmup = 20, count = 1;
  std::string json;
  po::options_description flags("wait_policy: small allreduce, blocking MPI vs flexcomm wait policies");
  flags.add_options()("help,h", "this text")
      ("iters,n", counts::at_least<1>(&iterations), "timed iterations")
      ("warmup_iters,w", counts::at_least<0>(&warmup), "untimed iterations first")
      ("count,c", counts::at_least<1>(&count), "int32 elements per allreduce (1 = 4 bytes)")
      ("json,j", po::value(&json), "also write the results to this JSON file");
  if (const auto status = benchmark_flags::parse(argc, argv, flags, world.rank())) return *status;

  const int n = world.size();
  std::vector<std::int32_t> send(static_cast<std::size_t>(count), world.rank() + 1), recv(send.size());
  const std::int32_t expected = n * (n + 1) / 2;
  std::vector<result> results;
  auto wrong = [&] {
    return static_cast<int>(std::count_if(recv.begin(), recv.end(), [&](std::int32_t v) { return v != expected; }));
  };

  const double blocking = time_it(world, warmup, iterations, [&] {
    MPI_Allreduce(send.data(), recv.data(), count, MPI_INT32_T, MPI_SUM, world.native());
  });
  results.push_back({"MPI_Allreduce (blocking)", blocking, wrong()});
  for (const auto& policy : {fc::wait_policy::spin(), fc::wait_policy::yield(), fc::wait_policy::backoff()}) {
    const double t = time_it(world, warmup, iterations, [&] {
      fc::mpi::iallreduce<std::int32_t>(world, send, fc::span<std::int32_t>(recv), fc::op::sum).wait(policy);
    });
    results.push_back({std::string("flexcomm iallreduce, ") + fc::name_of(policy.kind), t, wrong()});
  }

  if (world.rank() != 0) return 0;
  const double bytes = 4.0 * count;
  std::printf("# %s; ranks %d, ranks on this node %d, cores %u, default wait policy here: %s\n",
              fc::mpi_implementation::name, n, env.ranks_on_node(),
              std::thread::hardware_concurrency(), fc::name_of(env.wait().kind));
  std::printf("# %10s %10s %6s %6s %-32s %10s %8s %8s %6s %9s\n", "size", "count", "type", "redop", "variant",
              "time(us)", "algbw", "busbw", "#wrong", "speedup");
  for (const auto& r : results) {
    const double algbw = bytes / r.seconds_per_op / 1e9;
    std::printf("  %10.0f %10d %6s %6s %-32s %10.2f %8.4f %8.4f %6d %8.2fx\n", bytes, count, "int32", "sum",
                r.variant.c_str(), r.seconds_per_op * 1e6, algbw, algbw * 2.0 * (n - 1) / n, r.wrong,
                blocking / r.seconds_per_op);
  }
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\"benchmark\":\"wait_policy\",\"ranks\":" << n << ",\"ranks_on_node\":" << env.ranks_on_node()
        << ",\"bytes\":" << bytes << ",\"results\":[";
    for (std::size_t i = 0; i < results.size(); ++i)
      out << (i ? "," : "") << "{\"variant\":\"" << results[i].variant << "\",\"time_us\":" << results[i].seconds_per_op * 1e6
          << ",\"speedup_vs_blocking\":" << blocking / results[i].seconds_per_op << ",\"wrong\":" << results[i].wrong << "}";
    out << "]}\n";
  }
  return 0;
}
