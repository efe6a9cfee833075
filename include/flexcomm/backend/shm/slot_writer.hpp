// How a rank writes into its shared-memory slots, which peers on other cores read next: with
// ordinary stores, or with streaming (non-temporal) stores, whichever this rank finds faster.
//
// Ordinary stores must first take each line back from the peer that read it last, a round trip
// where that peer or the memory is far; streaming stores skip that but make a near reader fetch
// from memory. Only timing tells which wins (docs/architecture.md), so each rank times its own.
// The choice is local: a streaming write ends with a store fence, before the release store of
// the step that publishes it, so readers see the same bytes either way.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace flexcomm::detail {

// Copies with streaming stores where the target has them (x86-64: SSE2), else memcpy; returns
// once the stores are ordered before any later store (a fence), so a release store of a step
// afterwards publishes them.
inline void stream_copy(void* dst, const void* src, std::size_t bytes) {
#if defined(__SSE2__)
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  // Up to the first 16-byte boundary of the destination: ordinary stores.
  const std::size_t head = std::min(bytes, (16 - reinterpret_cast<std::uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  std::size_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, s + i, bytes - i);
  _mm_sfence();
#else
  std::memcpy(dst, src, bytes);
#endif
}

// Which stores a rank uses for its slot writes, learned from whole allreduces: each rank times
// its own (from the moment every rank has its first chunk in to the end; per byte) and keeps the
// faster kind, for each size class apart (a factor of 4 each, from 256 KiB to 64 MiB): a task
// whose data stays in the caches wants ordinary stores where one many times their size may want
// streaming ones. In each class the first four tasks try ordinary, streaming, ordinary,
// streaming stores, and one in `explore_every` after them tries the kind not preferred, so a
// change of placement shows. Timing the copies alone would mislead: streaming stores are cheap
// for the writer and make its readers fetch from memory.
class slot_writer {
 public:
  enum kind : int { cached = 0, streaming = 1 };
  static constexpr unsigned explore_every = 16;
  static constexpr int classes = 6;

  // The size class of a task of `bytes`: 0 below 256 KiB, then one per factor of 4, the last
  // from 64 MiB up.
  static int size_class(std::size_t bytes) noexcept {
    int cls = 0;
    for (std::size_t limit = std::size_t{256} << 10; cls < classes - 1 && bytes >= limit; limit *= 4) ++cls;
    return cls;
  }

  // The kind for the `nth` task of class `cls` on this reducer (counted alike on every rank, so
  // they explore together).
  kind choose(int cls, std::uint64_t nth) const noexcept {
    if (nth < 4) return nth % 2 == 0 ? cached : streaming;
    const kind best = preferred(cls);
    return nth % explore_every == explore_every - 1 ? (best == cached ? streaming : cached) : best;
  }
  kind preferred(int cls) const noexcept {
    const double c = cost_[cls][cached].load(std::memory_order_relaxed);
    const double s = cost_[cls][streaming].load(std::memory_order_relaxed);
    return s > 0 && (c == 0 || s < c) ? streaming : cached;
  }
  // A task of class `cls` with stores of kind `k` took `ns_per_byte`. Callable from any thread
  // (a race only blurs the estimate). The estimate falls at once and rises slowly: the kernel only
  // ever makes a task slower, so a faster sample is the better estimate, while a real change of
  // placement lasts and still moves it (benchmarks/history/allreduce.md, "The store learner").
  void learn(int cls, kind k, double ns_per_byte) noexcept {
    std::atomic<double>& cost = cost_[cls][k];
    const double old = cost.load(std::memory_order_relaxed);
    double now = ns_per_byte;
    if (old > 0 && ns_per_byte >= old) now = 0.875 * old + 0.125 * std::min(ns_per_byte, 2 * old);
    cost.store(now, std::memory_order_relaxed);
  }

  static void copy(kind k, void* slot, const void* from, std::size_t bytes) {
    if (k == streaming)
      stream_copy(slot, from, bytes);
    else
      std::memcpy(slot, from, bytes);
  }

 private:
  std::atomic<double> cost_[classes][2] = {};  // ns per byte, smoothed; 0: not measured yet
};

}  // namespace flexcomm::detail
