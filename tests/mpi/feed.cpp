#define BOOST_TEST_MODULE mpi_feed
#include "mpi_fixture.hpp"

#include <boost/mpl/list.hpp>

#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace fc = flexcomm;
using fc::testing::all_ranks;
using fc::testing::world;

namespace {

using feeds = boost::mpl::list<fc::local_feed, fc::one_to_many<fc::mpi>, fc::all_shared<fc::mpi>>;

// Layouts for this world size: homogeneous and heterogeneous members, none to several producers.
std::vector<std::string> layouts_for(int n) {
  switch (n) {
    case 1: return {"members=1"};
    case 2: return {"producers=1 members=1", "members=2", "members=1,1"};
    case 3: return {"producers=1 members=2x1", "producers=1 members=2", "producers=2 members=1", "members=1,2"};
    case 4: return {"producers=1 members=1,2", "producers=2 members=2x1", "members=2x2", "producers=1 members=3x1"};
    case 5: return {"producers=1 members=2x2", "producers=2 members=1,2", "producers=1 members=1,3", "members=2,3"};
    case 6: return {"producers=1 members=2,3", "producers=2 members=2x2", "producers=3 members=3x1", "members=1,2,3"};
    default: return {fc::cat("producers=1 members=", n - 1, "x1")};
  }
}

template <class Feed>
std::vector<std::string> usable_layouts(int n) {
  std::vector<std::string> out;
  for (auto& text : layouts_for(n))
    if (!Feed::needs_producers || fc::ensemble_layout::parse(text).producers() > 0) out.push_back(text);
  return out;
}

std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// What the loader writes for (step, shard): a size from 0 to capacity and bytes from a hash,
// so that every trainer can check what it received without being told.
std::size_t expected_size(std::int64_t step, int shard, std::size_t capacity) {
  return mix(static_cast<std::uint64_t>(step) * 131 + static_cast<std::uint64_t>(shard)) % (capacity + 1);
}
std::byte expected_byte(std::int64_t step, int shard, std::size_t i) {
  return static_cast<std::byte>(mix((static_cast<std::uint64_t>(step) << 20) ^ (static_cast<std::uint64_t>(shard) << 40) ^ i));
}

fc::loader test_loader(std::size_t capacity) {
  return [capacity](std::int64_t step, int shard, fc::span<std::byte> out) {
    const std::size_t n = expected_size(step, shard, capacity);
    for (std::size_t i = 0; i < n && i < out.size(); ++i) out[i] = expected_byte(step, shard, i);
    return n;
  };
}

// True when `b` holds exactly the loader's bytes for this trainer's shards of its step.
bool batch_is_exact(const fc::batch& b, const fc::shard_range& shards, std::size_t capacity) {
  if (b.first_shard() != shards.first || b.shards() != shards.count) return false;
  std::size_t total = 0;
  for (int i = 0; i < b.shards(); ++i) {
    const auto bytes = b.shard(i);
    const int shard = shards.first + i;
    if (bytes.size() != expected_size(b.step(), shard, capacity)) return false;
    if (bytes.data() != b.bytes().data() + total) return false;  // shards are concatenated
    for (std::size_t k = 0; k < bytes.size(); ++k)
      if (bytes[k] != expected_byte(b.step(), shard, k)) return false;
    total += bytes.size();
  }
  return total == b.bytes().size();
}

struct outcome {
  bool ok = true;
  std::vector<std::int64_t> steps;  // delivered, in order
  std::int64_t skipped = 0;
};

// Runs one stream on every rank: producers produce, trainers check every batch.
template <class Feed>
outcome run_stream(const fc::ensemble_layout& layout, const fc::feed_options& options, fc::loader load,
                   const std::function<void(std::int64_t)>& train = {}) {
  outcome out;
  Feed feed(world(), layout, std::move(load), options);
  const auto role = layout.role_of(world().rank());
  if (role.kind == fc::role::producer) {
    feed.produce();
    return out;
  }
  const auto shards = layout.shards_of(role.member, role.rank_in_member);
  while (auto b = feed.next()) {
    out.ok = out.ok && batch_is_exact(*b, shards, options.shard_capacity);
    out.steps.push_back(b->step());
    if (train) train(b->step());
  }
  out.skipped = feed.skipped();
  return out;
}

bool every_step_once_in_order(const outcome& o, std::int64_t steps) {
  if (static_cast<std::int64_t>(o.steps.size()) != steps || o.skipped != 0) return false;
  for (std::int64_t s = 0; s < steps; ++s)
    if (o.steps[static_cast<std::size_t>(s)] != s) return false;
  return true;
}

bool is_trainer(const fc::ensemble_layout& layout) { return layout.role_of(world().rank()).kind == fc::role::trainer; }

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const fc::error& e) {
    return e.what();
  }
  return "";
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

BOOST_AUTO_TEST_CASE_TEMPLATE(every_trainer_gets_every_step_once_in_order_byte_exact, Feed, feeds) {
  for (const auto& text : usable_layouts<Feed>(world().size())) {
    const auto layout = fc::ensemble_layout::parse(text);
    for (int depth : {1, 3}) {
      fc::feed_options options;
      options.steps = 37;  // not a multiple of the member count: all_shared's last round is partial
      options.shard_capacity = 48;
      options.depth = depth;
      const auto o = run_stream<Feed>(layout, options, test_loader(options.shard_capacity));
      const bool ok = !is_trainer(layout) || (o.ok && every_step_once_in_order(o, options.steps));
      BOOST_TEST(all_ranks(ok), "layout '" << text << "' depth " << depth);
    }
  }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(an_empty_stream_ends_at_once, Feed, feeds) {
  const auto text = usable_layouts<Feed>(world().size());
  if (text.empty()) return;
  const auto layout = fc::ensemble_layout::parse(text.front());
  fc::feed_options options;
  options.steps = 0;
  options.shard_capacity = 8;
  const auto o = run_stream<Feed>(layout, options, test_loader(8));
  BOOST_TEST(all_ranks(o.steps.empty()));
}

// 10,000 small batches, with random short delays on producers (in the loader) and trainers.
BOOST_AUTO_TEST_CASE_TEMPLATE(stress_ten_thousand_small_batches_with_random_delays, Feed, feeds) {
  const auto text = usable_layouts<Feed>(world().size());
  if (text.empty()) return;
  const auto layout = fc::ensemble_layout::parse(text.front());
  fc::feed_options options;
  options.steps = 10000;
  options.shard_capacity = 16;
  options.depth = 4;
  std::mt19937 rng(static_cast<unsigned>(world().rank()) * 7919u + 1u);
  auto pause = [&rng] {
    if (rng() % 64 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
  };
  auto inner = test_loader(options.shard_capacity);
  fc::loader delayed = [&](std::int64_t step, int shard, fc::span<std::byte> out) {
    pause();
    return inner(step, shard, out);
  };
  const auto o = run_stream<Feed>(layout, options, delayed, [&](std::int64_t) { pause(); });
  BOOST_TEST(all_ranks(!is_trainer(layout) || (o.ok && every_step_once_in_order(o, options.steps))),
             "layout '" << text.front() << "'");
}

// Lockstep: a member that trains slowly gets every step all the same.
BOOST_AUTO_TEST_CASE_TEMPLATE(lockstep_delivers_every_step_to_a_slow_member, Feed, feeds) {
  for (const auto& text : usable_layouts<Feed>(world().size())) {
    const auto layout = fc::ensemble_layout::parse(text);
    const auto role = layout.role_of(world().rank());
    fc::feed_options options;
    options.steps = 30;
    options.shard_capacity = 32;
    options.flow = fc::flow_control::lockstep();
    const auto o = run_stream<Feed>(layout, options, test_loader(32), [&](std::int64_t) {
      if (role.member == layout.members() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    });
    BOOST_TEST(all_ranks(!is_trainer(layout) || (o.ok && every_step_once_in_order(o, options.steps))),
               "layout '" << text << "'");
  }
}

// skip_ahead(1): the slow member skips to the newest step; what it gets is still exact and in
// order, it always gets the last step, and its skipped steps are counted, the same on each of
// its ranks. Feeds without a shared producer stream never hold a member back, so never skip.
BOOST_AUTO_TEST_CASE_TEMPLATE(skip_ahead_lets_a_slow_member_skip_and_counts_it, Feed, feeds) {
  for (const auto& text : usable_layouts<Feed>(world().size())) {
    const auto layout = fc::ensemble_layout::parse(text);
    const auto role = layout.role_of(world().rank());
    const bool slow = role.kind == fc::role::trainer && role.member == layout.members() - 1;
    fc::feed_options options;
    options.steps = 30;
    options.shard_capacity = 32;
    options.flow = fc::flow_control::skip_ahead(1);
    const auto o = run_stream<Feed>(layout, options, test_loader(32), [&](std::int64_t) {
      if (slow) std::this_thread::sleep_for(std::chrono::milliseconds(15));
    });
    bool ok = true;
    if (is_trainer(layout)) {
      ok = o.ok && !o.steps.empty() && o.steps.back() == options.steps - 1 &&
           static_cast<std::int64_t>(o.steps.size()) + o.skipped == options.steps;
      for (std::size_t i = 1; i < o.steps.size(); ++i) ok = ok && o.steps[i] > o.steps[i - 1];
      if (Feed::needs_producers && slow) ok = ok && o.skipped > 0;
      if (!Feed::needs_producers) ok = ok && o.skipped == 0;
    }
    // Ranks of one member deliver the same steps: compare a hash of the sequence per member.
    std::uint64_t h = 0;
    for (auto s : o.steps) h = mix(h ^ static_cast<std::uint64_t>(s));
    std::vector<std::int64_t> lo(static_cast<std::size_t>(layout.members()), INT64_MIN), hi = lo;
    if (role.kind == fc::role::trainer) {
      lo[static_cast<std::size_t>(role.member)] = -static_cast<std::int64_t>(h >> 1);
      hi[static_cast<std::size_t>(role.member)] = static_cast<std::int64_t>(h >> 1);
    }
    fc::mpi::iallreduce(world(), fc::span<std::int64_t>(lo), fc::op::max).wait();
    fc::mpi::iallreduce(world(), fc::span<std::int64_t>(hi), fc::op::max).wait();
    for (std::size_t m = 0; m < lo.size(); ++m) ok = ok && -lo[m] == hi[m];
    BOOST_TEST(all_ranks(ok), "layout '" << text << "' skipped " << o.skipped);
  }
}

// A trainer that leaves the loop early does not strand the others: its feed drains the stream.
BOOST_AUTO_TEST_CASE_TEMPLATE(a_trainer_that_stops_early_does_not_block_the_others, Feed, feeds) {
  for (const auto& text : usable_layouts<Feed>(world().size())) {
    const auto layout = fc::ensemble_layout::parse(text);
    const auto role = layout.role_of(world().rank());
    fc::feed_options options;
    options.steps = 20;
    options.shard_capacity = 16;
    bool ok = true;
    {
      Feed feed(world(), layout, test_loader(16), options);
      if (role.kind == fc::role::producer) {
        feed.produce();
      } else {
        const bool quitter = role.member == 0 && role.rank_in_member == 0;
        std::int64_t seen = 0;
        while (auto b = feed.next()) {
          ok = ok && b->step() == seen++;
          if (quitter && seen == 5) break;
        }
        ok = ok && seen == (quitter ? 5 : options.steps);
      }
    }
    BOOST_TEST(all_ranks(ok), "layout '" << text << "'");
  }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(a_loader_that_overfills_is_an_error_naming_step_and_shard, Feed, feeds) {
  for (const auto& text : usable_layouts<Feed>(world().size())) {
    const auto layout = fc::ensemble_layout::parse(text);
    fc::feed_options options;
    options.steps = 12;
    options.shard_capacity = 16;
    const int bad_shard = layout.shards_per_step() - 1;
    auto inner = test_loader(16);
    fc::loader load = [&](std::int64_t step, int shard, fc::span<std::byte> out) -> std::size_t {
      if (step == 5 && shard == bad_shard) return out.size() + 1;
      return inner(step, shard, out);
    };
    std::vector<std::int64_t> seen;
    const std::string e = error_of([&] {
      Feed feed(world(), layout, load, options);
      if (!is_trainer(layout)) {
        feed.produce();
        return;
      }
      while (auto b = feed.next()) seen.push_back(b->step());
    });
    // Trainers that receive the bad shard fail at step 5 after steps 0..4; the others finish.
    const auto role = layout.role_of(world().rank());
    const bool receives = role.kind == fc::role::trainer && layout.owner_of(role.member, bad_shard) == role.rank_in_member;
    const bool loads = role.kind == fc::role::producer ? Feed::needs_producers && 5 % layout.producers() == role.producer
                                                       : !Feed::needs_producers;
    bool ok;
    if (receives || (loads && Feed::needs_producers)) {
      ok = contains(e, "step 5 shard " + std::to_string(bad_shard)) && contains(e, "wrote 17 bytes, slot holds 16");
      if (role.kind == fc::role::trainer) ok = ok && seen == std::vector<std::int64_t>{0, 1, 2, 3, 4};
    } else {
      ok = e.empty();
    }
    BOOST_TEST(all_ranks(ok), "layout '" << text << "': " << e);
  }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(a_loader_that_throws_reaches_the_trainers, Feed, feeds) {
  const auto text = usable_layouts<Feed>(world().size());
  if (text.empty()) return;
  const auto layout = fc::ensemble_layout::parse(text.front());
  fc::feed_options options;
  options.steps = 6;
  options.shard_capacity = 64;
  fc::loader load = [](std::int64_t step, int, fc::span<std::byte>) -> std::size_t {
    if (step == 2) throw std::runtime_error("corrupt record 2");
    return 0;
  };
  std::string e = error_of([&] {
    Feed feed(world(), layout, load, options);
    if (!is_trainer(layout)) return feed.produce();
    while (auto b = feed.next()) {
    }
  });
  const auto role = layout.role_of(world().rank());
  const bool idle = role.kind == fc::role::producer && (!Feed::needs_producers || 2 % layout.producers() != role.producer);
  BOOST_TEST(all_ranks(idle ? e.empty() : contains(e, "step 2") && contains(e, "corrupt record 2")), e);
}

BOOST_AUTO_TEST_CASE_TEMPLATE(a_layout_for_another_world_size_is_rejected_on_every_rank, Feed, feeds) {
  const auto layout = fc::ensemble_layout::parse(fc::cat("producers=1 members=", world().size(), "x1"));
  fc::feed_options options;
  options.steps = 3;
  options.shard_capacity = 8;
  const std::string e = error_of([&] { Feed feed(world(), layout, test_loader(8), options); });
  BOOST_TEST(all_ranks(contains(e, fc::cat("needs ", world().size() + 1, " ranks, world has ", world().size()))), e);
}

BOOST_AUTO_TEST_CASE(one_to_many_without_producers_is_rejected) {
  const auto layout = fc::ensemble_layout::parse(fc::cat("members=", world().size()));
  fc::feed_options options;
  options.steps = 3;
  options.shard_capacity = 8;
  const std::string e = error_of([&] { fc::one_to_many<fc::mpi> feed(world(), layout, test_loader(8), options); });
  BOOST_TEST(all_ranks(contains(e, "needs producer ranks")), e);
  static_assert(fc::one_to_many<fc::mpi>::needs_producers && !fc::all_shared<fc::mpi>::needs_producers &&
                !fc::local_feed::needs_producers);
}

// Ranks that pass different options would post different streams: every rank refuses.
BOOST_AUTO_TEST_CASE(ranks_that_disagree_on_the_options_are_refused_on_every_rank) {
  const auto layout = fc::ensemble_layout::parse(fc::cat("members=", world().size()));
  fc::feed_options options;
  options.steps = world().rank() == 0 ? 10 : 11;
  options.shard_capacity = 8;
  const std::string e = error_of([&] { fc::all_shared<fc::mpi> feed(world(), layout, test_loader(8), options); });
  BOOST_TEST(all_ranks(world().size() == 1 ? e.empty() : contains(e, "ranks disagree on steps")), e);
  options.steps = 4;
  options.shard_capacity = 0;
  const std::string bad = error_of([&] { fc::all_shared<fc::mpi> feed(world(), layout, test_loader(8), options); });
  BOOST_TEST(all_ranks(contains(bad, "shard_capacity must be > 0")), bad);
}
