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
// The aggregator may take rounds as they come while it trains or produces (poll_rounds, never
// waiting), or all of them up to the end round that trainers send with close() (gather_rounds):
// one round per epoch, say, scored while the next epoch trains.
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

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/layout.hpp"
#include "../../core/progress.hpp"
#include "../../core/reduce.hpp"
#include "../../core/span.hpp"
#include "../../backend/contract.hpp"

namespace flexcomm {

// What the aggregator receives in one round of gather(), gather_rounds() or poll_rounds(). It
// owns its data: member() and trainer() of a non-const gathered are mutable spans, which a
// framework can wrap without a cast (torch::from_blob(each.member(m).data(), ...)).
template <class T>
struct gathered {
  std::vector<T> data;                      // every trainer's tensor, member by member, rank by rank
  std::vector<std::size_t> rank_counts;     // elements from each trainer, in the same order
  std::vector<std::size_t> member_counts;   // elements from each member (its ranks together)
  std::vector<int> member_sizes;            // ranks per member, to index rank_counts

  // A member's contribution: its ranks' tensors concatenated.
  span<const T> member(int m) const { return {data.data() + member_offset(m), member_counts[static_cast<std::size_t>(m)]}; }
  span<T> member(int m) { return {data.data() + member_offset(m), member_counts[static_cast<std::size_t>(m)]}; }

  // What rank r of member m submitted.
  span<const T> trainer(int m, int r) const {
    const std::size_t i = trainer_index(m, r);
    return {data.data() + trainer_offset(i), rank_counts[i]};
  }
  span<T> trainer(int m, int r) {
    const std::size_t i = trainer_index(m, r);
    return {data.data() + trainer_offset(i), rank_counts[i]};
  }

 private:
  std::size_t member_offset(int m) const {
    check(m >= 0 && static_cast<std::size_t>(m) < member_counts.size(), "many_to_one: gathered",
          cat("member ", m, " is not one of ", member_counts.size()));
    std::size_t offset = 0;
    for (int i = 0; i < m; ++i) offset += member_counts[static_cast<std::size_t>(i)];
    return offset;
  }
  std::size_t trainer_index(int m, int r) const {
    check(m >= 0 && static_cast<std::size_t>(m) < member_sizes.size() && r >= 0 &&
              r < member_sizes[static_cast<std::size_t>(m)],
          "many_to_one: gathered", cat("member ", m, " rank ", r, " is not a trainer of this layout"));
    std::size_t index = 0;
    for (int i = 0; i < m; ++i) index += static_cast<std::size_t>(member_sizes[static_cast<std::size_t>(i)]);
    return index + static_cast<std::size_t>(r);
  }
  std::size_t trainer_offset(std::size_t index) const {
    std::size_t offset = 0;
    for (std::size_t i = 0; i < index; ++i) offset += rank_counts[i];
    return offset;
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

  // On trainers: no round follows. Sends the end round (a round without data that every trainer
  // submits last), after which the aggregator's gather_rounds() returns and poll_rounds() says so.
  void close();
  // This trainer has closed; on the aggregator, the end round has arrived.
  bool closed() const noexcept { return closed_; }
  bool finished() const noexcept { return finished_; }

  // On the aggregator: the next round, concatenated in member order. A trainer that is also the
  // aggregator submits its own tensor before gathering.
  template <class T>
  gathered<T> gather();

  // On the aggregator, while it does other work (trains, produces): completes what has arrived of
  // the rounds in flight without waiting, calls each(round, gathered<T>&) for every round that
  // completes, in order, and returns true once the end round has arrived (every trainer closed).
  // A trainer that aggregates takes part with each round it has submitted.
  template <class T, class F>
  bool poll_rounds(F&& each);
  // On the aggregator: each(round, gathered<T>&) for every round up to the end round, waiting.
  template <class T, class F>
  void gather_rounds(F&& each);
  // On the aggregator: waits for the end round; a round with data still before it is an error
  // naming it as never gathered.
  void finish();

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

  // The aggregator's round in flight: its header gather, then its data gather.
  struct incoming {
    std::int64_t header[2] = {-1, 0};
    std::vector<std::int64_t> headers;
    std::vector<int> twos, counts;
    std::vector<std::uint8_t> mine, scratch;
    std::shared_ptr<void> result;  // gathered<T> of the type that posted the data
    dtype type = dtype::f32;
    bool data_posted = false, end = false;
    std::string mismatch;
    typename B::request header_request, data_request;
  };
  enum class arrival { none, round, end };
  // Takes the round in flight as far as it can (all the way with `wait`); fills `out` when a
  // round with data completes.
  template <class T>
  arrival advance(bool wait, gathered<T>& out);
  // advance's parts: posts the header gather of the next round (false: this aggregator, a
  // trainer too, has not submitted its own yet); reads the headers and posts the data gather;
  // checks the headers (the round's bytes); counts what each rank and member sent.
  bool start_round(bool wait, const std::string& what);
  template <class T>
  void post_data(incoming& r, std::int64_t round, const std::string& what);
  template <class T>
  std::size_t read_headers(incoming& r, std::int64_t round);
  template <class T>
  void count_ranks(const incoming& done, gathered<T>& out) const;
  template <class T, class F>
  bool take_rounds(bool wait, F& each);

  static constexpr std::int64_t end_type = -2;  // the header type of the end round
  std::string where(const char* what) const { return cat("many_to_one: ", what); }
  void post(std::int64_t type, const std::uint8_t* data, std::size_t bytes);
  void prune();

  ensemble_layout layout_;
  communicator comm_;  // trainers and the aggregator; empty on other ranks
  int root_ = -1;      // the aggregator's rank in comm_
  bool trainer_ = false, aggregator_ = false;
  std::vector<bool> comm_rank_is_trainer_;  // by rank in comm_
  std::vector<int> comm_world_rank_;        // by rank in comm_: the rank in the layout
  std::int64_t submitted_ = 0, collected_ = 0;
  bool closed_ = false, finished_ = false;
  bool any_type_ = false;  // finish(): the round is only looked at, whatever it carries
  std::unique_ptr<incoming> in_;
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
  check(!closed_, where("submit"), cat("round ", submitted_, ": this trainer has closed the stream (close())"));
  post(static_cast<std::int64_t>(dtype_of<E>), reinterpret_cast<const std::uint8_t*>(tensor.data()),
       tensor.size_bytes());
}

template <class B>
void many_to_one<B>::close() {
  check(!closed_, where("close"), "close() once per collect");
  post(end_type, nullptr, 0);
  closed_ = true;
}

template <class B>
void many_to_one<B>::post(std::int64_t type, const std::uint8_t* data, std::size_t bytes) {
  const char* what = type == end_type ? "close" : "submit";
  check(trainer_, where(what),
        cat("only trainers ", what, "; this rank is ",
            aggregator_ ? "the aggregator (a producer)" : "a producer", " of layout '", layout_.str(), "'"));
  check(bytes <= static_cast<std::size_t>(INT32_MAX), where(what),
        cat("round ", submitted_, ": ", bytes, " bytes exceed what one round carries (", INT32_MAX, ")"));
  ++submitted_;
  if (aggregator_) {  // the aggregator's round posts it; until then the copy waits here
    own_.emplace_back(data, data + bytes);
    own_types_.push_back(type);
    return;
  }
  prune();
  auto out = std::make_shared<outgoing>();
  out->header[0] = type;
  out->header[1] = static_cast<std::int64_t>(bytes);
  out->bytes.assign(data, data + bytes);
  // Header and data of a round are posted together, in round order, so they match the
  // aggregator's calls whenever it makes them.
  out->header_request = B::template igatherv<std::int64_t>(comm_, span<const std::int64_t>(out->header, 2),
                                                           span<std::int64_t>{}, span<const int>{}, root_);
  out->data_request = B::template igatherv<std::uint8_t>(comm_, span<const std::uint8_t>(out->bytes),
                                                         span<std::uint8_t>{}, span<const int>{}, root_);
  in_flight_.push_back(progress_engine::instance().submit(
      [out] { return out->header_request.test() && out->data_request.test(); },
      cat("many_to_one: ", what, " round ", submitted_ - 1, " (", bytes, " bytes) to the aggregator")));
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
  const std::string what = cat("many_to_one: gather round ", collected_);
  gathered<T> out;
  if (advance<T>(true, out) == arrival::end)
    fail(what, "every trainer has closed the stream (close()): no round is left to gather");
  return out;
}

template <class B>
template <class T, class F>
bool many_to_one<B>::poll_rounds(F&& each) {
  return take_rounds<T>(false, each);
}

// Hands every round that arrives to `each` until the end round; without `wait`, stops (false)
// at the first round not there yet.
template <class B>
template <class T, class F>
bool many_to_one<B>::take_rounds(bool wait, F& each) {
  while (!finished_) {
    const std::int64_t round = collected_;
    gathered<T> out;
    const arrival a = advance<T>(wait, out);
    if (a == arrival::none) return false;
    if (a == arrival::round) each(round, out);
  }
  return true;
}

template <class B>
void many_to_one<B>::finish() {
  if (finished_) return;
  const std::int64_t first = collected_;
  const std::string what = cat("many_to_one: finish at round ", first);
  // Rounds nobody gathered are taken all the same, up to the end round, so that the trainers'
  // transfers complete; then the error names them.
  any_type_ = true;
  try {
    gathered<std::uint8_t> out;
    while (advance<std::uint8_t>(true, out) != arrival::end) {
    }
  } catch (...) {
    any_type_ = false;
    throw;
  }
  any_type_ = false;
  const std::int64_t left = collected_ - 1 - first;
  check(left == 0, what,
        cat("the trainers submitted ", left, left == 1 ? " round" : " rounds", " (", first, "..", collected_ - 2,
            ") that the aggregator never gathered: gather every round, or collect them with gather_rounds / "
            "poll_rounds"));
}

template <class B>
template <class T, class F>
void many_to_one<B>::gather_rounds(F&& each) {
  take_rounds<T>(true, each);
}

template <class B>
template <class T>
typename many_to_one<B>::arrival many_to_one<B>::advance(bool wait, gathered<T>& out) {
  static_assert(is_element_v<T>, "many_to_one::gather<T>: T has no flexcomm dtype "
                                 "(use float, double, int32, int64, uint8, half or bfloat16)");
  const auto round = collected_;
  const std::string what = cat("many_to_one: gather round ", round);
  check(aggregator_, what,
        cat("only the aggregator (rank ", layout_.aggregator(), " of layout '", layout_.str(), "') gathers"));
  check(!finished_, what, "every trainer has closed the stream (close()): no round is left to gather");
  if (!in_ && !start_round(wait, what)) return arrival::none;
  incoming& r = *in_;
  if (!r.data_posted) {
    if (wait) {
      r.header_request.wait();
    } else if (!r.header_request.test()) {
      return arrival::none;
    }
    post_data<T>(r, round, what);
  }
  if (wait) {
    r.data_request.wait();
  } else if (!r.data_request.test()) {
    return arrival::none;
  }
  const std::unique_ptr<incoming> done = std::move(in_);
  ++collected_;
  if (done->end) {
    finished_ = true;
    return arrival::end;
  }
  check(done->mismatch.empty(), what, done->mismatch);
  if (any_type_) return arrival::round;
  check(done->type == dtype_of<T>, what,
        cat("the round's data was received as ", name_of(done->type), " and is now asked for as ",
            name_of(dtype_of<T>)));
  out = std::move(*std::static_pointer_cast<gathered<T>>(done->result));
  count_ranks(*done, out);
  return arrival::round;
}

template <class B>
bool many_to_one<B>::start_round(bool wait, const std::string& what) {
  if (trainer_ && own_.empty()) {
    check(!wait, what, "this aggregator is also a trainer and must submit() its own tensor before gather()");
    return false;
  }
  const int ranks = comm_.size();
  auto r = std::make_unique<incoming>();
  if (trainer_) {
    r->mine = std::move(own_.front());
    own_.pop_front();
    r->header[0] = own_types_.front();
    r->header[1] = static_cast<std::int64_t>(r->mine.size());
    own_types_.pop_front();
  }
  r->headers.resize(2 * static_cast<std::size_t>(ranks));
  r->twos.assign(static_cast<std::size_t>(ranks), 2);
  r->header_request = B::template igatherv<std::int64_t>(comm_, span<const std::int64_t>(r->header, 2),
                                                         span<std::int64_t>(r->headers),
                                                         span<const int>(r->twos), root_);
  in_ = std::move(r);
  return true;
}

template <class B>
template <class T>
void many_to_one<B>::post_data(incoming& r, std::int64_t round, const std::string& what) {
  const std::size_t total = read_headers<T>(r, round);
  check(total <= static_cast<std::size_t>(INT32_MAX), what,
        cat("the round carries ", total, " bytes, more than one gather moves (", INT32_MAX, ")"));
  span<std::uint8_t> landing;
  if (r.mismatch.empty() && !r.end && !any_type_) {
    auto g = std::make_shared<gathered<T>>();
    g->data.resize(total / sizeof(T));
    landing = span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(g->data.data()), total);
    r.result = g;
    r.type = dtype_of<T>;
  } else {
    r.scratch.resize(total);
    landing = span<std::uint8_t>(r.scratch);
  }
  r.data_request = B::template igatherv<std::uint8_t>(comm_, span<const std::uint8_t>(r.mine), landing,
                                                      span<const int>(r.counts), root_);
  r.data_posted = true;
}

// Check everything first, but finish the round before throwing, so the trainers' transfers
// complete and the next round starts in step on every rank: a problem goes into r.mismatch.
template <class B>
template <class T>
std::size_t many_to_one<B>::read_headers(incoming& r, std::int64_t round) {
  const int ranks = comm_.size();
  r.counts.assign(static_cast<std::size_t>(ranks), 0);
  std::size_t total = 0;
  int closing = 0, trainers = 0, first_closed = -1, first_open = -1;
  for (int i = 0; i < ranks; ++i) {
    const auto type = r.headers[2 * static_cast<std::size_t>(i)];
    const auto bytes = r.headers[2 * static_cast<std::size_t>(i) + 1];
    r.counts[static_cast<std::size_t>(i)] = static_cast<int>(bytes);
    total += static_cast<std::size_t>(bytes);
    if (!comm_rank_is_trainer_[static_cast<std::size_t>(i)]) continue;
    ++trainers;
    if (type == end_type) {
      ++closing;
      if (first_closed < 0) first_closed = i;
      continue;
    }
    if (first_open < 0) first_open = i;
    if (!any_type_ && type != static_cast<std::int64_t>(dtype_of<T>) && r.mismatch.empty()) {
      const auto who = layout_.role_of(comm_world_rank_[static_cast<std::size_t>(i)]);
      r.mismatch = cat("member ", who.member, " rank ", who.rank_in_member, " submitted ",
                       type >= 0 && type <= static_cast<std::int64_t>(dtype::bf16) ? name_of(static_cast<dtype>(type))
                                                                                   : "an unknown type",
                       " but the aggregator gathers ", name_of(dtype_of<T>));
    }
  }
  r.end = closing == trainers;
  if (closing > 0 && !r.end) {
    const auto shut = layout_.role_of(comm_world_rank_[static_cast<std::size_t>(first_closed)]);
    const auto open = layout_.role_of(comm_world_rank_[static_cast<std::size_t>(first_open)]);
    r.mismatch = cat("member ", shut.member, " rank ", shut.rank_in_member, " closed the stream after ", round,
                     " rounds while member ", open.member, " rank ", open.rank_in_member,
                     " submitted another: every trainer submits the same number of rounds");
  }
  return total;
}

template <class B>
template <class T>
void many_to_one<B>::count_ranks(const incoming& done, gathered<T>& out) const {
  out.member_sizes = layout_.member_sizes();
  out.member_counts.assign(static_cast<std::size_t>(layout_.members()), 0);
  int member = 0, left = layout_.member_size(0);
  for (int i = 0; i < comm_.size(); ++i) {
    if (!comm_rank_is_trainer_[static_cast<std::size_t>(i)]) continue;
    const auto n = static_cast<std::size_t>(done.counts[static_cast<std::size_t>(i)]) / sizeof(T);
    out.rank_counts.push_back(n);
    while (left == 0) left = layout_.member_size(++member);
    out.member_counts[static_cast<std::size_t>(member)] += n;
    --left;
  }
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
