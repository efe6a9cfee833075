#define BOOST_TEST_MODULE mpi_pipeline
#include "mpi_fixture.hpp"
#include "errors.hpp"

#include <flexcomm/pipeline/preset_layout.hpp>
#include <flexcomm/pipeline/presets.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <chrono>
#include <map>
#include <optional>
#include <thread>
#include <string>
#include <type_traits>
#include <vector>

namespace fc = flexcomm;
using fc::mpi;
using fc::testing::world;

namespace {

// A deterministic trainer: a linear model on integer-valued records (4 features and a target,
// each in -3..3), plain gradient descent with a power-of-two learning rate. Members have at most
// two ranks, so their averages are a + b then a halving, the same rounding in any algorithm:
// every preset must produce the same model bit for bit.
constexpr int features = 4, record_bytes = features + 1, records_per_shard = 3;
constexpr std::int64_t steps = 6;
constexpr float learning_rate = 1.0f / 64;

std::int8_t value_of(std::int64_t step, int shard, int i) {
  std::uint64_t x = static_cast<std::uint64_t>(step) * 1000003u + static_cast<std::uint64_t>(shard) * 7919u +
                    static_cast<std::uint64_t>(i) * 104729u;
  x ^= x >> 13;
  x *= 0x9E3779B97F4A7C15ull;
  return static_cast<std::int8_t>(static_cast<int>((x >> 33) % 7) - 3);
}

std::size_t load(std::int64_t step, int shard, fc::span<std::byte> out) {
  const std::size_t n = records_per_shard * record_bytes;
  fc::check(out.size() >= n, "test loader", "slot too small");
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>(value_of(step, shard, static_cast<int>(i)));
  return n;
}

struct linear_model {
  std::vector<float> weights = std::vector<float>(features, 0.0f);
  std::vector<float> bias = std::vector<float>(1, 0.0f);
  std::vector<float> grad_weights = std::vector<float>(features), grad_bias = std::vector<float>(1);

  // Sum over the records of (w.x + b - y) * (x, 1).
  void gradient(const std::int8_t* records, std::size_t count) {
    std::fill(grad_weights.begin(), grad_weights.end(), 0.0f);
    grad_bias[0] = 0.0f;
    for (std::size_t r = 0; r < count; ++r) {
      const std::int8_t* x = records + r * record_bytes;
      float error = bias[0] - static_cast<float>(x[features]);
      for (int f = 0; f < features; ++f) error += weights[static_cast<std::size_t>(f)] * static_cast<float>(x[f]);
      for (int f = 0; f < features; ++f) grad_weights[static_cast<std::size_t>(f)] += error * static_cast<float>(x[f]);
      grad_bias[0] += error;
    }
  }
  void step() {
    for (int f = 0; f < features; ++f)
      weights[static_cast<std::size_t>(f)] -= learning_rate * grad_weights[static_cast<std::size_t>(f)];
    bias[0] -= learning_rate * grad_bias[0];
  }
  std::vector<float> parameters() const {
    auto p = weights;
    p.push_back(bias[0]);
    return p;
  }
};

// The hand-over of members' linear models: a member's state is its weights and bias, the model
// in `models` under its number (made on first use, on a rank that joins it).
fc::handover_options handover_of(std::map<int, linear_model>& models) {
  return {[&models](int m) {
            auto& model = models[m];
            return std::vector<fc::span<std::byte>>{fc::as_writable_bytes(fc::span<float>(model.weights)),
                                                    fc::as_writable_bytes(fc::span<float>(model.bias))};
          },
          {}};
}

// The same training done serially: what member m of `layout` must end with.
std::vector<float> reference_model(const fc::ensemble_layout& layout, int m) {
  linear_model model;
  const int n = layout.member_size(m);
  for (std::int64_t s = 0; s < steps; ++s) {
    std::vector<float> sum_w(features, 0.0f), sum_b(1, 0.0f);
    for (int r = 0; r < n; ++r) {
      const auto shards = layout.shards_of(m, r);
      std::vector<std::byte> bytes(static_cast<std::size_t>(shards.count) * records_per_shard * record_bytes);
      for (int k = 0; k < shards.count; ++k)
        load(s, shards.first + k,
             fc::span<std::byte>(bytes.data() + static_cast<std::size_t>(k) * records_per_shard * record_bytes,
                                 records_per_shard * record_bytes));
      model.gradient(reinterpret_cast<const std::int8_t*>(bytes.data()), bytes.size() / record_bytes);
      if (r == 0) {
        sum_w = model.grad_weights;
        sum_b = model.grad_bias;
      } else {  // two ranks at most: one addition, as every allreduce does it
        for (int f = 0; f < features; ++f) sum_w[static_cast<std::size_t>(f)] += model.grad_weights[static_cast<std::size_t>(f)];
        sum_b[0] += model.grad_bias[0];
      }
    }
    model.grad_weights = sum_w;
    model.grad_bias = sum_b;
    fc::divide_by(model.grad_weights.data(), features, n);
    fc::divide_by(model.grad_bias.data(), 1, n);
    model.step();
  }
  return model.parameters();
}

std::int64_t digest(std::int64_t seed, fc::span<const std::byte> bytes) {
  std::uint64_t h = 1469598103934665603ull ^ static_cast<std::uint64_t>(seed);
  for (std::byte b : bytes) h = (h ^ static_cast<std::uint64_t>(b)) * 1099511628211ull;
  return static_cast<std::int64_t>(h >> 1);
}

// Members of the trainers left once the largest producer count is taken away: sizes 2 and 1.
std::vector<int> member_sizes(int trainers) {
  std::vector<int> sizes;
  for (int left = trainers; left > 0; left -= 2) sizes.push_back(left >= 2 ? 2 : 1);
  return sizes;
}

struct preset_result {
  std::vector<float> models;           // every member's parameters, member by member
  std::vector<std::int64_t> digests;   // every trainer's digest of the batches it was fed
  bool batches_as_loaded = true;       // every batch equal to the loader's bytes for its shards
};

// While alive, every rank pretends its hosts are `blocks` (set identically on every rank).
struct pretend_hosts {
  explicit pretend_hosts(const std::string& blocks) {
    if (!blocks.empty()) setenv("FLEXCOMM_HOSTS", blocks.c_str(), 1);
  }
  ~pretend_hosts() { unsetenv("FLEXCOMM_HOSTS"); }
  pretend_hosts(const pretend_hosts&) = delete;
  pretend_hosts& operator=(const pretend_hosts&) = delete;
};

// Runs the trainer under preset P on the first ranks of the world, the aggregator on world rank 0.
// With `hosts` (pretend hosts of the whole world), the layout has a producer per host instead of
// P's producers, and the pipeline places it.
template <class P, class Sync = void>
void run_preset(std::map<std::string, preset_result>& results, const std::string& name, int trainers, bool& ok,
                const std::string& hosts = "") {
  const int producers = hosts.empty() ? P::min_producers : fc::host_map::parse(hosts).hosts();
  const int used = producers + trainers;
  if (used > world().size()) return;
  const fc::ensemble_layout layout = hosts.empty() ? fc::ensemble_layout(producers, member_sizes(trainers), 0)
                                                   : fc::ensemble_layout(fc::producers_per_host, member_sizes(trainers), 0);
  const auto comm = world().split(world().rank() < used ? 0 : mpi::communicator::undefined, world().rank(),
                                  "preset " + name);
  if (!comm) return;
  typename P::options options;
  options.feed.steps = steps;
  options.feed.shard_capacity = records_per_shard * record_bytes;
  options = P::configure(options);
  pretend_hosts pretend(hosts);
  typename P::pipeline pipe(comm, layout, options);
  if (!hosts.empty()) {  // every member's trainers where the placement puts them
    const auto& placed = pipe.layout();
    const auto me = placed.role_of(comm.rank());
    ok = ok && placed.producers() == producers &&
         (me.kind == fc::role::producer ? placed.producer_rank(me.producer) == comm.rank()
                                        : placed.trainer_rank(me.member, me.rank_in_member) == comm.rank());
  }
  bool fed_as_loaded = true;
  preset_result result;
  pipe.run(
      load,
      [&](auto& ctx) {
        linear_model model;
        std::int64_t seen = 0, expected_step = 0, hash = 0;
        const auto shards = layout.shards_of(ctx.member(), ctx.rank_in_member());
        while (auto batch = ctx.feed().next()) {
          const auto bytes = batch->bytes();
          std::vector<std::byte> want(static_cast<std::size_t>(shards.count) * records_per_shard * record_bytes);
          for (int k = 0; k < shards.count; ++k)
            load(batch->step(), shards.first + k,
                 fc::span<std::byte>(want.data() + static_cast<std::size_t>(k) * records_per_shard * record_bytes,
                                     records_per_shard * record_bytes));
          fed_as_loaded = fed_as_loaded && batch->step() == expected_step++ && bytes.size() == want.size() &&
                          std::equal(want.begin(), want.end(), bytes.begin());
          hash = digest(hash, bytes);
          ++seen;
          model.gradient(reinterpret_cast<const std::int8_t*>(bytes.data()), bytes.size() / record_bytes);
          ctx.sync().ready(1, fc::span<float>(model.grad_bias));  // backprop order: the last layer first
          ctx.sync().ready(0, fc::span<float>(model.grad_weights));
          ctx.sync().finish();
          model.step();
        }
        fed_as_loaded = fed_as_loaded && seen == steps;
        // Rank 0 of a member submits its model, the others an empty tensor.
        const auto parameters = model.parameters();
        ctx.collect().submit(ctx.rank_in_member() == 0 ? fc::span<const float>(parameters) : fc::span<const float>());
        ctx.collect().submit(std::vector<std::int64_t>{hash});
      },
      [&](auto& ctx) {
        result.models = ctx.collect().template gather<float>().data;
        result.digests = ctx.collect().template gather<std::int64_t>().data;
      });
  result.batches_as_loaded = fed_as_loaded;
  ok = ok && fed_as_loaded;
  if (world().rank() == 0) {
    std::vector<float> want;
    for (int m = 0; m < layout.members(); ++m) {
      const auto r = reference_model(layout, m);
      want.insert(want.end(), r.begin(), r.end());
    }
    BOOST_TEST_INFO("preset " << name << " on layout " << layout.str() << (hosts.empty() ? "" : " hosts " + hosts));
    BOOST_TEST(result.models == want, "the model matches the serial reference");
    ok = ok && result.models == want;
    results[name] = result;
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(every_preset_feeds_the_same_batches_and_trains_the_same_model) {
  const int n = world().size();
  const int trainers = n >= 3 ? n - 2 : 1;  // leaves room for multi_broadcast's two producers
  std::map<std::string, preset_result> results;
  bool ok = true;
  namespace p = fc::presets;
  run_preset<p::baseline<>>(results, "baseline", trainers, ok);
  run_preset<p::single_broadcast<fc::subgroup_allreduce>>(results, "single_broadcast/allreduce", trainers, ok);
  run_preset<p::single_broadcast<fc::overlapped_ring>>(results, "single_broadcast/ring", trainers, ok);
  run_preset<p::multi_broadcast<fc::subgroup_allreduce>>(results, "multi_broadcast/allreduce", trainers, ok);
  run_preset<p::multi_broadcast<fc::overlapped_ring>>(results, "multi_broadcast/ring", trainers, ok);
  run_preset<p::all_shared<fc::subgroup_allreduce>>(results, "all_shared/allreduce", trainers, ok);
  run_preset<p::all_shared<fc::overlapped_ring>>(results, "all_shared/ring", trainers, ok);
  run_preset<p::adaptive<fc::subgroup_allreduce>>(results, "adaptive/allreduce", trainers, ok);
  run_preset<p::adaptive<fc::overlapped_ring>>(results, "adaptive/ring", trainers, ok);
  // A producer per host, on two pretend hosts (one from 2 ranks down): every rank of the world used.
  const std::string hosts = n >= 3 ? fc::cat("2+", n - 2) : std::to_string(n);
  run_preset<p::single_broadcast<fc::subgroup_allreduce>>(results, "per_host/allreduce", trainers, ok, hosts);
  run_preset<p::single_broadcast<fc::overlapped_ring>>(results, "per_host/ring", trainers, ok, hosts);
  run_preset<p::adaptive<fc::subgroup_allreduce>>(results, "adaptive per_host/allreduce", trainers, ok, hosts);
  if (world().rank() == 0) {
    const auto& base = results.at("baseline");
    for (const auto& [name, r] : results) {
      BOOST_TEST_INFO("preset " << name);
      BOOST_TEST((r.digests == base.digests && r.models == base.models), "same batches and model as the baseline");
      ok = ok && r.digests == base.digests && r.models == base.models;
    }
    // At 1 rank only the presets without producers fit; from 3 ranks on, all of them.
    BOOST_TEST(results.size() == (n >= 3 ? 12u : n == 2 ? 10u : 5u));
  }
  BOOST_TEST(fc::testing::all_ranks(ok));
}

BOOST_AUTO_TEST_CASE(a_layout_that_does_not_fit_is_refused_on_every_rank) {
  const fc::ensemble_layout layout(0, std::vector<int>(static_cast<std::size_t>(world().size() + 1), 1), 0);
  bool ok = false;
  try {
    fc::presets::baseline<>::pipeline pipe(world(), layout, {});
  } catch (const fc::error& e) {
    ok = std::string(e.what()).find("world has " + std::to_string(world().size())) != std::string::npos;
  }
  BOOST_TEST(fc::testing::all_ranks(ok));
}

BOOST_AUTO_TEST_CASE(a_broadcast_feed_without_producers_is_refused) {
  const fc::ensemble_layout layout(0, std::vector<int>(static_cast<std::size_t>(world().size()), 1), 0);
  fc::presets::single_broadcast<>::options options;
  options.feed.steps = 1;
  options.feed.shard_capacity = 8;
  bool ok = false, preset_named = false;
  try {  // the pipeline itself, whatever preset would have named it
    fc::ensemble_pipeline<fc::one_to_many<mpi>, fc::subgroup_allreduce<mpi>, fc::many_to_one<mpi>> pipe(world(), layout,
                                                                                                        options);
  } catch (const fc::error& e) {
    ok = std::string(e.what()).find("needs producer ranks") != std::string::npos;
  }
  try {
    fc::presets::single_broadcast<>::pipeline pipe(world(), layout, options);
  } catch (const fc::error& e) {
    preset_named = std::string(e.what()).find("has 0 producers; single_broadcast takes 1") != std::string::npos;
  }
  BOOST_TEST(fc::testing::all_ranks(preset_named));
  bool checked = false;
  try {
    fc::presets::multi_broadcast<>::check_layout(fc::ensemble_layout(1, {1}, 0), "multi_broadcast");
  } catch (const fc::error& e) {
    checked = std::string(e.what()).find("multi_broadcast takes 2 or more") != std::string::npos;
  }
  BOOST_TEST(fc::testing::all_ranks(ok && checked));
}

// A baseline given a layout with a producer would train with that rank idle: refused, named.
BOOST_AUTO_TEST_CASE(a_preset_refuses_a_layout_with_the_wrong_producers) {
  if (world().size() < 2) return;
  const fc::ensemble_layout layout(1, std::vector<int>(static_cast<std::size_t>(world().size() - 1), 1), 0);
  std::string what;
  try {
    fc::presets::baseline<>::pipeline pipe(world(), layout, {});
  } catch (const fc::error& e) {
    what = e.what();
  }
  BOOST_TEST(fc::testing::all_ranks(what.find("preset baseline") != std::string::npos &&
                                    what.find("has 1 producers; baseline takes no producers") != std::string::npos),
             what);
  what.clear();
  try {
    fc::presets::all_shared<>::pipeline pipe(world(), layout, {});
  } catch (const fc::error& e) {
    what = e.what();
  }
  BOOST_TEST(fc::testing::all_ranks(what.find("all_shared takes no producers") != std::string::npos), what);
}

// A Sync backend with NCCL's traits (no tags, MPI as its host backend), stood in for by MPI that
// claims them: presets put the feed and collect on its host backend, and visit() refuses the
// ring by name.
struct order_matched : fc::mpi {
  static constexpr bool tag_matched_p2p = false;
  using host_backend = fc::mpi;
};

BOOST_AUTO_TEST_CASE(presets_split_the_sync_backend_from_the_host_backend) {
  using P = fc::presets::single_broadcast<fc::subgroup_allreduce, order_matched>;
  static_assert(std::is_same_v<P::pipeline::feed_type, fc::one_to_many<mpi>>);
  static_assert(std::is_same_v<P::pipeline::sync_type, fc::subgroup_allreduce<order_matched>>);
  static_assert(std::is_same_v<P::pipeline::collect_type, fc::many_to_one<mpi>>);
  std::string chosen;
  fc::presets::visit<order_matched>("all_shared", "allreduce", [&](auto preset) {
    using Q = decltype(preset);
    chosen = std::is_same_v<typename Q::pipeline::sync_type, fc::subgroup_allreduce<order_matched>> ? "allreduce" : "?";
  });
  BOOST_TEST(chosen == "allreduce");
  std::string what;
  try {
    fc::presets::visit<order_matched>("single_broadcast", "ring", [](auto) {});
  } catch (const fc::error& e) {
    what = e.what();
  }
  BOOST_TEST(what.find("sync 'ring' (overlapped_ring) needs a backend whose messages match by tag") != std::string::npos,
             what);
  // On MPI the ring is there.
  fc::presets::visit<mpi>("multi_broadcast", "ring", [&](auto preset) {
    using Q = decltype(preset);
    chosen = std::is_same_v<typename Q::pipeline::sync_type, fc::overlapped_ring<mpi>> ? "ring" : "?";
  });
  BOOST_TEST(chosen == "ring");
}

BOOST_AUTO_TEST_CASE(with_producers_keeps_the_aggregator_on_its_trainer) {
  const auto l = fc::with_producers(fc::ensemble_layout(1, {2, 1}, 2), 3);  // member 0 rank 1 aggregates
  const auto r = l.role_of(l.aggregator());
  const auto none = fc::with_producers(fc::ensemble_layout(2, {1}, 1), 0);  // a producer aggregated
  BOOST_TEST((l.producers() == 3 && r.member == 0 && r.rank_in_member == 1));
  BOOST_TEST((none.producers() == 0 && none.aggregator() == 0));
  // From a producer per host: the aggregator's trainer, wherever the placement put it.
  const auto placed = fc::ensemble_layout::parse("producers=per-host members=2,1 aggregator=1")
                          .placed_on(fc::host_map::parse("2+3"));  // member 1 on rank 1, member 0 on 3, 4
  const auto classic = fc::with_producers(placed, 1);
  BOOST_TEST((classic.aggregator() == 3 && classic.role_of(3).member == 1));
  BOOST_TEST(fc::with_producers(fc::ensemble_layout::parse("producers=per-host members=2"), 0).aggregator() == 0);
  using single = fc::presets::single_broadcast<>;
  BOOST_TEST(single::layout_for(placed).per_host());
  BOOST_CHECK_NO_THROW(single::check_layout(placed, "single_broadcast"));
  BOOST_CHECK_THROW(fc::presets::baseline<>::check_layout(placed, "baseline"), fc::error);
}

// presets::choose keeps the user's layout: producers and an aggregator it names stay (or are
// refused, naming the presets that take them), refusals quote the text, name the preset and say
// what it added, and plain data parallel with no room for the preset's producers runs the
// baseline, saying so. Pure layout logic: every rank computes the same.
BOOST_AUTO_TEST_CASE(a_chosen_layout_is_the_users_and_says_what_the_preset_added) {
  using fc::testing::contains;
  using fc::testing::error_of;
  // The case: 2 producers and aggregator 2 fit 5 ranks; kept where the preset takes them.
  const char* two = "producers=2 members=2,1 aggregator=2";
  for (const char* preset : {"multi_broadcast", "adaptive"}) {
    const auto kept = fc::presets::choose(preset, two, 0, 5);
    BOOST_TEST((kept.preset == preset && kept.layout.str() == two && kept.note.empty()));
  }
  BOOST_TEST(contains(error_of([&] { fc::presets::choose("single_broadcast", two, 0, 5); }),
                      ": presets::choose: layout 'producers=2 members=2,1 aggregator=2' has 2 producers; preset "
                      "single_broadcast takes 1 producer, and a layout's own producers are kept as written (presets "
                      "that take these: multi_broadcast, adaptive)"));
  BOOST_TEST(contains(error_of([] { fc::presets::choose("baseline", "producers=per-host members=2", 0, 3); }),
                      "puts a producer on each host; preset baseline takes no producers"));
  // What the preset added, quoted with the user's own text.
  BOOST_TEST(contains(error_of([] { fc::presets::choose("single_broadcast", "members=2,1,1", 0, 3); }),
                      "layout 'members=2,1,1' with preset single_broadcast (which adds producers=1 and aggregator=1, "
                      "making 'producers=1 members=2,1,1 aggregator=1') needs 5 ranks, world has 3"));
  BOOST_TEST(contains(error_of([] { fc::presets::choose("single_broadcast", "members=2 aggregator=1", 0, 2); }),
                      "layout 'members=2 aggregator=1' with preset single_broadcast (which adds producers=1 and "
                      "aggregator=2 for 1, the same trainer, making 'producers=1 members=2 aggregator=2') needs 3 "
                      "ranks, world has 2"));
  BOOST_TEST(contains(error_of([] { fc::presets::choose("baseline", "members=2,1", 0, 4); }),
                      "layout 'members=2,1' with preset baseline needs 3 ranks, world has 4"));
  BOOST_TEST(contains(error_of([] { fc::presets::choose("fast", "", 0, 2); }),
                      "unknown preset 'fast' (known: baseline, single_broadcast, multi_broadcast, all_shared, "
                      "adaptive)"));
  // Room for the producers: the preset runs as asked; none: the baseline, said once.
  const auto roomy = fc::presets::choose("single_broadcast", "members=2", 0, 3);
  BOOST_TEST((roomy.preset == "single_broadcast" && roomy.layout.str() == "producers=1 members=2 aggregator=1" &&
              roomy.note.empty()));
  const auto plain = fc::presets::choose("single_broadcast", "members=2", 0, 2);
  BOOST_TEST((plain.preset == "baseline" && plain.layout.str() == "members=2"));
  BOOST_TEST(plain.note ==
             "preset single_broadcast asked for, baseline used: no room for single_broadcast's 1 producer beside "
             "layout 'members=2' on 2 ranks, so every trainer loads its own batches (single_broadcast runs from 3 "
             "ranks)");
  // No layout: the members spread over the world, on the baseline where the producers find no room.
  const int n = world().size();
  const auto spread = fc::presets::choose("multi_broadcast", "", 0, n);
  BOOST_TEST((spread.preset == (n >= 3 ? "multi_broadcast" : "baseline") &&
              spread.layout.world_size() == n && spread.layout.producers() == (n >= 3 ? 2 : 0)));
  BOOST_TEST(contains(error_of([&] { fc::presets::choose("baseline", "", n + 1, n); }),
                      "fewer than the " + std::to_string(n + 1) + " members"));
}

// A layout flexcomm sizes ("members=auto:N") comes back unplanned with the preset's producers in
// front where the world has room for them beside a rank per member (the aggregator on its
// trainer), the baseline where it has not, and a world too small for the members refused.
BOOST_AUTO_TEST_CASE(a_chosen_auto_layout_gets_the_presets_producers_and_stays_unplanned) {
  using fc::testing::contains;
  using fc::testing::error_of;
  const auto roomy = fc::presets::choose("single_broadcast", "members=auto:3", 0, 6);
  BOOST_TEST((roomy.preset == "single_broadcast" && !roomy.layout.is_planned() && roomy.note.empty()));
  BOOST_TEST(roomy.layout.str() == "producers=1 members=auto:3 aggregator=1");
  BOOST_TEST(roomy.layout.rank_budget(6) == 5);
  const auto moved = fc::presets::choose("multi_broadcast", "members=auto:2 aggregator=1", 0, 6);
  BOOST_TEST(moved.layout.str() == "producers=2 members=auto:2 aggregator=3");
  const auto kept = fc::presets::choose("adaptive", "producers=2 members=auto:2", 0, 6);
  BOOST_TEST(kept.layout.str() == "producers=2 members=auto:2");
  const auto plain = fc::presets::choose("single_broadcast", "members=auto:3", 0, 3);
  BOOST_TEST((plain.preset == "baseline" && plain.layout.str() == "members=auto:3"));
  BOOST_TEST(contains(plain.note, "no room for single_broadcast's 1 producer beside layout 'members=auto:3' on 3 ranks"));
  BOOST_TEST(fc::presets::choose("baseline", "members=auto:3", 0, 4).layout.str() == "members=auto:3");
  BOOST_TEST(contains(error_of([] { fc::presets::choose("multi_broadcast", "members=auto:4 aggregator=1", 0, 5); }),
                      "layout 'members=auto:4 aggregator=1' with preset multi_broadcast (which adds producers=2, making "
                      "'producers=2 members=auto:4 aggregator=3') sizes 4 members from 3 trainer ranks: each needs "
                      "one at least (world has 5)"));
  BOOST_TEST(contains(error_of([] { fc::presets::choose("single_broadcast", "producers=2 members=auto:2", 0, 6); }),
                      "has 2 producers; preset single_broadcast takes 1 producer"));
  BOOST_TEST(contains(error_of([] { fc::presets::choose("baseline", "members=auto:3", 0, 2); }),
                      "sizes 3 members from 2 trainer ranks"));
  BOOST_TEST(contains(error_of([] { fc::presets::choose("baseline", "members=auto:3", 2, 4); }),
                      "has 3 members; the trainer asks for 2"));
}

BOOST_AUTO_TEST_CASE(run_happens_once) {
  const fc::ensemble_layout layout(0, std::vector<int>(static_cast<std::size_t>(world().size()), 1), 0);
  fc::presets::baseline<>::options options;
  options.feed.steps = 1;
  options.feed.shard_capacity = records_per_shard * record_bytes;
  fc::presets::baseline<>::pipeline pipe(world(), layout, options);
  std::int64_t batches = 0;
  pipe.run(load, [&](auto& ctx) {
    while (ctx.feed().next()) ++batches;
  });
  bool ok = batches == 1;
  try {
    pipe.run(load, [](auto&) {});
    ok = false;
  } catch (const fc::error& e) {
    ok = ok && std::string(e.what()).find("once per pipeline") != std::string::npos;
  }
  BOOST_TEST(fc::testing::all_ranks(ok));
}

// run() makes the feed, but the constructor already refuses its options, on every rank at once:
// options wrong everywhere, and options that differ between ranks (which local_feed, checking
// only what its rank can see, would not tell).
BOOST_AUTO_TEST_CASE(the_constructor_refuses_bad_feed_options_on_every_rank) {
  using fc::testing::contains;
  using fc::testing::error_of;
  const fc::ensemble_layout layout(0, std::vector<int>(static_cast<std::size_t>(world().size()), 1), 0);
  fc::presets::all_shared<>::options options;
  options.feed.steps = 1;
  options.feed.shard_capacity = records_per_shard * record_bytes;
  options.feed.depth = 0;
  const std::string bad = error_of([&] { fc::presets::all_shared<>::pipeline pipe(world(), layout, options); });
  BOOST_TEST(fc::testing::all_ranks(contains(bad, "ensemble_pipeline: depth must be >= 1")), bad);
  fc::presets::baseline<>::options differ;
  differ.feed.steps = world().rank() == 0 ? 2 : 1;
  differ.feed.shard_capacity = records_per_shard * record_bytes;
  const std::string split = error_of([&] { fc::presets::baseline<>::pipeline pipe(world(), layout, differ); });
  BOOST_TEST(fc::testing::all_ranks(world().size() == 1 ? split.empty() : contains(split, "ranks disagree on steps")),
             split);
}

// ---- members that finish early hand their ranks on (pipeline/handover.hpp)

namespace {

// Members 0 and 1 of one rank, then members of two (and one of one for an odd world): a step has
// 2 shards, so member 0's rank can join member 1, the running member with the longest expected
// step (cost 1 / 1 rank).
std::vector<int> handover_sizes(int world_size) {
  std::vector<int> sizes{1, 1};
  for (int left = world_size - 2; left > 0; left -= 2) sizes.push_back(left >= 2 ? 2 : 1);
  return sizes;
}

// What a member must end with when it ran step s on ranks[s] ranks (the layout's shards split as
// the hand-over splits them), one step for each entry.
std::vector<float> reference_over(int shards, const std::vector<int>& ranks) {
  linear_model model;
  for (std::size_t s = 0; s < ranks.size(); ++s) {
    const int n = ranks[s];
    std::vector<float> sum_w, sum_b;
    for (int r = 0; r < n; ++r) {
      const int first = r * shards / n, count = (r + 1) * shards / n - first;
      std::vector<std::byte> bytes(static_cast<std::size_t>(count) * records_per_shard * record_bytes);
      for (int k = 0; k < count; ++k)
        load(static_cast<std::int64_t>(s), first + k,
             fc::span<std::byte>(bytes.data() + static_cast<std::size_t>(k) * records_per_shard * record_bytes,
                                 records_per_shard * record_bytes));
      model.gradient(reinterpret_cast<const std::int8_t*>(bytes.data()), bytes.size() / record_bytes);
      if (r == 0) {
        sum_w = model.grad_weights;
        sum_b = model.grad_bias;
      } else {
        for (std::size_t f = 0; f < features; ++f) sum_w[f] += model.grad_weights[f];
        sum_b[0] += model.grad_bias[0];
      }
    }
    model.grad_weights = sum_w;
    model.grad_bias = sum_b;
    fc::divide_by(model.grad_weights.data(), features, n);
    fc::divide_by(model.grad_bias.data(), 1, n);
    model.step();
  }
  return model.parameters();
}

// What member m must end with when it ran on `before` ranks up to step `joined_at`, then on
// `after`, for the test's `steps`.
std::vector<float> reference_across(int shards, int before, int after, std::int64_t joined_at) {
  std::vector<int> ranks;
  for (std::int64_t s = 0; s < steps; ++s) ranks.push_back(s < joined_at ? before : after);
  return reference_over(shards, ranks);
}

// Every rank's words, on every rank (rank order).
std::vector<std::int64_t> everyone(const std::vector<std::int64_t>& mine) {
  std::vector<std::int64_t> count{static_cast<std::int64_t>(mine.size())};
  std::vector<std::int64_t> counts(static_cast<std::size_t>(world().size()));
  mpi::iallgather(world(), fc::span<const std::int64_t>(count), fc::span<std::int64_t>(counts)).wait();
  const auto most = *std::max_element(counts.begin(), counts.end());
  std::vector<std::int64_t> padded(static_cast<std::size_t>(most), -1), all(counts.size() * padded.size());
  std::copy(mine.begin(), mine.end(), padded.begin());
  mpi::iallgather(world(), fc::span<const std::int64_t>(padded), fc::span<std::int64_t>(all)).wait();
  return all;
}

// Every rank's deliveries as everyone() gathers them (per batch: member, step, first shard,
// shards; -1 past a rank's last), tallied: how often each shard of each (member, step) came, and
// whether every rank had each member's steps in order.
struct delivery_tally {
  std::map<std::pair<std::int64_t, std::int64_t>, std::vector<int>> shards;  // (member, step) -> counts
  bool ordered = true;
};

delivery_tally tally_of(const std::vector<std::int64_t>& all, int ranks, int shards_per_step) {
  delivery_tally t;
  const std::size_t per_rank = all.size() / static_cast<std::size_t>(ranks);
  for (int r = 0; r < ranks; ++r) {
    std::map<std::int64_t, std::int64_t> last;  // member -> last step this rank had
    for (std::size_t i = 0; i + 3 < per_rank; i += 4) {
      const auto* d = all.data() + static_cast<std::size_t>(r) * per_rank + i;
      if (d[0] < 0) break;
      t.ordered = t.ordered && (!last.count(d[0]) || d[1] > last[d[0]]);
      last[d[0]] = d[1];
      auto& counts = t.shards[{d[0], d[1]}];
      counts.resize(static_cast<std::size_t>(shards_per_step));
      for (std::int64_t k = 0; k < d[3]; ++k) ++counts[static_cast<std::size_t>(d[2] + k)];
    }
  }
  return t;
}

using handover_pipeline = fc::ensemble_pipeline<fc::local_feed, fc::subgroup_allreduce<mpi>, fc::many_to_one<mpi>>;
// The main job's default preset's (single_broadcast): producers broadcast each step's pieces.
using broadcast_pipeline = fc::ensemble_pipeline<fc::one_to_many<mpi>, fc::subgroup_allreduce<mpi>, fc::many_to_one<mpi>>;

std::int64_t bits(float x) {
  std::uint32_t b = 0;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

template <class Pipeline = handover_pipeline>
typename Pipeline::options handover_options_for(std::int64_t n_steps) {
  typename Pipeline::options options;
  options.feed.steps = n_steps;
  options.feed.shard_capacity = records_per_shard * record_bytes;
  return options;
}

// Whether every shard of the batch holds the loader's bytes for that step and shard.
bool as_loaded(const fc::batch& batch) {
  bool same = true;
  for (int k = 0; same && k < batch.shards(); ++k) {
    std::vector<std::byte> want(records_per_shard * record_bytes);
    load(batch.step(), batch.first_shard() + k, fc::span<std::byte>(want));
    const auto got = batch.shard(k);
    same = got.size() == want.size() && std::memcmp(want.data(), got.data(), want.size()) == 0;
  }
  return same;
}

// One batch a rank was fed: its member, step, first shard and shard count into `seen`, and
// whether it held the loader's bytes into `same_bytes`.
void log_batch(int member, const fc::batch& batch, std::vector<std::int64_t>& seen, bool& same_bytes) {
  seen.insert(seen.end(), {member, batch.step(), batch.first_shard(), batch.shards()});
  same_bytes = same_bytes && as_loaded(batch);
}

}  // namespace

// Member 0 ends at step 2; its rank joins member 1 with member 1's model, the member's steps
// from then on are split over both ranks, each step's shards delivered once per member and in
// order; the other members train on untouched.
namespace {

// The order both hand-over cases need. Member 0 asks only once member 1 has trained step 0, so
// that the state it receives is not the initial one (it joins at step 1 or later). Member 1 must
// still run when the request comes: before the hand-over, at step 2, its rank 0 waits for member
// 0's word that it has finished, then its ranks take 10 ms a step (the request follows that word
// at once, on the hand-over's own communicator). after_step() is true where the trainer function
// returns (member 0, finished).
struct join_after_step_one {
  int before;  // member 1's ranks before the hand-over
  int root0 = 0, root1 = 1;  // members 0's and 1's rank 0, world ranks
  int target = -1;           // the member member 0 names in finish_member (-1: the pipeline's choice)
  std::int64_t token = 0;
  bool waited = false;

  template <class Ctx>
  bool after_step(Ctx& ctx, std::int64_t step) {
    if (ctx.member() == 1 && step == 0 && ctx.rank_in_member() == 0)
      mpi::isend(world(), fc::span<const std::int64_t>(&token, 1), root0, 78).wait();
    if (ctx.member() == 0 && step == 1) {
      std::int64_t trained = 0;  // member 1 has a step behind it
      mpi::irecv(world(), fc::span<std::int64_t>(&trained, 1), root1, 78).wait();
      ctx.finish_member(target);
      mpi::isend(world(), fc::span<const std::int64_t>(&token, 1), root1, 77).wait();
      return true;
    }
    if (ctx.member() == 1 && step == 2 && ctx.member_size() == before && ctx.rank_in_member() == 0) {
      mpi::irecv(world(), fc::span<std::int64_t>(&token, 1), root0, 77).wait();
      waited = true;
    }
    if (ctx.member() == 1 && step >= 2 && ctx.member_size() == before)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return false;
  }
  // Member 1's rank 0 takes the word it did not wait for at its step 2.
  void end() {
    if (world().rank() == root1 && !waited) mpi::irecv(world(), fc::span<std::int64_t>(&token, 1), root0, 77).wait();
  }
};

// The gradient_memory() a rank takes once, at its first member's first step, for `model`'s
// gradients (weights, then bias); empty where the trainer keeps them in its own vectors.
template <class Ctx>
fc::span<float> kept_memory(Ctx& ctx) {
  const auto bytes = ctx.sync().gradient_memory((features + 1) * sizeof(float));
  return fc::span<float>(reinterpret_cast<float*>(bytes.data()), features + 1);
}

// One step of the test's trainer on `batch`: the gradients averaged in the model's own vectors,
// or copied into `kept` (kept_memory()) and averaged there.
template <class Ctx>
void train_step(Ctx& ctx, linear_model& model, const fc::batch& batch, fc::span<float> kept) {
  model.gradient(reinterpret_cast<const std::int8_t*>(batch.bytes().data()), batch.size() / record_bytes);
  if (kept.empty()) {
    ctx.sync().ready(1, fc::span<float>(model.grad_bias));
    ctx.sync().ready(0, fc::span<float>(model.grad_weights));
    ctx.sync().finish();
  } else {
    std::copy(model.grad_weights.begin(), model.grad_weights.end(), kept.data());
    kept[features] = model.grad_bias[0];
    ctx.sync().ready(1, kept.subspan(features, 1));
    ctx.sync().ready(0, kept.subspan(0, features));
    ctx.sync().finish();
    std::copy(kept.data(), kept.data() + features, model.grad_weights.begin());
    model.grad_bias[0] = kept[features];
  }
  model.step();
}

// Collective: whether, over every rank's `seen` (log_batch()), each step s of each member m came
// once per shard where due(m, s) and not at all elsewhere, and each rank's steps in order.
template <class Due>
bool delivered_once(const std::vector<std::int64_t>& seen, int members, std::int64_t n_steps, int shards, Due due) {
  const auto tally = tally_of(everyone(seen), world().size(), shards);
  bool ok = tally.ordered;
  for (int m = 0; m < members; ++m)
    for (std::int64_t s = 0; s < n_steps; ++s) {
      const auto it = tally.shards.find({m, s});
      const bool wanted = due(m, s);
      ok = ok && (it != tally.shards.end()) == wanted &&
           (!wanted || std::all_of(it->second.begin(), it->second.end(), [](int c) { return c == 1; }));
    }
  return ok;
}

// Runs `pipe` on the test's loader: every trainer logs its batches (log_batch()) and trains each
// on its member's model in `models`; after each step, after(ctx, step) true returns from the
// trainer function. `now`: the member this rank trained last (-1: none); `ends`: the aggregator's
// report of how the members ended.
template <class Pipeline, class After>
void train_logged(Pipeline& pipe, std::map<int, linear_model>& models, std::vector<std::int64_t>& seen, bool& same_bytes,
                  int& now, std::vector<fc::handover_record>& ends, After after) {
  pipe.run(
      load,
      [&](auto& ctx) {
        now = ctx.member();
        auto& model = models[ctx.member()];
        while (auto batch = ctx.feed().next()) {
          log_batch(ctx.member(), *batch, seen, same_bytes);
          train_step(ctx, model, *batch, {});
          if (after(ctx, batch->step())) return;
        }
      },
      [&](auto& ctx) { ends = ctx.member_ends(); });
}

// Collective: whether every rank's last member `now` (-1: none) holds the serial run's parameters
// over the ranks that member had at each step it trained (ranks_of(m)), within `tolerance`
// (0: bit for bit).
template <class RanksOf>
bool as_serial(int now, std::map<int, linear_model>& models, int shards, RanksOf ranks_of, float tolerance) {
  std::vector<std::int64_t> mine{now};
  if (now >= 0)
    for (const float p : models[now].parameters()) mine.push_back(bits(p));
  const auto all = everyone(mine);
  const std::size_t width = all.size() / static_cast<std::size_t>(world().size());
  bool ok = true;
  for (int r = 0; r < world().size(); ++r) {
    const auto* row = all.data() + static_cast<std::size_t>(r) * width;
    if (row[0] < 0) continue;
    const auto want = reference_over(shards, ranks_of(static_cast<int>(row[0])));
    for (std::size_t i = 0; i < want.size(); ++i) {
      float got = 0;
      const auto b = static_cast<std::uint32_t>(row[1 + i]);
      std::memcpy(&got, &b, sizeof got);
      ok = ok && (tolerance == 0 ? row[1 + i] == bits(want[i])
                                 : std::abs(got - want[i]) <= tolerance * (1 + std::abs(want[i])));
    }
  }
  return ok;
}

// Member 0 (one rank) ends after step 1 and joins member 1 (`sizes`: the layout's members, on the
// world with `producers`). Member 1's parameters must match the serial run across the hand-over
// within `tolerance` (0: bit for bit), and be the same bits on each of its ranks; every batch
// holds the loader's bytes. `memory_once`: every rank keeps its gradients in its first member's
// gradient_memory(), taken once before the hand-over, so member 1's own ranks go on handing the
// grown member's sync memory from the sync it outgrew (the joiner keeps its own vectors).
// Whether a feed makes its steps by whoever is idle (adaptive's balancing()); false for others.
template <class F>
auto balances(F& feed, int) -> decltype(feed.balancing()) {
  return feed.balancing();
}
template <class F>
bool balances(F&, long) {
  return false;
}

// `balanced`: set on trainers to whether their feed balanced (balances()). `producers` -1: one per
// host (the pipeline places them). `target`: the member member 0 names (-1: the pipeline's choice).
template <class Pipeline = handover_pipeline>
bool hand_over_and_check(const std::vector<int>& sizes, float tolerance, int producers = 0,
                         bool memory_once = false, bool* balanced = nullptr, int target = -1) {
  const int n = world().size();
  Pipeline pipe(world(),
                producers < 0 ? fc::ensemble_layout(fc::producers_per_host, sizes, 0) : fc::ensemble_layout(producers, sizes, 0),
                handover_options_for<Pipeline>(steps));
  const fc::ensemble_layout& layout = pipe.layout();
  std::map<int, linear_model> models;
  pipe.on_handover(handover_of(models));
  std::vector<std::int64_t> seen;  // per batch: member, step, first shard, shards
  std::vector<fc::handover_record> records, ends;  // ends: the aggregator's report
  const int before = layout.member_size(1);
  join_after_step_one choreography{before, layout.trainer_rank(0, 0), layout.trainer_rank(1, 0), target};
  bool same_bytes = true;
  const int first_member = layout.role_of(world().rank()).member;
  pipe.run(load, [&](auto& ctx) {
    auto& model = models[ctx.member()];
    const auto kept = memory_once && ctx.member() == first_member ? kept_memory(ctx) : fc::span<float>();
    if (balanced) *balanced = balances(ctx.feed(), 0);
    while (auto batch = ctx.feed().next()) {
      log_batch(ctx.member(), *batch, seen, same_bytes);
      train_step(ctx, model, *batch, kept);
      if (choreography.after_step(ctx, batch->step())) return;
    }
    records = ctx.handovers();
  }, [&](auto& ctx) { ends = ctx.member_ends(); });
  choreography.end();
  // Every rank's member at the end and its parameters; member 0's rank says where it went.
  const int me = pipe.layout().role_of(world().rank()).member;
  const int now = me == 0 ? 1 : me;  // a producer: -1
  std::vector<std::int64_t> mine{now};
  for (const float p : models[now].parameters()) mine.push_back(bits(p));
  const auto all = everyone(mine);
  const auto deliveries = everyone(seen);
  bool ok = same_bytes;
  std::int64_t joined_at = -1;
  if (me == 0) {
    ok = records.size() == 1 && records[0].member == 0 && records[0].ended_at == 2 && records[0].joined == 1 &&
         records[0].joined_at >= 1 && records[0].joined_at < steps;
    if (ok) joined_at = records[0].joined_at;
  }
  mpi::iallreduce(world(), fc::span<std::int64_t>(&joined_at, 1), fc::op::max).wait();
  ok = ok && joined_at >= 1;
  if (pipe.is_aggregator()) {  // member 0 ended at step 2 into member 1; the others ran to the end
    ok = ok && static_cast<int>(ends.size()) == layout.members();
    for (int m = 0; ok && m < layout.members(); ++m) {
      const auto& e = ends[static_cast<std::size_t>(m)];
      ok = e.member == m && (m == 0 ? e.ended_at == 2 && e.joined == 1 && e.joined_at == joined_at
                                    : e.ended_at == -1 && e.joined == -1);
    }
  }
  // Member 1's ranks hold the same bits, those of the serial run across the hand-over.
  const std::size_t width = all.size() / static_cast<std::size_t>(n);
  const auto want = reference_across(layout.shards_per_step(), before, before + 1, joined_at);
  const std::int64_t* first = nullptr;
  for (int r = 0; r < n; ++r) {
    const auto* row = all.data() + static_cast<std::size_t>(r) * width;
    if (row[0] != 1) continue;
    if (!first) first = row;
    for (std::size_t i = 0; i < want.size(); ++i) {
      float got = 0;
      const auto b = static_cast<std::uint32_t>(row[1 + i]);
      std::memcpy(&got, &b, sizeof got);
      ok = ok && row[1 + i] == first[1 + i] &&
           (tolerance == 0 ? row[1 + i] == bits(want[i])
                           : std::abs(got - want[i]) <= tolerance * (1 + std::abs(want[i])));
    }
  }
  // Each member's steps: every shard once per step, each rank's steps in order; member 0 stops at 2.
  const auto tally = tally_of(deliveries, n, layout.shards_per_step());
  const auto& shards = tally.shards;
  ok = ok && tally.ordered;
  for (int m = 0; m < layout.members(); ++m)
    for (std::int64_t s = 0; s < steps; ++s) {
      const auto it = shards.find({m, s});
      const bool delivered = it != shards.end();
      ok = ok && delivered == (m != 0 || s < 2);
      if (delivered) ok = ok && std::all_of(it->second.begin(), it->second.end(), [](int c) { return c == 1; });
    }
  BOOST_TEST_INFO("layout " << layout.str() << ", joined at " << joined_at << ", batches as loaded " << same_bytes);
  return ok;
}

}  // namespace

// A member of one rank takes the joiner at once; members of two and one, sums of two: bit for bit.
BOOST_AUTO_TEST_CASE(a_finished_member_hands_its_rank_on_with_the_state) {
  if (world().size() < 4) return;  // below: no member with room (a_member_with_nowhere_to_go_is_refused)
  BOOST_TEST(fc::testing::all_ranks(hand_over_and_check(handover_sizes(world().size()), 0)));
}

// The target's own ranks keep the gradient_memory() they took before the joiner came, and hand
// it to the grown member's sync: the sync they outgrew is kept (retired) until run() returns, so
// that memory stays theirs (it was freed under them before: a use-after-free). Member 1 of one
// rank (its memory the sync's own buffer) and, at 6 ranks, of two (shared memory, unmapped
// before). Below 4 ranks no member has room: member 0 ends with nowhere to go, and member 1's
// ranks, with their memory taken once, match the serial run bit for bit.
BOOST_AUTO_TEST_CASE(a_target_keeps_the_gradient_memory_it_took_before_ranks_joined) {
  const int n = world().size();
  if (n >= 4) {
    BOOST_TEST(fc::testing::all_ranks(hand_over_and_check(handover_sizes(n), 0, 0, true)));
    if (n == 6) BOOST_TEST(fc::testing::all_ranks(hand_over_and_check({1, 2, 3}, 1e-5f, 0, true)), "members=1,2,3");
    return;
  }
  const fc::ensemble_layout layout(0, n == 1 ? std::vector<int>{1} : std::vector<int>{1, n - 1}, 0);
  handover_pipeline pipe(world(), layout, handover_options_for(steps));
  pipe.on_handover({});
  linear_model model;
  std::int64_t batches = 0;
  pipe.run(load, [&](auto& ctx) {
    const auto kept = kept_memory(ctx);
    while (auto batch = ctx.feed().next()) {
      ++batches;
      train_step(ctx, model, *batch, kept);
      if (ctx.member() == 0 && batch->step() == 1) return ctx.finish_member();
    }
  });
  const int me = pipe.layout().role_of(world().rank()).member;
  bool ok = batches == (me == 0 ? 2 : steps);
  if (me == 1) {
    const auto want = reference_across(layout.shards_per_step(), n - 1, n - 1, steps);
    const auto got = model.parameters();
    for (std::size_t i = 0; i < want.size(); ++i) ok = ok && bits(got[i]) == bits(want[i]);
  }
  BOOST_TEST(fc::testing::all_ranks(ok), layout.str() << ": " << batches << " batches");
}

// A member grows twice (6 ranks, members=1,1,1,3, a step of 3 shards): member 0 ends after step 1
// and joins member 1; once member 1 trains on two ranks, member 2 ends after step 2 and joins it
// too, at a later step. Member 1's first rank keeps the gradient_memory() it took at its first
// step through both (two retired syncs, dropped in the order they were made). Each member's
// steps: every shard once, each rank's in order, the loader's bytes; member 1's parameters the
// same bits on its three ranks, those of the serial run across both hand-overs (within 1e-5, as
// sums of three may round in another order; on one host's shared memory they were the same bits).
// Over local_feed, all_shared and adaptive (a_member_grows_twice_on_shared_feeds, below).
namespace {
template <class Pipeline>
void grows_twice() {
  constexpr std::int64_t long_steps = 16;  // on 2 busy cores the second joiner came at step 7-9 of 10
  const fc::ensemble_layout layout(0, {1, 1, 1, 3}, 0);
  // Every step in flight: a shared feed (all_shared, adaptive) holds members within its depth of
  // one another, and member 2 waits at its step 2 until member 1 has grown (at step 3-9 on 2 busy
  // cores), so member 1 must be able to run on past member 2's window meanwhile.
  auto options = handover_options_for<Pipeline>(long_steps);
  options.feed.depth = long_steps;
  Pipeline pipe(world(), layout, options);
  std::map<int, linear_model> models;
  pipe.on_handover(handover_of(models));
  const int root1 = layout.trainer_rank(1, 0), root2 = layout.trainer_rank(2, 0);
  join_after_step_one first{1, layout.trainer_rank(0, 0), root1};
  // The second hand-over, as the first: member 2 ends once member 1 has grown (its root's word,
  // tag 79), and member 1's root waits, one step later, for member 2's word that it has ended
  // (tag 80), its ranks then taking 10 ms a step, so that member 1 still runs when the request comes.
  std::int64_t token = 0, grown_at = -1;
  bool waited = false;
  std::vector<std::int64_t> seen;  // per batch: member, step, first shard, shards
  bool same_bytes = true;
  std::vector<fc::handover_record> ends;
  const int first_member = layout.role_of(world().rank()).member;
  pipe.run(
      load,
      [&](auto& ctx) {
        auto& model = models[ctx.member()];
        const auto kept = ctx.member() == first_member ? kept_memory(ctx) : fc::span<float>();
        while (auto batch = ctx.feed().next()) {
          const std::int64_t step = batch->step();
          log_batch(ctx.member(), *batch, seen, same_bytes);
          train_step(ctx, model, *batch, kept);
          if (first.after_step(ctx, step)) return;
          if (ctx.member() == 2 && step == 2) {
            mpi::irecv(world(), fc::span<std::int64_t>(&token, 1), root1, 79).wait();
            ctx.finish_member();
            mpi::isend(world(), fc::span<const std::int64_t>(&token, 1), root1, 80).wait();
            return;
          }
          if (ctx.member() != 1 || ctx.member_size() != 2) continue;
          if (ctx.rank_in_member() == 0 && grown_at < 0) {
            grown_at = step;
            mpi::isend(world(), fc::span<const std::int64_t>(&token, 1), root2, 79).wait();
          } else if (ctx.rank_in_member() == 0 && !waited) {
            mpi::irecv(world(), fc::span<std::int64_t>(&token, 1), root2, 80).wait();
            waited = true;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      },
      [&](auto& ctx) { ends = ctx.member_ends(); });
  first.end();
  if (world().rank() == root1 && !waited) mpi::irecv(world(), fc::span<std::int64_t>(&token, 1), root2, 80).wait();
  // Where members 0 and 2 went and from which step, as their ranks recorded it.
  const auto& records = pipe.handovers();
  bool ok = same_bytes;
  std::int64_t joined[2] = {-1, -1};  // members 0 and 2 joined member 1 at
  if (first_member == 0 || first_member == 2) {
    const int k = first_member / 2;
    ok = ok && records.size() == 1 && records[0].member == first_member &&
         records[0].ended_at == (first_member == 0 ? 2 : 3) && records[0].joined == 1;
    if (ok) joined[k] = records[0].joined_at;
  }
  mpi::iallreduce(world(), fc::span<std::int64_t>(joined, 2), fc::op::max).wait();
  ok = ok && joined[0] >= 1 && joined[1] > joined[0] && joined[1] < long_steps;
  if (pipe.is_aggregator()) {
    ok = ok && ends.size() == 4;
    for (int m = 0; ok && m < 4; ++m) {
      const auto& e = ends[static_cast<std::size_t>(m)];
      ok = e.member == m && (m == 0   ? e.ended_at == 2 && e.joined == 1 && e.joined_at == joined[0]
                             : m == 2 ? e.ended_at == 3 && e.joined == 1 && e.joined_at == joined[1]
                                      : e.ended_at == -1 && e.joined == -1);
    }
  }
  // Member 1's three ranks: the same bits, those of the serial run on 1, then 2, then 3 ranks.
  const int now = first_member == 3 ? 3 : 1;
  std::vector<std::int64_t> mine{now};
  for (const float p : models[now].parameters()) mine.push_back(bits(p));
  const auto all = everyone(mine);
  std::vector<int> ranks;
  for (std::int64_t s = 0; s < long_steps; ++s) ranks.push_back(s < joined[0] ? 1 : s < joined[1] ? 2 : 3);
  const auto want = reference_over(layout.shards_per_step(), ranks);
  const std::size_t width = all.size() / static_cast<std::size_t>(world().size());
  int on_member1 = 0;
  for (int r = 0; r < world().size(); ++r) {
    const auto* row = all.data() + static_cast<std::size_t>(r) * width;
    if (row[0] != 1) continue;
    ++on_member1;
    for (std::size_t i = 0; i < want.size(); ++i) {
      float got = 0;
      const auto b = static_cast<std::uint32_t>(row[1 + i]);
      std::memcpy(&got, &b, sizeof got);
      ok = ok && row[1 + i] == all[static_cast<std::size_t>(root1) * width + 1 + i] &&
           std::abs(got - want[i]) <= 1e-5f * (1 + std::abs(want[i]));
    }
  }
  ok = ok && on_member1 == 3;
  // Each member's steps: every shard once per step, each rank's in order.
  const auto tally = tally_of(everyone(seen), world().size(), layout.shards_per_step());
  ok = ok && tally.ordered;
  for (int m = 0; m < 4; ++m)
    for (std::int64_t s = 0; s < long_steps; ++s) {
      const auto it = tally.shards.find({m, s});
      const bool due = m == 0 ? s < 2 : m == 2 ? s < 3 : true;
      ok = ok && (it != tally.shards.end()) == due &&
           (!due || std::all_of(it->second.begin(), it->second.end(), [](int c) { return c == 1; }));
    }
  BOOST_TEST(fc::testing::all_ranks(ok), "joined at " << joined[0] << " and " << joined[1] << ", bytes " << same_bytes
                                                      << ", ordered " << tally.ordered);
}
}  // namespace

BOOST_AUTO_TEST_CASE(a_member_grows_twice) {
  if (world().size() != 6) {
    BOOST_TEST_MESSAGE("a member that grows twice: needs 6 ranks, the world has " << world().size());
    return;
  }
  grows_twice<handover_pipeline>();
}

// A member of two learns of the joiner in its sync's per-step check word and takes it at the step
// after (members=1,2,3: a step has 6 shards, member 1 grows to 3 ranks of 2 shards each). Sums of
// three may round in another order than the serial one's: within 1e-5.
BOOST_AUTO_TEST_CASE(a_member_of_two_takes_the_joiner_at_the_step_its_check_agreed) {
  if (world().size() != 6) return;
  BOOST_TEST(fc::testing::all_ranks(hand_over_and_check({1, 2, 3}, 1e-5f)));
}

// Member 0 ends after step 1 where no member has room for its rank (a step has too few shards):
// it ends with nowhere to go, the aggregator hears so, and every other member trains each of the
// `steps` on, its bytes as loaded. True on every rank when so.
namespace {
template <class Pipeline>
bool ends_with_nowhere_to_go(const fc::ensemble_layout& layout, std::int64_t steps) {
  Pipeline pipe(world(), layout, handover_options_for<Pipeline>(steps));
  pipe.on_handover({});
  std::vector<std::int64_t> seen;
  bool same_bytes = true;
  std::vector<fc::handover_record> ends;
  pipe.run(
      load,
      [&](auto& ctx) {
        while (auto batch = ctx.feed().next()) {
          seen.push_back(batch->step());
          same_bytes = same_bytes && as_loaded(*batch);
          if (ctx.member() == 0 && batch->step() == 1) return ctx.finish_member();
        }
      },
      [&](auto& ctx) { ends = ctx.member_ends(); });
  const auto role = pipe.layout().role_of(world().rank());
  std::vector<std::int64_t> want;
  for (std::int64_t s = 0; s < (role.member == 0 ? 2 : steps); ++s) want.push_back(s);
  const bool heard = world().rank() != 0 || (ends.size() == static_cast<std::size_t>(layout.members()) &&
                                             ends[0].ended_at == 2 && ends[0].joined == -1);
  return fc::testing::all_ranks(heard && (role.kind == fc::role::producer || (same_bytes && seen == want)));
}
}  // namespace

namespace {
// While alive, FLEXCOMM_SHM is `value` on every rank (the feed options' default).
struct shared_memory_env {
  explicit shared_memory_env(const char* value) { setenv("FLEXCOMM_SHM", value, 1); }
  ~shared_memory_env() { unsetenv("FLEXCOMM_SHM"); }
  shared_memory_env(const shared_memory_env&) = delete;
  shared_memory_env& operator=(const shared_memory_env&) = delete;
};
}  // namespace

// The same over one_to_many (the main job's default, single_broadcast), one producer and two
// round-robin, with shared memory off and on (auto: on one host, the trainers read in place and
// ask in counters there): member 1's split changes where no credit has gone out on the old one,
// the producers learn it from its rank 0 and send its steps from there as one message per rank.
// Below 5 ranks no member has room: member 0 then ends with nowhere to go and the producers go
// on without it.
BOOST_AUTO_TEST_CASE(a_one_to_many_member_hands_its_rank_on_with_the_state) {
  const int n = world().size();
  for (const char* shm : {"off", "auto"})
  for (int producers = 1; producers <= 2; ++producers) {
    shared_memory_env setting(shm);
    if (n - producers >= 4) {
      BOOST_TEST(fc::testing::all_ranks(hand_over_and_check<broadcast_pipeline>(handover_sizes(n - producers), 0, producers)),
                 producers << " producer(s), FLEXCOMM_SHM=" << shm);
    } else {
      BOOST_TEST_MESSAGE("one_to_many hand-over with " << producers << " producer(s): needs " << producers + 4
                                                       << " ranks (a member with room), the world has " << n);
    }
  }
  if (n < 2 || n >= 5) return;
  // members=1 or 1,k: a step has too few shards for member 0's rank to join another.
  const fc::ensemble_layout layout(1, n == 2 ? std::vector<int>{1} : std::vector<int>{1, n - 2}, 0);
  BOOST_TEST(ends_with_nowhere_to_go<broadcast_pipeline>(layout, 4), layout.str());
}

// The same over all_shared (no producers: the members take turns loading each step for all),
// with shared memory off and on (auto, on one host): member 0's rank keeps its turn in every round after it ended,
// and member 1's steps from the hand-over come from member 1's layout rank by message. Below 4
// ranks no member has room: member 0 ends with nowhere to go and takes its turn to the end of
// the stream, which the others need. At 6 ranks also members=1,2,3 (member 1 of two grows to three).
namespace {
using shared_pipeline = fc::ensemble_pipeline<fc::all_shared<mpi>, fc::subgroup_allreduce<mpi>, fc::many_to_one<mpi>>;

}  // namespace

BOOST_AUTO_TEST_CASE(an_all_shared_member_hands_its_rank_on_with_the_state) {
  const int n = world().size();
  const char* before = std::getenv("FLEXCOMM_SHM");
  const std::string kept = before ? before : "";
  // auto, not on: on pretend hosts (the cluster suite) a member's sync refuses "on" across hosts.
  for (const char* shm : {"off", "auto"}) {
    shared_memory_env setting(shm);
    if (n >= 4) {
      BOOST_TEST(fc::testing::all_ranks(hand_over_and_check<shared_pipeline>(handover_sizes(n), 0)),
                 "FLEXCOMM_SHM=" << shm);
      if (n == 6)
        BOOST_TEST(fc::testing::all_ranks(hand_over_and_check<shared_pipeline>({1, 2, 3}, 1e-5f)),
                   "members=1,2,3 FLEXCOMM_SHM=" << shm);
      continue;
    }
    // members=1, 1,1 or 1,2: a step has too few shards for member 0's rank to join another.
    const fc::ensemble_layout layout(0, n == 1 ? std::vector<int>{1} : std::vector<int>{1, n - 1}, 0);
    BOOST_TEST(ends_with_nowhere_to_go<shared_pipeline>(layout, 7), layout.str() << " FLEXCOMM_SHM=" << shm);
  }
  if (!kept.empty()) setenv("FLEXCOMM_SHM", kept.c_str(), 1);
}

// The same over adaptive. On its boards in shared memory (auto: on one host; across hosts with
// no producer, the couriers carry every piece to every host), with no producer and, on one host,
// one: member 0's rank lets its reader line go when it ends, holds the step it joins at, and
// reads its new shards out of the board's pieces, repacked (at 6 ranks, members=1,2,3: member 1
// of two grows to three, and a rank's shards lie in two pieces). Shared memory off and no
// producer, it takes turns: all_shared's hand-over; with a round-robin producer and no board
// (shared memory off, or across hosts) it runs as one_to_many and hands over as one_to_many
// does. Below 4 trainers, nowhere to go.
namespace {
using adaptive_pipeline = fc::ensemble_pipeline<fc::adaptive<mpi>, fc::subgroup_allreduce<mpi>, fc::many_to_one<mpi>>;
}  // namespace

BOOST_AUTO_TEST_CASE(an_adaptive_member_hands_its_rank_on_with_the_state) {
  const int n = world().size();
  const bool one_host = fc::mpi::hosts(world()).hosts() == 1;
  for (const char* shm : {"off", "auto"})
    for (int producers = 0; producers <= 1 && producers < n; ++producers) {
      shared_memory_env setting(shm);
      const std::string what = fc::cat("FLEXCOMM_SHM=", shm, ", ", producers, " producer(s)");
      const int trainers = n - producers;
      if (trainers >= 4) {
        // A board where shared memory is on and, with a producer, one host; else one_to_many
        // (a round-robin producer) or turns.
        const bool board = std::string(shm) == "auto" && (producers == 0 || one_host);
        bool balanced = board;                            // a producer's stays
        BOOST_TEST(fc::testing::all_ranks(
                       hand_over_and_check<adaptive_pipeline>(handover_sizes(trainers), 0, producers, false, &balanced) &&
                       balanced == board),
                   what << (balanced == board ? "" : board ? ": no board" : ": a board"));
        if (n == 6 && producers == 0)
          BOOST_TEST(fc::testing::all_ranks(hand_over_and_check<adaptive_pipeline>({1, 2, 3}, 1e-5f)),
                     "members=1,2,3 " << what);
        continue;
      }
      const fc::ensemble_layout layout(producers, trainers == 1 ? std::vector<int>{1} : std::vector<int>{1, trainers - 1},
                                       0);
      BOOST_TEST(ends_with_nowhere_to_go<adaptive_pipeline>(layout, 7), layout.str() << " " << what);
    }
}

// A member grows twice over the shared feeds: all_shared (the two ended members' ranks keep
// their turns; member 1's parts from its one layout rank) and adaptive on its board (two joiners
// hold their joining steps; the second joins a member whose ranks already read repacked shards).
BOOST_AUTO_TEST_CASE(a_member_grows_twice_on_shared_feeds) {
  if (world().size() != 6) {
    BOOST_TEST_MESSAGE("a member that grows twice: needs 6 ranks, the world has " << world().size());
    return;
  }
  BOOST_TEST_CONTEXT("all_shared") { grows_twice<shared_pipeline>(); }
  BOOST_TEST_CONTEXT("adaptive") { grows_twice<adaptive_pipeline>(); }
}

// Two members that end at the same step (members 0 and 1, one rank each, after step 1) over
// every feed: both ask at once, a target busy with one asker refuses the other, which asks the
// next. Members=1,1,1..1,2 (a step of 2 shards: each running member of one rank has room for one
// joiner, the member of two for none): at 6 trainers both join, at 5 one joins and one ends,
// below 5 both end. A target behind the enders may take one at a step before 2. The enders hear
// each other's word before they finish, so that neither takes the other (the test
// a_target_that_ends_before_the_joining_step covers a target that finishes after agreeing).
// Each running member's rank 0 waits at its step 2 for both enders' word and its ranks take
// 10 ms a step until they grow, so that the targets still run when asked. Checked: the records
// and the aggregator's report, every member's parameters the serial run's bits over the ranks
// it trained on at each step, each step's shards once per member and in order.
namespace {
template <class Pipeline>
bool two_end_at_once(int producers, std::string& what) {
  const int n = world().size(), trainers = n - producers;
  std::vector<int> sizes(static_cast<std::size_t>(trainers >= 4 ? trainers - 2 : trainers), 1);
  if (trainers >= 4) sizes.push_back(2);
  const fc::ensemble_layout layout(producers, sizes, 0);
  what = layout.str();
  constexpr std::int64_t long_steps = 20;
  Pipeline pipe(world(), layout, handover_options_for<Pipeline>(long_steps));
  std::map<int, linear_model> models;
  pipe.on_handover(handover_of(models));
  const int roots[2] = {layout.trainer_rank(0, 0), layout.trainer_rank(1, 0)};
  std::vector<std::int64_t> seen;  // per batch: member, step, first shard, shards
  bool same_bytes = true;
  int now = -1;  // the member this rank trained last
  std::int64_t token = 0;
  std::vector<fc::handover_record> ends;
  train_logged(pipe, models, seen, same_bytes, now, ends, [&](auto& ctx, std::int64_t step) {
    if (ctx.member() < 2 && step == 1) {  // each ender hears the other's word first: no ender takes the other
      std::int64_t other = 0;
      const int peer = roots[1 - ctx.member()];
      auto heard = mpi::irecv(world(), fc::span<std::int64_t>(&other, 1), peer, 76);
      mpi::isend(world(), fc::span<const std::int64_t>(&token, 1), peer, 76).wait();
      heard.wait();
      ctx.finish_member();
      for (int m = 2; m < layout.members(); ++m)  // the word to every running member's rank 0
        mpi::isend(world(), fc::span<const std::int64_t>(&token, 1), layout.trainer_rank(m, 0), 77).wait();
      return true;
    }
    if (ctx.member() >= 2 && step == 2 && ctx.rank_in_member() == 0)
      for (const int root : roots) mpi::irecv(world(), fc::span<std::int64_t>(&token, 1), root, 77).wait();
    if (ctx.member() >= 2 && step >= 2 && ctx.member_size() == layout.member_size(ctx.member()))
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return false;
  });
  const int first_member = layout.role_of(world().rank()).member;
  const auto& records = pipe.handovers();
  bool ok = same_bytes;
  std::int64_t joins[4] = {-1, -1, -1, -1};  // members 0 and 1: the member each joined, and at which step
  if (first_member == 0 || first_member == 1) {
    ok = ok && records.size() == 1 && records[0].member == first_member && records[0].ended_at == 2;
    if (ok) {
      joins[2 * first_member] = records[0].joined;
      joins[2 * first_member + 1] = records[0].joined_at;
    }
  }
  mpi::iallreduce(world(), fc::span<std::int64_t>(joins, 4), fc::op::max).wait();
  const int rooms = std::max(0, layout.members() - 3);  // the running members of one rank
  int joined = 0;
  for (int e = 0; e < 2; ++e)
    if (joins[2 * e] >= 0) {
      ++joined;
      ok = ok && joins[2 * e] >= 2 && joins[2 * e] < layout.members() - 1 && joins[2 * e + 1] >= 0 &&
           joins[2 * e + 1] < long_steps;
    }
  ok = ok && joined == std::min(2, rooms) && (joined < 2 || joins[0] != joins[2]);
  if (pipe.is_aggregator()) {
    ok = ok && static_cast<int>(ends.size()) == layout.members();
    for (int m = 0; ok && m < layout.members(); ++m) {
      const auto& e = ends[static_cast<std::size_t>(m)];
      ok = e.member == m && (m < 2 ? e.ended_at == 2 && e.joined == joins[2 * m] && e.joined_at == joins[2 * m + 1]
                                   : e.ended_at == -1 && e.joined == -1);
    }
  }
  const auto ranks_of = [&](int m) {  // member m's ranks at each step it trained
    std::vector<int> ranks;
    for (std::int64_t s = 0; s < (m < 2 ? 2 : long_steps); ++s) {
      int k = layout.member_size(m);
      for (int e = 0; e < 2; ++e) k += joins[2 * e] == m && joins[2 * e + 1] <= s;
      ranks.push_back(k);
    }
    return ranks;
  };
  const bool serial = as_serial(now, models, layout.shards_per_step(), ranks_of, 0);
  const bool once = delivered_once(seen, layout.members(), long_steps, layout.shards_per_step(),
                                   [](int m, std::int64_t s) { return m >= 2 || s < 2; });
  ok = ok && serial && once;
  what = fc::cat(what, ": member 0 joined ", joins[0], " at ", joins[1], ", member 1 joined ", joins[2], " at ", joins[3],
                 ", bytes ", same_bytes, ", parameters ", serial, ", delivered once in order ", once);
  return fc::testing::all_ranks(ok);
}
}  // namespace

BOOST_AUTO_TEST_CASE(two_members_that_end_at_the_same_step_hand_their_ranks_on) {
  const int n = world().size();
  std::string what;
  if (n < 2) return;
  BOOST_TEST(two_end_at_once<handover_pipeline>(0, what), "local_feed " << what);
  BOOST_TEST(two_end_at_once<shared_pipeline>(0, what), "all_shared " << what);
  BOOST_TEST(two_end_at_once<adaptive_pipeline>(0, what), "adaptive " << what);
  if (n >= 3) BOOST_TEST(two_end_at_once<broadcast_pipeline>(1, what), "one_to_many " << what);
}

// An uneven split over one_to_many, then its end (6 ranks: one producer, members=1,1,3, a step
// of 3 shards in 3 pieces): member 1 grows to 2 ranks of 1 and 2 shards, so a rank's message is
// repacked from two pieces; two steps later it ends with nowhere to go (member 2 has no room),
// which releases its changed split's stream, and member 2 trains on to the end. Each member's
// steps: every shard once, each rank's in order, the loader's bytes.
BOOST_AUTO_TEST_CASE(a_one_to_many_member_grows_unevenly_then_ends) {
  if (world().size() != 6) {
    BOOST_TEST_MESSAGE("uneven one_to_many hand-over: needs 6 ranks, the world has " << world().size());
    return;
  }
  constexpr std::int64_t long_steps = 8;
  const fc::ensemble_layout layout(1, {1, 1, 3}, 0);
  broadcast_pipeline pipe(world(), layout, handover_options_for<broadcast_pipeline>(long_steps));
  pipe.on_handover({});
  std::vector<std::int64_t> seen;  // per batch: member, step, first shard, shards
  bool same_bytes = true, split = true;
  std::int64_t grown_at = -1;  // the first step member 1 trained on two ranks
  std::vector<fc::handover_record> ends;
  join_after_step_one choreography{1, layout.trainer_rank(0, 0), layout.trainer_rank(1, 0)};
  pipe.run(
      load,
      [&](auto& ctx) {
        while (auto batch = ctx.feed().next()) {
          log_batch(ctx.member(), *batch, seen, same_bytes);
          if (choreography.after_step(ctx, batch->step())) return;
          if (ctx.member() != 1 || ctx.member_size() != 2) continue;
          split = split && batch->first_shard() == ctx.rank_in_member() && batch->shards() == 1 + ctx.rank_in_member();
          if (grown_at < 0) grown_at = batch->step();
          if (batch->step() == grown_at + 1) return ctx.finish_member();
        }
      },
      [&](auto& ctx) { ends = ctx.member_ends(); });
  choreography.end();
  const auto tally = tally_of(everyone(seen), world().size(), layout.shards_per_step());
  const auto& shards = tally.shards;
  const bool ordered = tally.ordered;
  // How the members ended, as the aggregator (the producer) heard it.
  std::int64_t ended1 = pipe.is_aggregator() && ends.size() == 3 ? ends[1].ended_at : -1;
  mpi::iallreduce(world(), fc::span<std::int64_t>(&ended1, 1), fc::op::max).wait();
  bool once = ended1 > 2 && ended1 < long_steps;
  for (int m = 0; m < 3; ++m)
    for (std::int64_t s = 0; s < long_steps; ++s) {
      const auto it = shards.find({m, s});
      const bool due = m == 2 || s < (m == 0 ? 2 : ended1);
      once = once && (it != shards.end()) == due &&
             (!due || std::all_of(it->second.begin(), it->second.end(), [](int c) { return c == 1; }));
    }
  const bool heard = !pipe.is_aggregator() || (ends[0].joined == 1 && ends[1].joined == -1 && ends[2].ended_at == -1);
  BOOST_TEST(fc::testing::all_ranks(same_bytes && split && ordered && once && heard),
             "bytes " << same_bytes << " split " << split << " ordered " << ordered << " once " << once << " heard "
                      << heard << " member 1 ended at " << ended1);
}

// A target that ends between the agreement and the step it takes the joiner at (one_to_many, one
// producer; members=1,1,1,2 at 6 ranks, 1,1,2 at 5; a step of 2 shards). Member 0 ends after step
// 1 and asks member 1, which agrees to take it at a later step (ctx.joiners_at(), the first step
// it has not asked for) and returns right after the step it agreed at. The joiner is turned away
// in the handshake and asks again: member 2, of one rank (at 6 ranks), takes it, its rank 0
// waiting at step 8 for member 1's word that it returned and taking 10 ms a step until it grows,
// so that it still runs when asked; at 5 ranks member 1 ends itself there (finish_member(), which
// before was refused until the joining step), no member has room and both end. Nothing fails; each member's steps come once per shard, in order, as loaded; every rank's parameters
// are the serial run's bits. Before, the joiner waited in the handshake until FLEXCOMM_TIMEOUT.
BOOST_AUTO_TEST_CASE(a_target_that_ends_before_the_joining_step_turns_the_joiner_away) {
  const int n = world().size();
  if (n < 5 || n > 6) {
    BOOST_TEST_MESSAGE("a target that ends before the joining step: needs 5 or 6 ranks, the world has " << n);
    return;
  }
  constexpr std::int64_t long_steps = 20;
  const bool second = n == 6;  // member 2 has one rank and room for the joiner
  const fc::ensemble_layout layout(1, second ? std::vector<int>{1, 1, 1, 2} : std::vector<int>{1, 1, 2}, 0);
  broadcast_pipeline pipe(world(), layout, handover_options_for<broadcast_pipeline>(long_steps));
  std::map<int, linear_model> models;
  pipe.on_handover(handover_of(models));
  join_after_step_one choreography{1, layout.trainer_rank(0, 0), layout.trainer_rank(1, 0)};
  const int root1 = layout.trainer_rank(1, 0), root2 = layout.trainer_rank(2, 0);
  std::vector<std::int64_t> seen;  // per batch: member, step, first shard, shards
  bool same_bytes = true, heard = false;
  std::int64_t agreed[2] = {-1, -1};  // member 1: the step it agreed at, the step it was to take the joiner at
  std::int64_t token = 0;
  int now = -1;  // the member this rank trained last
  std::vector<fc::handover_record> ends;
  train_logged(pipe, models, seen, same_bytes, now, ends, [&](auto& ctx, std::int64_t step) {
    if (choreography.after_step(ctx, step)) return true;
    if (ctx.member() == 1 && ctx.joiners_at() >= 0) {  // agreed: it ends before the joiner comes
      agreed[0] = step;
      agreed[1] = ctx.joiners_at();
      if (second) mpi::isend(world(), fc::span<const std::int64_t>(&token, 1), root2, 81).wait();
      if (!second) ctx.finish_member();
      return true;
    }
    if (second && ctx.member() == 2 && ctx.member_size() == 1) {
      if (step == 8 && ctx.rank_in_member() == 0) {
        mpi::irecv(world(), fc::span<std::int64_t>(&token, 1), root1, 81).wait();
        heard = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  });
  choreography.end();
  if (second && world().rank() == root2 && !heard)
    mpi::irecv(world(), fc::span<std::int64_t>(&token, 1), root1, 81).wait();
  // Where member 0's rank went, from its record; where member 1 agreed.
  const int first_member = layout.role_of(world().rank()).member;
  const auto& records = pipe.handovers();
  bool ok = same_bytes;
  std::int64_t at[3] = {agreed[0], agreed[1], -1};  // and the step member 0's rank joined member 2 at
  if (first_member == 0) {
    ok = ok && records.size() == 1 && records[0].member == 0 && records[0].ended_at == 2 &&
         records[0].joined == (second ? 2 : -1);
    if (ok && second) at[2] = records[0].joined_at;
  }
  // At 5 ranks member 1 finished, at the step after the one it agreed at, with nowhere to go.
  if (first_member == 1)
    ok = ok && records.size() == (second ? 0u : 1u) &&
         (second || (records[0].member == 1 && records[0].ended_at == agreed[0] + 1 && records[0].joined == -1));
  mpi::iallreduce(world(), fc::span<std::int64_t>(at, 3), fc::op::max).wait();
  ok = ok && at[0] >= 2 && at[1] > at[0] && at[1] < long_steps && (!second || (at[2] > at[0] && at[2] < long_steps));
  if (pipe.is_aggregator()) {  // at 6 ranks member 1 returned without finish_member: it "ran to the end"
    ok = ok && static_cast<int>(ends.size()) == layout.members();
    for (int m = 0; ok && m < layout.members(); ++m) {
      const auto& e = ends[static_cast<std::size_t>(m)];
      const std::int64_t ended = m == 1 && !second ? at[0] + 1 : -1;
      ok = e.member == m && (m == 0 ? e.ended_at == 2 && e.joined == (second ? 2 : -1) && e.joined_at == at[2]
                                    : e.ended_at == ended && e.joined == -1);
    }
  }
  // Each rank's last member and its parameters: the serial run's bits for that member's ranks per step.
  const auto ranks_of = [&](int m) {  // member m's ranks at each step it trained
    std::vector<int> r;
    const std::int64_t last = m == 0 ? 2 : m == 1 ? at[0] + 1 : long_steps;
    for (std::int64_t s = 0; s < last; ++s) r.push_back(m == 2 && second ? (s < at[2] ? 1 : 2) : layout.member_size(m));
    return r;
  };
  const bool serial = as_serial(now, models, layout.shards_per_step(), ranks_of, 0);
  const bool once = delivered_once(seen, layout.members(), long_steps, layout.shards_per_step(), [&](int m, std::int64_t s) {
    return m == 0 ? s < 2 : m == 1 ? s <= at[0] : true;
  });
  BOOST_TEST(fc::testing::all_ranks(ok && serial && once),
             layout.str() << ": member 1 agreed at " << at[0] << " to take the joiner at " << at[1]
                          << ", it joined member 2 at " << at[2] << ", bytes " << same_bytes << ", parameters " << serial
                          << ", delivered once in order " << once);
}

// The same on a member already grown, whose producer learns of the split it agreed to from the
// credits of its changed one (7 ranks: one producer, members=1,1,1,3, a step of 3 shards; the
// test 'mpi_pipeline np7' runs this case alone). Member 0 joins member 1 as above; once
// member 1 trains on two ranks, member 2 ends and asks it, and member 1 returns right after the
// step it agreed at: member 2's rank is turned away and ends (member 3 has no room). Member 2
// looks for member 1's word that it grew at each step (10 ms a step meanwhile), not blocking:
// in lockstep a member that waits holds every member within `depth` steps of it. The word orders
// the two in time, not in steps: member 2 may end at a step before the one member 1 grew at.
BOOST_AUTO_TEST_CASE(a_grown_target_that_ends_before_the_joining_step_turns_the_joiner_away) {
  const int n = world().size();
  if (n != 7) {
    BOOST_TEST_MESSAGE("a grown target that ends before the joining step: needs 7 ranks, the world has " << n);
    return;
  }
  constexpr std::int64_t long_steps = 20;
  const fc::ensemble_layout layout(1, {1, 1, 1, 3}, 0);
  broadcast_pipeline pipe(world(), layout, handover_options_for<broadcast_pipeline>(long_steps));
  std::map<int, linear_model> models;
  pipe.on_handover(handover_of(models));
  join_after_step_one first{1, layout.trainer_rank(0, 0), layout.trainer_rank(1, 0)};
  const int root1 = layout.trainer_rank(1, 0), root2 = layout.trainer_rank(2, 0);
  std::vector<std::int64_t> seen;  // per batch: member, step, first shard, shards
  bool same_bytes = true, waited = false;
  std::int64_t at[4] = {-1, -1, -1, -1};  // member 1: grown at, agreed at, to take member 2 at; member 2 ended at
  std::optional<decltype(mpi::irecv(world(), fc::span<std::int64_t>(), 0, 0))> grown;  // member 2: the word
  std::int64_t token = 0;
  int now = -1;
  std::vector<fc::handover_record> ends;
  train_logged(pipe, models, seen, same_bytes, now, ends, [&](auto& ctx, std::int64_t step) {
    if (first.after_step(ctx, step)) return true;
    if (ctx.member() == 2) {  // ends once member 1 has grown (tag 79)
      if (!grown) grown = mpi::irecv(world(), fc::span<std::int64_t>(&token, 1), root1, 79);
      if (!grown->test()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        return false;
      }
      ctx.finish_member();
      at[3] = step + 1;
      mpi::isend(world(), fc::span<const std::int64_t>(&token, 1), root1, 80).wait();
      return true;
    }
    if (ctx.member() != 1 || ctx.member_size() != 2) return false;
    if (ctx.joiners_at() >= 0) {
      at[1] = step;
      at[2] = ctx.joiners_at();
      return true;
    }
    if (at[0] < 0) {
      at[0] = step;
      if (ctx.rank_in_member() == 0) mpi::isend(world(), fc::span<const std::int64_t>(&token, 1), root2, 79).wait();
    } else if (ctx.rank_in_member() == 0 && !waited) {
      mpi::irecv(world(), fc::span<std::int64_t>(&token, 1), root2, 80).wait();
      waited = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return false;
  });
  first.end();
  if (world().rank() == root1 && !waited) mpi::irecv(world(), fc::span<std::int64_t>(&token, 1), root2, 80).wait();
  const int first_member = layout.role_of(world().rank()).member;
  const auto& records = pipe.handovers();
  bool ok = same_bytes;
  if (first_member == 2) ok = ok && records.size() == 1 && records[0].ended_at == at[3] && records[0].joined == -1;
  mpi::iallreduce(world(), fc::span<std::int64_t>(at, 4), fc::op::max).wait();
  if (first_member == 0) ok = ok && records.size() == 1 && records[0].joined == 1 && records[0].joined_at == at[0];
  ok = ok && at[0] >= 1 && at[1] > at[0] && at[2] > at[1] && at[2] < long_steps && at[3] >= 1;
  if (pipe.is_aggregator()) {
    ok = ok && ends.size() == 4 && ends[0].joined == 1 && ends[0].joined_at == at[0] && ends[2].ended_at == at[3] &&
         ends[2].joined == -1 && ends[1].ended_at == -1 && ends[3].ended_at == -1;
  }
  const auto ranks_of = [&](int m) {  // member m's ranks at each step it trained
    std::vector<int> ranks;
    const std::int64_t last = m == 1 ? at[1] + 1 : m == 2 ? at[3] : long_steps;
    for (std::int64_t s = 0; s < last; ++s) ranks.push_back(m == 1 ? (s < at[0] ? 1 : 2) : layout.member_size(m));
    return ranks;
  };
  const bool serial = as_serial(now, models, layout.shards_per_step(), ranks_of, 1e-5f);  // sums of three: another order
  const bool once = delivered_once(seen, 4, long_steps, layout.shards_per_step(), [&](int m, std::int64_t s) {
    return m == 0 ? s < 2 : m == 1 ? s <= at[1] : m == 2 ? s < at[3] : true;
  });
  BOOST_TEST(fc::testing::all_ranks(ok && serial && once),
             "member 1 grew at " << at[0] << ", agreed at " << at[1] << " to take member 2 at " << at[2]
                                 << ", member 2 ended at " << at[3] << ", bytes " << same_bytes << ", parameters "
                                 << serial << ", delivered once in order " << once);
}

// one_to_many hands over in lockstep: skip_ahead is refused, on every rank, by name.
BOOST_AUTO_TEST_CASE(a_one_to_many_hand_over_skipping_is_refused) {
  if (world().size() < 2) return;
  const fc::ensemble_layout layout(1, std::vector<int>(static_cast<std::size_t>(world().size() - 1), 1), 0);
  auto options = handover_options_for<broadcast_pipeline>(2);
  options.feed.flow = fc::flow_control::skip_ahead(1);
  broadcast_pipeline skipping(world(), layout, options);
  const std::string skips = fc::testing::error_of([&] { skipping.on_handover({}); });
  BOOST_TEST(fc::testing::all_ranks(fc::testing::contains(skips, "under lockstep flow control, not skip_ahead")), skips);
}

// With a producer per host: member 0 ends after step 1 and joins member 1, which its rank 0's
// host's producer then feeds alone (every rank of it, across hosts by message), making afresh
// any piece its own trainers do not own. On this host (one producer) with shared memory off and
// auto; on pretend hosts 2+4 at 6 ranks (member 0's rank on the first host, member 1 on the
// second: the joiner's steps cross hosts, its own host's producer goes on without it); on 3+3+3
// at 9 ranks (the test 'mpi_pipeline np9' runs this case alone), members=1,3,2: member 1 spans
// two hosts, and the joiner's shards 4-5 are a piece that member 1's rank 0's host never made.
// Under adaptive with shared memory off (no board) the same, as one_to_many. Member 1's
// parameters are the serial run's (bit for bit up to two ranks); every step's shards once per
// member, in order.
BOOST_AUTO_TEST_CASE(a_member_hands_its_rank_on_with_a_producer_per_host) {
  const int n = world().size();
  const bool one_host = fc::mpi::hosts(world()).hosts() == 1;
  std::vector<std::string> maps{""};  // the hosts as they are
  if (n == 6 && one_host) maps.push_back("2+4");
  if (n == 9) maps = {one_host ? "3+3+3" : ""};
  for (const auto& map : maps)
    for (const char* shm : {"off", "auto"}) {
      pretend_hosts pretend(map);
      shared_memory_env setting(shm);
      const int hosts = fc::mpi::hosts(world()).hosts();
      const std::string what = fc::cat("hosts ", map.empty() ? "as they are" : map, ", FLEXCOMM_SHM=", shm);
      if (n - hosts < 4) {
        BOOST_TEST_MESSAGE("per-host hand-over: needs " << hosts + 4 << " ranks (a member with room), the world has " << n);
        continue;
      }
      const bool spans = n == 9 && hosts == 3;
      const auto sizes = spans ? std::vector<int>{1, 3, 2} : handover_sizes(n - hosts);
      const float tolerance = spans ? 1e-5f : 0;  // sums of three and four: another order
      BOOST_TEST(fc::testing::all_ranks(
                     hand_over_and_check<broadcast_pipeline>(sizes, tolerance, -1, false, nullptr, spans ? 1 : -1)),
                 "one_to_many, " << what);
      if (std::string(shm) == "off")
        BOOST_TEST(fc::testing::all_ranks(
                       hand_over_and_check<adaptive_pipeline>(sizes, tolerance, -1, false, nullptr, spans ? 1 : -1)),
                   "adaptive, " << what);
    }
}

// The typed feed hands over too (run(dataset, ...), ctx.batches()): member 0 ends after step 1
// and joins member 1, whose batches from the agreed step are sliced by the new split. Every step's
// samples reach each member exactly once and in order, each rank's slice as the split says.
namespace {

template <class Pipeline>
void typed_hand_over(int producers) {
  const int n = world().size();
  const fc::ensemble_layout layout(producers, handover_sizes(n - producers), 0);  // a step has 2 shards
  Pipeline pipe(world(), layout, {});
  pipe.on_handover({});
  fc::dataset data;
  data.size = 4 * steps;  // one epoch of `steps` steps, 2 samples a shard
  data.batch = 4;
  data.sample = fc::field::of<float>({1});
  data.load_sample = [](std::int64_t index, const fc::sample_slot& out) {
    out.sample<float>()[0] = static_cast<float>(index);
  };
  std::vector<std::int64_t> seen;  // per sample: member, step, index (from the sample's bytes)
  bool sizes = true;  // each batch holds the samples of its rank's share of the member's split
  join_after_step_one choreography{layout.member_size(1), layout.trainer_rank(0, 0), layout.trainer_rank(1, 0)};
  pipe.run(data, [&](auto& ctx) {
    while (auto b = ctx.batches().next()) {
      const auto x = b->template as<float>();
      for (std::int64_t i = 0; i < b->samples(); ++i)
        seen.insert(seen.end(), {ctx.member(), b->step(), static_cast<std::int64_t>(x[static_cast<std::size_t>(i)])});
      sizes = sizes && b->samples() == 4 / ctx.member_size() && b->first_sample() == 4 / ctx.member_size() * ctx.rank_in_member();
      if (choreography.after_step(ctx, b->step())) return;
    }
  });
  choreography.end();
  const auto all = everyone(seen);
  std::map<std::pair<std::int64_t, std::int64_t>, std::vector<std::int64_t>> got;  // (member, step) -> indices
  bool ordered = true;
  const std::size_t per_rank = all.size() / static_cast<std::size_t>(n);
  for (int r = 0; r < n; ++r) {
    std::map<std::int64_t, std::int64_t> last;  // member -> last step this rank had
    for (std::size_t i = 0; i + 2 < per_rank; i += 3) {
      const auto* d = all.data() + static_cast<std::size_t>(r) * per_rank + i;
      if (d[0] < 0) break;
      ordered = ordered && (!last.count(d[0]) || d[1] >= last[d[0]]);
      last[d[0]] = d[1];
      got[{d[0], d[1]}].push_back(d[2]);
    }
  }
  bool once = true;
  for (int m = 0; m < layout.members(); ++m)
    for (std::int64_t s = 0; s < steps; ++s) {
      auto& indices = got[{m, s}];
      std::sort(indices.begin(), indices.end());
      const std::vector<std::int64_t> want{4 * s, 4 * s + 1, 4 * s + 2, 4 * s + 3};
      once = once && (m == 0 && s >= 2 ? indices.empty() : indices == want);
    }
  const auto& records = pipe.handovers();
  const bool joined = pipe.layout().role_of(world().rank()).member != 0 ||
                      (records.size() == 1 && records[0].joined == 1 && records[0].joined_at >= 1);
  BOOST_TEST(fc::testing::all_ranks(sizes && ordered && once && joined),
             layout.str() << ": sizes " << sizes << " ordered " << ordered << " once " << once << " joined " << joined
                          << " records " << records.size() << " " << (records.empty() ? -9 : records[0].joined)
                          << " at " << (records.empty() ? -9 : records[0].joined_at));
}

}  // namespace

BOOST_AUTO_TEST_CASE(the_typed_feed_hands_a_finished_members_rank_on) {
  if (world().size() < 4) return;  // below: no member with room
  typed_hand_over<handover_pipeline>(0);
}

// The same over all_shared (the members take turns; the grown member's parts by message).
BOOST_AUTO_TEST_CASE(the_typed_feed_over_all_shared_hands_a_finished_members_rank_on) {
  if (world().size() < 4) return;  // below: no member with room
  typed_hand_over<shared_pipeline>(0);
}

// The same over adaptive (no producer: its board in shared memory, with couriers across hosts).
BOOST_AUTO_TEST_CASE(the_typed_feed_over_adaptive_hands_a_finished_members_rank_on) {
  if (world().size() < 4) return;  // below: no member with room
  typed_hand_over<adaptive_pipeline>(0);
}

// The same over one_to_many (run(dataset, ...), as the main example runs single_broadcast).
BOOST_AUTO_TEST_CASE(the_typed_feed_over_one_to_many_hands_a_finished_members_rank_on) {
  if (world().size() < 5) {
    BOOST_TEST_MESSAGE("typed one_to_many hand-over: needs 5 ranks (a producer, a member with room), the world has "
                       << world().size());
    return;
  }
  typed_hand_over<broadcast_pipeline>(1);
}

// A member with nowhere to go (one member, or every other member without room) ends all the
// same: its ranks stop at that step and the aggregator hears that no member took them. A target
// named that cannot take it is refused, and changes nothing. The member still running trains on
// for longer than the timeout after that: its root answers, so the ended root's wait for its bye
// goes on (it failed here before).
BOOST_AUTO_TEST_CASE(a_member_with_nowhere_to_go_ends_and_a_named_target_without_room_is_refused) {
  using fc::testing::contains;
  using fc::testing::error_of;
  const int n = world().size();
  if (n > 3) return;  // from 4 ranks a member has room (a_finished_member_hands_its_rank_on_with_the_state)
  // members=1,1 or 1,2: a step has 1 or 2 shards, too few for member 0's rank to join another.
  const fc::ensemble_layout layout(0, n == 1 ? std::vector<int>{1} : std::vector<int>{1, n - 1}, 0);
  const auto timeout = fc::default_timeout();
  const std::chrono::milliseconds short_timeout{1000};
  fc::set_default_timeout(short_timeout);
  handover_pipeline pipe(world(), layout, handover_options_for(4));
  pipe.on_handover({});
  std::int64_t batches = 0;
  std::string named;
  std::vector<fc::handover_record> ends;
  pipe.run(
      load,
      [&](auto& ctx) {
        while (auto batch = ctx.feed().next()) {
          ++batches;
          if (ctx.member() != 0 && batch->step() >= 2) std::this_thread::sleep_for(short_timeout * 4 / 5);
          if (ctx.member() != 0 || batch->step() != 1) continue;
          if (n > 1) named = error_of([&] { ctx.finish_member(1); });
          return ctx.finish_member();
        }
      },
      [&](auto& ctx) { ends = ctx.member_ends(); });
  fc::set_default_timeout(timeout);
  const bool first = pipe.layout().role_of(world().rank()).member == 0;
  const bool heard = world().rank() != 0 || (ends.size() == static_cast<std::size_t>(layout.members()) &&
                                             ends[0].ended_at >= 1 && ends[0].joined == -1 &&
                                             (n == 1 || ends[1].ended_at == -1));
  BOOST_TEST(fc::testing::all_ranks(heard && batches == (first ? 2 : 4) &&
                                    (first && n > 1 ? contains(named, "member 1 has ended or has no room")
                                                    : named.empty())),
             named);
}

BOOST_AUTO_TEST_CASE(finish_member_is_refused_on_a_producer_and_at_different_steps) {
  using fc::testing::contains;
  using fc::testing::error_of;
  const int n = world().size();
  if (n < 3) return;
  // A producer (the aggregator, idle under local_feed) asks; member 0's two ranks end at
  // different steps; the other members train on.
  std::vector<int> sizes{2};
  for (int left = n - 3; left > 0; --left) sizes.push_back(1);
  const fc::ensemble_layout layout(1, sizes, 0);
  handover_pipeline pipe(world(), layout, handover_options_for(4));
  pipe.on_handover({});
  std::int64_t batches = 0;
  std::string e, aggregate_error;
  std::vector<fc::handover_record> ends;
  pipe.run(
      load,
      [&](auto& ctx) {
        while (auto batch = ctx.feed().next()) {
          if (ctx.member() == 0 && batch->step() == ctx.rank_in_member())
            e = error_of([&] { ctx.finish_member(); });
          ++batches;
        }
      },
      [&](auto& ctx) {
        aggregate_error = error_of([&] { ctx.finish_member(); });
        ends = ctx.member_ends();  // the producer hears every root's bye: all ran to the end
      });
  const auto role = pipe.layout().role_of(world().rank());
  const bool ok = role.kind == fc::role::producer
                      ? contains(aggregate_error, "is for trainers; this rank is a producer") &&
                            static_cast<int>(ends.size()) == layout.members() &&
                            std::all_of(ends.begin(), ends.end(), [](const auto& x) { return x.ended_at == -1; })
                      : batches == 4 && (role.member == 0 ? contains(e, "called it at different steps, from 1 to 2")
                                                          : e.empty());
  BOOST_TEST(fc::testing::all_ranks(ok), e << aggregate_error);
}

// A member that returns before the end of a one_to_many stream (1 and 2 producers; steps in
// shared memory and by message) lets the producers go on without it (release()): the other
// members get every step, each the loader's bytes once and in order, and nobody waits for it
// (before, its missing credits stalled every producer, and the run with them).
BOOST_AUTO_TEST_CASE(a_member_that_returns_early_releases_the_producers) {
  const int n = world().size();
  if (n < 3) return;
  using one_to_many_pipeline = fc::ensemble_pipeline<fc::one_to_many<mpi>, fc::subgroup_allreduce<mpi>, fc::many_to_one<mpi>>;
  constexpr std::int64_t long_steps = 12;
  const auto releases = [&](const fc::ensemble_layout& layout, fc::shared_memory_use shm, const std::string& hosts) {
    one_to_many_pipeline::options options;
    options.feed.steps = long_steps;
    options.feed.shard_capacity = records_per_shard * record_bytes;
    options.feed.shared_memory = shm;
    std::optional<pretend_hosts> pretend;  // none: the hosts as they are (a cluster run's stay set)
    if (!hosts.empty()) pretend.emplace(hosts);
    one_to_many_pipeline pipe(world(), layout, options);
    std::vector<std::int64_t> seen;
    bool same_bytes = true;
    pipe.run(load, [&](auto& ctx) {
      while (auto batch = ctx.feed().next()) {
        seen.push_back(batch->step());
        same_bytes = same_bytes && batch->shards() == layout.shards_per_step();
        for (int k = 0; same_bytes && k < batch->shards(); ++k) {
          std::vector<std::byte> want(records_per_shard * record_bytes);
          load(batch->step(), batch->first_shard() + k, fc::span<std::byte>(want));
          const auto got = batch->shard(k);
          same_bytes = got.size() == want.size() && std::memcmp(want.data(), got.data(), want.size()) == 0;
        }
        if (ctx.member() == 0 && batch->step() == 1) return;  // ends early, long before the stream
      }
    });
    const auto role = pipe.layout().role_of(world().rank());
    std::vector<std::int64_t> want;
    for (std::int64_t s = 0; s < (role.member == 0 ? 2 : long_steps); ++s) want.push_back(s);
    const bool ok = role.kind == fc::role::producer || (same_bytes && seen == want);
    BOOST_TEST(fc::testing::all_ranks(ok), layout.str() << " hosts '" << hosts << "', shared memory " << fc::name_of(shm));
  };
  for (const auto shm : {fc::shared_memory_use::off, fc::shared_memory_use::automatic}) {
    for (int producers = 1; producers <= 2 && n - producers >= 2; ++producers)
      releases(fc::ensemble_layout(producers, std::vector<int>(static_cast<std::size_t>(n - producers), 1), 0), shm, "");
    if (n >= 4)  // a producer per host, on two pretend hosts
      releases(fc::ensemble_layout(fc::producers_per_host, std::vector<int>(static_cast<std::size_t>(n - 2), 1), 0), shm,
               fc::cat("2+", n - 2));
  }
  // The same through the typed feed (run(dataset, ...), as the main example runs single_broadcast).
  const fc::ensemble_layout layout(1, std::vector<int>(static_cast<std::size_t>(n - 1), 1), 0);
  one_to_many_pipeline pipe(world(), layout, {});
  fc::dataset data;
  data.size = 2 * long_steps;
  data.batch = 2;
  data.sample = fc::field::of<float>({1});
  data.load_sample = [](std::int64_t index, const fc::sample_slot& out) {
    out.sample<float>()[0] = static_cast<float>(index);
  };
  std::vector<std::int64_t> seen;  // the samples' indices, from their bytes
  pipe.run(data, [&](auto& ctx) {
    while (auto b = ctx.batches().next()) {
      const auto x = b->template as<float>();
      for (std::int64_t i = 0; i < b->samples(); ++i) seen.push_back(static_cast<std::int64_t>(x[static_cast<std::size_t>(i)]));
      if (ctx.member() == 0 && b->step() == 1) return;
    }
  });
  const auto role = pipe.layout().role_of(world().rank());
  std::vector<std::int64_t> want;
  for (std::int64_t i = 0; i < (role.member == 0 ? 4 : data.size); ++i) want.push_back(i);
  BOOST_TEST(fc::testing::all_ranks(role.kind == fc::role::producer || seen == want), "typed feed");
}
