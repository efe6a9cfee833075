#define BOOST_TEST_MODULE mpi_dataset
#include "mpi_fixture.hpp"
#include "errors.hpp"

#include <boost/mpl/list.hpp>
#include <flexcomm/pipeline/presets.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace fc = flexcomm;
using fc::testing::all_ranks;
using fc::testing::world;

namespace {
using fc::testing::contains;
using fc::testing::error_of;

using feeds = boost::mpl::list<fc::local_feed, fc::one_to_many<fc::mpi>, fc::all_shared<fc::mpi>>;

// Layouts for this world size with uneven members (lcm shards 2, 3, 6), none to two producers.
std::vector<std::string> layouts_for(int n) {
  switch (n) {
    case 1: return {"members=1"};
    case 2: return {"producers=1 members=1", "members=2", "members=1,1"};
    case 3: return {"producers=1 members=2", "producers=2 members=1", "members=1,2", "producers=1 members=1,1"};
    case 4: return {"producers=1 members=1,2", "members=1,3", "producers=1 members=3", "members=2x2",
                    "producers=2 members=2"};
    default: return {fc::cat("producers=1 members=1,", n - 2)};
  }
}

template <class Feed>
std::vector<fc::ensemble_layout> usable_layouts(int n) {
  std::vector<fc::ensemble_layout> out;
  for (auto& text : layouts_for(n)) {
    const auto layout = fc::ensemble_layout::parse(text);
    if (!Feed::needs_producers || layout.producers() > 0) out.push_back(layout);
  }
  return out;
}

// Sample i: a 2x3 float tensor i*10 + j; its label the int64 7i + 1.
constexpr std::int64_t sample_elements = 6;
float value_of(std::int64_t index, std::int64_t j) { return static_cast<float>(index * 10 + j); }
std::int64_t label_of(std::int64_t index) { return 7 * index + 1; }

struct shape {
  std::int64_t size, batch, epochs;
  bool drop_last, shuffle, per_batch;
};
// A short last batch of one sample (empty shards wherever a step has 2 or more), a shuffled
// stream loaded a run at a time, a dropped last batch, and a batch larger than any shard count.
const shape shapes[] = {{21, 4, 2, false, false, false}, {17, 6, 3, false, true, true},
                        {10, 4, 1, true, false, false}, {9, 64, 2, false, true, false}};

fc::dataset dataset_of(const shape& s) {
  fc::dataset d;
  d.size = s.size;
  d.batch = s.batch;
  d.epochs = s.epochs;
  d.drop_last = s.drop_last;
  d.shuffle = s.shuffle;
  d.seed = 1234;
  d.sample = fc::field::of<float>({2, 3});
  d.label = fc::field::of<std::int64_t>();
  if (s.per_batch) {
    d.load_batch = [](const fc::batch_slot& out) {
      auto x = out.samples<float>();
      auto y = out.labels<std::int64_t>();
      for (std::int64_t i = 0; i < out.count(); ++i) {
        for (std::int64_t j = 0; j < sample_elements; ++j)
          x[static_cast<std::size_t>(i * sample_elements + j)] = value_of(out.indices()[static_cast<std::size_t>(i)], j);
        y[static_cast<std::size_t>(i)] = label_of(out.indices()[static_cast<std::size_t>(i)]);
      }
    };
  } else {
    d.load_sample = [](std::int64_t index, const fc::sample_slot& out) {
      auto x = out.sample<float>();
      for (std::int64_t j = 0; j < sample_elements; ++j) x[static_cast<std::size_t>(j)] = value_of(index, j);
      out.label<std::int64_t>()[0] = label_of(index);
    };
  }
  return d;
}

bool aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % fc::batch_alignment == 0; }

// Checks one typed batch against the plan and the loader; counts its samples in `seen`.
bool check_batch(const fc::typed_batch& b, const fc::batch_plan& plan, const fc::shard_range& shards,
                 std::vector<std::int64_t>& seen) {
  const auto want = plan.shards_samples(b.step(), shards.first, shards.count);
  bool ok = b.samples() == want.count && b.first_sample() == want.first &&
            b.batch_samples() == plan.batch_samples(b.step()) && b.epoch() == plan.epoch_of(b.step()) &&
            b.step_in_epoch() == plan.step_in_epoch(b.step()) && b.steps_in_epoch() == plan.steps_per_epoch() &&
            b.last_in_epoch() == plan.last_in_epoch(b.step());
  const auto x = b.as<float>();
  const auto y = b.labels<std::int64_t>();
  ok = ok && x.shape() == std::vector<std::int64_t>{b.samples(), 2, 3} && y.shape() == std::vector<std::int64_t>{b.samples()};
  ok = ok && aligned(x.data()) && aligned(y.data()) && x.numel() == static_cast<std::size_t>(b.samples() * 6);
  for (std::int64_t i = 0; i < b.samples() && ok; ++i) {
    const std::int64_t index = b.indices()[static_cast<std::size_t>(i)];
    ok = index >= 0 && index < plan.size() && y[static_cast<std::size_t>(i)] == label_of(index);
    for (std::int64_t j = 0; j < sample_elements; ++j) ok = ok && x[static_cast<std::size_t>(i * 6 + j)] == value_of(index, j);
    if (ok) ++seen[static_cast<std::size_t>(b.epoch() * plan.size() + index)];
  }
  return ok;
}

// Within each member, every sample of every epoch reached exactly one of its trainers (none of
// the samples a dropped last batch would have held).
bool each_member_saw_each_sample_once(const fc::ensemble_layout& layout, const fc::batch_plan& plan,
                                      std::vector<std::int64_t> seen) {
  const auto role = layout.role_of(world().rank());
  const bool trainer = role.kind == fc::role::trainer;
  const auto member = world().split(trainer ? role.member : fc::mpi::communicator::undefined, role.rank_in_member,
                                    "dataset test member");
  if (!trainer) return true;
  fc::mpi::iallreduce(member, fc::span<std::int64_t>(seen), fc::op::sum).wait();
  const std::int64_t used = plan.drop_last() ? plan.steps_per_epoch() * plan.batch() : plan.size();
  bool ok = true;
  for (std::int64_t e = 0; e < plan.epochs(); ++e) {
    std::int64_t total = 0;
    for (std::int64_t i = 0; i < plan.size(); ++i) {
      const auto n = seen[static_cast<std::size_t>(e * plan.size() + i)];
      ok = ok && n <= 1;
      total += n;
    }
    ok = ok && total == used;
  }
  return ok;
}

}  // namespace

// Every feed, every layout, every shape: each trainer's typed batches are exact, aligned, in
// order and in their epochs, the epoch-end callback comes once per epoch right after its last
// step, and each member sees every sample of an epoch once.
BOOST_AUTO_TEST_CASE_TEMPLATE(every_sample_once_per_epoch_to_one_trainer_of_each_member, Feed, feeds) {
  for (const auto& layout : usable_layouts<Feed>(world().size())) {
    for (const auto& s : shapes) {
      const auto data = dataset_of(s);
      fc::feed_options options;
      options.depth = 2;
      fc::typed_feed<Feed> feed(world(), layout, data, options);
      const auto& plan = feed.plan();
      const auto role = layout.role_of(world().rank());
      std::vector<std::int64_t> seen(static_cast<std::size_t>(plan.epochs() * plan.size()), 0);
      std::vector<std::int64_t> events, want;  // steps delivered, -1 - epoch for an epoch's end
      bool ok = true;
      if (role.kind == fc::role::producer) {
        feed.produce();
      } else {
        feed.on_epoch_end([&](std::int64_t e) { events.push_back(-1 - e); });
        const auto shards = layout.shards_of(role.member, role.rank_in_member);
        while (auto b = feed.next()) {
          events.push_back(b->step());
          ok = ok && check_batch(*b, plan, shards, seen);
        }
        for (std::int64_t e = 0; e < plan.epochs(); ++e) {
          for (std::int64_t k = 0; k < plan.steps_per_epoch(); ++k) want.push_back(e * plan.steps_per_epoch() + k);
          want.push_back(-1 - e);
        }
        ok = ok && events == want && feed.skipped() == 0;
      }
      ok = each_member_saw_each_sample_once(layout, plan, seen) && ok;
      BOOST_TEST(all_ranks(ok), "layout '" << layout.str() << "' size " << s.size << " batch " << s.batch);
    }
  }
}

// The derived stream: steps, capacity and an even split for a batch that divides into nothing.
BOOST_AUTO_TEST_CASE(options_are_derived_from_the_dataset) {
  const auto layout = fc::ensemble_layout::parse("producers=1 members=1,3,2");
  fc::dataset d;
  d.size = 60000;
  d.batch = 64;
  d.epochs = 3;
  d.sample = fc::field::of<float>({1, 28, 28});
  d.label = fc::field::of<std::int64_t>();
  const auto o = fc::typed_feed<fc::one_to_many<fc::mpi>>::options_for(layout, d);
  BOOST_TEST(o.steps == 3 * 938);
  // 11 samples at most per shard: indices, samples and labels.
  BOOST_TEST(o.shard_capacity == 11 * (8 + 784 * 4 + 8));
  BOOST_TEST(all_ranks(true));
}

// Only the ranks that load need the data: under one_to_many the trainers' dataset has no loader.
BOOST_AUTO_TEST_CASE(only_loading_ranks_need_a_loader) {
  if (world().size() < 2) return;
  const auto layout = fc::ensemble_layout::parse(fc::cat("producers=1 members=", world().size() - 1));
  auto d = dataset_of(shapes[0]);
  const bool producer = world().rank() == 0;
  if (!producer) d.load_sample = nullptr;
  fc::typed_feed<fc::one_to_many<fc::mpi>> feed(world(), layout, d);
  std::int64_t steps = 0;
  if (producer) {
    feed.produce();
  } else {
    while (auto b = feed.next()) ++steps;
  }
  BOOST_TEST(all_ranks(producer || steps == feed.plan().steps()));
}

BOOST_AUTO_TEST_CASE_TEMPLATE(a_rank_that_loads_without_a_loader_is_refused_on_every_rank, Feed, feeds) {
  const auto layouts = usable_layouts<Feed>(world().size());
  if (layouts.empty()) return;
  const auto& layout = layouts.front();
  auto d = dataset_of(shapes[0]);
  d.load_sample = nullptr;
  const std::string e = error_of([&] { fc::typed_feed<Feed> feed(world(), layout, d); });
  const auto role = layout.role_of(world().rank());
  const bool loads = (role.kind == fc::role::producer) == Feed::needs_producers;
  BOOST_TEST(all_ranks(loads ? contains(e, "neither load_sample nor load_batch")
                             : contains(e, "another rank rejected the dataset")),
             e);
}

// Ranks that describe the data differently would slice different streams: every rank refuses.
BOOST_AUTO_TEST_CASE(ranks_that_disagree_on_the_dataset_are_refused_on_every_rank) {
  const auto layout = fc::ensemble_layout::parse(fc::cat("members=", world().size()));
  const bool alone = world().size() == 1;
  auto d = dataset_of(shapes[0]);
  d.batch = world().rank() == 0 ? 5 : 6;
  std::string e = error_of([&] { fc::typed_feed<fc::all_shared<fc::mpi>> feed(world(), layout, d); });
  BOOST_TEST(all_ranks(alone ? e.empty() : contains(e, "ranks disagree on the dataset's batch: values range from 5 to 6")), e);
  d = dataset_of(shapes[0]);
  if (world().rank() == world().size() - 1) d.sample = fc::field::of<double>({2, 3});
  e = error_of([&] { fc::typed_feed<fc::local_feed> feed(world(), layout, d); });
  BOOST_TEST(all_ranks(alone ? e.empty() : contains(e, "ranks disagree on the dataset's sample field")), e);
  d = dataset_of(shapes[0]);
  d.sample.shape = {2, 0};
  e = error_of([&] { fc::typed_feed<fc::all_shared<fc::mpi>> feed(world(), layout, d); });
  BOOST_TEST(all_ranks(contains(e, "shape float{2,0} has a dimension <= 0")), e);
  d = dataset_of(shapes[0]);
  fc::feed_options options;
  options.steps = 7;
  e = error_of([&] { fc::typed_feed<fc::all_shared<fc::mpi>> feed(world(), layout, d, options); });
  BOOST_TEST(all_ranks(contains(e, "feed_options.steps is derived from the dataset")), e);
}

// A typed view asked for the wrong element type is an error, not a reinterpretation.
BOOST_AUTO_TEST_CASE(a_typed_view_of_the_wrong_type_is_refused) {
  const auto layout = fc::ensemble_layout::parse(fc::cat("members=", world().size()));
  fc::typed_feed<fc::local_feed> feed(world(), layout, dataset_of(shapes[0]));
  auto b = feed.next();
  const std::string e = error_of([&] { b->as<double>(); });
  const std::string l = error_of([&] { b->labels<std::int32_t>(); });
  BOOST_TEST(all_ranks(contains(e, "the field is float{2,3}, asked for double elements") &&
                       contains(l, "the field is int64{}, asked for int32 elements")),
             e << " / " << l);
}

namespace {
// A pipeline run through the typed front end under preset P: trainers submit, at each epoch's
// end, {epoch, sum of the dataset indices they saw in it}; the aggregator collects every round
// with on_round. The aggregator's member trains slowly, so that rounds complete while it trains.
template <class P>
void rounds_arrive_per_epoch(const fc::ensemble_layout& layout, const char* name) {
  using pipeline = typename P::pipeline;
  typename pipeline::options options = P::configure({});
  pipeline pipe(world(), layout, options);
  auto data = dataset_of({13, 3, 3, false, true, false});  // 5 steps per epoch, shuffled
  // Work this rank has done (samples loaded, batches trained), to tell when round 0 arrived.
  std::int64_t work = 0, work_at_round_0 = -1;
  auto load = data.load_sample;
  data.load_sample = [&, load](std::int64_t i, const fc::sample_slot& out) {
    ++work;
    load(i, out);
  };
  const std::int64_t all = 13 * 12 / 2;
  std::vector<std::int64_t> rounds;
  bool contents = true;
  pipe.on_round([&](std::int64_t round, fc::gathered<std::int64_t>& each) {
    rounds.push_back(round);
    if (round == 0) work_at_round_0 = work;
    for (int m = 0; m < layout.members(); ++m) {
      std::int64_t sum = 0;
      for (int r = 0; r < layout.member_size(m); ++r) {
        const auto t = each.trainer(m, r);
        contents = contents && t.size() == 2 && t[0] == round;
        if (t.size() == 2) sum += t[1];
      }
      contents = contents && sum == all;
    }
    each.member(0)[0] = -1;  // results are the aggregator's to use, in place
  });
  const auto aggregator = layout.role_of(layout.aggregator());
  pipe.run(
      data,
      [&](auto& ctx) {
        std::int64_t sum = 0;
        ctx.batches().on_epoch_end([&](std::int64_t epoch) {
          ctx.collect().submit(std::vector<std::int64_t>{epoch, sum});
          sum = 0;
        });
        const bool slow = aggregator.kind == fc::role::trainer && ctx.member() == aggregator.member;
        while (auto b = ctx.batches().next()) {
          for (auto i : b->indices()) sum += i;
          ++work;
          if (slow && b->epoch() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
          float g = 1;
          ctx.sync().ready(0, fc::span<float>(&g, 1));
          ctx.sync().finish();
        }
      });
  bool ok = true;
  if (world().rank() == layout.aggregator()) {
    const bool during = work_at_round_0 >= 0 && work_at_round_0 < work;
    ok = rounds == std::vector<std::int64_t>{0, 1, 2} && contents && during;
    BOOST_TEST(ok, name << " on '" << layout.str() << "': rounds " << rounds.size() << " contents " << contents
                        << " round 0 after " << work_at_round_0 << " of " << work << " units of work");
  }
  BOOST_TEST(all_ranks(ok), name << " on '" << layout.str() << "'");
}
}  // namespace

BOOST_AUTO_TEST_CASE(the_aggregator_collects_each_epoch_while_training_goes_on) {
  const int n = world().size();
  namespace p = fc::presets;
  // The aggregator trains (member 0's last rank), on every preset that fits.
  const fc::ensemble_layout trainers(0, n >= 3 ? std::vector<int>{2, n - 2} : std::vector<int>{n}, n >= 3 ? 1 : 0);
  rounds_arrive_per_epoch<p::baseline<>>(trainers, "baseline");
  rounds_arrive_per_epoch<p::all_shared<fc::overlapped_ring>>(trainers, "all_shared");
  if (n >= 2) {  // the aggregator is a trainer, then the producer
    const auto last = n >= 3 ? std::vector<int>{1, n - 2} : std::vector<int>{1};
    rounds_arrive_per_epoch<p::single_broadcast<>>(fc::ensemble_layout(1, last, n - 1), "single_broadcast");
    rounds_arrive_per_epoch<p::single_broadcast<>>(fc::ensemble_layout(1, last, 0), "single_broadcast (producer aggregates)");
  }
}

// Rounds the aggregator never gathers are named when the pipeline ends, not left to hang.
BOOST_AUTO_TEST_CASE(rounds_left_ungathered_are_an_error_at_the_end) {
  const fc::ensemble_layout layout(0, std::vector<int>(static_cast<std::size_t>(world().size()), 1), 0);
  fc::presets::baseline<>::pipeline pipe(world(), layout, {});
  const std::string e = error_of([&] {
    pipe.run(dataset_of(shapes[2]), [&](auto& ctx) {
      while (ctx.batches().next()) {
        float g = 0;
        ctx.sync().ready(0, fc::span<float>(&g, 1));
        ctx.sync().finish();
      }
      ctx.collect().submit(std::vector<float>{1.0f});
      ctx.collect().submit(std::vector<float>{2.0f});
    }, [&](auto& ctx) { ctx.collect().template gather<float>(); });
  });
  BOOST_TEST(all_ranks(world().rank() != 0 ? e.empty() : contains(e, "submitted 1 round (1..1) that the aggregator never gathered")), e);
}

// The feed as a range, in generic code: the batch's type is named, so as<T>() needs no keyword.
BOOST_AUTO_TEST_CASE(a_typed_feed_is_a_range_of_its_batches) {
  const auto layout = fc::ensemble_layout::parse(fc::cat("members=", world().size()));
  fc::typed_feed<fc::all_shared<fc::mpi>> feed(world(), layout, dataset_of(shapes[1]));
  auto visit = [](auto& generic) {
    std::int64_t steps = 0, samples = 0;
    for (const fc::typed_batch& batch : generic) {
      steps += batch.step() == steps ? 1 : 1000;
      samples += static_cast<std::int64_t>(batch.as<float>().numel() / 6);
    }
    return std::make_pair(steps, samples);
  };
  const auto [steps, samples] = visit(feed);
  // All ranks of the one member together see every sample of every epoch.
  std::int64_t total = samples;
  fc::mpi::iallreduce(world(), fc::span<std::int64_t>(&total, 1), fc::op::sum).wait();
  BOOST_TEST(all_ranks(steps == feed.plan().steps() && total == feed.plan().epochs() * feed.plan().size()),
             steps << " steps, " << total << " samples");
}
