// What one post of a device operation costs the host, counted (issue 52, item 1): heap
// allocations (this test program replaces the global operator new and delete, and counts per
// thread), flexcomm's locks (flexcomm::mutex counts them), and device-layer calls (counted by the
// stand-in; a GPU build counts none). The stand-in's own calls allocate (its queues and tasks are
// host C++): a post is charged only what it allocates beyond the same raw calls (`raw`), made the
// same way in the same state. Include from one source file of a test program only.
#pragma once

#include <flexcomm/backend/cuda/runtime.hpp>
#include <flexcomm/core/mutex.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace flexcomm::testing {
inline std::uint64_t& thread_allocations() noexcept {
  thread_local std::uint64_t n = 0;
  return n;
}

struct post_cost {
  std::uint64_t allocations = 0, locks = 0, calls = 0;
};

// What `post()` costs this thread over `tries` posts: the most locks and calls, and the fewest
// allocations (a stand-in queue that grows, a block its worker has not freed yet, are the
// stand-in's, not the post's).
template <class Post>
post_cost cost_of(Post&& post, int tries = 8) {
  post_cost least{~0ull, 0, 0};
  for (int i = 0; i < tries; ++i) {
    const auto a = thread_allocations();
    const auto l = locks_taken();
    const auto c = device::calls();
    post();
    least.allocations = std::min(least.allocations, thread_allocations() - a);
    least.locks = std::max(least.locks, locks_taken() - l);
    least.calls = std::max(least.calls, device::calls() - c);
  }
  return least;
}
}  // namespace flexcomm::testing

// The host's (nvcc's device pass keeps the device's own).
#if !defined(__CUDA_ARCH__)
void* operator new(std::size_t n) {
  ++flexcomm::testing::thread_allocations();
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return ::operator new(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  ++flexcomm::testing::thread_allocations();
  return std::malloc(n ? n : 1);
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return ::operator new(n, t); }
void* operator new(std::size_t n, std::align_val_t a) {
  ++flexcomm::testing::thread_allocations();
  const auto align = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(align, (n + align - 1) / align * align)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) { return ::operator new(n, a); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
#endif
