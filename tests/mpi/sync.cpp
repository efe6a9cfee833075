#define BOOST_TEST_MODULE mpi_sync
#include "mpi_fixture.hpp"
#include "errors.hpp"
#include "exact_values.hpp"

#include <boost/mpl/list.hpp>

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace fc = flexcomm;
using fc::mpi;
using fc::testing::world;
using fc::testing::all_ops;
using fc::testing::contains;
using fc::testing::element_types;
using fc::testing::gradient;
using fc::testing::reference;
using fc::testing::same;

namespace {

using adapters = boost::mpl::list<fc::subgroup_allreduce<mpi>, fc::overlapped_ring<mpi>>;

std::vector<int> all_world_ranks() {
  std::vector<int> r(static_cast<std::size_t>(world().size()));
  std::iota(r.begin(), r.end(), 0);
  return r;
}

// A random model: gradient sizes (zero, below the rank count, not divisible by it) and the
// same permutation of them on every rank, from a seed every rank shares.
struct model {
  std::vector<std::size_t> sizes;
  std::vector<std::vector<int>> order;  // per step: the order backprop hands gradients over
};

model random_model(std::mt19937& rng, int steps) {
  const std::size_t picks[] = {0, 1, 2, 3, 5, 7, 64, 333, 1000, 2049};
  model m;
  const int gradients = std::uniform_int_distribution<int>(1, 7)(rng);
  for (int i = 0; i < gradients; ++i)
    m.sizes.push_back(picks[std::uniform_int_distribution<std::size_t>(0, std::size(picks) - 1)(rng)]);
  std::vector<int> order(static_cast<std::size_t>(gradients));
  std::iota(order.rbegin(), order.rend(), 0);  // backprop: last layer first
  for (int s = 0; s < steps; ++s) {
    m.order.push_back(order);
    std::shuffle(order.begin(), order.end(), rng);  // later steps may finish layers in another order
  }
  return m;
}

// Runs `steps` steps of `Sync` over the model on `member`; true when every gradient ends equal
// to the reference over `member_ranks`.
template <class Sync, class T>
bool run_steps(const mpi::communicator& member, const std::vector<int>& member_ranks, const model& m,
               fc::sync_options options, std::string& detail) {
  Sync sync(member, options);
  const int rank = world().rank();
  bool ok = true;
  for (int step = 0; step < static_cast<int>(m.order.size()); ++step) {
    std::vector<std::vector<T>> grads(m.sizes.size());
    for (std::size_t i = 0; i < m.sizes.size(); ++i) grads[i] = gradient<T>(rank, step, static_cast<int>(i), m.sizes[i]);
    for (int i : m.order[static_cast<std::size_t>(step)]) sync.ready(i, fc::span<T>(grads[static_cast<std::size_t>(i)]));
    sync.finish();
    for (std::size_t i = 0; i < m.sizes.size(); ++i)
      if (!same(grads[i], reference<T>(options.op, member_ranks, step, static_cast<int>(i), m.sizes[i]))) {
        ok = false;
        detail = fc::cat("step ", step, " gradient ", i, " (", m.sizes[i], " elements)");
      }
  }
  return ok;
}

template <class Sync>
bool threw_on_finish(Sync& sync, std::string& cause) {
  try {
    sync.finish();
  } catch (const fc::error& e) {
    cause = e.cause();
    return e.rank() == world().rank();
  }
  return false;
}

}  // namespace

BOOST_AUTO_TEST_CASE_TEMPLATE(both_adapters_equal_the_reference_for_every_op, T, element_types) {
  std::mt19937 rng(1234 + static_cast<unsigned>(fc::dtype_of<T>));  // same on every rank
  const auto everyone = all_world_ranks();
  {
    const auto m = random_model(rng, 3);
    fc::sync_options options;
    // From one bucket per gradient to everything in one bucket; segments from one element up.
    const std::size_t capacities[] = {1, 16, 700, 4096, 1 << 20};
    const std::size_t segments[] = {16, 100, 1000, 1 << 20};
    options.bucket_bytes = capacities[std::uniform_int_distribution<std::size_t>(0, 4)(rng)];
    options.segment_bytes = segments[std::uniform_int_distribution<std::size_t>(0, 3)(rng)];
    options.segments_in_flight = std::uniform_int_distribution<int>(1, 3)(rng);
    // No last bucket of its own, or one of a gradient or a few, or the default.
    const std::size_t lasts[] = {0, 8, 256, std::size_t{64} << 10};
    options.last_bucket_bytes = lasts[std::uniform_int_distribution<std::size_t>(0, 3)(rng)];
    for (fc::op o : all_ops) {
      options.op = o;
      std::string detail;
      const auto where = fc::cat("op ", fc::name_of(o), " buckets of ", options.bucket_bytes, " bytes, the last of at most ",
                                 options.last_bucket_bytes, ", segments of ",
                                 options.segment_bytes, " bytes x", options.segments_in_flight);
      options.launch_when_full = false;
      BOOST_TEST(fc::testing::all_ranks(run_steps<fc::subgroup_allreduce<mpi>, T>(world(), everyone, m, options, detail)),
                 "subgroup_allreduce " << where << " " << detail);
      options.launch_when_full = true;
      BOOST_TEST(fc::testing::all_ranks(run_steps<fc::subgroup_allreduce<mpi>, T>(world(), everyone, m, options, detail)),
                 "subgroup_allreduce launched when full " << where << " " << detail);
      BOOST_TEST(fc::testing::all_ranks(run_steps<fc::overlapped_ring<mpi>, T>(world(), everyone, m, options, detail)),
                 "overlapped_ring " << where << " " << detail);
    }
  }
}

// Random reals: the ring adds in another order than MPI, so floats agree within a tolerance
// (relative to the sum of magnitudes); every rank must still end with the same bits.
BOOST_AUTO_TEST_CASE_TEMPLATE(random_reals_agree_with_mpi_allreduce_within_tolerance, Sync, adapters) {
  const int rank = world().rank();
  std::mt19937 rng(99 + static_cast<unsigned>(rank));
  std::normal_distribution<double> normal(0.0, 1.0);
  const std::size_t sizes[] = {1, 17, 4099, 30000};
  std::vector<std::vector<float>> f(std::size(sizes)), f_ref(std::size(sizes)), f_abs(std::size(sizes));
  std::vector<std::vector<double>> d(std::size(sizes)), d_ref(std::size(sizes));
  fc::sync_options options;
  options.bucket_bytes = 64 << 10;
  options.segment_bytes = 4 << 10;
  options.op = fc::op::avg;
  Sync sync(world(), options);
  for (int step = 0; step < 2; ++step) {
    for (std::size_t i = 0; i < std::size(sizes); ++i) {
      f[i].resize(sizes[i]);
      d[i].resize(sizes[i]);
      for (auto& x : f[i]) x = static_cast<float>(normal(rng));
      for (auto& x : d[i]) x = normal(rng);
      f_ref[i].assign(sizes[i], 0.0f);
      d_ref[i].assign(sizes[i], 0.0);
      f_abs[i].resize(sizes[i]);
      std::vector<float> magnitude(sizes[i]);
      for (std::size_t k = 0; k < sizes[i]; ++k) magnitude[k] = std::fabs(f[i][k]);
      MPI_Allreduce(f[i].data(), f_ref[i].data(), static_cast<int>(sizes[i]), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      MPI_Allreduce(magnitude.data(), f_abs[i].data(), static_cast<int>(sizes[i]), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      MPI_Allreduce(d[i].data(), d_ref[i].data(), static_cast<int>(sizes[i]), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    }
    for (std::size_t i = std::size(sizes); i-- > 0;) {
      sync.ready(static_cast<int>(2 * i), fc::span<float>(f[i]));
      sync.ready(static_cast<int>(2 * i + 1), fc::span<double>(d[i]));
    }
    sync.finish();
    const double n = world().size();
    bool ok = true;
    double first = 0;
    for (std::size_t i = 0; i < std::size(sizes); ++i)
      for (std::size_t k = 0; k < sizes[i]; ++k) {
        ok = ok && std::fabs(f[i][k] - f_ref[i][k] / n) <= 2e-6 * (f_abs[i][k] / n) + 1e-30;
        ok = ok && std::fabs(d[i][k] - d_ref[i][k] / n) <= 1e-13 * (std::fabs(d_ref[i][k]) / n + 1.0);
        first += f[i][k] + d[i][k];
      }
    BOOST_TEST(fc::testing::all_ranks(ok), "step " << step);
    // Same bits everywhere: the rank-0 checksum, broadcast, equals each rank's own.
    double from_zero = first;
    mpi::ibcast(world(), fc::span<double>(&from_zero, 1), 0).wait();
    BOOST_TEST(fc::testing::all_ranks(from_zero == first), "step " << step);
  }
}

// Members split from one world: interleaved (even and odd world ranks), so a ring that
// strayed onto the world would mix them.
BOOST_AUTO_TEST_CASE_TEMPLATE(two_members_in_one_world_never_mix_gradients, Sync, adapters) {
  const int rank = world().rank(), size = world().size();
  const int member = rank % 2;
  auto comm = world().split(member, rank, fc::cat("member ", member));
  std::vector<int> mine;
  for (int r = member; r < size; r += 2) mine.push_back(r);
  std::mt19937 rng(7);
  const auto m = random_model(rng, 3);
  for (std::size_t capacity : {std::size_t{8}, std::size_t{1} << 20}) {
    fc::sync_options options;
    options.bucket_bytes = capacity;
    options.segment_bytes = 64;
    std::string detail;
    BOOST_TEST(fc::testing::all_ranks(run_steps<Sync, std::int64_t>(comm, mine, m, options, detail)),
               "member " << member << " " << detail);
    options.op = fc::op::sum;
    BOOST_TEST(fc::testing::all_ranks(run_steps<Sync, float>(comm, mine, m, options, detail)),
               "member " << member << " " << detail);
  }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(different_order_at_the_first_step_is_an_error_on_every_rank, Sync, adapters) {
  const int rank = world().rank(), size = world().size();
  for (std::size_t capacity : {std::size_t{4}, std::size_t{1} << 20}) {
    fc::sync_options options;
    options.bucket_bytes = capacity;
    Sync sync(world(), options);
    std::vector<float> a(10, 1.0f), b(20, 2.0f);
    if (rank == 0) {
      sync.ready(0, fc::span<float>(a));
      sync.ready(1, fc::span<float>(b));
    } else {
      sync.ready(1, fc::span<float>(b));
      sync.ready(0, fc::span<float>(a));
    }
    std::string cause;
    const bool threw = threw_on_finish(sync, cause);
    BOOST_TEST(fc::testing::all_ranks(threw == (size > 1)), "capacity " << capacity << ": " << cause);
    BOOST_TEST(fc::testing::all_ranks(size == 1 || contains(cause, "different orders or with different sizes")), cause);
    // The failed first step formed no plan: a consistent step now works.
    std::fill(a.begin(), a.end(), static_cast<float>(rank));
    sync.ready(0, fc::span<float>(a));
    sync.ready(1, fc::span<float>(b));
    sync.finish();
    BOOST_TEST(fc::testing::all_ranks(a[0] == static_cast<float>(size - 1) / 2.0f && b[19] == 2.0f));
  }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(different_sizes_at_the_first_step_are_an_error_on_every_rank, Sync, adapters) {
  const int rank = world().rank(), size = world().size();
  Sync sync(world(), fc::sync_options{});
  std::vector<double> a(10), b(rank == size - 1 ? 21 : 20);
  sync.ready(0, fc::span<double>(a));
  sync.ready(1, fc::span<double>(b));
  std::string cause;
  BOOST_TEST(fc::testing::all_ranks(threw_on_finish(sync, cause) == (size > 1)), cause);
}

BOOST_AUTO_TEST_CASE_TEMPLATE(misuse_after_the_plan_is_fixed_is_an_error_on_every_rank, Sync, adapters) {
  const int rank = world().rank(), size = world().size();
  fc::sync_options options;
  options.bucket_bytes = 48;  // two gradients per bucket
  Sync sync(world(), options);
  std::vector<std::int32_t> g0(6), g1(6), g2(5), g3(7), wrong(8);
  auto step = [&](auto&& hand_over) {
    for (auto* g : {&g0, &g1, &g2, &g3}) std::fill(g->begin(), g->end(), rank);
    hand_over();
    std::string cause;
    const bool threw = threw_on_finish(sync, cause);
    return std::make_pair(threw, cause);
  };
  auto correct = [&] {
    sync.ready(3, fc::span<std::int32_t>(g3));
    sync.ready(2, fc::span<std::int32_t>(g2));
    sync.ready(1, fc::span<std::int32_t>(g1));
    sync.ready(0, fc::span<std::int32_t>(g0));
  };
  const std::int32_t avg = (size - 1) * size / 2 / size;
  auto [threw, cause] = step(correct);  // the first step fixes the plan
  BOOST_TEST(fc::testing::all_ranks(!threw && g0[5] == avg && g3[0] == avg), cause);

  // One rank hands a gradient over with another size.
  std::tie(threw, cause) = step([&] {
    sync.ready(3, fc::span<std::int32_t>(g3));
    sync.ready(2, rank == 0 ? fc::span<std::int32_t>(wrong) : fc::span<std::int32_t>(g2));
    sync.ready(1, fc::span<std::int32_t>(g1));
    sync.ready(0, fc::span<std::int32_t>(g0));
  });
  BOOST_TEST(fc::testing::all_ranks(threw), cause);
  BOOST_TEST(fc::testing::all_ranks(rank != 0 || contains(cause, "gradient 2 is 8 x int32 but was 5 x int32")), cause);
  BOOST_TEST(fc::testing::all_ranks(rank == 0 || contains(cause, "rank 0 of the member misused")), cause);

  // One rank hands gradients over in another order.
  std::tie(threw, cause) = step([&] {
    if (rank == size - 1) {
      sync.ready(0, fc::span<std::int32_t>(g0));
      sync.ready(1, fc::span<std::int32_t>(g1));
      sync.ready(2, fc::span<std::int32_t>(g2));
      sync.ready(3, fc::span<std::int32_t>(g3));
    } else {
      correct();
    }
  });
  BOOST_TEST(fc::testing::all_ranks(threw == (size > 1)), cause);

  // The same gradient twice; an unknown one; one missing at finish(); a type that changed.
  std::tie(threw, cause) = step([&] {
    correct();
    sync.ready(1, fc::span<std::int32_t>(g1));
  });
  BOOST_TEST(fc::testing::all_ranks(threw && contains(cause, "handed over twice")), cause);
  std::tie(threw, cause) = step([&] {
    correct();
    sync.ready(9, fc::span<std::int32_t>(g1));
  });
  BOOST_TEST(fc::testing::all_ranks(threw && contains(cause, "gradient 9 is not in the bucket plan")), cause);
  std::tie(threw, cause) = step([&] {
    sync.ready(3, fc::span<std::int32_t>(g3));
    sync.ready(2, fc::span<std::int32_t>(g2));
    sync.ready(1, fc::span<std::int32_t>(g1));
  });
  BOOST_TEST(fc::testing::all_ranks(threw && contains(cause, "finish() after 3 of the plan's 4 gradients")), cause);
  // A gradient handed over after finish() belongs to the next step, which then lacks the rest.
  std::tie(threw, cause) = step(correct);
  BOOST_TEST(fc::testing::all_ranks(!threw), cause);
  std::tie(threw, cause) = step([&] { sync.ready(0, fc::span<std::int32_t>(g0)); });
  BOOST_TEST(fc::testing::all_ranks(threw && contains(cause, "finish() after 1 of the plan's 4 gradients")), cause);
  std::vector<float> as_float(6);
  std::tie(threw, cause) = step([&] {
    sync.ready(3, fc::span<std::int32_t>(g3));
    sync.ready(2, fc::span<std::int32_t>(g2));
    sync.ready(1, fc::span<std::int32_t>(g1));
    sync.ready(0, fc::span<float>(as_float));
  });
  BOOST_TEST(fc::testing::all_ranks(threw && contains(cause, "gradient 0 is 6 x float but was 6 x int32")), cause);

  // After all that, a correct step still averages.
  std::tie(threw, cause) = step(correct);
  BOOST_TEST(fc::testing::all_ranks(!threw && g0[0] == avg && g1[5] == avg && g2[4] == avg && g3[6] == avg), cause);
}

// Trainer code that places its gradients in gradient_memory() runs unchanged whatever the route:
// on one host a bucket of one gradient is reduced where it lies (and fused buckets stage in
// shared memory anyway); with shared memory off, or across hosts, it is ordinary memory. Both
// launch modes, three steps, sum, avg and max, buckets of 4 KiB (7000 elements alone: in place)
// and of 1 MiB (all fused, past the one-round path: staged in shared memory): the exact reference.
BOOST_AUTO_TEST_CASE_TEMPLATE(gradients_in_gradient_memory_equal_the_reference, Sync, adapters) {
  const std::vector<std::size_t> sizes{1, 3, 64, 333, 2049, 7000};
  std::vector<std::size_t> at;
  std::size_t total = 0;
  for (std::size_t n : sizes) {
    at.push_back(total);
    total += (n + 15) / 16 * 16 + 5;  // not all on cache lines
  }
  const int rank = world().rank();
  const auto everyone = all_world_ranks();
  for (const auto use : {fc::shared_memory_use::automatic, fc::shared_memory_use::off})
    for (const bool early : {false, true})
      for (const fc::op o : {fc::op::sum, fc::op::avg, fc::op::max}) {
        fc::sync_options options;
        options.shared_memory = use;
        options.launch_when_full = early;
        options.bucket_bytes = o == fc::op::avg ? std::size_t{1} << 20 : 4096;
        options.op = o;
        Sync sync(world(), options);
        const auto memory = sync.gradient_memory(total * sizeof(float));
        BOOST_TEST(memory.size() == total * sizeof(float));
        float* const base = reinterpret_cast<float*>(memory.data());
        bool ok = true;
        std::string detail;
        for (int step = 0; step < 3; ++step) {
          for (std::size_t i = 0; i < sizes.size(); ++i) {
            const auto g = gradient<float>(rank, step, static_cast<int>(i), sizes[i]);
            std::copy(g.begin(), g.end(), base + at[i]);
          }
          for (std::size_t i = sizes.size(); i-- > 0;) sync.ready(static_cast<int>(i), fc::span<float>(base + at[i], sizes[i]));
          sync.finish();
          for (std::size_t i = 0; i < sizes.size(); ++i)
            if (!same(std::vector<float>(base + at[i], base + at[i] + sizes[i]),
                      reference<float>(o, everyone, step, static_cast<int>(i), sizes[i]))) {
              ok = false;
              detail = fc::cat("step ", step, " gradient ", i);
            }
        }
        BOOST_TEST(fc::testing::all_ranks(ok), "shared memory " << fc::name_of(use) << (early ? ", launched when full, " : ", ")
                                                                << fc::name_of(o) << ": " << detail);
      }
}

// Where buckets are reduced in gradient_memory() (one host, 2+ ranks), placing them there must be
// the same on every rank: a gradient there on some ranks only at the first step is an error on
// every rank at that step; one at another offset on one rank at a later step is an error on every
// rank before anything is written. And a step's check carried by a bucket reduced in place still
// tells every rank of one rank's misuse.
BOOST_AUTO_TEST_CASE_TEMPLATE(gradient_memory_used_unalike_is_an_error_on_every_rank, Sync, adapters) {
  const int rank = world().rank(), last = world().size() - 1;
  fc::sync_options options;
  options.bucket_bytes = 4096;
  {
    Sync sync(world(), options);
    const auto memory = sync.gradient_memory(8192 * sizeof(float));
    std::vector<float> elsewhere(8000, 1.0f);
    float* g = rank == last ? elsewhere.data() : reinterpret_cast<float*>(memory.data());
    std::fill(g, g + 8000, 1.0f);
    sync.ready(0, fc::span<float>(g, 8000));
    std::string cause;
    const bool threw = threw_on_finish(sync, cause);
    const bool expected = sync.shared_memory() && !sync.hierarchical() && world().size() > 1;  // one host
    BOOST_TEST(fc::testing::all_ranks(threw == expected), cause);
    BOOST_TEST(fc::testing::all_ranks(!expected || contains(cause, "in gradient_memory() on every rank or on none")),
               cause);
  }
  {
    Sync sync(world(), options);
    const auto memory = sync.gradient_memory(8192 * sizeof(float));
    float* g = reinterpret_cast<float*>(memory.data());
    std::fill(g, g + 8000, 1.0f);
    sync.ready(0, fc::span<float>(g, 8000));
    sync.finish();
    BOOST_TEST(fc::testing::all_ranks(g[7999] == 1.0f));  // the average of ones
    if (rank == last) g += 64;
    std::fill(g, g + 8000, 3.0f);
    sync.ready(0, fc::span<float>(g, 8000));
    std::string cause;
    const bool threw = threw_on_finish(sync, cause);
    const bool expected = sync.shared_memory() && !sync.hierarchical() && world().size() > 1;  // one host
    BOOST_TEST(fc::testing::all_ranks(threw == expected), cause);
    BOOST_TEST(fc::testing::all_ranks(!expected || contains(cause, "every rank must place the same data at the same offset")),
               cause);
    BOOST_TEST(fc::testing::all_ranks(!expected || std::count(g, g + 8000, 3.0f) == 8000));  // nobody wrote
  }
  {
    // A fused bucket past the one-round path stages in shared memory and carries the step's check
    // in its round: misuse on one rank at a later step still reaches every rank.
    fc::sync_options fused = options;
    fused.bucket_bytes = std::size_t{1} << 20;
    Sync sync(world(), fused);
    std::vector<float> a(8000, 1.0f), b(8000, 1.0f), shorter(7999, 1.0f);
    sync.ready(0, fc::span<float>(a));
    sync.ready(1, fc::span<float>(b));
    sync.finish();
    sync.ready(0, fc::span<float>(a));
    sync.ready(1, fc::span<float>(rank == last ? shorter : b));
    std::string cause;
    BOOST_TEST(fc::testing::all_ranks(threw_on_finish(sync, cause)), cause);
    BOOST_TEST(fc::testing::all_ranks(contains(cause, rank == last ? "7999" : "misused")), cause);
  }
  {
    // Mid-step, on every rank: refused on every rank before any collective, and the step goes on.
    Sync sync(world(), options);
    std::vector<float> a(8000, 1.0f), b(100, 2.0f);
    sync.ready(0, fc::span<float>(a));
    std::string cause;
    try {
      sync.gradient_memory(4096);
    } catch (const fc::error& e) {
      cause = e.cause();
    }
    BOOST_TEST(fc::testing::all_ranks(contains(cause, "called mid-step, after 1 gradient(s)")), cause);
    sync.ready(1, fc::span<float>(b));
    sync.finish();
    BOOST_TEST(fc::testing::all_ranks(a[7999] == 1.0f && b[99] == 2.0f));
    BOOST_TEST(sync.gradient_memory(4096).size() == 4096u);  // between steps
  }
  {
    Sync sync(world(), options);
    std::string cause;
    try {
      sync.gradient_memory(rank == last ? 128 : 64);
    } catch (const fc::error& e) {
      cause = e.cause();
    }
    BOOST_TEST(fc::testing::all_ranks(world().size() == 1 || contains(cause, "every rank must ask for the same size")),
               cause);
  }
}

// The trainer's own vectors, on the shared-memory route, are reduced in place too: each bucket of
// one gradient past the one-round path has its whole pages made shared where they lie
// (registered_range.hpp), its partial edge pages going with the same round. Gradients at 0, 4, 16
// and 4092 bytes past a page (another offset on each rank), of 20 KiB (its interior of 16 KiB is
// too small: the slots), 36 KiB, 280 KiB and 1.2 MiB: the exact reference, three steps, sum, avg
// and max, both launch modes; max with sync_options::share_own_memory off (nothing registered).
namespace {

struct pages {
  explicit pages(std::size_t bytes) : bytes(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    BOOST_REQUIRE(p != MAP_FAILED);
    at = static_cast<std::byte*>(p);
  }
  ~pages() { munmap(at, bytes); }
  // Frees the pages and maps fresh private ones at the same address (a freed and reallocated
  // vector: glibc munmaps large chunks, and a new mmap may land where they were).
  void reallocate() {
    BOOST_REQUIRE(munmap(at, bytes) == 0);
    BOOST_REQUIRE(mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == at);
  }
  std::size_t bytes;
  std::byte* at = nullptr;
};

// How many of this process's mappings in [from, to) are registered gradient pages (a peer's view
// elsewhere may outlive the adapter for a moment, until the engine drops its last task).
int registered_mappings(const std::byte* from, const std::byte* to) {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    const auto* at = reinterpret_cast<const std::byte*>(std::stoull(line.substr(0, line.find('-')), nullptr, 16));
    n += at >= from && at < to && contains(line, "flexcomm-gradient");
  }
  return n;
}

}  // namespace

BOOST_AUTO_TEST_CASE_TEMPLATE(own_vectors_at_any_offset_equal_the_reference, Sync, adapters) {
  const std::vector<std::size_t> sizes{5000, 9000, 70000, 300000};
  const std::size_t offsets[] = {0, 4, 16, 4092};
  const int rank = world().rank();
  const auto everyone = all_world_ranks();
  for (const bool early : {false, true})
    for (const fc::op o : {fc::op::sum, fc::op::avg, fc::op::max}) {
      fc::sync_options options;
      options.launch_when_full = early;
      options.bucket_bytes = 4096;  // each gradient its own bucket
      options.op = o;
      options.share_own_memory = o != fc::op::max;
      bool ok = true, registers = false;
      std::string detail;
      std::vector<std::unique_ptr<pages>> memory;
      std::vector<float*> at;
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        memory.push_back(std::make_unique<pages>(sizes[i] * sizeof(float) + 2 * 4096));
        at.push_back(reinterpret_cast<float*>(memory.back()->at + offsets[(i + static_cast<std::size_t>(rank)) % 4]));
      }
      {
        Sync sync(world(), options);
        for (int step = 0; step < 3; ++step) {
          for (std::size_t i = 0; i < sizes.size(); ++i) {
            const auto g = gradient<float>(rank, step, static_cast<int>(i), sizes[i]);
            std::copy(g.begin(), g.end(), at[i]);
          }
          for (std::size_t i = sizes.size(); i-- > 0;) sync.ready(static_cast<int>(i), fc::span<float>(at[i], sizes[i]));
          sync.finish();
          for (std::size_t i = 0; i < sizes.size(); ++i)
            if (!same(std::vector<float>(at[i], at[i] + sizes[i]),
                      reference<float>(o, everyone, step, static_cast<int>(i), sizes[i]))) {
              ok = false;
              detail = fc::cat("step ", step, " gradient ", i);
            }
        }
        registers = options.share_own_memory && sync.shared_memory() && !sync.hierarchical() && world().size() > 1;
      }
      // The three larger gradients were registered, the smallest not (one host, 2+ ranks); the
      // adapter gone, only their own pages are left mapped, still holding the averages.
      int mapped = 0;
      for (const auto& m : memory) mapped += registered_mappings(m->at, m->at + m->bytes);
      BOOST_TEST(fc::testing::all_ranks(mapped == (registers ? 3 : 0)), mapped << " registered");
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        ok = ok && same(std::vector<float>(at[i], at[i] + sizes[i]),
                        reference<float>(o, everyone, 2, static_cast<int>(i), sizes[i]));
        std::fill(at[i], at[i] + sizes[i], 1.0f);  // still the trainer's, writable
        ok = ok && std::count(at[i], at[i] + sizes[i], 1.0f) == static_cast<std::ptrdiff_t>(sizes[i]);
      }
      BOOST_TEST(fc::testing::all_ranks(ok), (early ? "launched when full, " : "") << fc::name_of(o) << ": " << detail);
    }
}

// A registered gradient freed and reallocated at the same address (fresh private pages, as
// zero_grad(set_to_none) may leave it) on one rank is never reduced as stale memory: that step
// goes through the slots on every rank, the next one is registered again; so is a gradient
// handed over from another vector. The exact reference every step.
BOOST_AUTO_TEST_CASE_TEMPLATE(own_vectors_freed_and_reallocated_equal_the_reference, Sync, adapters) {
  const std::size_t n = 20000;
  const int rank = world().rank(), last = world().size() - 1;
  const auto everyone = all_world_ranks();
  for (const bool early : {false, true}) {
    fc::sync_options options;
    options.launch_when_full = early;
    options.bucket_bytes = 4096;
    Sync sync(world(), options);
    pages first(n * sizeof(float) + 4096), second(n * sizeof(float) + 4096);
    const bool registers = sync.shared_memory() && !sync.hierarchical() && world().size() > 1;
    bool ok = true;
    std::string detail;
    for (int step = 0; step < 5; ++step) {
      if (step == 1 && rank == last) first.reallocate();
      float* g = reinterpret_cast<float*>((step == 3 && rank == 0 ? second : first).at + 16);
      const auto values = gradient<float>(rank, step, 0, n);
      std::copy(values.begin(), values.end(), g);
      sync.ready(0, fc::span<float>(g, n));
      sync.finish();
      if (!same(std::vector<float>(g, g + n), reference<float>(fc::op::avg, everyone, step, 0, n))) {
        ok = false;
        detail = fc::cat("step ", step);
      }
      // Registered again after the steps that went through the slots.
      if (registers && step == 2)
        BOOST_TEST(fc::testing::all_ranks(registered_mappings(first.at, first.at + first.bytes) == 1));
    }
    BOOST_TEST(fc::testing::all_ranks(ok), (early ? "launched when full: " : "") << detail);
  }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(bad_options_are_named_errors, Sync, adapters) {
  fc::sync_options zero;
  zero.bucket_bytes = 0;
  BOOST_CHECK_EXCEPTION((Sync{world(), zero}), fc::error,
                        [](const fc::error& e) { return contains(e.cause(), "bucket_bytes must be positive"); });
  BOOST_TEST(fc::testing::all_ranks(true));
}

BOOST_AUTO_TEST_CASE(ring_options_and_byte_counts) {
  fc::sync_options options;
  options.segments_in_flight = 0;
  BOOST_CHECK_THROW((fc::overlapped_ring<mpi>{world(), options}), fc::error);
  BOOST_TEST(fc::parse_bytes("26214400", "x") == 26214400u);
  BOOST_TEST(fc::parse_bytes("64K", "x") == 65536u);
  BOOST_TEST(fc::parse_bytes("25M", "x") == fc::default_bucket_bytes);
  BOOST_TEST(fc::parse_bytes("1GiB", "x") == std::size_t{1} << 30);
  for (const char* bad : {"", "0", "-5", "12Q", "M", "1.5M"})
    BOOST_CHECK_EXCEPTION(fc::parse_bytes(bad, "FLEXCOMM_BUCKET_BYTES"), fc::error,
                          [](const fc::error& e) { return contains(e.cause(), "expected a positive byte count"); });
  BOOST_TEST(fc::testing::all_ranks(true));
}
