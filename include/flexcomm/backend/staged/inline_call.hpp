// A callable kept inside its owner, never on the heap: a staged operation's per-chunk steps are
// small lambdas (a few pointers and counts), set anew at every post of a pooled operation, where a
// std::function too big for its small buffer would allocate each time (docs/cuda.md, issue 52).
// Only trivially copyable callables that fit are taken, which the compiler checks.
#pragma once

#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>

namespace flexcomm::detail {

template <class Signature, std::size_t Size = 64>
class inline_call;

template <class R, class... Args, std::size_t Size>
class inline_call<R(Args...), Size> {
 public:
  template <class F>
  void set(F f) noexcept {
    static_assert(sizeof(F) <= Size && alignof(F) <= alignof(std::max_align_t),
                  "an inline_call holds small callables only: capture pointers and counts");
    static_assert(std::is_trivially_copy_constructible_v<F> && std::is_trivially_destructible_v<F>,
                  "an inline_call holds trivially copyable callables only");
    ::new (static_cast<void*>(storage_)) F(f);
    call_ = [](void* s, Args... a) -> R { return (*static_cast<F*>(s))(std::forward<Args>(a)...); };
  }
  explicit operator bool() const noexcept { return call_ != nullptr; }
  R operator()(Args... a) { return call_(storage_, std::forward<Args>(a)...); }

 private:
  alignas(std::max_align_t) unsigned char storage_[Size];
  R (*call_)(void*, Args...) = nullptr;
};

}  // namespace flexcomm::detail
