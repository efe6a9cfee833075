// Cost of the watchdog's consistency check (FLEXCOMM_CHECK): allreduce latency with the check
// off and on, in the same run, nccl-tests style. The baseline is the same backend call with the
// check off; the ratio on/off is what the check costs.
//
//   mpiexec -n 4 check_overhead -b 8 -e 1M -f 4 -n 200 -w 20 -c 1 [-J check_overhead.json]
#include <flexcomm/flexcomm.hpp>

#include <boost/program_options.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "../examples/common/counts.hpp"
#include "flags.hpp"

namespace fc = flexcomm;
namespace po = boost::program_options;
using fc::mpi;

namespace {

// Mean microseconds of one allreduce of `buf`, and the number of wrong elements.
double run(const mpi::communicator& world, std::vector<float>& buf, int iters, int warmup, bool check,
           long& wrong) {
  fc::set_checks(check);
  for (int i = 0; i < warmup; ++i) mpi::iallreduce(world, fc::span<float>(buf), fc::op::max).wait();
  std::fill(buf.begin(), buf.end(), static_cast<float>(world.rank()));
  int ready = 0;
  mpi::iallreduce(world, fc::span<int>(&ready, 1), fc::op::sum).wait();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) mpi::iallreduce(world, fc::span<float>(buf), fc::op::max).wait();
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
  for (float v : buf) wrong += v != static_cast<float>(world.size() - 1);
  double worst = us;  // the slowest rank's time is the operation's time
  mpi::iallreduce(world, fc::span<double>(&worst, 1), fc::op::max).wait();
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  fc::environment env(argc, argv);
  const auto& world = env.world();
  std::size_t min_bytes = 8, max_bytes = 1 << 20;
  double factor = 4;
  int iters = 200, warmup = 20, check = 1;
  std::string json = "check_overhead.json";
  po::options_description flags("check_overhead: allreduce with FLEXCOMM_CHECK off and on (nccl-tests flags)");
  flags.add_options()("help,h", "this text")
      ("minbytes,b", benchmark_flags::bytes(&min_bytes, "8"), "smallest size")
      ("maxbytes,e", benchmark_flags::bytes(&max_bytes, "1M"), "largest size")
      ("stepfactor,f", benchmark_flags::above_one(&factor), "size multiplier")
      ("iters,n", counts::at_least<1>(&iters), "timed iterations")
      ("warmup_iters,w", counts::at_least<0>(&warmup), "warmup iterations")
      ("check,c", counts::at_least<0>(&check), "check results (#wrong)")
      ("json,J", po::value(&json)->default_value(json), "JSON output file (rank 0)");
  if (const auto status = benchmark_flags::parse(argc, argv, flags, world.rank())) return *status;
  const int n = world.size();
  const double bus = n > 1 ? 2.0 * (n - 1) / n : 1.0;  // allreduce's bus-bandwidth factor
  FILE* out = world.rank() == 0 ? std::fopen(json.c_str(), "w") : nullptr;
  if (world.rank() == 0) {
    std::printf("# check_overhead: %d ranks, FLEXCOMM_CHECK off vs on, allreduce max, %d iterations, %d warm-up\n",
                n, iters, warmup);
    std::printf("# %10s %10s %6s %6s %5s | %10s %8s %8s | %10s %8s %8s %7s | %9s\n", "size", "count", "type",
                "redop", "root", "off us", "algbw", "busbw", "on us", "algbw", "busbw", "#wrong", "on/off");
    if (out) std::fprintf(out, "{\"ranks\": %d, \"iterations\": %d, \"results\": [", n, iters);
  }
  bool first = true;
  for (std::size_t bytes = min_bytes; bytes <= max_bytes;
       bytes = std::max(bytes + 1, static_cast<std::size_t>(static_cast<double>(bytes) * factor))) {
    std::vector<float> buf(std::max<std::size_t>(1, bytes / sizeof(float)));
    long wrong = 0;
    // Alternate off/on three times and keep each one's best, so that load from elsewhere on the
    // machine does not land on one side only.
    double off = 1e30, on = 1e30;
    for (int round = 0; round < 3; ++round) {
      off = std::min(off, run(world, buf, iters, warmup, false, wrong));
      on = std::min(on, run(world, buf, iters, warmup, true, wrong));
    }
    if (!check) wrong = 0;
    long all_wrong = wrong;
    mpi::iallreduce(world, fc::span<long>(&all_wrong, 1), fc::op::sum).wait();
    const double gb = static_cast<double>(buf.size() * sizeof(float)) / 1e9;
    if (world.rank() == 0) {
      std::printf("  %10zu %10zu %6s %6s %5d | %10.2f %8.3f %8.3f | %10.2f %8.3f %8.3f %7ld | %9.3f\n",
                  buf.size() * sizeof(float), buf.size(), "float", "max", -1, off, gb / (off * 1e-6),
                  gb / (off * 1e-6) * bus, on, gb / (on * 1e-6), gb / (on * 1e-6) * bus, all_wrong, on / off);
      if (out)
        std::fprintf(out, "%s\n  {\"size\": %zu, \"count\": %zu, \"type\": \"float\", \"redop\": \"max\", "
                     "\"off_us\": %.3f, \"on_us\": %.3f, \"ratio\": %.4f, \"wrong\": %ld}",
                     first ? "" : ",", buf.size() * sizeof(float), buf.size(), off, on, on / off, all_wrong);
    }
    first = false;
  }
  if (out) {
    std::fprintf(out, "\n]}\n");
    std::fclose(out);
  }
  fc::set_checks(true);
  return 0;
}
