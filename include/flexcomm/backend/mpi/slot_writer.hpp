// How a rank writes into its shared-memory slots, which peers on other cores read next: with
// ordinary stores, or with streaming (non-temporal) stores, whichever this rank finds faster.
//
// Ordinary stores leave the lines in the writer's caches, where a peer sharing them reads them
// at once; but each store must first take the line back from the peer that read it last time.
// When that peer, or the slot's memory, is far (another die or socket; on this project's VM,
// one process in two or three at random), every such line is a round trip: a 64 MiB allreduce
// at 2 ranks took 40-50 ms instead of 8-14 (the same-run probe, which writes no slot it reads
// back, 8-16). Streaming stores go to memory without taking the line: 11-19 ms in those
// processes, but 1.5x slower than ordinary stores where the peer is near. Neither wins
// everywhere, and the difference shows only by timing, so each rank times its allreduces and
// keeps the faster kind (slot_writer), trying the other now and then. The choice is local:
// readers see the same bytes either way, since a streaming write ends with a store fence,
// before the release store of the step that publishes it.
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
// its own (from the moment every rank has its first chunk in to the end; per byte, smoothed) and
// keeps the faster kind. The first large allreduce uses ordinary stores and the second
// streaming ones, and one in `explore_every` tries the kind not preferred, so a change of
// placement shows. Timing the copies alone would mislead: streaming stores are cheap for the
// writer and make its readers fetch from memory.
class slot_writer {
 public:
  enum kind : int { cached = 0, streaming = 1 };
  static constexpr unsigned explore_every = 32;

  // The kind for the `nth` large allreduce on this reducer (counted alike on every rank, so
  // they explore together).
  kind choose(std::uint64_t nth) const noexcept {
    if (nth == 0) return cached;
    if (nth == 1) return streaming;
    const kind best = preferred();
    return nth % explore_every == explore_every - 1 ? (best == cached ? streaming : cached) : best;
  }
  kind preferred() const noexcept {
    const double c = cost_[cached].load(std::memory_order_relaxed), s = cost_[streaming].load(std::memory_order_relaxed);
    return s > 0 && (c == 0 || s < c) ? streaming : cached;
  }
  // An allreduce with stores of kind `k` took `ns_per_byte`. Callable from any thread (a race
  // only blurs the estimate).
  void learn(kind k, double ns_per_byte) noexcept {
    const double old = cost_[k].load(std::memory_order_relaxed);
    // An allreduce the kernel interrupted says little of the stores: a sample counts for at most
    // twice the estimate (a real change moves it 1.25x per allreduce).
    const double sample = old > 0 ? std::min(ns_per_byte, 2 * old) : ns_per_byte;
    cost_[k].store(old > 0 ? 0.75 * old + 0.25 * sample : sample, std::memory_order_relaxed);
  }

  static void copy(kind k, void* slot, const void* from, std::size_t bytes) {
    if (k == streaming)
      stream_copy(slot, from, bytes);
    else
      std::memcpy(slot, from, bytes);
  }

 private:
  std::atomic<double> cost_[2] = {0.0, 0.0};  // ns per byte, smoothed; 0: not measured yet
};

}  // namespace flexcomm::detail
