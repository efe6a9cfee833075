#define BOOST_TEST_MODULE batching
#include <boost/test/unit_test.hpp>

#include "errors.hpp"

#include <flexcomm/core/batching.hpp>
#include <flexcomm/patterns/feed/dataset.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace fc = flexcomm;

namespace {
using fc::testing::contains;
using fc::testing::error_of;
}  // namespace

// Fashion-MNIST's 60000 images in batches of 64 over members 1,3,2 (6 shards a step): the case
// the bundled example used to refuse.
BOOST_AUTO_TEST_CASE(sixty_thousand_in_batches_of_64_over_six_shards) {
  const fc::batch_plan plan(60000, 64, 3, 6);
  BOOST_TEST(plan.steps_per_epoch() == 938);
  BOOST_TEST(plan.steps() == 3 * 938);
  BOOST_TEST(plan.batch_samples(0) == 64);
  BOOST_TEST(plan.batch_samples(937) == 60000 % 64);  // the short last batch: 32
  BOOST_TEST(plan.batch_samples(938) == 64);          // epoch 1 starts whole
  BOOST_TEST(plan.epoch_of(938) == 1);
  BOOST_TEST(plan.step_in_epoch(938) == 0);
  BOOST_TEST(plan.last_in_epoch(937));
  BOOST_TEST(!plan.last_in_epoch(938));
  // DistributedSampler's split: the first 64 % 6 = 4 shards get 11, the others 10.
  std::vector<std::int64_t> counts, firsts;
  for (int k = 0; k < 6; ++k) {
    counts.push_back(plan.shard_samples(0, k).count);
    firsts.push_back(plan.shard_samples(0, k).first);
  }
  BOOST_TEST(counts == (std::vector<std::int64_t>{11, 11, 11, 11, 10, 10}), boost::test_tools::per_element());
  BOOST_TEST(firsts == (std::vector<std::int64_t>{0, 11, 22, 33, 44, 54}), boost::test_tools::per_element());
  BOOST_TEST(plan.max_shard_samples() == 11);
  // Member of 3 ranks: rank 1 owns shards 2..3; member of 2 ranks: rank 1 owns shards 3..5.
  BOOST_TEST(plan.shards_samples(0, 2, 2).first == 22);
  BOOST_TEST(plan.shards_samples(0, 2, 2).count == 22);
  BOOST_TEST(plan.shards_samples(0, 3, 3).first == 33);
  BOOST_TEST(plan.shards_samples(0, 3, 3).count == 31);
  BOOST_TEST(plan.shards_samples(937, 3, 3).count == 5 + 5 + 5);  // 32 = 6 + 6 + 5 + 5 + 5 + 5
}

BOOST_AUTO_TEST_CASE(drop_last_drops_the_short_batch) {
  const fc::batch_plan plan(60000, 64, 2, 6, true);
  BOOST_TEST(plan.steps_per_epoch() == 937);
  BOOST_TEST(plan.batch_samples(936) == 64);
  BOOST_TEST(plan.epoch_of(937) == 1);
  const fc::batch_plan exact(60, 20, 1, 7, true);
  BOOST_TEST(exact.steps_per_epoch() == 3);
  const fc::batch_plan none(5, 20, 4, 1, true);  // a batch larger than the dataset: no step at all
  BOOST_TEST(none.steps() == 0);
}

// Every small case: within each step the shards tile the batch in order, sizes differ by at most
// one (larger first), and every epoch visits each position of [0, size) exactly once.
BOOST_AUTO_TEST_CASE(shards_tile_every_batch_and_epochs_cover_the_dataset) {
  for (std::int64_t size = 0; size <= 40; ++size)
    for (std::int64_t batch = 1; batch <= 11; ++batch)
      for (int shards = 1; shards <= 8; ++shards)
        for (bool drop : {false, true}) {
          const fc::batch_plan plan(size, batch, 2, shards, drop);
          std::vector<int> seen(static_cast<std::size_t>(2 * size), 0);
          bool ok = true;
          for (std::int64_t s = 0; s < plan.steps(); ++s) {
            const std::int64_t b = plan.batch_samples(s);
            ok = ok && b > 0 && b <= batch && (!drop || b == batch);
            std::int64_t next = 0, previous = batch + 1;
            for (int k = 0; k < shards; ++k) {
              const auto r = plan.shard_samples(s, k);
              ok = ok && r.first == next && r.count >= 0 && r.count <= previous && r.count <= plan.max_shard_samples();
              ok = ok && r.count >= b / shards && r.count <= b / shards + 1;
              previous = r.count;
              next += r.count;
              for (int width = 1; k + width <= shards; ++width) {  // a trainer's run of shards
                const auto run = plan.shards_samples(s, k, width);
                const auto last = plan.shard_samples(s, k + width - 1);
                ok = ok && run.first == r.first && run.first + run.count == last.first + last.count;
              }
            }
            ok = ok && next == b;
            for (std::int64_t p = 0; p < b; ++p)
              ++seen[static_cast<std::size_t>(plan.epoch_of(s) * size + plan.first_in_epoch(s) + p)];
          }
          const std::int64_t used = drop ? size / batch * batch : size;
          for (std::int64_t e = 0; e < 2; ++e)
            for (std::int64_t p = 0; p < size; ++p)
              ok = ok && seen[static_cast<std::size_t>(e * size + p)] == (p < used ? 1 : 0);
          BOOST_TEST(ok, "size " << size << " batch " << batch << " shards " << shards << " drop_last " << drop);
        }
}

BOOST_AUTO_TEST_CASE(shuffled_epochs_are_permutations_drawn_from_seed_and_epoch) {
  fc::epoch_order a(1000, true, 42), b(1000, true, 42), c(1000, true, 43), plain(1000, false, 42);
  std::vector<std::int64_t> e0, e1, again, other;
  for (std::int64_t p = 0; p < 1000; ++p) {
    e0.push_back(a.index(0, p));
    other.push_back(c.index(0, p));
    BOOST_TEST(plain.index(5, p) == p);
  }
  for (std::int64_t p = 0; p < 1000; ++p) e1.push_back(a.index(1, p));
  for (std::int64_t p = 0; p < 1000; ++p) again.push_back(b.index(0, p));  // another rank, the same draw
  BOOST_TEST(e0 == again);
  BOOST_TEST(e0 != e1);
  BOOST_TEST(e0 != other);
  for (auto* order : {&e0, &e1, &other}) {
    auto sorted = *order;
    std::sort(sorted.begin(), sorted.end());
    std::vector<std::int64_t> identity(1000);
    std::iota(identity.begin(), identity.end(), std::int64_t{0});
    BOOST_TEST(sorted == identity);
  }
  // Back to an earlier epoch: the same permutation, drawn again.
  BOOST_TEST(a.index(0, 17) == e0[17]);
}

BOOST_AUTO_TEST_CASE(impossible_plans_are_errors) {
  BOOST_TEST(contains(error_of([] { fc::batch_plan(10, 0, 1, 2); }), "batch size must be > 0, got 0"));
  BOOST_TEST(contains(error_of([] { fc::batch_plan(-1, 4, 1, 2); }), "dataset size must be >= 0"));
  BOOST_TEST(contains(error_of([] { fc::batch_plan(10, 4, -1, 2); }), "epochs must be >= 0"));
  BOOST_TEST(contains(error_of([] { fc::batch_plan(10, 4, 1, 0); }), "shards per step must be > 0"));
  BOOST_TEST(contains(error_of([] { fc::batch_plan(INT64_MAX, 1, 3, 1); }), "overflow the step count"));
}

// A shard's record keeps every block 8-byte aligned whatever the field sizes.
BOOST_AUTO_TEST_CASE(shard_records_keep_blocks_aligned) {
  const fc::detail::shard_record r{3, 5};  // e.g. uint8{3} samples, five-byte labels
  for (std::size_t n = 0; n < 20; ++n) {
    BOOST_TEST(r.samples_offset(n) % 8 == 0);
    BOOST_TEST(r.labels_offset(n) % 8 == 0);
    BOOST_TEST(r.bytes(n) % 8 == 0);
    BOOST_TEST(r.labels_offset(n) >= r.samples_offset(n) + 3 * n);
    BOOST_TEST(r.bytes(n) >= r.labels_offset(n) + 5 * n);
  }
  const auto f = fc::field::of<float>({1, 28, 28});
  BOOST_TEST(f.elements() == 784);
  BOOST_TEST(f.bytes() == 784 * sizeof(float));
  BOOST_TEST(f.str() == "float{1,28,28}");
  BOOST_TEST(fc::field::of<std::int64_t>().bytes() == 8u);  // a scalar
}
