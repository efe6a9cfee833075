// Fashion-MNIST as an ensemble's input pipeline: the idx.gz files read with zlib, images kept
// deflated in blocks (like the records of a real input pipeline), and a per-step decode +
// normalize + random crop/flip/rotation augmentation that is identical wherever it runs.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <flexcomm/core/error.hpp>

namespace fashion_mnist {

constexpr int rows = 28, cols = 28, pixels = rows * cols, classes = 10;

// One augmented sample as it travels through a feed: normalized pixels, then the label.
// A batch is a plain sequence of samples, so shards concatenate into batches.
struct sample {
  float pixel[pixels];
  std::int32_t label;
};
static_assert(sizeof(sample) == pixels * sizeof(float) + sizeof(std::int32_t), "samples are packed");
constexpr std::size_t sample_bytes = sizeof(sample);

enum class split { train, test };

// The images and labels of one split, decompressed: row-major uint8 pixels.
struct dataset {
  std::size_t count = 0;
  std::vector<std::uint8_t> images;  // count * pixels
  std::vector<std::uint8_t> labels;  // count
  const std::uint8_t* image(std::size_t i) const { return images.data() + i * pixels; }
};

// $FASHION_MNIST_DIR, or where Debian's dataset-fashion-mnist installs the files.
inline std::string default_dir() {
  const char* dir = std::getenv("FASHION_MNIST_DIR");
  return dir && *dir ? dir : "/usr/share/datasets/fashion-mnist";
}

// The whole content of a gzip file.
inline std::vector<std::uint8_t> gunzip_file(const std::string& path);

// Reads one split; `limit` > 0 keeps only its first `limit` images.
inline dataset load(split which = split::train, const std::string& dir = default_dir(), std::size_t limit = 0);

// The number of images load() would keep, from the idx header alone: what a rank that never
// loads the images needs to know about them.
inline std::size_t count(split which = split::train, const std::string& dir = default_dir(), std::size_t limit = 0);

// A dataset whose images stay deflated in blocks of `block_images`; decode() inflates the
// blocks a batch touches, which is the "decode" cost every member of a baseline ensemble pays.
class packed_dataset {
 public:
  explicit packed_dataset(const dataset& data, std::size_t block_images = 64, int level = 6);

  std::size_t count() const noexcept { return count_; }
  std::size_t block_images() const noexcept { return block_images_; }
  std::uint8_t label(std::size_t i) const { return labels_.at(i); }
  std::size_t compressed_bytes() const noexcept;

  // Inflates block `b` into `out` (block_images * pixels bytes); returns the images in it.
  std::size_t decode_block(std::size_t b, std::uint8_t* out) const;

 private:
  std::size_t count_, block_images_;
  std::vector<std::vector<std::uint8_t>> blocks_;
  std::vector<std::uint8_t> labels_;
};

struct augment_options {
  int pad = 2;                       // random crop of a 28x28 window from the image padded by this
  bool flip = true;                  // random horizontal flip
  float max_rotation_degrees = 10;   // random rotation, bilinear
  // Elastic distortion (Simard et al. 2003): a random displacement field smoothed by a Gaussian
  // of this sigma and scaled by alpha pixels; alpha 0 turns it off. It is the costly part.
  float elastic_alpha = 0, elastic_sigma = 4;
  float mean = 0.2860f, stddev = 0.3530f;  // Fashion-MNIST's pixel statistics
};

// The seed of image `index` of step `step`: every rank that preprocesses it draws the same.
inline std::uint64_t seed_of(std::int64_t step, std::size_t index);

// Normalizes and augments one 28x28 uint8 image into `out` (pixels floats).
inline void augment(const std::uint8_t* image, float* out, std::uint64_t seed, const augment_options& opt = {});

// The samples of a step: sample j of step s is image (s * batch + j) mod count.
// Writes samples [first, first + n) of step `step` into `out` (n samples); decodes, normalizes
// and augments each. Returns the bytes written.
inline std::size_t make_samples(const packed_dataset& data, std::int64_t step, std::size_t batch,
                                std::size_t first, std::size_t n, sample* out, const augment_options& opt = {});

// Samples of step `step` at dataset indices `indices`, the j-th at position `first + j` of its
// batch: decoded, normalized and augmented (seeded by step and position, as make_samples), one
// row of `pixels` floats per sample into `images`, the labels into `labels`.
inline void make_samples_at(const packed_dataset& data, std::int64_t step, std::size_t first,
                            const std::int64_t* indices, std::size_t n, float* images, std::int32_t* labels,
                            const augment_options& opt = {});

namespace detail {
inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// Uniform in [0, 1) from the next state of a splitmix64 stream.
inline float uniform(std::uint64_t& state) {
  state = splitmix64(state);
  return static_cast<float>(state >> 40) * (1.0f / 16777216.0f);
}
// A random field in [-1, 1] smoothed by a separable Gaussian, scaled to `alpha` at its peak.
inline void elastic_field(std::uint64_t& state, float alpha, float sigma, float* field) {
  const int radius = std::max(1, static_cast<int>(std::ceil(2 * sigma)));
  std::vector<float> kernel(static_cast<std::size_t>(2 * radius + 1));
  float sum = 0;
  for (int i = -radius; i <= radius; ++i)
    sum += kernel[static_cast<std::size_t>(i + radius)] = std::exp(-0.5f * i * i / (sigma * sigma));
  for (auto& k : kernel) k /= sum;
  float noise[pixels], rowpass[pixels];
  for (float& v : noise) v = 2 * uniform(state) - 1;
  auto clamp = [](int v) { return v < 0 ? 0 : v >= rows ? rows - 1 : v; };
  for (int y = 0; y < rows; ++y)
    for (int x = 0; x < cols; ++x) {
      float acc = 0;
      for (int i = -radius; i <= radius; ++i) acc += kernel[static_cast<std::size_t>(i + radius)] * noise[y * cols + clamp(x + i)];
      rowpass[y * cols + x] = acc;
    }
  float peak = 1e-6f;
  for (int y = 0; y < rows; ++y)
    for (int x = 0; x < cols; ++x) {
      float acc = 0;
      for (int i = -radius; i <= radius; ++i) acc += kernel[static_cast<std::size_t>(i + radius)] * rowpass[clamp(y + i) * cols + x];
      field[y * cols + x] = acc;
      peak = std::max(peak, std::abs(acc));
    }
  for (int i = 0; i < pixels; ++i) field[i] *= alpha / peak;
}

inline std::uint32_t big_endian(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) | p[3];
}
}  // namespace detail

inline std::vector<std::uint8_t> gunzip_file(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  flexcomm::check(file != nullptr, "fashion_mnist", flexcomm::cat("cannot open '", path, "'"));
  std::vector<std::uint8_t> out;
  std::uint8_t chunk[1 << 16];
  for (;;) {
    const int n = gzread(file, chunk, sizeof chunk);
    if (n < 0) {
      int code = 0;
      const std::string why = gzerror(file, &code);
      gzclose(file);
      flexcomm::fail("fashion_mnist", flexcomm::cat("cannot decompress '", path, "': ", why));
    }
    if (n == 0) break;
    out.insert(out.end(), chunk, chunk + n);
  }
  gzclose(file);
  return out;
}

inline dataset load(split which, const std::string& dir, std::size_t limit) {
  const std::string prefix = dir + (which == split::train ? "/train" : "/t10k");
  const auto images = gunzip_file(prefix + "-images-idx3-ubyte.gz");
  const auto labels = gunzip_file(prefix + "-labels-idx1-ubyte.gz");
  // idx: a big-endian magic (0x0803 images, 0x0801 labels), the dimensions, then the bytes.
  flexcomm::check(images.size() >= 16 && detail::big_endian(images.data()) == 0x803, "fashion_mnist",
                  flexcomm::cat(prefix, "-images: not an idx3 image file"));
  flexcomm::check(labels.size() >= 8 && detail::big_endian(labels.data()) == 0x801, "fashion_mnist",
                  flexcomm::cat(prefix, "-labels: not an idx1 label file"));
  const std::size_t count = detail::big_endian(images.data() + 4);
  flexcomm::check(detail::big_endian(images.data() + 8) == rows && detail::big_endian(images.data() + 12) == cols,
                  "fashion_mnist", flexcomm::cat(prefix, "-images: images are not 28x28"));
  flexcomm::check(images.size() == 16 + count * pixels, "fashion_mnist",
                  flexcomm::cat(prefix, "-images: header says ", count, " images, file holds ",
                                (images.size() - 16) / pixels));
  flexcomm::check(detail::big_endian(labels.data() + 4) == count && labels.size() == 8 + count, "fashion_mnist",
                  flexcomm::cat(prefix, "-labels: label count does not match the ", count, " images"));
  dataset d;
  d.count = limit > 0 ? std::min(limit, count) : count;
  d.images.assign(images.begin() + 16, images.begin() + 16 + static_cast<std::ptrdiff_t>(d.count * pixels));
  d.labels.assign(labels.begin() + 8, labels.begin() + 8 + static_cast<std::ptrdiff_t>(d.count));
  for (auto l : d.labels)
    flexcomm::check(l < classes, "fashion_mnist", flexcomm::cat(prefix, "-labels: label ", int{l}, " out of range"));
  return d;
}

inline std::size_t count(split which, const std::string& dir, std::size_t limit) {
  const std::string path = dir + (which == split::train ? "/train" : "/t10k") + "-images-idx3-ubyte.gz";
  gzFile file = gzopen(path.c_str(), "rb");
  flexcomm::check(file != nullptr, "fashion_mnist", flexcomm::cat("cannot open '", path, "'"));
  std::uint8_t header[8];
  const int n = gzread(file, header, sizeof header);
  gzclose(file);
  flexcomm::check(n == 8 && detail::big_endian(header) == 0x803, "fashion_mnist",
                  flexcomm::cat(path, ": not an idx3 image file"));
  const std::size_t images = detail::big_endian(header + 4);
  return limit > 0 ? std::min(limit, images) : images;
}

inline packed_dataset::packed_dataset(const dataset& data, std::size_t block_images, int level)
    : count_(data.count), block_images_(block_images), labels_(data.labels) {
  flexcomm::check(block_images_ > 0 && count_ > 0, "fashion_mnist", "packing needs images and blocks of >= 1");
  for (std::size_t first = 0; first < count_; first += block_images_) {
    const std::size_t n = std::min(block_images_, count_ - first);
    uLongf size = compressBound(static_cast<uLong>(n * pixels));
    std::vector<std::uint8_t> block(size);
    const int rc = compress2(block.data(), &size, data.image(first), static_cast<uLong>(n * pixels), level);
    flexcomm::check(rc == Z_OK, "fashion_mnist", flexcomm::cat("deflate failed (zlib ", rc, ")"));
    block.resize(size);
    blocks_.push_back(std::move(block));
  }
}

inline std::size_t packed_dataset::compressed_bytes() const noexcept {
  std::size_t total = 0;
  for (const auto& b : blocks_) total += b.size();
  return total;
}

inline std::size_t packed_dataset::decode_block(std::size_t b, std::uint8_t* out) const {
  flexcomm::check(b < blocks_.size(), "fashion_mnist", flexcomm::cat("block ", b, " of ", blocks_.size()));
  const std::size_t n = std::min(block_images_, count_ - b * block_images_);
  uLongf size = static_cast<uLongf>(n * pixels);
  const int rc = uncompress(out, &size, blocks_[b].data(), static_cast<uLong>(blocks_[b].size()));
  flexcomm::check(rc == Z_OK && size == n * pixels, "fashion_mnist",
                  flexcomm::cat("inflate of block ", b, " failed (zlib ", rc, ")"));
  return n;
}

inline std::uint64_t seed_of(std::int64_t step, std::size_t index) {
  return detail::splitmix64(detail::splitmix64(static_cast<std::uint64_t>(step)) ^ index);
}

inline void augment(const std::uint8_t* image, float* out, std::uint64_t seed, const augment_options& opt) {
  std::uint64_t state = seed;
  const float dx = opt.pad > 0 ? std::floor(detail::uniform(state) * (2 * opt.pad + 1)) - opt.pad : 0.0f;
  const float dy = opt.pad > 0 ? std::floor(detail::uniform(state) * (2 * opt.pad + 1)) - opt.pad : 0.0f;
  const bool flip = opt.flip && detail::uniform(state) < 0.5f;
  const float angle = (2 * detail::uniform(state) - 1) * opt.max_rotation_degrees * 3.14159265f / 180.0f;
  const float c = std::cos(angle), s = std::sin(angle), centre = (cols - 1) * 0.5f;
  const float scale = 1.0f / (255.0f * opt.stddev), shift = opt.mean / opt.stddev;
  float ex[pixels] = {}, ey[pixels] = {};
  if (opt.elastic_alpha > 0) {
    detail::elastic_field(state, opt.elastic_alpha, opt.elastic_sigma, ex);
    detail::elastic_field(state, opt.elastic_alpha, opt.elastic_sigma, ey);
  }
  // Each output pixel samples the source at its inverse-transformed position; outside is zero.
  auto at = [&](int y, int x) -> float {
    return y < 0 || y >= rows || x < 0 || x >= cols ? 0.0f : image[y * cols + x];
  };
  for (int y = 0; y < rows; ++y) {
    for (int x = 0; x < cols; ++x) {
      const float ox = (flip ? cols - 1 - x : x) - centre, oy = y - centre;
      const float sx = c * ox + s * oy + centre + dx + ex[y * cols + x];
      const float sy = -s * ox + c * oy + centre + dy + ey[y * cols + x];
      const float fx = std::floor(sx), fy = std::floor(sy);
      const int x0 = static_cast<int>(fx), y0 = static_cast<int>(fy);
      const float ax = sx - fx, ay = sy - fy;
      const float v = (1 - ay) * ((1 - ax) * at(y0, x0) + ax * at(y0, x0 + 1)) +
                      ay * ((1 - ax) * at(y0 + 1, x0) + ax * at(y0 + 1, x0 + 1));
      out[y * cols + x] = v * scale - shift;
    }
  }
}

inline std::size_t make_samples(const packed_dataset& data, std::int64_t step, std::size_t batch,
                                std::size_t first, std::size_t n, sample* out, const augment_options& opt) {
  flexcomm::check(step >= 0 && first + n <= batch, "fashion_mnist",
                  flexcomm::cat("samples [", first, ", ", first + n, ") of step ", step, " outside its batch of ",
                                batch));
  std::vector<std::uint8_t> block(data.block_images() * pixels);
  std::size_t decoded = static_cast<std::size_t>(-1);
  for (std::size_t j = 0; j < n; ++j) {
    const std::size_t index =
        (static_cast<std::size_t>(step) % data.count() * (batch % data.count()) + first + j) % data.count();
    const std::size_t b = index / data.block_images();
    if (b != decoded) decoded = (data.decode_block(b, block.data()), b);
    augment(block.data() + (index % data.block_images()) * pixels, out[j].pixel, seed_of(step, first + j), opt);
    out[j].label = data.label(index);
  }
  return n * sample_bytes;
}

inline void make_samples_at(const packed_dataset& data, std::int64_t step, std::size_t first,
                            const std::int64_t* indices, std::size_t n, float* images, std::int32_t* labels,
                            const augment_options& opt) {
  std::vector<std::uint8_t> block(data.block_images() * pixels);
  std::size_t decoded = static_cast<std::size_t>(-1);
  for (std::size_t j = 0; j < n; ++j) {
    const auto index = static_cast<std::size_t>(indices[j]);
    flexcomm::check(index < data.count(), "fashion_mnist",
                    flexcomm::cat("image ", index, " of a dataset of ", data.count()));
    const std::size_t b = index / data.block_images();
    if (b != decoded) decoded = (data.decode_block(b, block.data()), b);
    augment(block.data() + (index % data.block_images()) * pixels, images + j * pixels, seed_of(step, first + j), opt);
    labels[j] = data.label(index);
  }
}

}  // namespace fashion_mnist
