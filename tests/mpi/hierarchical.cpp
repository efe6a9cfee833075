#define BOOST_TEST_MODULE mpi_hierarchical
#include "mpi_fixture.hpp"
#include "errors.hpp"
#include "exact_values.hpp"

#include <algorithm>
#include <boost/mpl/list.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace fc = flexcomm;
using fc::mpi;
using fc::testing::all_ranks;
using fc::testing::world;
using fc::testing::all_ops;
using fc::testing::contains;
using fc::testing::element_types;
using fc::testing::gradient;
using fc::testing::same;

namespace {

using adapters = boost::mpl::list<fc::subgroup_allreduce<mpi>, fc::overlapped_ring<mpi>>;

// Pretends the world's ranks sit on hosts (FLEXCOMM_HOSTS) while it lives; every rank sets the same.
struct pretend_hosts {
  explicit pretend_hosts(const std::string& blocks) { setenv("FLEXCOMM_HOSTS", blocks.c_str(), 1); }
  ~pretend_hosts() { unsetenv("FLEXCOMM_HOSTS"); }
};

// Host maps of this world size: one host, a rank per host, pairs, a lone rank first, 2+1+2...
std::vector<std::string> host_maps(int n) {
  std::vector<std::string> out{std::to_string(n)};
  if (n == 1) return out;
  std::string singles = "1", pairs;
  for (int r = 1; r < n; ++r) singles += "+1";
  for (int r = 0; r < n; r += 2) pairs += fc::cat(r ? "+" : "", std::min(2, n - r));
  out.push_back(singles);
  out.push_back(pairs);
  out.push_back(fc::cat("1+", n - 1));
  if (n == 5) out.push_back("2+1+2");
  if (n >= 4) out.push_back(fc::cat(n - 1, "+1"));
  return out;
}

// What MPI_Allreduce over `comm` gives (avg: MPI_SUM, then the same division the adapters do).
template <class T>
std::vector<T> mpi_allreduce(const mpi::communicator& comm, fc::op o, std::vector<T> g) {
  mpi::iallreduce(comm, fc::span<T>(g), o).wait();
  return g;
}

// Three steps of `Sync` on `member` over gradients of awkward sizes (zero, below the rank count,
// not divisible by it); true when every gradient equals MPI_Allreduce's result.
template <class Sync, class T>
bool equals_mpi_allreduce(const mpi::communicator& member, fc::sync_options options, std::string& detail) {
  const std::vector<std::size_t> sizes{0, 1, 3, 64, 333, 2049};
  Sync sync(member, options);
  const int rank = world().rank();
  bool ok = true;
  for (int step = 0; step < 3; ++step) {
    std::vector<std::vector<T>> grads(sizes.size()), expected(sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      grads[i] = gradient<T>(rank, step, static_cast<int>(i), sizes[i]);
      expected[i] = mpi_allreduce(member, options.op, grads[i]);
    }
    for (std::size_t i = sizes.size(); i-- > 0;) sync.ready(static_cast<int>(i), fc::span<T>(grads[i]));
    sync.finish();
    for (std::size_t i = 0; i < sizes.size(); ++i)
      if (!same(grads[i], expected[i])) {
        ok = false;
        detail = fc::cat("step ", step, " gradient ", i, " (", sizes[i], " elements)");
      }
  }
  return ok;
}

// What each adapter's automatic choice weighs the tiers against.
template <class Sync>
constexpr fc::flat_algorithm flat_of = std::is_same_v<Sync, fc::overlapped_ring<mpi>> ? fc::flat_algorithm::ring
                                                                                      : fc::flat_algorithm::backend_allreduce;

}  // namespace

// Hierarchical forced on: the intra-host stages run even where the ranks share one machine, and
// results equal MPI_Allreduce's for every type and op. Each type takes the next pretend host map
// (the seven types cover every map at every world size), which keeps 6 ranks on 2 cores quick.
// Labelled: only pretend hosts vary here, so the cluster suite leaves it out (!@pretend_hosts_only).
BOOST_TEST_DECORATOR(*boost::unit_test::label("pretend_hosts_only"))
BOOST_AUTO_TEST_CASE_TEMPLATE(forced_hierarchy_equals_mpi_allreduce_for_every_op, T, element_types) {
  std::mt19937 rng(77 + static_cast<unsigned>(fc::dtype_of<T>));  // same on every rank
  const auto maps = host_maps(world().size());
  {
    const auto& hosts = maps[static_cast<std::size_t>(fc::dtype_of<T>) % maps.size()];
    pretend_hosts pretend(hosts);
    fc::sync_options options;
    options.hierarchical = fc::hierarchy::on;
    const std::size_t capacities[] = {1, 700, 1 << 20};
    const std::size_t segments[] = {16, 1000, 1 << 20};
    options.bucket_bytes = capacities[std::uniform_int_distribution<std::size_t>(0, 2)(rng)];
    options.segment_bytes = segments[std::uniform_int_distribution<std::size_t>(0, 2)(rng)];
    options.segments_in_flight = std::uniform_int_distribution<int>(1, 3)(rng);
    for (fc::op o : all_ops) {
      options.op = o;
      std::string detail;
      const auto where = fc::cat("hosts ", hosts, " op ", fc::name_of(o), " buckets of ", options.bucket_bytes,
                                 " bytes, segments of ", options.segment_bytes, " x", options.segments_in_flight);
      options.launch_when_full = false;
      BOOST_TEST(all_ranks(equals_mpi_allreduce<fc::subgroup_allreduce<mpi>, T>(world(), options, detail)),
                 "subgroup_allreduce " << where << " " << detail);
      options.launch_when_full = true;
      BOOST_TEST(all_ranks(equals_mpi_allreduce<fc::subgroup_allreduce<mpi>, T>(world(), options, detail)),
                 "subgroup_allreduce launched when full " << where << " " << detail);
      BOOST_TEST(all_ranks(equals_mpi_allreduce<fc::overlapped_ring<mpi>, T>(world(), options, detail)),
                 "overlapped_ring " << where << " " << detail);
    }
  }
}

// On pretend hosts that are one machine, each host's two intra-host stages (a reduce to the
// leader, a broadcast from it) go through shared memory by default: results still equal
// MPI_Allreduce's, in chunks of a small slot too (the broadcast and the reduction then pipeline
// several chunks), and the same with shared memory off; a rank alone on its host has no stage
// to share, nor has a pretend host whose ranks are on several real ones.
BOOST_AUTO_TEST_CASE_TEMPLATE(intra_host_stages_in_shared_memory_equal_mpi_allreduce, Sync, adapters) {
  const int n = world().size(), me = world().rank();
  const auto real = fc::hosts_of(world());  // the cluster suite runs this across simulated hosts
  for (const auto& hosts : host_maps(n)) {
    const auto map = fc::host_map::parse(hosts);
    // One rank a host has no stage to share: the maps with a lone rank beside a pair cover it
    // (kept at 2 ranks, where it is the only split).
    if (map.hosts() < 2 || (map.hosts() == n && n > 2)) continue;
    pretend_hosts pretend(hosts);
    // This rank's pretend host shares memory when it has 2+ ranks, all on this rank's real host.
    const auto& mates = map.ranks_on(map.host_of(me));
    const bool shares_host = mates.size() > 1 && std::all_of(mates.begin(), mates.end(), [&](int r) {
                               return real.host_of(r) == real.host_of(me);
                             });
    for (const auto use : {fc::shared_memory_use::automatic, fc::shared_memory_use::off}) {
      fc::sync_options options;
      options.hierarchical = fc::hierarchy::on;
      options.shared_memory = use;
      options.shared_memory_slot_bytes = 256;  // 64 floats a chunk: the larger gradients take many
      options.bucket_bytes = 4096;
      {
        Sync sync(world(), options);
        BOOST_TEST(all_ranks(sync.shared_memory() == (use == fc::shared_memory_use::automatic && shares_host)),
                   hosts << " shared memory " << fc::name_of(use));
      }
      // A reduction that divides and one that selects, on a real and an integer type (every op on
      // every type is forced_hierarchy's case; here the stages' transport is what varies).
      std::string detail;
      options.op = fc::op::avg;
      BOOST_TEST(all_ranks(equals_mpi_allreduce<Sync, float>(world(), options, detail)),
                 hosts << " shared memory " << fc::name_of(use) << " avg float " << detail);
      options.op = fc::op::max;
      BOOST_TEST(all_ranks(equals_mpi_allreduce<Sync, std::int64_t>(world(), options, detail)),
                 hosts << " shared memory " << fc::name_of(use) << " max int64 " << detail);
    }
  }
}

// Members of interleaved world ranks on pretend hosts of two: each member has a rank on several
// hosts, and hosts hold ranks of several members; nothing mixes.
BOOST_AUTO_TEST_CASE_TEMPLATE(interleaved_members_across_hosts, Sync, adapters) {
  const int rank = world().rank(), size = world().size();
  std::string pairs;
  for (int r = 0; r < size; r += 2) pairs += fc::cat(r ? "+" : "", std::min(2, size - r));
  pretend_hosts pretend(pairs);
  auto member = world().split(rank % 3 == 0 ? 0 : 1, rank, fc::cat("member ", rank % 3 == 0 ? 0 : 1));
  for (auto mode : {fc::hierarchy::on, fc::hierarchy::automatic}) {
    fc::sync_options options;
    options.hierarchical = mode;
    options.bucket_bytes = 256;
    options.segment_bytes = 64;
    std::string detail;
    BOOST_TEST(all_ranks(equals_mpi_allreduce<Sync, std::int64_t>(member, options, detail)), pairs << " " << detail);
    options.op = fc::op::sum;
    BOOST_TEST(all_ranks(equals_mpi_allreduce<Sync, float>(member, options, detail)), pairs << " " << detail);
  }
}

// auto: hierarchical exactly when the member spans hosts and some host holds two of its ranks.
BOOST_AUTO_TEST_CASE_TEMPLATE(automatic_choice_follows_the_host_map, Sync, adapters) {
  const int n = world().size();
  fc::sync_options options;
  options.hierarchical = fc::hierarchy::automatic;
  for (const auto& hosts : host_maps(n)) {
    pretend_hosts pretend(hosts);
    const auto map = fc::host_map::parse(hosts);
    Sync sync(world(), options);
    const bool expected = fc::use_hierarchy(fc::hierarchy::automatic, map, flat_of<Sync>);
    BOOST_TEST(all_ranks(sync.hierarchical() == expected), hosts);
    BOOST_TEST(all_ranks(sync.hosts() == map), hosts << " seen as " << sync.hosts().str());
  }
  options.hierarchical = fc::hierarchy::off;
  {
    pretend_hosts pretend(host_maps(n).back());
    Sync sync(world(), options);
    BOOST_TEST(all_ranks(!sync.hierarchical()));
  }
  // Without FLEXCOMM_HOSTS the real machine is one host: flat, as before.
  options.hierarchical = fc::hierarchy::automatic;
  Sync sync(world(), options);
  BOOST_TEST(all_ranks(sync.hosts().ranks() == n));
}

// Random reals through the hierarchy: within MPI's tolerance, and the same bits on every rank.
BOOST_AUTO_TEST_CASE_TEMPLATE(random_reals_have_the_same_bits_everywhere, Sync, adapters) {
  const int rank = world().rank(), n = world().size();
  const auto maps = host_maps(n);
  pretend_hosts pretend(maps[std::min<std::size_t>(2, maps.size() - 1)]);
  std::mt19937 rng(5 + static_cast<unsigned>(rank));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  fc::sync_options options;
  options.hierarchical = fc::hierarchy::on;
  options.bucket_bytes = 16 << 10;
  options.segment_bytes = 1 << 10;
  Sync sync(world(), options);
  for (int step = 0; step < 2; ++step) {
    std::vector<float> g(30000), sum(g.size()), magnitude(g.size()), total(g.size());
    for (auto& x : g) x = normal(rng);
    for (std::size_t k = 0; k < g.size(); ++k) magnitude[k] = std::fabs(g[k]);
    MPI_Allreduce(g.data(), sum.data(), static_cast<int>(g.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(magnitude.data(), total.data(), static_cast<int>(g.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    sync.ready(0, fc::span<float>(g));
    sync.finish();
    bool ok = true;
    double checksum = 0;
    for (std::size_t k = 0; k < g.size(); ++k) {
      ok = ok && std::fabs(g[k] - sum[k] / n) <= 2e-6 * (total[k] / n) + 1e-30;
      checksum += g[k];
    }
    double from_zero = checksum;
    mpi::ibcast(world(), fc::span<double>(&from_zero, 1), 0).wait();
    BOOST_TEST(all_ranks(ok), "step " << step);
    BOOST_TEST(all_ranks(from_zero == checksum), "step " << step);
  }
}

// Across the cluster suite's simulated hosts (tests/cluster/run.sh sets FLEXCOMM_TEST_HOSTS),
// nothing pretends: MPI's shared split must find the hosts the launcher used, automatic choice
// must average hierarchically, and the results must equal MPI_Allreduce's. On one machine the
// world is one host and both adapters stay flat.
BOOST_AUTO_TEST_CASE_TEMPLATE(real_hosts_are_found_and_used, Sync, adapters) {
  const char* expected = std::getenv("FLEXCOMM_TEST_HOSTS");
  const auto map = fc::hosts_of(world());
  const auto want = expected && *expected ? fc::host_map::parse(expected) : fc::host_map::single(world().size());
  BOOST_TEST(all_ranks(map == want), "found hosts " << map.str() << ", launched on " << want.str());
  fc::sync_options options;
  options.hierarchical = fc::hierarchy::automatic;
  options.bucket_bytes = 4096;
  options.segment_bytes = 512;
  {
    Sync sync(world(), options);
    BOOST_TEST(all_ranks(sync.hierarchical() == fc::use_hierarchy(fc::hierarchy::automatic, want, flat_of<Sync>)),
               want.str());
  }
  for (fc::op o : {fc::op::sum, fc::op::avg}) {
    options.op = o;
    std::string detail;
    BOOST_TEST(all_ranks(equals_mpi_allreduce<Sync, float>(world(), options, detail)), want.str() << " " << detail);
  }
}

BOOST_AUTO_TEST_CASE(host_maps_and_settings_are_checked) {
  const int n = world().size();
  {
    pretend_hosts pretend(fc::cat(n + 1));
    BOOST_CHECK_EXCEPTION(fc::hosts_of(world()), fc::error, [&](const fc::error& e) {
      return contains(e.cause(), fc::cat("describes ", n + 1, " ranks, world has ", n));
    });
  }
  setenv("FLEXCOMM_HIERARCHICAL", "sometimes", 1);
  BOOST_CHECK_EXCEPTION(fc::hierarchy_from_env(), fc::error,
                        [](const fc::error& e) { return contains(e.cause(), "expected auto, on or off"); });
  setenv("FLEXCOMM_HIERARCHICAL", "on", 1);
  BOOST_TEST((fc::sync_options{}.hierarchical == fc::hierarchy::on));
  unsetenv("FLEXCOMM_HIERARCHICAL");
  BOOST_TEST((fc::sync_options{}.hierarchical == fc::hierarchy::automatic));
  // A member whose ranks disagree on the setting is told so, on every rank, at construction.
  if (n > 1) {
    fc::sync_options options;
    options.hierarchical = world().rank() == 0 ? fc::hierarchy::on : fc::hierarchy::off;
    BOOST_CHECK_EXCEPTION((fc::overlapped_ring<mpi>{world(), options}), fc::error,
                          [](const fc::error& e) { return contains(e.cause(), "differs across the member's ranks"); });
  }
  BOOST_TEST(all_ranks(true));
}
