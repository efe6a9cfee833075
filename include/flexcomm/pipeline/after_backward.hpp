// after_backward<Sync>: the baseline's gradient averaging. It takes the gradients as backprop
// hands them over but reduces none until finish(), i.e. after backward, as a trainer that calls
// allreduce on its gradients after loss.backward() does; no overlap with computation.
#pragma once

#include <functional>
#include <utility>
#include <vector>

#include "../core/span.hpp"

namespace flexcomm {

template <class Sync>
class after_backward {
 public:
  using inner_type = Sync;

  template <class Communicator, class Options>
  after_backward(const Communicator& member, Options options) : sync_(member, std::move(options)) {}

  // Remembers the gradient; the buffer must stay valid until finish().
  template <class T>
  void ready(int index, span<T> grad) {
    held_.push_back([this, index, grad] { sync_.ready(index, grad); });
  }

  // Hands every held gradient to the sync, in the order backprop produced them, and waits.
  void finish() {
    for (auto& hand_over : held_) hand_over();
    held_.clear();
    sync_.finish();
  }

  Sync& inner() noexcept { return sync_; }

 private:
  Sync sync_;
  std::vector<std::function<void()>> held_;
};

}  // namespace flexcomm
