#define BOOST_TEST_MODULE fashion_mnist
#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstring>
#include <vector>

#include "../../examples/common/fashion_mnist.hpp"

namespace fm = fashion_mnist;

namespace {
const fm::dataset& test_split() {
  static const fm::dataset d = fm::load(fm::split::test);
  return d;
}
}  // namespace

BOOST_AUTO_TEST_CASE(the_test_split_reads_as_ten_thousand_labelled_images) {
  const auto& d = test_split();
  BOOST_TEST(d.count == 10000u);
  BOOST_TEST(d.images.size() == 10000u * fm::pixels);
  std::vector<int> per_class(fm::classes);
  for (auto l : d.labels) ++per_class.at(l);
  for (int c : per_class) BOOST_TEST(c == 1000);  // Fashion-MNIST's test split is balanced
  BOOST_TEST(fm::load(fm::split::test, fm::default_dir(), 100).count == 100u);
}

BOOST_AUTO_TEST_CASE(a_missing_file_is_a_flexcomm_error) {
  BOOST_CHECK_THROW(fm::load(fm::split::test, "/nonexistent"), flexcomm::error);
}

BOOST_AUTO_TEST_CASE(packed_blocks_decode_to_the_original_images) {
  const auto& d = test_split();
  const fm::packed_dataset p(d, 64);
  BOOST_TEST(p.count() == d.count);
  BOOST_TEST(p.compressed_bytes() < d.images.size());
  std::vector<std::uint8_t> block(64 * fm::pixels);
  const std::size_t last = (d.count - 1) / 64;
  BOOST_TEST(p.decode_block(last, block.data()) == d.count - last * 64);  // a short last block
  BOOST_TEST(std::memcmp(block.data(), d.image(last * 64), (d.count - last * 64) * fm::pixels) == 0);
  BOOST_TEST(p.decode_block(3, block.data()) == 64u);
  BOOST_TEST(std::memcmp(block.data(), d.image(3 * 64), 64 * fm::pixels) == 0);
}

BOOST_AUTO_TEST_CASE(without_augmentation_pixels_are_only_normalized_and_flips_mirror) {
  const auto& d = test_split();
  fm::augment_options plain;
  plain.pad = 0;
  plain.flip = false;
  plain.max_rotation_degrees = 0;
  std::vector<float> out(fm::pixels);
  fm::augment(d.image(7), out.data(), 42, plain);
  for (int i = 0; i < fm::pixels; ++i)
    BOOST_TEST(std::abs(out[i] - (d.image(7)[i] / 255.0f - plain.mean) / plain.stddev) < 1e-4f);
  // With flips allowed, some seed flips: the result is the mirror image.
  fm::augment_options flips = plain;
  flips.flip = true;
  bool seen_flip = false;
  for (std::uint64_t seed = 0; seed < 16 && !seen_flip; ++seed) {
    std::vector<float> f(fm::pixels);
    fm::augment(d.image(7), f.data(), seed, flips);
    bool mirrored = true;
    for (int y = 0; y < fm::rows; ++y)
      for (int x = 0; x < fm::cols; ++x)
        mirrored = mirrored && std::abs(f[y * fm::cols + x] - out[y * fm::cols + fm::cols - 1 - x]) < 1e-4f;
    seen_flip = mirrored;
  }
  BOOST_TEST(seen_flip);
}

BOOST_AUTO_TEST_CASE(samples_are_the_same_wherever_they_are_made_and_differ_between_steps) {
  const fm::packed_dataset p(test_split(), 32);
  const std::size_t batch = 48;
  std::vector<fm::sample> whole(batch), halves(batch), next(batch);
  BOOST_TEST(fm::make_samples(p, 5, batch, 0, batch, whole.data()) == batch * fm::sample_bytes);
  // Two ranks making half a batch each produce the same bytes as one making all of it.
  fm::make_samples(p, 5, batch, 0, batch / 2, halves.data());
  fm::make_samples(p, 5, batch, batch / 2, batch / 2, halves.data() + batch / 2);
  BOOST_TEST(std::memcmp(whole.data(), halves.data(), batch * fm::sample_bytes) == 0);
  fm::make_samples(p, 6, batch, 0, batch, next.data());
  BOOST_TEST(std::memcmp(whole.data(), next.data(), batch * fm::sample_bytes) != 0);
  for (std::size_t j = 0; j < batch; ++j)
    BOOST_TEST(whole[j].label == int{test_split().labels[(5 * batch + j) % test_split().count]});
  BOOST_CHECK_THROW(fm::make_samples(p, 5, batch, 40, 16, whole.data()), flexcomm::error);
}

// The typed feed's loader: samples at given indices are those make_samples makes for the same
// images at the same positions of the same step; the split's size comes from its header alone.
BOOST_AUTO_TEST_CASE(samples_at_indices_match_samples_by_step) {
  const fm::packed_dataset p(test_split(), 32);
  const std::size_t batch = 20, first = 7, n = 9;
  std::vector<fm::sample> want(n);
  fm::make_samples(p, 3, batch, first, n, want.data());
  std::vector<std::int64_t> indices(n);
  for (std::size_t j = 0; j < n; ++j) indices[j] = static_cast<std::int64_t>((3 * batch + first + j) % p.count());
  std::vector<float> images(n * fm::pixels);
  std::vector<std::int32_t> labels(n);
  fm::make_samples_at(p, 3, first, indices.data(), n, images.data(), labels.data());
  for (std::size_t j = 0; j < n; ++j) {
    BOOST_TEST(std::memcmp(want[j].pixel, images.data() + j * fm::pixels, sizeof want[j].pixel) == 0);
    BOOST_TEST(want[j].label == labels[j]);
  }
  const std::int64_t outside = static_cast<std::int64_t>(p.count());
  BOOST_CHECK_THROW(fm::make_samples_at(p, 3, 0, &outside, 1, images.data(), labels.data()), flexcomm::error);
  BOOST_TEST(fm::count(fm::split::test) == test_split().count);
  BOOST_TEST(fm::count(fm::split::test, fm::default_dir(), 123) == 123u);
}

BOOST_AUTO_TEST_CASE(elastic_distortion_is_deterministic_per_seed_and_moves_pixels) {
  const auto& d = test_split();
  fm::augment_options plain, elastic;
  plain.flip = false;
  plain.max_rotation_degrees = 0;
  plain.pad = 0;
  elastic = plain;
  elastic.elastic_alpha = 2;
  std::vector<float> a(fm::pixels), b(fm::pixels), c(fm::pixels);
  fm::augment(d.image(3), a.data(), 9, plain);
  fm::augment(d.image(3), b.data(), 9, elastic);
  fm::augment(d.image(3), c.data(), 9, elastic);
  BOOST_TEST(a != b);
  BOOST_TEST(b == c);
  for (float v : b) BOOST_TEST(std::isfinite(v));
}
