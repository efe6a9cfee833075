// A step captured into a CUDA graph: the trainer's stream (on_stream), whether this step is being
// captured, the refusals where a graph could not replay it, and how a captured step's buckets end.
// A captured step's work runs at each replay, on the stream, so its host side (the step's and each
// bucket's consistency checks, the flight recorder) happens once, at capture.
#pragma once

#include <string>

#include "../../backend/contract.hpp"
#include "../../core/error.hpp"
#include "flight.hpp"

namespace flexcomm::detail {

template <class B>
class step_capture {
 public:
  using stream = typename B::stream;

  // Where the Sync's copies and operations go: the trainer's stream, or (unnamed) the legacy
  // default stream and the communicators' own streams.
  void use(stream s) {
    stream_ = s;
    named_ = true;
  }
  const stream& on() const noexcept { return stream_; }
  bool captured() const noexcept { return captured_; }

  // At a step's first call (ready or finish): whether this step is being captured, refused by
  // name where it cannot be replayed. `planning`: the first step, which forms the bucket plan.
  // (Averaging in tiers across hosts, which runs on the host, is the host backends' alone:
  // device backends stay flat, and NCCL crosses hosts itself.)
  void begin(const std::string& what, bool planning) {
    captured_ = false;
    if (!stream_capturing<B>(stream_, what)) return;
    const char* cause = !captures_into_graphs<B>
                            ? "this backend moves bytes with MPI from the host, which a replay of the graph never "
                              "does; capture steps on nccl"
                        : planning
                            ? "the first step forms the bucket plan (device memory, checks across ranks); run one "
                              "step uncaptured first, as CUDA graph users warm up"
                        : !named_
                            ? "a stream of this device is capturing and this Sync was given none, so its work would "
                              "go outside the graph; name the capturing stream with on_stream()"
                            : nullptr;
    if (cause) fail(what, cat("this step cannot be captured into a CUDA graph: ", cause));
    captured_ = true;
  }

  // Ends a captured step's bucket without asking the device: its work is the graph's.
  void release(flight<B>& f) {
    if constexpr (captures_into_graphs<B>) {
      if (f.request) f.request->release_captured();
    }
    f.reset();
  }

 private:
  stream stream_{};
  bool named_ = false;
  bool captured_ = false;
};

}  // namespace flexcomm::detail
