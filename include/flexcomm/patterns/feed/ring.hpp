// The batches a feed keeps in flight: a fixed ring of entries, step (or round) s in slot
// s mod size, so that buffers are allocated once and a slot is reused only once the step
// before it there is released.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace flexcomm {
namespace detail {

// Entries are shared because a pump keeps an entry alive while its requests are pending, even
// past the feed that posted them. Which step each slot holds is kept here, not in the entry, so
// that posting, consuming and draining agree on one answer.
template <class Entry>
class batch_ring {
 public:
  batch_ring() = default;

  // `init(entry)` sizes each entry's buffers once, for every step the slot will hold.
  template <class Init>
  batch_ring(std::size_t size, Init&& init) : slots_(size) {
    for (auto& s : slots_) {
      s.entry = std::make_shared<Entry>();
      init(*s.entry);
    }
  }

  std::size_t size() const noexcept { return slots_.size(); }

  // The entry of step `index`'s slot, whichever step it holds now.
  Entry& at(std::int64_t index) { return *slot(index).entry; }
  // The same entry, as a pump keeps it.
  const std::shared_ptr<Entry>& shared(std::int64_t index) { return slot(index).entry; }

  // The step `index`'s slot holds, or -1 when it is free.
  std::int64_t holder(std::int64_t index) const { return slots_[position(index)].held; }
  // Takes `index`'s slot for it, unless the slot still holds an earlier step.
  bool claim(std::int64_t index) {
    auto& s = slot(index);
    if (s.held >= 0) return false;
    s.held = index;
    return true;
  }
  void release(std::int64_t index) { slot(index).held = -1; }

  // f(step, entry), held slots only: a free slot's entry still carries the flags of its last step.
  template <class F>
  void for_each_held(F&& f) {
    for (auto& s : slots_)
      if (s.held >= 0) f(s.held, *s.entry);
  }
  // f(entry) for every slot, for a user that does not claim (a producer keeps its own account
  // of what it posted).
  template <class F>
  void for_each(F&& f) {
    for (auto& s : slots_) f(*s.entry);
  }

  // Until nothing is held: `post()` claims what it can, then the oldest step held is awaited
  // (`await(entry, step)`) and released. Oldest first: its slot is the one the next step to
  // post needs. A failed wait leaves its step held.
  template <class Post, class Await>
  void drain(Post&& post, Await&& await) {
    for (;;) {
      post();
      std::int64_t oldest = -1;
      for (const auto& s : slots_)
        if (s.held >= 0 && (oldest < 0 || s.held < oldest)) oldest = s.held;
      if (oldest < 0) return;
      await(at(oldest), oldest);
      release(oldest);
    }
  }

 private:
  struct slot_state {
    std::shared_ptr<Entry> entry;
    std::int64_t held = -1;
  };

  std::size_t position(std::int64_t index) const {
    return static_cast<std::size_t>(index % static_cast<std::int64_t>(slots_.size()));
  }
  slot_state& slot(std::int64_t index) { return slots_[position(index)]; }

  std::vector<slot_state> slots_;
};

}  // namespace detail
}  // namespace flexcomm
