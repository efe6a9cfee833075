// The device reduction kernels against core/reduce.hpp's host loops, bit for bit: every element
// type and op, inputs full of NaNs (with payloads, of both signs), infinities, signed zeros and
// subnormals, odd counts, pointers aligned alike and differently (the funnel-shifted path), on the
// legacy stream and a non-blocking one, with nothing written outside the range.
// Suite on_the_host runs the kernels' bodies (__host__ __device__) on the host, thread by thread,
// and needs no GPU: `gpu_reduce_kernels --host-only` (the unit suite's reduce_kernels_on_the_host).
#define BOOST_TEST_MODULE gpu_reduce_kernels
#define BOOST_TEST_NO_MAIN
#include <boost/test/unit_test.hpp>
#include <boost/mpl/list.hpp>

#include <flexcomm/backend/cuda/local_work.hpp>
#include <flexcomm/backend/cuda/reduce_kernels.cuh>

#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace fc = flexcomm;
namespace kd = flexcomm::cuda::kernels::detail;

namespace {
using element_types = boost::mpl::list<float, double, std::int32_t, std::int64_t, std::uint8_t, fc::half, fc::bfloat16>;
const fc::op all_ops[] = {fc::op::sum, fc::op::prod, fc::op::min, fc::op::max, fc::op::avg};

template <class T> constexpr std::size_t lanes = 16 / sizeof(T);

// Random bits (every class of value, integers over their whole range), specials, and plain
// numbers that round when added or multiplied.
template <class T>
std::vector<T> sample(std::size_t n, unsigned seed) {
  std::mt19937_64 gen(seed);
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t r = gen();
    if constexpr (std::is_integral_v<T>) {
      v[i] = static_cast<T>(r % 4 == 0 ? r % 7 : r >> 8);
    } else if constexpr (sizeof(T) == 2) {
      v[i].bits = static_cast<std::uint16_t>(r % 3 == 0 ? r >> 20 : T(static_cast<float>((r >> 8) % 20001) / 97.f - 100.f).bits);
    } else {
      using U = std::conditional_t<sizeof(T) == 8, std::uint64_t, std::uint32_t>;
      const T plain = static_cast<T>(static_cast<double>((r >> 8) % 20001) / 97.0 - 100.0);
      const T specials[] = {std::numeric_limits<T>::quiet_NaN(), -std::numeric_limits<T>::infinity(),
                            std::numeric_limits<T>::infinity(), std::numeric_limits<T>::denorm_min(), -T(0), T(0)};
      const U bits = static_cast<U>(r >> 3);
      T x;
      std::memcpy(&x, &bits, sizeof x);
      v[i] = r % 4 == 0 ? x : r % 4 == 1 ? specials[(r >> 40) % 6] : plain;
    }
  }
  return v;
}

template <class T>
bool bitwise_equal(const T* a, const T* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(T)) == 0;
}

// A device allocation of up to `capacity` elements, reused across cases. Uploads are synchronized
// (the kernels may then run on any stream); reads wait for the given stream first.
template <class T>
struct device_array {
  T* ptr = nullptr;
  std::size_t used = 0;
  explicit device_array(std::size_t capacity) {
    fc::check_cuda(cudaMalloc(&ptr, capacity * sizeof(T) + 1), "test: cudaMalloc");
  }
  explicit device_array(const std::vector<T>& h) : device_array(h.size()) { upload(h); }
  ~device_array() { cudaFree(ptr); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  void upload(const std::vector<T>& h) {
    used = h.size();
    fc::check_cuda(cudaMemcpy(ptr, h.data(), used * sizeof(T), cudaMemcpyHostToDevice), "test: upload");
    fc::check_cuda(cudaDeviceSynchronize(), "test: upload synchronized");
  }
  std::vector<T> host(cudaStream_t after) const {
    fc::check_cuda(cudaStreamSynchronize(after), "test: cudaStreamSynchronize");
    fc::check_cuda(cudaDeviceSynchronize(), "test: cudaDeviceSynchronize");
    std::vector<T> h(used);
    fc::check_cuda(cudaMemcpy(h.data(), ptr, used * sizeof(T), cudaMemcpyDeviceToHost), "test: download");
    return h;
  }
};

struct stream_holder {
  cudaStream_t s = nullptr;
  stream_holder() { fc::check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "test: cudaStreamCreate"); }
  ~stream_holder() { cudaStreamDestroy(s); }
};

// Element offsets of inout and in into their allocations: aligned alike, misaligned alike, and
// misaligned differently (every pair of {0, 1, lanes - 1}).
template <class T>
std::vector<std::size_t> offsets() {
  std::vector<std::size_t> o{0, 1};
  if (lanes<T> > 2) o.push_back(lanes<T> - 1);
  return o;
}

// Elements around each range: canaries, never written. pad / 2 elements are 16-byte multiples for
// every type, so that offset 0 is aligned.
const std::size_t pad = 64;

// One combine on the device at the given offsets against the host loop on the same data.
template <class T>
void check_combine(fc::op o, std::size_t n, std::size_t at, std::size_t from, cudaStream_t stream, device_array<T>& da,
                   device_array<T>& db) {
  const auto a = sample<T>(n + 2 * pad, static_cast<unsigned>(n * 7 + at)), b = sample<T>(n + 2 * pad, static_cast<unsigned>(n * 11 + from + 1));
  da.upload(a);
  db.upload(b);
  fc::cuda::combine(o, da.ptr + at, db.ptr + from, n, stream);
  auto want = a;
  fc::combine(o, want.data() + at, b.data() + from, n);
  const auto got = da.host(stream), in = db.host(stream);
  BOOST_TEST_REQUIRE(bitwise_equal(got.data(), want.data(), got.size()),
                     fc::name_of(o) << " n=" << n << " inout+" << at << " in+" << from);
  BOOST_TEST_REQUIRE(bitwise_equal(in.data(), b.data(), b.size()), "the input was written");
}
}  // namespace

// Counts around the vector width and beyond one block; offsets of 0, 1 and lanes - 1 elements
// from 16-byte alignment for inout and in, every pair (alike: vectors; different: shifted).
BOOST_AUTO_TEST_CASE_TEMPLATE(combine_equals_the_host_reference_at_every_alignment, T, element_types) {
  stream_holder side;
  const std::size_t sizes[] = {1, 3, lanes<T>, 2 * lanes<T> + 1, 1001, 4099};
  device_array<T> da(4099 + 2 * pad), db(4099 + 2 * pad);
  int k = 0;
  for (fc::op o : all_ops)
    for (std::size_t n : sizes)
      for (std::size_t at : offsets<T>())
        for (std::size_t from : offsets<T>())
          check_combine<T>(o, n, pad / 2 + at, pad / 2 + from, ++k % 2 ? side.s : nullptr, da, db);
}

// Past one grid (4096 blocks of 256 threads, a vector each): every thread loops.
BOOST_AUTO_TEST_CASE_TEMPLATE(combine_past_one_grid, T, element_types) {
  stream_holder side;
  const std::size_t n = 4096 * 256 * lanes<T> + 2 * lanes<T> + 3;
  device_array<T> da(n + 2 * pad), db(n + 2 * pad);
  check_combine<T>(fc::op::sum, n, pad / 2, pad / 2, side.s, da, db);
  check_combine<T>(fc::op::max, n, pad / 2 + 1, pad / 2, nullptr, da, db);
}

BOOST_AUTO_TEST_CASE_TEMPLATE(divide_equals_the_host_reference, T, element_types) {
  stream_holder side;
  device_array<T> da(4099 + 2 * pad);
  for (int ranks : {1, 2, 3, 7, 256, 1000, 2147483647})
    for (std::size_t n : {std::size_t{1}, std::size_t{5}, 2 * lanes<T> + 1, std::size_t{4099}})
      for (std::size_t at : offsets<T>()) {
        const auto a = sample<T>(n + 2 * pad, static_cast<unsigned>(n + at + static_cast<std::size_t>(ranks)));
        da.upload(a);
        cudaStream_t s = ranks % 2 ? side.s : nullptr;
        fc::cuda::divide(da.ptr + pad / 2 + at, n, ranks, s);
        auto want = a;
        fc::divide_by(want.data() + pad / 2 + at, n, ranks);
        const auto got = da.host(s);
        BOOST_TEST_REQUIRE(bitwise_equal(got.data(), want.data(), got.size()), "n=" << n << " ranks=" << ranks << " +" << at);
      }
}

BOOST_AUTO_TEST_CASE(a_count_of_zero_launches_nothing) {
  std::vector<float> a{1.f, 2.f};
  device_array<float> d(a);
  fc::cuda::combine(fc::op::sum, d.ptr, d.ptr + 1, 0, nullptr);
  fc::cuda::divide(d.ptr, 0, 3, nullptr);
  BOOST_TEST(bitwise_equal(d.host(nullptr).data(), a.data(), 2));
}

// ---- The kernels' bodies on the host, no GPU needed ----
BOOST_AUTO_TEST_SUITE(on_the_host)

namespace {
// Every thread of a grid of `threads`, one after another: each element belongs to one thread.
template <class T>
void emulate_combine(fc::op o, T* inout, const T* in, std::size_t n, std::size_t threads) {
  using D = typename kd::device_type<T>::type;
  const kd::plan p = kd::plan_for(inout, in, n, sizeof(T));
  auto run = [&](auto tag) {
    constexpr fc::op O = decltype(tag)::value;
    for (std::size_t t = 0; t < threads; ++t) {
      if (p.shift == 0) kd::combine_part<O, D, false>(reinterpret_cast<D*>(inout), reinterpret_cast<const D*>(in), p, t, threads);
      else kd::combine_part<O, D, true>(reinterpret_cast<D*>(inout), reinterpret_cast<const D*>(in), p, t, threads);
    }
  };
  switch (o) {
    case fc::op::sum: case fc::op::avg: run(std::integral_constant<fc::op, fc::op::sum>{}); break;
    case fc::op::prod: run(std::integral_constant<fc::op, fc::op::prod>{}); break;
    case fc::op::min: run(std::integral_constant<fc::op, fc::op::min>{}); break;
    case fc::op::max: run(std::integral_constant<fc::op, fc::op::max>{}); break;
  }
}

template <class T>
void emulate_divide(T* buf, std::size_t n, int ranks, std::size_t threads) {
  using D = typename kd::device_type<T>::type;
  if (n == 0 || ranks <= 1) return;
  const kd::plan p = kd::plan_for(buf, buf, n, sizeof(T));
  for (std::size_t t = 0; t < threads; ++t) kd::divide_part<D>(reinterpret_cast<D*>(buf), kd::divide_by_arg<D>(ranks), p, t, threads);
}

// Host buffers aligned to 16 bytes, so that offsets mean what they do on the device.
template <class T>
struct aligned_copy {
  std::vector<unsigned char> bytes;
  T* data;
  explicit aligned_copy(const std::vector<T>& v) : bytes(v.size() * sizeof(T) + 16) {
    void* p = bytes.data();
    std::size_t space = bytes.size();
    data = static_cast<T*>(std::align(16, v.size() * sizeof(T), p, space));
    std::memcpy(static_cast<void*>(data), v.data(), v.size() * sizeof(T));
  }
};
}  // namespace

BOOST_AUTO_TEST_CASE(the_shift_takes_the_right_sixteen_bytes) {
  unsigned char window[32];
  for (int i = 0; i < 32; ++i) window[i] = static_cast<unsigned char>(i * 7 + 1);
  uint4 lo, hi;
  std::memcpy(&lo, window, 16);
  std::memcpy(&hi, window + 16, 16);
  for (unsigned s = 0; s < 16; ++s) {
    const uint4 r = kd::shifted(lo, hi, s);
    BOOST_TEST(std::memcmp(&r, window + s, 16) == 0, "shift " << s);
  }
}

// The plan keeps every access inside the ranges: the body aligned, in's aligned blocks within
// [in - shift, in + n) and every element covered once.
BOOST_AUTO_TEST_CASE(plans_stay_inside_the_ranges) {
  alignas(16) static unsigned char base[256];
  for (std::size_t size : {1, 2, 4, 8})
    for (std::size_t a = 0; a < 16; a += size)
      for (std::size_t b = 0; b < 16; b += size)
        for (std::size_t n = 0; n < 40; ++n) {
          const kd::plan p = kd::plan_for(base + a, base + 64 + b, n, size);
          const std::size_t tail_from = p.head + p.vectors * (16 / size);
          BOOST_TEST_REQUIRE((tail_from <= n && (p.vectors == 0 || (a + p.head * size) % 16 == 0)));
          if (p.vectors > 0 && p.shift != 0) {
            const std::size_t first = 64 + b + p.head * size - p.shift, last = first + 16 * (p.vectors + 1);
            BOOST_TEST_REQUIRE((first % 16 == 0 && first >= 64 && last <= 64 + b + n * size));
          }
        }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(combine_bodies_equal_the_host_loop, T, element_types) {
  for (fc::op o : all_ops)
    for (std::size_t n : {std::size_t{1}, std::size_t{3}, lanes<T>, 2 * lanes<T> + 1, std::size_t{301}, std::size_t{4099}})
      for (std::size_t at : offsets<T>())
        for (std::size_t from : offsets<T>())
          for (std::size_t threads : {std::size_t{1}, std::size_t{5}, std::size_t{64}}) {
            const auto a = sample<T>(n + 2 * pad, static_cast<unsigned>(n + at)), b = sample<T>(n + 2 * pad, static_cast<unsigned>(n + from + 9));
            aligned_copy<T> x(a), y(b);
            emulate_combine(o, x.data + pad / 2 + at, y.data + pad / 2 + from, n, threads);
            auto want = a;
            fc::combine(o, want.data() + pad / 2 + at, b.data() + pad / 2 + from, n);
            BOOST_TEST_REQUIRE(bitwise_equal(x.data, want.data(), want.size()),
                               fc::name_of(o) << " n=" << n << " inout+" << at << " in+" << from << " threads=" << threads);
            BOOST_TEST_REQUIRE(bitwise_equal(y.data, b.data(), b.size()));
          }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(divide_bodies_equal_the_host_loop, T, element_types) {
  for (int ranks : {2, 3, 7, 256, 1000, 2147483647})
    for (std::size_t n : {std::size_t{1}, std::size_t{5}, 2 * lanes<T> + 1, std::size_t{4099}})
      for (std::size_t at : offsets<T>()) {
        const auto a = sample<T>(n + 2 * pad, static_cast<unsigned>(n * 3 + at + static_cast<std::size_t>(ranks)));
        aligned_copy<T> x(a);
        emulate_divide(x.data + pad / 2 + at, n, ranks, 7);
        auto want = a;
        fc::divide_by(want.data() + pad / 2 + at, n, ranks);
        BOOST_TEST_REQUIRE(bitwise_equal(x.data, want.data(), want.size()), "n=" << n << " ranks=" << ranks << " +" << at);
      }
}

// flexcomm's 16-bit conversions are CUDA's own (cuda_fp16.h and cuda_bf16.h on the host):
// rounding, overflow, subnormals and NaN -> 0x7fff.
BOOST_AUTO_TEST_CASE(narrowing_equals_cuda) {
  std::mt19937 gen(5);
  std::vector<std::uint32_t> floats;
  for (std::uint32_t h = 0; h < 0x10000u; ++h)  // bfloat16's ties, just below and above
    for (std::uint32_t d : {0x7fffu, 0x8000u, 0x8001u}) floats.push_back((h << 16) | d);
  for (int k = 0; k < 1 << 20; ++k) floats.push_back(static_cast<std::uint32_t>(gen()));
  for (std::uint32_t e = 0x33000000u; e < 0x47800000u; e += 0x1000u) floats.push_back(e | (gen() & 0x1fffu));  // half's range
  for (std::uint32_t bits : floats) {
    float f;
    std::memcpy(&f, &bits, 4);
    const __half h = __float2half_rn(f);
    const __nv_bfloat16 b = __float2bfloat16_rn(f);
    std::uint16_t hb, bb;
    std::memcpy(&hb, &h, 2);
    std::memcpy(&bb, &b, 2);
    BOOST_TEST_REQUIRE(fc::half(f).bits == hb, std::hex << "half of " << bits);
    BOOST_TEST_REQUIRE(fc::bfloat16(f).bits == bb, std::hex << "bfloat16 of " << bits);
  }
}

BOOST_AUTO_TEST_SUITE_END()

int main(int argc, char** argv) {
  std::vector<char*> args(argv, argv + argc);
  std::string host_only_filter = "--run_test=on_the_host";
  bool host_only = false;
  for (auto it = args.begin(); it != args.end();)
    if (std::string(*it) == "--host-only") {
      host_only = true;
      it = args.erase(it);
    } else {
      ++it;
    }
  if (host_only) args.push_back(host_only_filter.data());
  if (!host_only && !fc::cuda_device_present()) {
    std::puts("no CUDA device: skipped");
    return 77;
  }
  return boost::unit_test::unit_test_main(&init_unit_test, static_cast<int>(args.size()), args.data());
}
