// benchmarks/feed_sweep: which feed wins as preprocessing and training costs change, and whether
// the adaptive feed follows the winner with no option changed. K one-rank members train on one
// stream; a step's preprocessing burns `pre` ms of CPU (once per step, on whichever rank makes
// it) and its training sleeps `train` ms: the trainer of a GPU model, whose host thread is idle
// while the device computes. For every (train, pre) point the feeds run back to back, each on
// the ranks its layout needs (the rest of the world waits at a barrier):
//
//   local_feed      members=Kx1              every trainer preprocesses every step
//   one_to_many 1p  producers=1 members=Kx1  one producer
//   one_to_many 2p  producers=2 members=Kx1  two producers taking turns
//   all_shared      members=Kx1              the trainers take turns
//   adaptive 1p     producers=1 members=Kx1  whoever is idle
//   adaptive 2p     producers=2 members=Kx1  the same with two producers
//   adaptive 0p     members=Kx1              the trainers alone, whoever is idle (across hosts:
//                                            each step made on its home host, couriers between)
//
// --feeds picks some of them (at least one fixed feed: the ratios are against those); --uneven F
// has member 0 train F times as long as the others (a slower GPU, a bigger model), which a feed
// with fixed turns waits for and one that balances works around. Under FLEXCOMM_HOSTS the ranks
// pretend to be on several hosts: all_shared then allgathers, and adaptive 0p ships by courier.
//
// Each row: the step bytes, then wall and CPU (all the feed's ranks, getrusage) and their ratios
// to the point's best wall and lowest CPU among the fixed feeds (CPU counted to the end of each
// rank's own part: a rank done early idles in the benchmark's barrier, not in the feed). The JSON (-J) holds every row;
// benchmarks/plot_feed_sweep.py draws it and prints the table of docs/benchmarks.md.
//
//   mpiexec.mpich -n 10 build/benchmarks/feed_sweep -K 8 -J sweep_k8.json
//   FLEXCOMM_HOSTS=2+2 mpiexec.mpich -n 4 build/benchmarks/feed_sweep -K 2 --feeds all_shared,adaptive_0p --uneven 3
#include <sys/resource.h>
#include <time.h>

#include <boost/program_options.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <flexcomm/flexcomm.hpp>

#include "../examples/common/counts.hpp"
#include "flags.hpp"
#include "job_clock.hpp"

namespace fc = flexcomm;
namespace po = boost::program_options;

namespace {

using namespace job_clock;  // cpu_seconds, now, barrier, reduce

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// Preprocessing as CPU work: this thread computes until it has used `seconds` of CPU, however
// long the shared cores make that take.
double burn(double seconds) {
  const double until = thread_cpu_seconds() + seconds;
  volatile double x = 1.0;
  while (thread_cpu_seconds() < until)
    for (int i = 0; i < 2000; ++i) x = x * 1.0000001 + 1e-9;
  return x;
}

// The bytes of a step, cheap to make and check: a word from the step, repeated.
std::uint64_t word_of(std::int64_t step) { return 0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(step + 1); }

struct point {
  double train_ms, pre_ms;
  std::int64_t steps;
};

struct result {
  std::string feed;
  int ranks = 0;
  double wall = 0, cpu = 0;
  bool exact = true;
  bool balancing = false;
  std::int64_t made_by_trainers = 0;
};

struct feed_run {
  const char* name;
  int producers;  // -1: no layout producers
};

bool per_rank = false;  // --per-rank: each rank's CPU and pieces on stderr
double uneven = 1;      // --uneven: member 0's training over the others'

template <class Feed>
result run(const fc::mpi::communicator& world, const feed_run& f, int members, const point& p, std::size_t bytes,
           int depth) {
  const int producers = std::max(f.producers, 0);
  const int used = producers + members;
  const auto comm = world.split(world.rank() < used ? 0 : fc::mpi::communicator::undefined, world.rank(), f.name);
  result r;
  r.feed = f.name;
  r.ranks = used;
  barrier(world);
  if (comm) {
    const auto layout = fc::ensemble_layout::parse(
        producers > 0 ? fc::cat("producers=", producers, " members=", members, "x1") : fc::cat("members=", members, "x1"));
    fc::feed_options options;
    options.steps = p.steps;
    options.shard_capacity = bytes;
    options.depth = depth;
    fc::loader load = [&](std::int64_t step, int, fc::span<std::byte> out) {
      burn(p.pre_ms * 1e-3);
      const std::uint64_t w = word_of(step);
      for (std::size_t i = 0; i + 8 <= bytes; i += 8) std::memcpy(out.data() + i, &w, 8);
      return bytes;
    };
    const auto role = layout.role_of(comm.rank());
    std::int64_t made = 0;
    Feed feed(comm, layout, load, options);
    barrier(comm);
    const double cpu0 = cpu_seconds(), t0 = now();
    if (role.kind == fc::role::producer) {
      feed.produce();
    } else {
      std::int64_t expected = 0;
      while (auto b = feed.next()) {
        std::uint64_t first = 0, last = 0;
        std::memcpy(&first, b->bytes().data(), 8);
        std::memcpy(&last, b->bytes().data() + b->size() - 8, 8);
        r.exact = r.exact && b->step() == expected++ && first == word_of(b->step()) && last == first;
        const double train_ms = p.train_ms * (role.member == 0 ? uneven : 1.0);
        std::this_thread::sleep_for(std::chrono::microseconds(static_cast<std::int64_t>(train_ms * 1e3)));
      }
      r.exact = r.exact && expected == p.steps;
      if constexpr (std::is_same_v<Feed, fc::adaptive<fc::mpi>>) made = feed.pieces_made();
    }
    // CPU up to the end of this rank's own part: a rank done early idles in the barrier, which
    // is the benchmark's, not the feed's.
    const double cpu = cpu_seconds() - cpu0;
    if (per_rank)
      std::fprintf(stderr, "# %s rank %d (%s): cpu %.4f s, pieces made %lld\n", f.name, comm.rank(),
                   role.kind == fc::role::producer ? "producer" : "trainer", cpu, static_cast<long long>(made));
    barrier(comm);
    const double wall = now() - t0;
    r.wall = reduce(comm, wall, fc::op::max);
    r.cpu = reduce(comm, cpu, fc::op::sum);
    r.exact = reduce(comm, r.exact ? 0.0 : 1.0, fc::op::sum) == 0;
    r.made_by_trainers = static_cast<std::int64_t>(reduce(comm, static_cast<double>(made), fc::op::sum));
    if constexpr (std::is_same_v<Feed, fc::adaptive<fc::mpi>>) r.balancing = feed.balancing();
  }
  barrier(world);
  // Rank 0 is in every feed's ranks: it holds the results.
  return r;
}

std::vector<double> list_of(const std::string& text) {
  std::vector<double> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stod(item));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  fc::environment env(argc, argv);
  const auto& world = env.world();
  int members = 0, depth = 2;
  std::size_t bytes = 800 * 1024;
  double target_s = 0.8;
  std::string trains = "0.1,2,10,50", pres = "1,10,50", json_path = "feed_sweep.json", wait_text;
  std::string chosen = "local_feed,one_to_many_1p,one_to_many_2p,all_shared,adaptive_1p,adaptive_2p,adaptive_0p";
  po::options_description flags("benchmarks/feed_sweep options");
  flags.add_options()("help,h", "this text")
      ("members,K", counts::at_least<1>(&members), "members (one rank each); the world needs K + 2 ranks")
      ("train", po::value(&trains)->default_value(trains), "training ms per step (host idle), comma-separated")
      ("pre", po::value(&pres)->default_value(pres), "preprocessing CPU ms per step, comma-separated")
      ("bytes", counts::at_least<64>(&bytes), "bytes per step")
      ("depth,d", counts::at_least<1>(&depth), "feed depth (the same for every feed and point)")
      ("seconds", po::value(&target_s)->default_value(target_s), "aim of each run's length; sets the steps per point")
      ("wait", po::value(&wait_text), "wait policy (spin, yield, backoff, backoff:<us>); default: flexcomm's")
      ("feeds", po::value(&chosen)->default_value(chosen), "the feeds to run, comma-separated")
      ("uneven", po::value(&uneven)->default_value(uneven), "member 0 trains this many times as long as the others")
      ("per-rank", po::bool_switch(&per_rank), "print each rank's CPU and the pieces it made (adaptive) on stderr")
      ("json,J", po::value(&json_path)->default_value(json_path), "JSON output file (rank 0)");
  if (const auto status = benchmark_flags::parse(argc, argv, flags, world.rank())) return *status;
  try {  // checks across flags, after --help so that the help needs no -K; refused like a bad flag
    fc::check(members > 0, "feed_sweep", "--members (-K) is required");
    fc::check(world.size() >= members + 2, "feed_sweep",
              fc::cat("-K ", members, " needs ", members + 2, " ranks (two producers), world has ", world.size()));
  } catch (const std::exception& e) {
    if (world.rank() == 0) std::cerr << e.what() << "\n" << flags;
    return 2;
  }
  if (!wait_text.empty()) fc::set_default_wait(fc::wait_policy::parse(wait_text));
  bytes = bytes / 8 * 8;
  const auto wait = fc::default_wait();
  if (world.rank() == 0) {
    std::printf("# flexcomm feed sweep on %s: K=%d one-rank members, %zu bytes/step, depth %d, wait %s (max sleep %lld "
                "us), %u cores; training sleeps (host idle), preprocessing burns CPU\n",
                fc::mpi_implementation::name, members, bytes, depth, fc::name_of(wait.kind),
                static_cast<long long>(wait.max_sleep.count()), std::thread::hardware_concurrency());
    std::printf("# %10s %6s %6s %9s %7s %16s %5s %7s %9s %9s %10s %9s %7s %6s\n", "size", "count", "type", "train(ms)",
                "pre(ms)", "feed", "ranks", "steps", "wall(s)", "cpu(s)", "wall/best", "cpu/low", "made_t", "#wrong");
  }
  const std::vector<feed_run> every_feed = {{"local_feed", -1},  {"one_to_many_1p", 1}, {"one_to_many_2p", 2},
                                            {"all_shared", -1},  {"adaptive_1p", 1},    {"adaptive_2p", 2},
                                            {"adaptive_0p", -1}};
  // The chosen feeds in the order above: the fixed ones first, then the adaptive ones.
  std::vector<feed_run> feeds;
  std::size_t fixed = 0;
  {
    std::vector<std::string> names;
    std::stringstream in(chosen);
    for (std::string name; std::getline(in, name, ',');) names.push_back(name);
    for (const auto& f : every_feed)
      if (std::find(names.begin(), names.end(), f.name) != names.end()) {
        feeds.push_back(f);
        fixed += std::string(f.name).rfind("adaptive", 0) == 0 ? 0 : 1;
      }
    if (feeds.size() != names.size() || fixed == 0) {
      if (world.rank() == 0)
        std::cerr << "feed_sweep: --feeds '" << chosen << "': name feeds of the list above, one fixed feed at least\n";
      return 2;
    }
  }
  std::ostringstream json;
  json << "{\"benchmark\":\"feed_sweep\",\"members\":" << members << ",\"bytes\":" << bytes << ",\"depth\":" << depth
       << ",\"wait\":\"" << fc::name_of(wait.kind) << ":" << wait.max_sleep.count() << "\",\"cores\":"
       << std::thread::hardware_concurrency() << ",\"uneven\":" << uneven << ",\"points\":[";
  bool first_point = true;
  std::vector<double> worst_wall(feeds.size() - fixed, 0), worst_cpu(feeds.size() - fixed, 0);  // per adaptive feed
  for (double train : list_of(trains))
    for (double pre : list_of(pres)) {
      // Steps so that the best feed runs about `seconds`: its step takes at least the training and
      // the preprocessing spread over the cores. And so that the steps' preprocessing comes to
      // 64 ms at least: at 16 steps of 1 ms (50 ms of training) the job's whole CPU was 20-30 ms,
      // and what every rank costs once (a few wakes, the first touch of its slots) moved the
      // same code's CPU ratio between 1.02 and 1.13 from run to run.
      const double ideal_ms = std::max(train, pre / std::max(1u, std::thread::hardware_concurrency()));
      const auto steps = static_cast<std::int64_t>(std::max(target_s * 1e3 / ideal_ms, 64 / pre));
      const point p{train, pre, std::clamp<std::int64_t>(steps, 10, 200)};
      std::vector<result> rows;
      for (const auto& f : feeds) {
        const std::string name = f.name;
        if (name == "local_feed") rows.push_back(run<fc::local_feed>(world, f, members, p, bytes, depth));
        else if (name.rfind("one_to_many", 0) == 0) rows.push_back(run<fc::one_to_many<fc::mpi>>(world, f, members, p, bytes, depth));
        else if (name == "all_shared") rows.push_back(run<fc::all_shared<fc::mpi>>(world, f, members, p, bytes, depth));
        else rows.push_back(run<fc::adaptive<fc::mpi>>(world, f, members, p, bytes, depth));
      }
      if (world.rank() != 0) continue;
      double best_wall = std::numeric_limits<double>::max(), low_cpu = best_wall;
      for (std::size_t i = 0; i < fixed; ++i) {
        best_wall = std::min(best_wall, rows[i].wall);
        low_cpu = std::min(low_cpu, rows[i].cpu);
      }
      json << (first_point ? "" : ",") << "{\"train_ms\":" << train << ",\"pre_ms\":" << pre << ",\"steps\":" << p.steps
           << ",\"best_fixed_wall_s\":" << best_wall << ",\"lowest_fixed_cpu_s\":" << low_cpu << ",\"feeds\":[";
      first_point = false;
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const auto& r = rows[i];
        std::printf("  %10zu %6lld %6s %9.1f %7.1f %16s %5d %7lld %9.3f %9.3f %10.2f %9.2f %7lld %6d\n", bytes,
                    static_cast<long long>(p.steps), "byte", train, pre, r.feed.c_str(), r.ranks,
                    static_cast<long long>(p.steps), r.wall, r.cpu, r.wall / best_wall, r.cpu / low_cpu,
                    static_cast<long long>(r.made_by_trainers), r.exact ? 0 : 1);
        json << (i ? "," : "") << "{\"feed\":\"" << r.feed << "\",\"ranks\":" << r.ranks << ",\"wall_s\":" << r.wall
             << ",\"cpu_s\":" << r.cpu << ",\"wall_over_best\":" << r.wall / best_wall
             << ",\"cpu_over_lowest\":" << r.cpu / low_cpu << ",\"made_by_trainers\":" << r.made_by_trainers
             << ",\"exact\":" << (r.exact ? "true" : "false") << "}";
      }
      json << "]}";
      for (std::size_t i = fixed; i < rows.size(); ++i) {
        worst_wall[i - fixed] = std::max(worst_wall[i - fixed], rows[i].wall / best_wall);
        worst_cpu[i - fixed] = std::max(worst_cpu[i - fixed], rows[i].cpu / low_cpu);
      }
      std::fflush(stdout);
    }
  json << "]}\n";
  if (world.rank() == 0) {
    for (std::size_t a = 0; a < worst_wall.size(); ++a)
      std::printf("# %s against the best fixed feed at each point: worst wall ratio %.2f, worst cpu ratio %.2f\n",
                  feeds[fixed + a].name, worst_wall[a], worst_cpu[a]);
    if (!json_path.empty()) std::ofstream(json_path) << json.str();
  }
  return 0;
}
