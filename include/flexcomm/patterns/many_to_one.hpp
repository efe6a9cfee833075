// many_to_one<B>: trainers hand tensors to the layout's aggregator, which gathers them
// (concatenated in member order, sizes may differ per rank) or reduces them over members.
//
// Who takes part: every trainer rank submits once per round (an empty tensor is a valid
// submission), the aggregator (layout.aggregator(), any rank of the layout) gathers or reduces
// once per round; producers that are not the aggregator never take part. A member's
// contribution is the concatenation of its ranks' submissions in rank order, so a member that
// splits its test set over its ranks contributes the whole set, and reduce() combines members.
//
// submit() never waits for the aggregator: it copies the tensor into a buffer it owns and
// hands the transfer to the progress engine, so a member does not stall on a slow aggregator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/datatype.hpp"
#include "../core/error.hpp"
#include "../core/layout.hpp"
#include "../core/progress.hpp"
#include "../core/reduce.hpp"
#include "../core/span.hpp"
#include "../backend/contract.hpp"

namespace flexcomm {

// What the aggregator receives in one round of gather().
template <class T>
struct gathered {
  std::vector<T> data;                      // every trainer's tensor, member by member, rank by rank
  std::vector<std::size_t> rank_counts;     // elements from each trainer, in the same order
  std::vector<std::size_t> member_counts;   // elements from each member (its ranks together)
  std::vector<int> member_sizes;            // ranks per member, to index rank_counts

  // A member's contribution: its ranks' tensors concatenated.
  span<const T> member(int m) const {
    check(m >= 0 && static_cast<std::size_t>(m) < member_counts.size(), "many_to_one: gathered",
          cat("member ", m, " is not one of ", member_counts.size()));
    std::size_t offset = 0;
    for (int i = 0; i < m; ++i) offset += member_counts[static_cast<std::size_t>(i)];
    return {data.data() + offset, member_counts[static_cast<std::size_t>(m)]};
  }

  // What rank r of member m submitted.
  span<const T> trainer(int m, int r) const {
    check(m >= 0 && static_cast<std::size_t>(m) < member_sizes.size() && r >= 0 &&
              r < member_sizes[static_cast<std::size_t>(m)],
          "many_to_one: gathered", cat("member ", m, " rank ", r, " is not a trainer of this layout"));
    std::size_t index = 0, offset = 0;
    for (int i = 0; i < m; ++i) index += static_cast<std::size_t>(member_sizes[static_cast<std::size_t>(i)]);
    index += static_cast<std::size_t>(r);
    for (std::size_t i = 0; i < index; ++i) offset += rank_counts[i];
    return {data.data() + offset, rank_counts[index]};
  }
};

template <class B>
class many_to_one {
  static_assert(holds_host_memory<B>,
                "many_to_one<B>: the aggregator receives host vectors (gather<T>() returns std::vector<T>), "
                "but B's buffers live in device memory; collect with a host backend such as many_to_one<mpi> "
                "and copy predictions to the host before submit()");

 public:
  using backend = B;
  using communicator = typename B::communicator;

  // Collective over `world` (every rank of the layout): builds the collect communicator, which
  // holds the aggregator (first, when it does not train) and every trainer in member order.
  many_to_one(const communicator& world, const ensemble_layout& layout);

  many_to_one(const many_to_one&) = delete;
  many_to_one& operator=(const many_to_one&) = delete;
  // Waits for this rank's submissions to leave (the aggregator must gather them).
  ~many_to_one();

  bool is_trainer() const noexcept { return trainer_; }
  bool is_aggregator() const noexcept { return aggregator_; }
  // Rounds this rank has submitted (trainers) or gathered (aggregator).
  std::int64_t submitted() const noexcept { return submitted_; }
  std::int64_t collected() const noexcept { return collected_; }

  // On trainers: one round's tensor (may be empty). Returns once the tensor is copied.
  template <class T>
  void submit(span<T> tensor);
  template <class T, class A>
  void submit(const std::vector<T, A>& tensor) { submit(span<const T>(tensor)); }

  // Waits until every tensor this rank submitted has reached the aggregator.
  void flush();

  // On the aggregator: the next round, concatenated in member order. A trainer that is also the
  // aggregator submits its own tensor before gathering.
  template <class T>
  gathered<T> gather();

  // On the aggregator: the next round, combined element-wise over members (a member's
  // contribution is its ranks' tensors concatenated; every member's must have the same length).
  // op::avg divides by the number of members.
  template <class T>
  std::vector<T> reduce(op o);

 private:
  struct outgoing {
    std::int64_t header[2] = {0, 0};  // element type, bytes
    std::vector<std::uint8_t> bytes;
    typename B::request header_request, data_request;
  };

  std::string where(const char* what) const { return cat("many_to_one: ", what); }
  void prune();

  ensemble_layout layout_;
  communicator comm_;  // trainers and the aggregator; empty on other ranks
  int root_ = -1;      // the aggregator's rank in comm_
  bool trainer_ = false, aggregator_ = false;
  std::vector<bool> comm_rank_is_trainer_;  // by rank in comm_
  std::vector<int> comm_world_rank_;        // by rank in comm_: the rank in the layout
  std::int64_t submitted_ = 0, collected_ = 0;
  std::deque<std::shared_ptr<completion>> in_flight_;
  std::deque<std::vector<std::uint8_t>> own_;  // the aggregator's own submissions, with their types
  std::deque<std::int64_t> own_types_;
};

// ---------------------------------------------------------------------------------------------

template <class B>
many_to_one<B>::many_to_one(const communicator& world, const ensemble_layout& layout)
    : layout_(detail::placed_for(world, layout, "many_to_one")) {
  layout_.validate(world.size());
  const int me = world.rank();
  trainer_ = layout_.role_of(me).kind == role::trainer;
  aggregator_ = me == layout_.aggregator();
  // Ranks of comm_: the aggregator first when it is a producer, then members in order, each
  // member's ranks in order (world order for round-robin layouts; a per-host placement need not be).
  if (layout_.role_of(layout_.aggregator()).kind != role::trainer) comm_world_rank_.push_back(layout_.aggregator());
  for (int m = 0; m < layout_.members(); ++m)
    for (int r : layout_.member_ranks(m)) comm_world_rank_.push_back(r);
  int key = 0;
  for (std::size_t i = 0; i < comm_world_rank_.size(); ++i) {
    const int r = comm_world_rank_[i];
    if (r == layout_.aggregator()) root_ = static_cast<int>(i);
    if (r == me) key = static_cast<int>(i);
    comm_rank_is_trainer_.push_back(layout_.role_of(r).kind == role::trainer);
  }
  comm_ = world.split(trainer_ || aggregator_ ? 0 : communicator::undefined, key, "collect");
}

template <class B>
many_to_one<B>::~many_to_one() {
  if (std::uncaught_exceptions() > 0) return;  // the engine keeps what is in flight alive
  try {
    flush();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n(while destroying many_to_one)\n", e.what());
  }
}

template <class B>
template <class T>
void many_to_one<B>::submit(span<T> tensor) {
  trace::span traced(trace::names::collect, -1, "step", "collect");
  using E = std::remove_const_t<T>;
  static_assert(is_element_v<E>, "many_to_one::submit: the element type has no flexcomm dtype "
                                 "(use float, double, int32, int64, uint8, half or bfloat16)");
  check(trainer_, where("submit"),
        cat("only trainers submit; this rank is ",
            aggregator_ ? "the aggregator (a producer)" : "a producer", " of layout '", layout_.str(), "'"));
  const auto bytes = tensor.size_bytes();
  check(bytes <= static_cast<std::size_t>(INT32_MAX), where("submit"),
        cat("round ", submitted_, ": ", bytes, " bytes exceed what one round carries (", INT32_MAX, ")"));
  const auto type = static_cast<std::int64_t>(dtype_of<E>);
  ++submitted_;
  if (aggregator_) {  // gather() posts the round; until then the copy waits here
    own_.emplace_back(reinterpret_cast<const std::uint8_t*>(tensor.data()),
                      reinterpret_cast<const std::uint8_t*>(tensor.data()) + bytes);
    own_types_.push_back(type);
    return;
  }
  prune();
  auto out = std::make_shared<outgoing>();
  out->header[0] = type;
  out->header[1] = static_cast<std::int64_t>(bytes);
  out->bytes.assign(reinterpret_cast<const std::uint8_t*>(tensor.data()),
                    reinterpret_cast<const std::uint8_t*>(tensor.data()) + bytes);
  // Header and data of a round are posted together, in round order, so they match the
  // aggregator's calls whenever it makes them.
  out->header_request = B::template igatherv<std::int64_t>(comm_, span<const std::int64_t>(out->header, 2),
                                                           span<std::int64_t>{}, span<const int>{}, root_);
  out->data_request = B::template igatherv<std::uint8_t>(comm_, span<const std::uint8_t>(out->bytes),
                                                         span<std::uint8_t>{}, span<const int>{}, root_);
  in_flight_.push_back(progress_engine::instance().submit(
      [out] { return out->header_request.test() && out->data_request.test(); },
      cat("many_to_one: submit round ", submitted_ - 1, " (", bytes, " bytes) to the aggregator")));
}

template <class B>
void many_to_one<B>::prune() {
  while (!in_flight_.empty() && in_flight_.front()->done()) {
    auto done = std::move(in_flight_.front());
    in_flight_.pop_front();
    done->wait();  // rethrows a failed transfer
  }
}

template <class B>
void many_to_one<B>::flush() {
  while (!in_flight_.empty()) {
    auto next = std::move(in_flight_.front());
    in_flight_.pop_front();
    next->wait();
  }
}

template <class B>
template <class T>
gathered<T> many_to_one<B>::gather() {
  trace::span traced(trace::names::collect, -1, "step", "collect");
  static_assert(is_element_v<T>, "many_to_one::gather<T>: T has no flexcomm dtype "
                                 "(use float, double, int32, int64, uint8, half or bfloat16)");
  const auto round = collected_;
  const std::string what = cat("many_to_one: gather round ", round);
  check(aggregator_, what,
        cat("only the aggregator (rank ", layout_.aggregator(), " of layout '", layout_.str(), "') gathers"));
  check(!trainer_ || !own_.empty(), what,
        "this aggregator is also a trainer and must submit() its own tensor before gather()");
  ++collected_;
  std::vector<std::uint8_t> mine;
  std::int64_t header[2] = {-1, 0};
  if (trainer_) {
    mine = std::move(own_.front());
    own_.pop_front();
    header[0] = own_types_.front();
    header[1] = static_cast<std::int64_t>(mine.size());
    own_types_.pop_front();
  }
  const int ranks = comm_.size();
  std::vector<std::int64_t> headers(2 * static_cast<std::size_t>(ranks));
  const std::vector<int> twos(static_cast<std::size_t>(ranks), 2);
  B::template igatherv<std::int64_t>(comm_, span<const std::int64_t>(header, 2), span<std::int64_t>(headers),
                                     span<const int>(twos), root_)
      .wait();

  // Check everything first, but finish the round before throwing, so the trainers' transfers
  // complete and the next round starts in step on every rank.
  std::string mismatch;
  std::vector<int> counts(static_cast<std::size_t>(ranks));
  std::size_t total = 0;
  for (int r = 0; r < ranks; ++r) {
    const auto type = headers[2 * static_cast<std::size_t>(r)];
    const auto bytes = headers[2 * static_cast<std::size_t>(r) + 1];
    counts[static_cast<std::size_t>(r)] = static_cast<int>(bytes);
    total += static_cast<std::size_t>(bytes);
    if (!comm_rank_is_trainer_[static_cast<std::size_t>(r)]) continue;
    if (type != static_cast<std::int64_t>(dtype_of<T>) && mismatch.empty()) {
      const auto who = layout_.role_of(comm_world_rank_[static_cast<std::size_t>(r)]);
      mismatch = cat("member ", who.member, " rank ", who.rank_in_member, " submitted ",
                     type >= 0 && type <= static_cast<std::int64_t>(dtype::bf16) ? name_of(static_cast<dtype>(type))
                                                                                 : "an unknown type",
                     " but the aggregator gathers ", name_of(dtype_of<T>));
    }
  }
  check(total <= static_cast<std::size_t>(INT32_MAX), what,
        cat("the round carries ", total, " bytes, more than one gather moves (", INT32_MAX, ")"));
  gathered<T> out;
  std::vector<std::uint8_t> scratch;
  span<std::uint8_t> landing;
  if (mismatch.empty()) {
    out.data.resize(total / sizeof(T));
    landing = span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(out.data.data()), total);
  } else {
    scratch.resize(total);
    landing = span<std::uint8_t>(scratch);
  }
  B::template igatherv<std::uint8_t>(comm_, span<const std::uint8_t>(mine), landing, span<const int>(counts), root_)
      .wait();
  check(mismatch.empty(), what, mismatch);

  out.member_sizes = layout_.member_sizes();
  out.member_counts.assign(static_cast<std::size_t>(layout_.members()), 0);
  int member = 0, left = layout_.member_size(0);
  for (int r = 0; r < ranks; ++r) {
    if (!comm_rank_is_trainer_[static_cast<std::size_t>(r)]) continue;
    const auto n = static_cast<std::size_t>(counts[static_cast<std::size_t>(r)]) / sizeof(T);
    out.rank_counts.push_back(n);
    while (left == 0) left = layout_.member_size(++member);
    out.member_counts[static_cast<std::size_t>(member)] += n;
    --left;
  }
  return out;
}

template <class B>
template <class T>
std::vector<T> many_to_one<B>::reduce(op o) {
  const auto round = collected_;
  auto all = gather<T>();
  const auto n = all.member_counts.front();
  for (std::size_t m = 1; m < all.member_counts.size(); ++m)
    check(all.member_counts[m] == n, cat("many_to_one: reduce round ", round),
          cat("member ", m, " submitted ", all.member_counts[m], " elements, member 0 submitted ", n,
              "; reduce needs the same length from every member (gather takes different ones)"));
  std::vector<T> out(all.data.begin(), all.data.begin() + static_cast<std::ptrdiff_t>(n));
  for (int m = 1; m < layout_.members(); ++m) B::combine(o, out.data(), all.member(m).data(), n);
  if (o == op::avg) B::divide(out.data(), n, layout_.members());
  return out;
}

}  // namespace flexcomm
