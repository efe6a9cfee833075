#define BOOST_TEST_MODULE mpi_many_to_one
#include "mpi_fixture.hpp"
#include "errors.hpp"

#include <flexcomm/patterns/collect/many_to_one.hpp>
#include <flexcomm/pipeline/member_costs.hpp>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace fc = flexcomm;
using fc::mpi;
using fc::testing::world;

namespace {

// Layouts of the whole world that put the aggregator on a trainer, on a producer, and last.
std::vector<fc::ensemble_layout> layouts(int n) {
  std::vector<fc::ensemble_layout> out;
  out.emplace_back(0, std::vector<int>(static_cast<std::size_t>(n), 1), 0);
  out.emplace_back(0, std::vector<int>(static_cast<std::size_t>(n), 1), n - 1);
  if (n >= 2) {  // one producer as aggregator, the rest in members of 2 and 1 ranks
    std::vector<int> sizes;
    for (int left = n - 1; left > 0; left -= 2) sizes.push_back(left >= 2 ? 2 : 1);
    out.emplace_back(1, sizes, 0);
    out.emplace_back(1, sizes, n - 1);
  }
  if (n >= 3) out.emplace_back(2, std::vector<int>{n - 2}, 1);  // a producer that does not aggregate
  return out;
}

// How many elements rank r of member m submits in `round`: differs per rank, zero included.
std::size_t count_of(int m, int r, int round) { return static_cast<std::size_t>((m * 3 + r * 5 + round) % 4); }

template <class T>
std::vector<T> tensor_of(int m, int r, int round) {
  std::vector<T> v(count_of(m, r, round));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<T>(100 * m + 10 * r + static_cast<int>(i) + round);
  return v;
}

template <class T>
bool check_gathered(const fc::ensemble_layout& layout, const fc::gathered<T>& g, int round) {
  std::vector<T> want;
  std::vector<std::size_t> counts;
  for (int m = 0; m < layout.members(); ++m) {
    std::size_t member_total = 0;
    for (int r = 0; r < layout.member_size(m); ++r) {
      const auto t = tensor_of<T>(m, r, round);
      want.insert(want.end(), t.begin(), t.end());
      counts.push_back(t.size());
      member_total += t.size();
      const auto seen = g.trainer(m, r);
      if (seen.size() != t.size() || !std::equal(t.begin(), t.end(), seen.begin())) return false;
    }
    if (g.member_counts.at(static_cast<std::size_t>(m)) != member_total) return false;
  }
  return g.data == want && g.rank_counts == counts;
}

}  // namespace

BOOST_AUTO_TEST_CASE(gather_concatenates_variable_sizes_in_member_order) {
  for (const auto& layout : layouts(world().size())) {
    fc::many_to_one<mpi> collect(world(), layout);
    const auto me = layout.role_of(world().rank());
    bool ok = true;
    for (int round = 0; round < 3; ++round) {
      if (collect.is_trainer()) collect.submit(tensor_of<std::int32_t>(me.member, me.rank_in_member, round));
      if (collect.is_aggregator()) ok = ok && check_gathered(layout, collect.gather<std::int32_t>(), round);
    }
    collect.flush();
    BOOST_TEST(fc::testing::all_ranks(ok), "layout " << layout.str());
  }
}

BOOST_AUTO_TEST_CASE(zero_sized_submissions_from_everyone) {
  for (const auto& layout : layouts(world().size())) {
    fc::many_to_one<mpi> collect(world(), layout);
    bool ok = true;
    if (collect.is_trainer()) {  // two rounds, both empty
      collect.submit(std::vector<double>{});
      collect.submit(std::vector<double>{});
    }
    if (collect.is_aggregator()) {
      const auto g = collect.gather<double>();
      ok = g.data.empty() && g.rank_counts.size() == static_cast<std::size_t>(layout.trainers());
      const auto r = collect.reduce<double>(fc::op::sum);  // a second, empty round
      ok = ok && r.empty();
    }
    BOOST_TEST(fc::testing::all_ranks(ok), "layout " << layout.str());
  }
}

// Trainers submit several large rounds and then wait for the aggregator in a collective the
// aggregator enters only before gathering: a submit that waited for the aggregator would hang.
BOOST_AUTO_TEST_CASE(submit_does_not_wait_for_the_aggregator_and_owns_its_copy) {
  const int n = world().size();
  const fc::ensemble_layout layout(0, std::vector<int>(static_cast<std::size_t>(n), 1), n - 1);
  fc::many_to_one<mpi> collect(world(), layout);
  const std::size_t big = 1 << 20;  // past MPICH's eager limit: the transfer needs the aggregator
  const int rank = world().rank();
  std::vector<float> buf(big);
  if (!collect.is_aggregator()) {
    for (int round = 0; round < 3; ++round) {
      std::fill(buf.begin(), buf.end(), static_cast<float>(rank * 10 + round));
      collect.submit(fc::span<const float>(buf));
    }
    std::fill(buf.begin(), buf.end(), -1.0f);  // the submissions are copies
  }
  BOOST_TEST(fc::testing::all_ranks(true));
  bool ok = true;
  if (collect.is_aggregator()) {
    for (int round = 0; round < 3; ++round) {
      std::fill(buf.begin(), buf.end(), static_cast<float>(rank * 10 + round));
      collect.submit(fc::span<const float>(buf));
      const auto g = collect.gather<float>();
      for (int r = 0; r < n; ++r) {
        const auto t = g.trainer(r, 0);
        ok = ok && t.size() == big && t[0] == static_cast<float>(r * 10 + round) &&
             t[big - 1] == static_cast<float>(r * 10 + round);
      }
    }
  }
  collect.flush();
  BOOST_TEST(fc::testing::all_ranks(ok));
}

BOOST_AUTO_TEST_CASE(reduce_combines_members_with_every_op) {
  const fc::op ops[] = {fc::op::sum, fc::op::prod, fc::op::min, fc::op::max, fc::op::avg};
  for (const auto& layout : layouts(world().size())) {
    fc::many_to_one<mpi> collect(world(), layout);
    const auto me = layout.role_of(world().rank());
    bool ok = true;
    for (fc::op o : ops) {
      // Each member contributes 5 values (m + i) % 3 + 1, split unevenly over its ranks.
      if (collect.is_trainer()) {
        const int size = layout.member_size(me.member);
        const std::size_t first = me.rank_in_member == 0 ? 0 : static_cast<std::size_t>(5 * me.rank_in_member / size);
        const std::size_t last = static_cast<std::size_t>(5 * (me.rank_in_member + 1) / size);
        std::vector<std::int64_t> part;
        for (std::size_t i = first; i < last; ++i) part.push_back((me.member + static_cast<int>(i)) % 3 + 1);
        collect.submit(part);
      }
      if (collect.is_aggregator()) {
        std::vector<std::int64_t> want(5), got = collect.reduce<std::int64_t>(o);
        for (std::size_t i = 0; i < 5; ++i) {
          want[i] = static_cast<std::int64_t>(i) % 3 + 1;
          for (int m = 1; m < layout.members(); ++m) {
            const std::int64_t v = (m + static_cast<int>(i)) % 3 + 1;
            fc::combine(o, &want[i], &v, 1);
          }
        }
        if (o == fc::op::avg) fc::divide_by(want.data(), 5, layout.members());
        ok = ok && got == want;
      }
    }
    BOOST_TEST(fc::testing::all_ranks(ok), "layout " << layout.str());
  }
}

BOOST_AUTO_TEST_CASE(reduce_average_of_float_probabilities) {
  const int n = world().size();
  const fc::ensemble_layout layout(0, std::vector<int>(static_cast<std::size_t>(n), 1), 0);
  fc::many_to_one<mpi> collect(world(), layout);
  collect.submit(std::vector<float>{static_cast<float>(world().rank()), 1.0f});
  bool ok = true;
  if (collect.is_aggregator()) {
    const auto avg = collect.reduce<float>(fc::op::avg);
    ok = avg.size() == 2 && avg[0] == static_cast<float>(n - 1) / 2.0f && avg[1] == 1.0f;
  }
  BOOST_TEST(fc::testing::all_ranks(ok));
}

BOOST_AUTO_TEST_CASE(misuse_is_reported_and_the_next_round_still_works) {
  const int n = world().size();
  const fc::ensemble_layout layout(0, std::vector<int>(static_cast<std::size_t>(n), 1), 0);
  fc::many_to_one<mpi> collect(world(), layout);
  bool ok = true;
  // The aggregator is a trainer here: gathering before its own submit is an error.
  if (collect.is_aggregator()) {
    try {
      collect.gather<float>();
      ok = false;
    } catch (const fc::error& e) {
      ok = std::string(e.what()).find("submit() its own tensor") != std::string::npos;
    }
  } else {
    try {
      collect.gather<float>();
      ok = false;
    } catch (const fc::error& e) {
      ok = std::string(e.what()).find("only the aggregator") != std::string::npos;
    }
  }
  // A type mismatch: trainers submit float, the aggregator gathers double.
  collect.submit(std::vector<float>(3, 1.0f));
  if (collect.is_aggregator()) {
    try {
      collect.gather<double>();
      ok = false;
    } catch (const fc::error& e) {
      ok = ok && std::string(e.what()).find("submitted float but the aggregator gathers double") != std::string::npos;
    }
  }
  // Members of different lengths cannot be reduced (one member here sends one element more).
  if (n > 1) {
    collect.submit(std::vector<int>(world().rank() == n - 1 ? 3 : 2, 1));
    if (collect.is_aggregator()) {
      try {
        collect.reduce<int>(fc::op::sum);
        ok = false;
      } catch (const fc::error& e) {
        ok = ok && std::string(e.what()).find("needs the same length") != std::string::npos;
      }
    }
  }
  // The collect communicator is still in step.
  collect.submit(std::vector<int>{world().rank()});
  if (collect.is_aggregator()) {
    const auto g = collect.gather<int>();
    for (int r = 0; r < n; ++r) ok = ok && g.data.at(static_cast<std::size_t>(r)) == r;
  }
  collect.flush();
  BOOST_TEST(fc::testing::all_ranks(ok));
}

BOOST_AUTO_TEST_CASE(producers_do_not_submit) {
  if (world().size() < 2) return;
  const fc::ensemble_layout layout(1, std::vector<int>(static_cast<std::size_t>(world().size() - 1), 1), 1);
  fc::many_to_one<mpi> collect(world(), layout);
  bool ok = true;
  if (world().rank() == 0) {
    try {
      collect.submit(std::vector<int>{1});
      ok = false;
    } catch (const fc::error& e) {
      ok = std::string(e.what()).find("only trainers submit") != std::string::npos;
    }
  }
  BOOST_TEST(fc::testing::all_ranks(ok));
}

BOOST_AUTO_TEST_CASE(a_layout_that_does_not_fit_the_world_is_refused) {
  const fc::ensemble_layout layout(1, std::vector<int>(static_cast<std::size_t>(world().size()), 1), 0);
  bool ok = false;
  try {
    fc::many_to_one<mpi> collect(world(), layout);
  } catch (const fc::error& e) {
    ok = std::string(e.what()).find("world has") != std::string::npos;
  }
  BOOST_TEST(fc::testing::all_ranks(ok));
}

// Rounds collected while the aggregator does other work: trainers submit three rounds and close;
// the aggregator polls between units of its own work until the end round, each round exact and
// in order, wherever the aggregator sits. Then a gather has nothing left, and says so.
BOOST_AUTO_TEST_CASE(polled_rounds_arrive_in_order_up_to_the_end_round) {
  for (const auto& layout : layouts(world().size())) {
    fc::many_to_one<mpi> collect(world(), layout);
    const auto me = layout.role_of(world().rank());
    std::vector<int> rounds;
    bool ok = true, ended = false;
    auto each = [&](std::int64_t round, fc::gathered<std::int32_t>& g) {
      rounds.push_back(static_cast<int>(round));
      ok = ok && check_gathered(layout, g, static_cast<int>(round));
      if (!g.data.empty()) g.member(0)[0] += 0;  // a mutable span
    };
    for (int round = 0; round < 3; ++round) {
      if (collect.is_trainer()) collect.submit(tensor_of<std::int32_t>(me.member, me.rank_in_member, round));
      if (collect.is_aggregator()) ended = collect.poll_rounds<std::int32_t>(each);
    }
    if (collect.is_trainer()) collect.close();
    if (collect.is_aggregator()) {
      while (!ended) ended = collect.poll_rounds<std::int32_t>(each);  // the aggregator's "other work"
      ok = ok && rounds == std::vector<int>{0, 1, 2} && collect.finished();
      try {
        collect.gather<std::int32_t>();
        ok = false;
      } catch (const fc::error& e) {
        ok = ok && std::string(e.what()).find("no round is left to gather") != std::string::npos;
      }
    }
    collect.flush();
    BOOST_TEST(fc::testing::all_ranks(ok), "layout " << layout.str());
  }
}

// gather_rounds waits for each round up to the end; submitting after close() is refused.
BOOST_AUTO_TEST_CASE(gather_rounds_waits_to_the_end_and_close_is_final) {
  for (const auto& layout : layouts(world().size())) {
    fc::many_to_one<mpi> collect(world(), layout);
    const auto me = layout.role_of(world().rank());
    bool ok = true;
    if (collect.is_trainer()) {
      collect.submit(tensor_of<std::int32_t>(me.member, me.rank_in_member, 0));
      collect.close();
      try {
        collect.submit(std::vector<std::int32_t>{1});
        ok = false;
      } catch (const fc::error& e) {
        ok = std::string(e.what()).find("has closed the stream") != std::string::npos;
      }
    }
    if (collect.is_aggregator()) {
      int rounds = 0;
      collect.gather_rounds<std::int32_t>([&](std::int64_t round, fc::gathered<std::int32_t>& g) {
        ok = ok && round == rounds++ && check_gathered(layout, g, 0);
      });
      ok = ok && rounds == 1 && collect.finished();
    }
    collect.flush();
    BOOST_TEST(fc::testing::all_ranks(ok), "layout " << layout.str());
  }
}

// "members=auto:N" planned on the world (pipeline/member_costs.hpp), then used by a consumer.
namespace {

// Whether every rank holds the same text (its fingerprint, agreed in one reduction).
bool same_on_every_rank(const std::string& text) {
  fc::agreement a({fc::fingerprint().add(text).folded()});
  mpi::iallreduce<std::int64_t>(world(), a.buffer(), fc::op::max).wait();
  return a.all_agreed();
}

// Every rank planned the same layout, which fills the budget, fits the world and gathers.
bool planned_and_usable(const fc::layout_plan& p, int budget) {
  bool ok = same_on_every_rank(p.layout.str()) && p.layout.trainers() == budget;
  fc::many_to_one<mpi> collect(world(), p.layout);
  const auto placed = fc::placed_on_hosts(world(), p.layout);
  const auto me = placed.role_of(world().rank());
  if (collect.is_trainer()) collect.submit(tensor_of<std::int32_t>(me.member, me.rank_in_member, 0));
  if (collect.is_aggregator()) ok = ok && check_gathered(placed, collect.gather<std::int32_t>(), 0);
  collect.flush();
  return ok;
}

// The layouts to plan at this world size: two members where there is room, with and without a
// producer, and one producer per host where a host keeps a trainer.
std::vector<std::string> auto_layouts(int n) {
  std::vector<std::string> out{n >= 2 ? "members=auto:2" : "members=auto:1"};
  if (n >= 3) out.push_back(fc::cat("producers=1 members=auto:2 aggregator=", n - 1));
  if (fc::mpi::hosts(world()).hosts() < n) out.push_back("producers=per-host members=auto:1");
  return out;
}

}  // namespace

BOOST_AUTO_TEST_CASE(auto_members_planned_from_hints_give_the_costly_member_more) {
  for (const auto& text : auto_layouts(world().size())) {
    const auto unplanned = fc::ensemble_layout::parse(text);
    const int budget = unplanned.rank_budget(fc::mpi::hosts(world()));
    const std::vector<double> hints{1.0, 10.0};
    const auto p = fc::plan_from_hints(world(), unplanned, {hints.begin(), hints.begin() + unplanned.members()});
    bool ok = p.layout.members() < 2 || p.layout.member_size(1) >= p.layout.member_size(0);
    BOOST_TEST(fc::testing::all_ranks(planned_and_usable(p, budget) && ok), text << " -> " << p.text());
  }
}

// Member 1's step sleeps 10 ms, member 0's 1 ms: robust under load is only that every rank has
// the same plan, that it fills the budget, and that the slow member has no fewer ranks.
BOOST_AUTO_TEST_CASE(auto_members_planned_from_measured_steps) {
  for (const auto& text : auto_layouts(world().size())) {
    const auto unplanned = fc::ensemble_layout::parse(text);
    const int budget = unplanned.rank_budget(fc::mpi::hosts(world()));
    const auto p = fc::measure_and_plan(world(), unplanned, [](int member) {
      std::this_thread::sleep_for(std::chrono::milliseconds(member == 1 ? 10 : 1));
    });
    bool ok = p.plan.measured && (p.layout.members() < 2 || p.layout.member_size(1) >= p.layout.member_size(0));
    if (world().rank() == 0) BOOST_TEST_MESSAGE(p.text());
    BOOST_TEST(fc::testing::all_ranks(planned_and_usable(p, budget) && ok), text << " -> " << p.text());
  }
}

// Unplanned, a layout is refused by its consumers; a plan that cannot be made, or hints that
// differ between ranks, are refused on every rank; a step that throws is rethrown where it
// threw and named everywhere else.
BOOST_AUTO_TEST_CASE(auto_members_refused_unplanned_too_many_or_when_a_step_throws) {
  using fc::testing::contains;
  const int n = world().size();
  const auto unplanned = fc::ensemble_layout::parse("members=auto:1");
  bool ok = contains(fc::testing::error_of([&] { fc::many_to_one<mpi> collect(world(), unplanned); }),
                     "is not planned yet");
  const auto too_many = fc::ensemble_layout::parse(fc::cat("members=auto:", n + 1));
  ok = ok && contains(fc::testing::error_of([&] { (void)fc::measure_and_plan(world(), too_many, [](int) {}); }),
                      fc::cat(n + 1, " members need at least ", n + 1, " ranks"));
  const std::string differ = fc::testing::error_of(
      [&] { (void)fc::plan_from_hints(world(), unplanned, {world().rank() == 0 ? 1.0 : 2.0}); });
  ok = ok && (n == 1 ? differ.empty() : contains(differ, "ranks disagree on the layout, the options or the hints"));
  std::string seen;
  try {
    (void)fc::measure_and_plan(world(), unplanned, [n](int) {
      if (world().rank() == n - 1) throw std::runtime_error("the user's step failed");
    });
  } catch (const std::exception& e) {
    seen = e.what();
  }
  ok = ok && contains(seen, world().rank() == n - 1 ? std::string("the user's step failed")
                                                    : fc::cat("world rank ", n - 1, "'s step threw"));
  BOOST_TEST(fc::testing::all_ranks(ok), seen);
}
