// device_feed: every batch arrives on the device intact, in step order, although the feed
// overwrites its one host slot on every next() and the trainer's kernels run asynchronously.
#define BOOST_TEST_MODULE gpu_device_batch
#define BOOST_TEST_NO_MAIN
#include <boost/test/unit_test.hpp>

#include <flexcomm/backend/cuda/device_batch.hpp>

#include <cstdio>
#include <optional>
#include <vector>

namespace fc = flexcomm;

namespace {
std::byte pattern(std::int64_t step, std::size_t i) {
  return static_cast<std::byte>((step * 131 + static_cast<std::int64_t>(i) * 7) & 0xff);
}

// A feed of the feed contract with one pinned host slot, rewritten by every next().
class one_slot_feed {
 public:
  struct batch {
    std::int64_t s;
    fc::span<const std::byte> b;
    std::int64_t step() const { return s; }
    fc::span<const std::byte> bytes() const { return b; }
  };
  one_slot_feed(std::int64_t steps, std::size_t bytes) : steps_(steps), bytes_(bytes) {
    fc::check_cuda(cudaMallocHost(&slot_, bytes_), "test: cudaMallocHost");
  }
  ~one_slot_feed() { cudaFreeHost(slot_); }
  std::optional<batch> next() {
    if (step_ == steps_) return std::nullopt;
    const std::size_t n = bytes_ - static_cast<std::size_t>(step_ % 3);  // sizes vary
    for (std::size_t i = 0; i < bytes_; ++i) slot_[i] = pattern(step_, i);
    return batch{step_++, {slot_, n}};
  }

 private:
  std::int64_t steps_, step_ = 0;
  std::size_t bytes_;
  std::byte* slot_ = nullptr;
};

// Slow on purpose (one thread), so that copies of later batches race it if ordering is wrong.
__global__ void checksum(const unsigned char* bytes, std::size_t n, unsigned long long* out) {
  unsigned long long sum = 0;
  for (std::size_t i = 0; i < n; ++i) sum = sum * 31 + bytes[i];
  *out = sum;
}
}  // namespace

BOOST_AUTO_TEST_CASE(batches_reach_the_device_intact_and_in_order) {
  const std::int64_t steps = 40;
  const std::size_t bytes = 1 << 16;
  cudaStream_t compute = nullptr;
  fc::check_cuda(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), "test: cudaStreamCreate");
  unsigned long long* sums = nullptr;
  fc::check_cuda(cudaMalloc(&sums, steps * sizeof(unsigned long long)), "test: cudaMalloc");
  std::vector<std::int64_t> seen;
  std::vector<std::size_t> sizes;
  {
    one_slot_feed feed(steps, bytes);
    fc::cuda::device_feed<one_slot_feed> device(feed, bytes, compute);
    while (auto batch = device.next()) {
      seen.push_back(batch->step());
      sizes.push_back(batch->bytes().size());
      checksum<<<1, 1, 0, compute>>>(batch->as<unsigned char>(), batch->bytes().size(), sums + batch->step());
      fc::check_cuda(cudaGetLastError(), "test: checksum launch");
    }
  }
  fc::check_cuda(cudaStreamSynchronize(compute), "test: sync");
  std::vector<unsigned long long> got(steps);
  fc::check_cuda(cudaMemcpy(got.data(), sums, steps * sizeof(unsigned long long), cudaMemcpyDeviceToHost), "test: download");
  bool ok = seen.size() == static_cast<std::size_t>(steps);
  for (std::int64_t s = 0; ok && s < steps; ++s) {
    unsigned long long want = 0;
    const std::size_t n = bytes - static_cast<std::size_t>(s % 3);
    for (std::size_t i = 0; i < n; ++i) want = want * 31 + static_cast<unsigned char>(pattern(s, i));
    ok = seen[static_cast<std::size_t>(s)] == s && sizes[static_cast<std::size_t>(s)] == n &&
         got[static_cast<std::size_t>(s)] == want;
  }
  BOOST_TEST(ok);
  cudaFree(sums);
  cudaStreamDestroy(compute);
}

BOOST_AUTO_TEST_CASE(a_batch_larger_than_the_device_slot_is_an_error) {
  one_slot_feed feed(1, 4096);
  fc::cuda::device_feed<one_slot_feed> device(feed, 1024);
  BOOST_CHECK_THROW(device.next(), fc::error);
}

int main(int argc, char** argv) {
  if (!fc::cuda_device_present()) {
    std::puts("no CUDA device: skipped");
    return 77;
  }
  return boost::unit_test::unit_test_main(&init_unit_test, argc, argv);
}
