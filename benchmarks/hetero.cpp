// hetero: a heterogeneous ensemble, members whose steps cost up to 8x apart and that stop after
// different numbers of steps (early stopping), trained to the end under several splits of the
// same ranks, one after the other in one job: the time until every member has finished, and the
// CPU the ranks spent (--feed: how the members' steps are loaded). Each step a trainer's
// accelerator computes its shards (the host sleeps for member cost x its share of the step, as in
// overlap's idle backward) and its member averages a gradient through subgroup_allreduce, so a
// member of r ranks steps in about cost/r + sync.
//   mpiexec.mpich -n 12 build/benchmarks/hetero -j hetero.json
// Rows: "even" (the ranks dealt evenly), "by work" (ranks in proportion to cost x steps), every
// --split given, --search splits that move one rank from the fastest split so far, and "auto" (members=auto:N planned from the costs as hints, pipeline/
// member_costs.hpp: even pace per step). "best fixed" names the fastest of the fixed rows. The
// speedup is the even row's wall over the row's.
#include <boost/program_options.hpp>

#include <flexcomm/flexcomm.hpp>

#include "../examples/common/counts.hpp"
#include "flags.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fc = flexcomm;
namespace po = boost::program_options;
using fc::mpi;

namespace {

template <class Feed>
using pipeline = fc::ensemble_pipeline<Feed, fc::subgroup_allreduce<mpi>, fc::many_to_one<mpi>>;

struct member_spec {
  double cost_ms;       // one step of the member's whole batch on one rank
  std::int64_t steps;   // when the member stops (converged, or pruned)
};

struct row {
  std::string name, layout;
  double wall_s = 0, cpu_s = 0;
  long long wrong = 0;
};

std::vector<double> numbers(const std::string& text, const char* what) {
  std::vector<double> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    std::size_t used = 0;
    double v = 0;
    try {
      v = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    fc::check(used == item.size() && used > 0 && std::isfinite(v) && v > 0, "hetero",
              fc::cat(what, ": '", item, "' is not a number > 0 in '", text, "'"));
    out.push_back(v);
  }
  return out;
}

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// `ranks` dealt in proportion to `weights`, at least one each (largest remainders).
std::vector<int> proportional(const std::vector<double>& weights, int ranks) {
  const std::size_t n = weights.size();
  std::vector<int> sizes(n, 1);
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  const int spare = ranks - static_cast<int>(n);
  std::vector<double> share(n);
  int given = 0;
  for (std::size_t m = 0; m < n; ++m) {
    share[m] = weights[m] / total * spare;
    sizes[m] += static_cast<int>(share[m]);
    given += static_cast<int>(share[m]);
  }
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return share[a] - std::floor(share[a]) > share[b] - std::floor(share[b]);
  });
  for (std::size_t i = 0; given < spare; ++i, ++given) ++sizes[order[i % n]];
  return sizes;
}

// Trains every member to its last step under `layout`; the wall until the last member finished
// and the CPU all ranks spent, the same on every rank. With `handover`, a member that reaches its
// last step ends with ctx.finish_member() and its ranks join the running member with the longest
// expected step (cost / ranks), which then steps faster; `ends` (on rank 0, the aggregator) gets
// how each member ended.
// `Feed`: each member loads its own steps (local_feed), or the members share the loading
// (all_shared, adaptive), which ties their paces together within the feed's depth.
template <class Feed>
row train(const mpi::communicator& world, const std::string& name, const fc::ensemble_layout& layout,
          const std::vector<member_spec>& members, std::size_t gradient, bool handover,
          std::vector<fc::handover_record>& ends) {
  typename pipeline<Feed>::options options;
  options.feed.steps = std::max_element(members.begin(), members.end(), [](auto& a, auto& b) { return a.steps < b.steps; })->steps;
  options.feed.shard_capacity = 8;
  pipeline<Feed> pipe(world, layout, options);
  std::map<int, std::vector<float>> models;  // a member's parameters, handed to a rank that joins it
  if (handover) {
    std::vector<double> costs;
    for (const auto& m : members) costs.push_back(m.cost_ms);
    pipe.on_handover({[&](int m) {
                        auto& p = models.try_emplace(m, std::vector<float>(16, 0.0f)).first->second;
                        return std::vector<fc::span<std::byte>>{fc::span<std::byte>(reinterpret_cast<std::byte*>(p.data()),
                                                                                    p.size() * sizeof(float))};
                      },
                      costs});
  }
  long long wrong = 0;
  MPI_Barrier(world.native());
  const double cpu0 = cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  pipe.run(
      [](std::int64_t step, int shard, fc::span<std::byte> out) {
        const std::int64_t v = step * 1000 + shard;
        std::memcpy(out.data(), &v, sizeof v);
        return sizeof v;
      },
      [&](auto& ctx) {  // called again for the member a rank joins
        const auto& spec = members[static_cast<std::size_t>(ctx.member())];
        auto& model = models.try_emplace(ctx.member(), std::vector<float>(16, 0.0f)).first->second;
        std::vector<float> grad(gradient);
        while (auto batch = ctx.feed().next()) {
          // The accelerator computes this rank's share of the step (it changes at a hand-over).
          const std::chrono::duration<double, std::milli> compute(spec.cost_ms * batch->shards() / layout.shards_per_step());
          std::this_thread::sleep_until(std::chrono::steady_clock::now() +
                                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(compute));
          std::fill(grad.begin(), grad.end(), static_cast<float>(ctx.rank_in_member() + 1));
          ctx.sync().ready(0, fc::span<float>(grad));
          ctx.sync().finish();
          const float want = static_cast<float>(ctx.member_size() + 1) / 2;  // the mean of 1..size
          wrong += grad.front() != want || grad.back() != want;
          for (float& p : model) p -= 1e-3f * want;
          if (batch->step() + 1 < spec.steps) continue;
          if (handover) ctx.finish_member();  // this member converged: its ranks go on elsewhere
          return;
        }
      },
      [&](auto& ctx) {
        if (handover) ends = ctx.member_ends();
      });
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double sums[2] = {-wall, cpu_seconds() - cpu0};
  double most = 0;
  MPI_Allreduce(&sums[0], &most, 1, MPI_DOUBLE, MPI_MIN, world.native());
  MPI_Allreduce(MPI_IN_PLACE, &sums[1], 1, MPI_DOUBLE, MPI_SUM, world.native());
  MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG_LONG, MPI_SUM, world.native());
  return {name, handover ? layout.str() + " + hand-over" : layout.str(), -most, sums[1], wrong};
}

}  // namespace

int main(int argc, char** argv) {
  fc::environment env(argc, argv);
  const auto& world = env.world();
  std::string costs_text, steps_text, json, feed = "local";
  std::vector<std::string> splits;
  double unit_ms = 20;
  std::size_t gradient = 65536;
  int repeat = 1, search = 6;
  po::options_description opts("hetero");
  opts.add_options()("help,h", "this help")
      ("costs", po::value(&costs_text)->default_value("1,1.6,2.5,4,6,8"),
       "each member's step on one rank, in units (at least 2 members)")
      ("steps", po::value(&steps_text)->default_value("150,100,120,80,100,120"), "the step each member stops at")
      ("unit-ms", po::value(&unit_ms)->default_value(unit_ms), "milliseconds per cost unit")
      ("gradient", counts::at_least<1>(&gradient), "floats each member averages per step")
      ("split", po::value(&splits)->composing(), "another fixed split to try, e.g. 1,1,2,2,3,3 (repeatable)")
      ("search", counts::at_least<0>(&search), "fixed splits tried by moving one rank from the fastest so far")
      ("feed", po::value(&feed)->default_value(feed), "local (each member loads its own), all_shared or adaptive")
      ("repeat,n", counts::at_least<1>(&repeat), "runs of every row (the fastest is kept)")
      ("json,j", po::value(&json), "write the rows as JSON here");
  if (const auto status = benchmark_flags::parse(argc, argv, opts, world.rank())) return *status;
  std::vector<double> costs, stops;
  std::vector<std::vector<int>> given;
  try {  // the same text on every rank: every rank refuses it alike, rank 0 says why
    numbers(fc::cat(unit_ms), "--unit-ms");
    costs = numbers(costs_text, "--costs");
    stops = numbers(steps_text, "--steps");
    fc::check(costs.size() == stops.size() && costs.size() >= 2, "hetero",
              fc::cat("--costs has ", costs.size(), " members and --steps ", stops.size(), "; give both, for 2 or more"));
    fc::check(feed == "local" || feed == "all_shared" || feed == "adaptive", "hetero",
              fc::cat("--feed ", feed, ": local, all_shared or adaptive"));
    fc::check(world.size() >= static_cast<int>(costs.size()), "hetero",
              fc::cat(costs.size(), " members need at least as many ranks; the job has ", world.size()));
    for (const auto& s : splits) {
      std::vector<int> sizes;
      for (double v : numbers(s, "--split")) sizes.push_back(static_cast<int>(v));
      fc::ensemble_layout(0, sizes, 0).validate(world.size());
      fc::check(sizes.size() == costs.size(), "hetero", fc::cat("--split ", s, " has ", sizes.size(), " members, --costs ", costs.size()));
      given.push_back(sizes);
    }
  } catch (const fc::error& e) {
    if (world.rank() == 0) std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  const int n = static_cast<int>(costs.size());
  std::vector<member_spec> members;
  std::vector<double> work;
  for (int m = 0; m < n; ++m) {
    members.push_back({costs[static_cast<std::size_t>(m)] * unit_ms, static_cast<std::int64_t>(stops[static_cast<std::size_t>(m)])});
    work.push_back(costs[static_cast<std::size_t>(m)] * stops[static_cast<std::size_t>(m)]);
  }
  std::vector<std::pair<std::string, std::vector<int>>> fixed{
      {"even", proportional(std::vector<double>(costs.size(), 1.0), world.size())},
      {"by work", proportional(work, world.size())}};
  for (std::size_t i = 0; i < splits.size(); ++i) fixed.push_back({"split " + splits[i], given[i]});
  const auto planned = fc::plan_from_hints(world, fc::ensemble_layout::parse(fc::cat("members=auto:", n)), costs);
  if (world.rank() == 0) std::printf("# %s\n", planned.text().c_str());

  std::vector<fc::handover_record> ends;
  auto best_of = [&](const std::string& name, const fc::ensemble_layout& layout, bool handover = false) {
    row best;
    for (int i = 0; i < repeat; ++i) {
      auto r = feed == "all_shared" ? train<fc::all_shared<mpi>>(world, name, layout, members, gradient, handover, ends)
               : feed == "adaptive"   ? train<fc::adaptive<mpi>>(world, name, layout, members, gradient, handover, ends)
                                      : train<fc::local_feed>(world, name, layout, members, gradient, handover, ends);
      if (i == 0 || r.wall_s < best.wall_s) best = r;
    }
    return best;
  };
  std::vector<row> rows;
  std::vector<std::vector<int>> tried;
  for (const auto& [name, sizes] : fixed) {
    rows.push_back(best_of(name, fc::ensemble_layout(0, sizes, 0)));
    tried.push_back(sizes);
  }
  // The search: one rank moved from one member to another, from the fastest split so far, kept
  // when it is faster. Every rank draws the same moves.
  std::mt19937 draw(1);
  for (int measured = 0, drawn = 0; measured < search && drawn < 100 * search; ++drawn) {
    const auto best = std::min_element(rows.begin(), rows.end(), [](auto& a, auto& b) { return a.wall_s < b.wall_s; });
    auto sizes = tried[static_cast<std::size_t>(best - rows.begin())];
    const auto from = static_cast<std::size_t>(draw() % sizes.size()), to = static_cast<std::size_t>(draw() % sizes.size());
    if (from == to || sizes[from] == 1) continue;
    --sizes[from];
    ++sizes[to];
    if (std::find(tried.begin(), tried.end(), sizes) != tried.end()) continue;
    std::string text;
    for (std::size_t m = 0; m < sizes.size(); ++m) text += fc::cat(m ? "," : "", sizes[m]);
    rows.push_back(best_of("search " + text, fc::ensemble_layout(0, sizes, 0)));
    tried.push_back(sizes);
    ++measured;
  }
  const auto best_fixed = std::min_element(rows.begin(), rows.end(), [](auto& a, auto& b) { return a.wall_s < b.wall_s; });
  const std::string best_name = best_fixed->name;
  rows.push_back(best_of("auto", planned.layout));
  rows.push_back(best_of("auto+hand-over", planned.layout, true));

  if (world.rank() != 0) return 0;
  std::printf("# hetero: %d ranks, %d members, costs %s units of %.2f ms, stopping at steps %s, %zu floats averaged, "
              "feed %s\n",
              world.size(), n, costs_text.c_str(), unit_ms, steps_text.c_str(), gradient, feed.c_str());
  std::printf("# %-14s %-28s %9s %9s %9s %7s\n", "config", "layout", "wall(s)", "cpu(s)", "speedup", "#wrong");
  for (const auto& r : rows)
    std::printf("  %-14s %-28s %9.3f %9.3f %9.2f %7lld\n", r.name.c_str(), r.layout.c_str(), r.wall_s, r.cpu_s,
                rows.front().wall_s / r.wall_s, r.wrong);
  std::printf("# best fixed: %s\n", best_name.c_str());
  std::printf("# auto+hand-over, as the aggregator saw the members end (the last run):\n");
  for (const auto& e : ends)
    std::printf("#   member %d ended after step %lld; %s\n", e.member, static_cast<long long>(e.ended_at),
                e.joined < 0 ? "no member took its ranks"
                             : fc::cat("its ranks joined member ", e.joined, " at its step ", e.joined_at).c_str());
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\"ranks\": " << world.size() << ", \"costs\": \"" << costs_text << "\", \"steps\": \"" << steps_text
        << "\", \"unit_ms\": " << unit_ms << ", \"feed\": \"" << feed << "\", \"best_fixed\": \"" << best_name << "\", \"rows\": [";
    for (std::size_t i = 0; i < rows.size(); ++i)
      out << (i ? ", " : "") << "{\"config\": \"" << rows[i].name << "\", \"layout\": \"" << rows[i].layout
          << "\", \"wall_s\": " << rows[i].wall_s << ", \"cpu_s\": " << rows[i].cpu_s
          << ", \"speedup_vs_even\": " << rows.front().wall_s / rows[i].wall_s << ", \"wrong\": " << rows[i].wrong << "}";
    out << "]}\n";
  }
  return 0;
}
