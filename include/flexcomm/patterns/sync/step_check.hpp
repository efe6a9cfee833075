// The cross-rank check of a step: every rank of a member handed over the same gradients, in the
// same order, and none misused ready()/finish(); the sync core runs it once per step.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../../backend/contract.hpp"
#include "../../core/agreement.hpp"
#include "../../core/error.hpp"
#include "../../core/reduce.hpp"
#include "../../core/span.hpp"

namespace flexcomm::detail {

// The gradients handed over in a step: how many, and the first few (index, count) for a
// mismatch's message, kept as numbers and spelled only when a step goes wrong (formatting them on
// every ready() cost a tenth of a small step).
struct first_handed {
  static constexpr std::size_t kept = 8;
  std::array<std::pair<int, std::size_t>, kept> first{};
  std::size_t handed = 0;
  void add(int index, std::size_t count) {
    if (handed < kept) first[handed] = {index, count};
    ++handed;
  }
  std::string str() const {
    std::string out;
    for (std::size_t i = 0; i < handed && i < kept; ++i)
      out += cat(i ? " " : "", first[i].first, ":", first[i].second);
    return out;
  }
};

// The cross-rank check of one step, one small max-reduction: the step's fingerprint, the
// highest misusing rank + 1, and a word the pipeline carries to every rank of the member (its
// hand-over notice, pipeline/handover.hpp: it rides here rather than in a collective of its
// own). Either nonblocking on the control communicator (start), or through the shared-memory
// route's segment (through: blocking, one round of flags instead of an MPI collective per step).
template <class B>
class signature_check {
 public:
  // The int64 words exchanged: the fingerprint and the misuse mark, each with its negation
  // (agreement; the carry takes one's place, see marked()), what a bucket that carries the check
  // must make room for.
  static constexpr std::size_t words = 4;
  std::int64_t carry = 0;  // this rank's word; carried() is the highest over the member

  void start(const typename B::communicator& comm, const fingerprint& f, bool misused) {
    same_.emplace(marked(f, misused ? comm.rank() + 1 : 0));
    request_.emplace(B::iallreduce(comm, same_->buffer(), op::max));
  }
  // `route.agree(span<int64_t>)` max-reduces over the member's ranks, blocking.
  template <class Route>
  void through(Route& route, const typename B::communicator& comm, const fingerprint& f, bool misused) {
    same_.emplace(marked(f, misused ? comm.rank() + 1 : 0));
    route.agree(same_->buffer());
  }
  // After verdict(): the highest carry over the member's ranks.
  std::int64_t carried() const { return same_ ? -same_->lowest(1) : 0; }
  // Waits; an empty string when every rank handed over the same gradients and none misused.
  // `sequence`: this rank's first hand-overs, for the message (str()).
  template <class Sequence>
  std::string verdict(const std::string& local_misuse, const Sequence& sequence) {
    if (request_) request_->wait();
    request_.reset();
    if (!local_misuse.empty()) return local_misuse;
    if (same_->highest(1) > 0)
      return cat("rank ", same_->highest(1) - 1,
                 " of the member misused ready()/finish() in this step (its error says how)");
    if (!same_->agreed(0))
      return cat("the member's ranks handed gradients over in different orders or with different sizes in this "
                 "step; every rank must call ready() with the same indices, sizes, types and order (and at a first "
                 "step, each gradient in gradient_memory() on every rank or on none). This rank's "
                 "sequence (index:count) starts ", sequence.str());
    return {};
  }

 private:
  // The carry takes the place of the misuse mark's lowest, which nobody reads: the check stays
  // four words, small enough to ride in a shared-memory round with a bucket (carried_words).
  agreement marked(const fingerprint& f, std::int64_t misuse) const {
    agreement a{f.folded(), misuse};
    a.buffer()[3] = carry;
    return a;
  }

  std::optional<agreement> same_;
  std::optional<typename B::request> request_;
};

// Where the cross-rank check travels: the backend itself for host backends; for device
// backends (whose operations take device memory only) the member's twin on the host backend
// beside it, control().
template <class B>
struct control_channel {
  using backend = host_backend_t<B>;
  static typename backend::communicator make(const typename B::communicator& member, const std::string& name) {
    if constexpr (holds_host_memory<B>)
      return member.dup(name);
    else
      return member.control().dup(name);
  }
};

}  // namespace flexcomm::detail
