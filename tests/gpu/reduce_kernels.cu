// The device reduction kernels against core/reduce.hpp's host loops: for every element type and
// op, bit-identical results (16-bit floats round the same way), on the default and an explicit stream.
#define BOOST_TEST_MODULE gpu_reduce_kernels
#define BOOST_TEST_NO_MAIN
#include <boost/test/unit_test.hpp>
#include <boost/mpl/list.hpp>

#include <flexcomm/backend/cuda/local_work.hpp>

#include <cstdio>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

namespace fc = flexcomm;

namespace {
using element_types = boost::mpl::list<float, double, std::int32_t, std::int64_t, std::uint8_t, fc::half, fc::bfloat16>;
const fc::op all_ops[] = {fc::op::sum, fc::op::prod, fc::op::min, fc::op::max, fc::op::avg};

// Values with fractions, signs, signed zeros and repeats; integers small enough that products
// stay defined (signed overflow would be undefined on both sides).
template <class T>
std::vector<T> sample(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    if constexpr (std::is_integral_v<T>) {
      const int x = static_cast<int>(gen() % 2001) - 1000;
      v[i] = static_cast<T>(std::is_unsigned_v<T> ? static_cast<unsigned>(x + 1000) % 256u : x);
    } else {
      const float x = static_cast<float>(static_cast<int>(gen() % 20001) - 10000) / 97.0f;
      v[i] = T(i % 17 == 0 ? (i % 2 ? -0.0f : 0.0f) : x);
    }
  }
  return v;
}

template <class T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  fc::check_cuda(cudaMalloc(&d, (h.size() + 1) * sizeof(T)), "test: cudaMalloc");
  fc::check_cuda(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), "test: upload");
  return d;
}

template <class T>
std::vector<T> to_host(const T* d, std::size_t n) {
  fc::check_cuda(cudaDeviceSynchronize(), "test: cudaDeviceSynchronize");
  std::vector<T> h(n);
  fc::check_cuda(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), "test: download");
  return h;
}

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}
}  // namespace

BOOST_AUTO_TEST_CASE_TEMPLATE(combine_equals_the_host_loop, T, element_types) {
  cudaStream_t stream = nullptr;
  fc::check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "test: cudaStreamCreate");
  // Above one block, above the grid-stride bound (4096 blocks of 256), and zero.
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{4099}, std::size_t{4096 * 256 + 3}})
    for (fc::op o : all_ops) {
      auto host = sample<T>(n, 1), other = sample<T>(n, 2);
      T* inout = to_device(host);
      T* in = to_device(other);
      fc::cuda::combine(o, inout, in, n, n % 2 ? stream : nullptr);
      fc::combine(o, host.data(), other.data(), n);
      BOOST_TEST(bitwise_equal(to_host(inout, n), host), "n=" << n << " op=" << fc::name_of(o));
      // The input is left alone and nothing past n is written.
      BOOST_TEST(bitwise_equal(to_host(in, n), other));
      cudaFree(inout);
      cudaFree(in);
    }
  cudaStreamDestroy(stream);
}

BOOST_AUTO_TEST_CASE_TEMPLATE(divide_equals_the_host_loop, T, element_types) {
  for (int ranks : {1, 2, 3, 7})
    for (std::size_t n : {std::size_t{0}, std::size_t{5}, std::size_t{70001}}) {
      auto host = sample<T>(n, 3);
      T* buf = to_device(host);
      fc::cuda::divide(buf, n, ranks, nullptr);
      fc::divide_by(host.data(), n, ranks);
      BOOST_TEST(bitwise_equal(to_host(buf, n), host), "n=" << n << " ranks=" << ranks);
      cudaFree(buf);
    }
}

BOOST_AUTO_TEST_CASE(writes_stay_inside_the_count) {
  std::vector<float> a(100, 1.f), b(100, 2.f);
  float* d = to_device(a);
  float* e = to_device(b);
  fc::cuda::combine(fc::op::sum, d, e, 99, nullptr);
  fc::cuda::divide(d, 99, 3, nullptr);
  fc::cuda::copy(e, d, 50 * sizeof(float), nullptr);
  const auto got = to_host(d, 100), copied = to_host(e, 100);
  bool ok = got[99] == 1.f && copied[50] == 2.f && copied[49] == got[49];
  for (int i = 0; i < 99; ++i) ok = ok && got[static_cast<std::size_t>(i)] == 3.f * (1.f / 3.f);
  BOOST_TEST(ok);
  cudaFree(d);
  cudaFree(e);
}

int main(int argc, char** argv) {
  if (!fc::cuda_device_present()) {
    std::puts("no CUDA device: skipped");
    return 77;
  }
  return boost::unit_test::unit_test_main(&init_unit_test, argc, argv);
}
