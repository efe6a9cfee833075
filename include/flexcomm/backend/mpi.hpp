// The MPI backend: host buffers (device buffers too where MPI is CUDA-aware) over MPICH.
// It models the Backend contract that every adapter is written against (see DESIGN.md).
#pragma once

#include <mpi.h>

#include <climits>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../core/datatype.hpp"
#include "../core/error.hpp"
#include "../core/reduce.hpp"
#include "../core/span.hpp"
#include "../core/trace.hpp"
#include "../core/wait.hpp"
#include "../core/watchdog.hpp"
#include "arguments.hpp"
#include "contract.hpp"
#include "mpi_watchdog.hpp"

namespace flexcomm {

namespace detail {
template <class T> struct identity { using type = T; };
template <class T> using identity_t = typename identity<T>::type;

inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return cat("MPI error code ", code);
  return std::string(text, static_cast<std::size_t>(len));
}
}  // namespace detail

// Turns an MPI return code into a flexcomm::error naming the operation.
inline void check_mpi(int code, const std::string& operation) {
  if (code != MPI_SUCCESS) fail(operation, detail::mpi_error_text(code));
}

namespace detail {
inline int mpi_count(std::size_t n, const std::string& operation) {
  check(n <= static_cast<std::size_t>(INT_MAX), operation,
        cat("count ", n, " exceeds what one MPI call carries (", INT_MAX, ")"));
  return static_cast<int>(n);
}

inline MPI_Datatype mpi_type(dtype t) {
  switch (t) {
    case dtype::f32: return MPI_FLOAT;
    case dtype::f64: return MPI_DOUBLE;
    case dtype::i32: return MPI_INT32_T;
    case dtype::i64: return MPI_INT64_T;
    case dtype::u8: return MPI_UINT8_T;
    case dtype::f16: case dtype::bf16: return MPI_UINT16_T;  // reduced by flexcomm's own MPI_Ops
  }
  return MPI_DATATYPE_NULL;
}

// MPI has no 16-bit floats: reductions on them use user-defined operators, made once and
// freed when MPI_Finalize deletes MPI_COMM_SELF's attributes.
template <class T, op O>
void mpi_user_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  combine(O, static_cast<T*>(inout), static_cast<const T*>(in), static_cast<std::size_t>(*len));
}

struct mpi_f16_ops {
  MPI_Op ops[2][4] = {};  // [half, bfloat16][sum, prod, min, max]
};

inline int free_f16_ops(MPI_Comm, int, void* ops, void*) {
  auto* table = static_cast<mpi_f16_ops*>(ops);
  for (auto& row : table->ops)
    for (auto& o : row)
      if (o != MPI_OP_NULL) MPI_Op_free(&o);
  delete table;
  return MPI_SUCCESS;
}

inline mpi_f16_ops& f16_ops() {
  static mpi_f16_ops* table = [] {
    auto* t = new mpi_f16_ops;
    MPI_Op_create(&mpi_user_reduce<half, op::sum>, 1, &t->ops[0][0]);
    MPI_Op_create(&mpi_user_reduce<half, op::prod>, 1, &t->ops[0][1]);
    MPI_Op_create(&mpi_user_reduce<half, op::min>, 1, &t->ops[0][2]);
    MPI_Op_create(&mpi_user_reduce<half, op::max>, 1, &t->ops[0][3]);
    MPI_Op_create(&mpi_user_reduce<bfloat16, op::sum>, 1, &t->ops[1][0]);
    MPI_Op_create(&mpi_user_reduce<bfloat16, op::prod>, 1, &t->ops[1][1]);
    MPI_Op_create(&mpi_user_reduce<bfloat16, op::min>, 1, &t->ops[1][2]);
    MPI_Op_create(&mpi_user_reduce<bfloat16, op::max>, 1, &t->ops[1][3]);
    int key = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &free_f16_ops, &key, nullptr);
    MPI_Comm_set_attr(MPI_COMM_SELF, key, t);
    return t;
  }();
  return *table;
}

inline MPI_Op mpi_op(op o, dtype t) {
  const int index = o == op::avg ? 0 : static_cast<int>(o);  // avg = sum, divided afterwards
  if (t == dtype::f16 || t == dtype::bf16) return f16_ops().ops[t == dtype::f16 ? 0 : 1][index];
  static const MPI_Op native[] = {MPI_SUM, MPI_PROD, MPI_MIN, MPI_MAX};
  return native[index];
}
}  // namespace detail

struct mpi {
  static constexpr memory_space memory = memory_space::host;
  static constexpr bool tag_matched_p2p = true;
  using stream = no_stream;
  // An adapter's own scratch space, in the memory this backend's buffers live in.
  template <class T>
  using buffer = std::vector<T>;
  class communicator;
  class request;

  // Point-to-point. A receive into a buffer smaller than what arrives is an error, never an
  // overrun (MPI truncation is reported, our communicators return errors instead of aborting).
  template <class T>
  static request isend(const communicator& comm, span<T> buf, int dest, int tag, stream = {});
  template <class T>
  static request irecv(const communicator& comm, span<T> buf, int source, int tag, stream = {});

  template <class T>
  static request ibcast(const communicator& comm, span<T> buf, int root, stream = {});
  template <class T>
  static request iallreduce(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                            op o, stream = {});
  template <class T>
  static request iallreduce(const communicator& comm, span<T> buf, op o, stream = {});
  // recv is significant at the root only (and may be empty elsewhere).
  template <class T>
  static request ireduce(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                         op o, int root, stream = {});
  // counts[r] elements from rank r, placed one after the other at the root.
  template <class T>
  static request igatherv(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                          span<const int> counts, int root, stream = {});
  template <class T>
  static request iallgather(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                            stream = {});
  template <class T>
  static request iallgatherv(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                             span<const int> counts, stream = {});
  // Rank r receives counts[r] elements of the reduction of every rank's send buffer.
  template <class T>
  static request ireduce_scatter(const communicator& comm, span<const detail::identity_t<T>> send,
                                 span<T> recv, span<const int> counts, op o, stream = {});

  // Local work adapters need besides communication, done where this backend's buffers live
  // (host loops here; kernels on the stream in device backends).
  template <class T>
  static void combine(op o, T* inout, const T* in, std::size_t n, stream = {}) {
    flexcomm::combine(o, inout, in, n);
  }
  template <class T>
  static void divide(T* buf, std::size_t n, int ranks, stream = {}) {
    flexcomm::divide_by(buf, n, ranks);
  }
  static void copy(void* dst, const void* src, std::size_t bytes, stream = {}) {
    if (bytes) std::memcpy(dst, src, bytes);
  }
};

// Move-only owner of an MPI communicator, with a name for error messages ("member 2").
class mpi::communicator {
 public:
  communicator() = default;

  // Takes ownership of `comm` (freed on destruction); errors return instead of aborting.
  // Collective over `comm`: it also makes the watchdog's side channel (see mpi_watchdog.hpp).
  communicator(MPI_Comm comm, std::string name) : comm_(comm), name_(std::move(name)) {
    if (comm_ != MPI_COMM_NULL) {
      check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), cat(name_, ": set error handler"));
      MPI_Comm_rank(comm_, &rank_);
      MPI_Comm_size(comm_, &size_);
      state_ = std::make_shared<detail::mpi_comm_state>(comm_, name_);
      watchdog::instance().add(state_);
    }
  }

  // A private duplicate of `comm`, so flexcomm's traffic never meets the trainer's own.
  static communicator duplicate(MPI_Comm comm, std::string name) {
    MPI_Comm copy = MPI_COMM_NULL;
    check_mpi(MPI_Comm_dup(comm, &copy), cat(name, ": MPI_Comm_dup"));
    return communicator(copy, std::move(name));
  }

  communicator(communicator&& o) noexcept { swap(o); }
  communicator& operator=(communicator&& o) noexcept {
    communicator(std::move(o)).swap(*this);
    return *this;
  }
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  ~communicator() { release(); }

  explicit operator bool() const noexcept { return comm_ != MPI_COMM_NULL; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  MPI_Comm native() const noexcept { return comm_; }
  const std::string& name() const noexcept { return name_; }

  // Collective over this communicator. A rank passing `undefined` as color takes part in the
  // split but gets an empty communicator back.
  static constexpr int undefined = -1;
  communicator split(int color, int key, std::string name) const {
    MPI_Comm out = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &out),
              cat(name_, ": split into '", name, "'"));
    return communicator(out, std::move(name));
  }

  communicator dup(std::string name) const { return duplicate(comm_, std::move(name)); }

  // Sequence number of the next operation on this communicator, for error reports.
  std::uint64_t next_sequence() noexcept { return state_ ? state_->recorder().reserve() : ++sequence_; }

  // How long a wait on this communicator's operations may take; zero: forever. Unset (or
  // negative), FLEXCOMM_TIMEOUT's default_timeout() applies.
  void set_timeout(std::chrono::milliseconds t) {
    if (state_) state_->limit.set(t);
  }
  std::chrono::milliseconds timeout() const { return state_ ? state_->timeout() : default_timeout(); }

  // The recent operations on this communicator (the watchdog prints them with a timeout).
  const flight_recorder* recorder() const noexcept { return state_ ? &state_->recorder() : nullptr; }

  // True once a timeout or a disagreement between ranks made this communicator unusable.
  bool poisoned() const noexcept { return state_ && state_->poisoned(); }

  // Watchdog bookkeeping shared with this communicator's requests (backend-internal).
  const std::shared_ptr<detail::mpi_comm_state>& watch_state() const noexcept { return state_; }

  // Sequence number of the next collective only: equal on every rank for the same collective
  // (point-to-point traffic differs by rank), so traces can be matched across ranks.
  std::uint64_t next_collective() const noexcept { return ++collectives_; }

  // The world rank of rank `r` of this communicator.
  int world_rank_of(int r) const {
    MPI_Group mine, world;
    MPI_Comm_group(comm_, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    int out = MPI_UNDEFINED;
    MPI_Group_translate_ranks(mine, 1, &r, world, &out);
    MPI_Group_free(&mine);
    MPI_Group_free(&world);
    return out;
  }

 private:
  void swap(communicator& o) noexcept {
    std::swap(comm_, o.comm_);
    std::swap(name_, o.name_);
    std::swap(rank_, o.rank_);
    std::swap(size_, o.size_);
    std::swap(sequence_, o.sequence_);
    std::swap(state_, o.state_);
    std::swap(collectives_, o.collectives_);
  }
  void release() noexcept {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::string name_;
  int rank_ = -1;
  int size_ = 0;
  std::uint64_t sequence_ = 0;
  std::shared_ptr<detail::mpi_comm_state> state_;
  mutable std::uint64_t collectives_ = 0;  // bookkeeping, like sequence_
};

// A nonblocking MPI operation. Waiting goes through a wait policy; completion runs the
// operation's epilogue (the division of avg). Destroying a pending request waits for it,
// because MPI may still write into its buffer; after a timeout (its communicator poisoned) it is
// abandoned instead, and the job must end (see core/watchdog.hpp).
class mpi::request {
 public:
  request() = default;
  request(MPI_Request req, std::string what, std::function<void()> then = {})
      : req_(req), what_(std::move(what)), then_(std::move(then)) {}
  // Backend-internal: an operation recorded as `seq` in its communicator's flight recorder, with
  // the consistency check that rides beside it (if any).
  request(MPI_Request req, std::string what, std::function<void()> then,
          std::shared_ptr<detail::mpi_comm_state> state, std::uint64_t seq,
          std::unique_ptr<detail::mpi_signature_check> check)
      : req_(req), what_(std::move(what)), then_(std::move(then)), state_(std::move(state)), seq_(seq),
        check_(std::move(check)) {}
  request(request&& o) noexcept { swap(o); }
  request& operator=(request&& o) noexcept {
    request(std::move(o)).swap(*this);
    return *this;
  }
  request(const request&) = delete;
  request& operator=(const request&) = delete;
  ~request() {
    if (!pending()) return;
    if (abandon_if_poisoned()) return;
    try {
      wait();
    } catch (const std::exception& e) {
      if (abandon_if_poisoned()) return;
      std::fprintf(stderr, "%s\n(while destroying a pending request; aborting)\n", e.what());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 3);
    }
  }

  bool pending() const noexcept { return req_ != MPI_REQUEST_NULL || (check_ && check_->req != MPI_REQUEST_NULL); }
  const std::string& what() const noexcept { return what_; }

  // Marks this request as collective `kind` on `comm` in the trace: arrival now, end when it
  // completes (on whichever thread sees it complete).
  void trace_collective(const char* kind, const communicator& comm) noexcept {
    trace_.begin(kind, comm.name(), comm.next_collective());
  }

  // True once the operation has finished (and its epilogue has run).
  bool test() {
    if (!pending()) return true;
    if (check_ && check_->req != MPI_REQUEST_NULL) test_check();
    if (req_ != MPI_REQUEST_NULL) {
      int flag = 0;
      // A single-request MPI_Test reports errors (truncation included) in its return code.
      const int rc = MPI_Test(&req_, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        req_ = MPI_REQUEST_NULL;
        // Ranks that disagree on the call explain the failure better than MPI does.
        if (check_ && check_->req != MPI_REQUEST_NULL) {
          const auto deadline = std::chrono::steady_clock::now() + watchdog::grace(timeout_of(inherit));
          while (check_->req != MPI_REQUEST_NULL && std::chrono::steady_clock::now() < deadline) {
            test_check();
            std::this_thread::yield();
          }
        }
        record(op_state::failed);
        trace_.end();
        fail(what_, detail::mpi_error_text(rc));
      }
      if (!flag) return false;
    }
    if (check_ && check_->req != MPI_REQUEST_NULL) return false;
    record(op_state::completed);
    trace_.end();
    if (then_) std::exchange(then_, {})();
    return true;
  }

  // Waits under the policy; past `timeout` (the communicator's, else FLEXCOMM_TIMEOUT) it is a
  // flexcomm::error that names the ranks that did not arrive (see core/watchdog.hpp).
  void wait(const wait_policy& policy = default_wait(), std::chrono::milliseconds timeout = inherit) {
    const auto limit = timeout_of(timeout);
    auto answer = [&] {
      if (state_) state_->answer_queries();
    };
    if (!wait_answering(policy, limit, [&] { return test() || poisoned(); }, answer)) timed_out(limit);
    if (pending() && poisoned())
      fail(what_, cat("communicator '", state_->name(), "' is unusable: ", state_->poison_reason()));
  }

  // wait()'s default: the communicator's own timeout, else FLEXCOMM_TIMEOUT.
  static constexpr std::chrono::milliseconds inherit = inherit_timeout;

 private:
  std::chrono::milliseconds timeout_of(std::chrono::milliseconds t) const {
    return state_ ? state_->limit.for_wait(t) : (t.count() >= 0 ? t : default_timeout());
  }
  bool poisoned() const noexcept { return state_ && state_->poisoned(); }

  void record(op_state s) noexcept {
    if (state_ && seq_) state_->recorder().finish(seq_, s);
    if (s != op_state::in_flight) seq_ = 0;
  }

  void test_check() {
    int flag = 0;
    if (MPI_Test(&check_->req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
      check_->req = MPI_REQUEST_NULL;  // no side channel: no check
      return;
    }
    if (!flag || check_->agreed()) return;
    const auto seq = seq_;
    record(op_state::failed);
    std::string detail = state_->disagreement(check_->mine, watchdog::grace(timeout_of(inherit)));
    state_->poison(cat("ranks disagreed on #", seq, " (", what_, ")"));
    fail(what_, cat(detail, " (FLEXCOMM_CHECK)"));
  }

  [[noreturn]] void timed_out(std::chrono::milliseconds limit) {
    const auto seq = seq_;
    if (state_ && seq_) state_->recorder().finish(seq_, op_state::timed_out);
    const std::string report = watchdog::instance().timed_out(state_.get(), seq, limit);
    if (state_) state_->poison(cat("operation #", seq, " timed out (", what_, ")"));
    fail(what_, cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT)\n", report));
  }

  bool abandon_if_poisoned() noexcept {
    if (!poisoned() && !watchdog::instance().job_must_end()) return false;
    // MPI may still write into the buffers: keep the handles alive; the job ends (environment).
    if (state_ && seq_) state_->recorder().finish(seq_, op_state::abandoned);
    seq_ = 0;
    req_ = MPI_REQUEST_NULL;
    if (check_) static_cast<void>(check_.release());
    watchdog::instance().abandon();
    return true;
  }

  void swap(request& o) noexcept {
    std::swap(req_, o.req_);
    std::swap(what_, o.what_);
    std::swap(then_, o.then_);
    std::swap(state_, o.state_);
    std::swap(seq_, o.seq_);
    std::swap(check_, o.check_);
    trace_.swap(o.trace_);
  }

  MPI_Request req_ = MPI_REQUEST_NULL;
  std::string what_;
  std::function<void()> then_;
  std::shared_ptr<detail::mpi_comm_state> state_;
  std::uint64_t seq_ = 0;
  std::unique_ptr<detail::mpi_signature_check> check_;
  trace::collective_mark trace_;
};

// Waits for every request in turn (each under the policy and timeout).
template <class Requests>
void wait_all(Requests& requests, const wait_policy& policy = default_wait()) {
  for (auto& r : requests) r.wait(policy);
}

namespace detail {
inline mpi::request traced(mpi::request r, const char* kind, const mpi::communicator& comm) {
  r.trace_collective(kind, comm);
  return r;
}

inline mpi::communicator& mutable_comm(const mpi::communicator& c) {
  // Sequence numbers are bookkeeping, not state the caller sees as a change.
  return const_cast<mpi::communicator&>(c);
}

// One operation being posted: recorded in the flight recorder at once (so that a failure while
// posting is recorded too), its consistency check posted just before the MPI call, and both
// handed to the request.
class mpi_op_start {
 public:
  mpi_op_start(const mpi::communicator& comm, const char* name, std::size_t count, dtype type,
               const char* redop = "", int peer = -1, int tag = -1, const std::string& extra = "")
      : state_(comm.watch_state()) {
    if (state_) {
      check(!state_->poisoned(), cat("mpi ", name, " on ", comm.name()),
            cat("communicator '", comm.name(), "' is unusable: ", state_->poison_reason()));
      seq_ = state_->recorder().enqueue(op_record::posting(name, count, type, redop, peer, tag));
    } else {
      seq_ = mutable_comm(comm).next_sequence();
    }
    what = describe_operation("mpi", name, comm.name(), seq_, count, type, extra);
    signature_.value = {mpi_op_code(name), static_cast<long long>(type), static_cast<long long>(count), -1, -1, 0,
                        check_label::current()};
  }
  mpi_op_start(const mpi_op_start&) = delete;
  mpi_op_start& operator=(const mpi_op_start&) = delete;
  ~mpi_op_start() {
    if (state_ && seq_) state_->recorder().finish(seq_, op_state::failed);  // never reached MPI
    if (check_ && check_->req != MPI_REQUEST_NULL) {
      // The check went out but the operation did not: the peers' matching is now off.
      static_cast<void>(check_.release());
      state_->poison(cat("posting ", what, " failed after its consistency check went out"));
    }
  }

  std::string what;

  // Fields every rank must agree on, besides the operation, type and count.
  void agree_on(op o) { signature_.value[mpi_signature::redop] = static_cast<long long>(o); }
  void agree_on_root(int root) { signature_.value[mpi_signature::root] = root; }
  void agree_on_counts(span<const int> counts) {
    signature_.value[mpi_signature::counts_hash] = hash_counts(counts.data(), counts.size());
  }
  void count_varies() { signature_.value[mpi_signature::count] = -1; }

  // Posts the consistency check (FLEXCOMM_CHECK) for a collective, just before the MPI call.
  void check_collective(int comm_size) {
    if (!state_ || comm_size < 2 || state_->side() == MPI_COMM_NULL || !checks_enabled()) return;
    check_ = std::make_unique<mpi_signature_check>();
    check_->mine = signature_;
    if (!check_->post(state_->side())) check_.reset();
  }

  mpi::request finish(MPI_Request r, std::function<void()> then = {}) {
    return mpi::request(r, std::move(what), std::move(then), state_, std::exchange(seq_, 0), std::move(check_));
  }

 private:
  std::shared_ptr<mpi_comm_state> state_;
  std::uint64_t seq_ = 0;
  mpi_signature signature_;
  std::unique_ptr<mpi_signature_check> check_;
};

template <class T>
std::function<void()> average_epilogue(op o, span<T> out, int ranks) {
  if (o != op::avg || out.empty()) return {};
  return [out, ranks] { divide_by(out.data(), out.size(), ranks); };
}
}  // namespace detail

template <class T>
mpi::request mpi::isend(const communicator& comm, span<T> buf, int dest, int tag, stream) {
  using E = std::remove_const_t<T>;
  detail::mpi_op_start start(comm, "isend", buf.size(), dtype_of<E>, "", dest, tag, cat(", to ", dest, ", tag ", tag));
  detail::check_rank_of(dest, comm.size(), "peer", start.what);
  MPI_Request r;
  check_mpi(MPI_Isend(buf.data(), detail::mpi_count(buf.size(), start.what), detail::mpi_type(dtype_of<E>), dest,
                      tag, comm.native(), &r),
            start.what);
  return start.finish(r);
}

template <class T>
mpi::request mpi::irecv(const communicator& comm, span<T> buf, int source, int tag, stream) {
  static_assert(!std::is_const_v<T>, "irecv writes into its buffer");
  detail::mpi_op_start start(comm, "irecv", buf.size(), dtype_of<T>, "", source, tag,
                             cat(", from ", source, ", tag ", tag));
  detail::check_rank_of(source, comm.size(), "peer", start.what);
  MPI_Request r;
  check_mpi(MPI_Irecv(buf.data(), detail::mpi_count(buf.size(), start.what), detail::mpi_type(dtype_of<T>), source,
                      tag, comm.native(), &r),
            start.what);
  return start.finish(r);
}

template <class T>
mpi::request mpi::ibcast(const communicator& comm, span<T> buf, int root, stream) {
  detail::mpi_op_start start(comm, "ibcast", buf.size(), dtype_of<T>, "", root, -1, cat(", root ", root));
  const auto& what = start.what;
  detail::check_rank_of(root, comm.size(), "root", what);
  start.agree_on_root(root);
  const int n = detail::mpi_count(buf.size(), what);
  start.check_collective(comm.size());
  MPI_Request r;
  check_mpi(MPI_Ibcast(buf.data(), n, detail::mpi_type(dtype_of<T>), root, comm.native(), &r), what);
  return detail::traced(start.finish(r), "ibcast", comm);
}

template <class T>
mpi::request mpi::iallreduce(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                             op o, stream) {
  detail::mpi_op_start start(comm, "iallreduce", recv.size(), dtype_of<T>, name_of(o), -1, -1, cat(", ", name_of(o)));
  const auto& what = start.what;
  detail::check_same_size(send.size(), recv.size(), what);
  start.agree_on(o);
  const int n = detail::mpi_count(recv.size(), what);
  start.check_collective(comm.size());
  MPI_Request r;
  check_mpi(MPI_Iallreduce(send.data() == recv.data() ? MPI_IN_PLACE : send.data(), recv.data(), n,
                           detail::mpi_type(dtype_of<T>), detail::mpi_op(o, dtype_of<T>), comm.native(), &r),
            what);
  return detail::traced(start.finish(r, detail::average_epilogue(o, recv, comm.size())), "iallreduce", comm);
}

template <class T>
mpi::request mpi::iallreduce(const communicator& comm, span<T> buf, op o, stream s) {
  return iallreduce<T>(comm, span<const T>(buf), buf, o, s);
}

template <class T>
mpi::request mpi::ireduce(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv, op o,
                          int root, stream) {
  detail::mpi_op_start start(comm, "ireduce", send.size(), dtype_of<T>, name_of(o), root, -1,
                             cat(", ", name_of(o), ", root ", root));
  const auto& what = start.what;
  detail::check_rank_of(root, comm.size(), "root", what);
  const bool at_root = comm.rank() == root;
  detail::check_root_receive(at_root, send.size(), recv.size(), what);
  start.agree_on(o);
  start.agree_on_root(root);
  const int n = detail::mpi_count(send.size(), what);
  start.check_collective(comm.size());
  MPI_Request r;
  const void* sendbuf = at_root && send.data() == recv.data() ? MPI_IN_PLACE : send.data();
  check_mpi(MPI_Ireduce(sendbuf, at_root ? recv.data() : nullptr, n, detail::mpi_type(dtype_of<T>),
                        detail::mpi_op(o, dtype_of<T>), root, comm.native(), &r),
            what);
  auto then = at_root ? detail::average_epilogue(o, recv, comm.size()) : std::function<void()>{};
  return detail::traced(start.finish(r, std::move(then)), "ireduce", comm);
}

template <class T>
mpi::request mpi::igatherv(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                           span<const int> counts, int root, stream) {
  detail::mpi_op_start start(comm, "igatherv", send.size(), dtype_of<T>, "", root, -1, cat(", root ", root));
  const auto& what = start.what;
  detail::check_rank_of(root, comm.size(), "root", what);
  std::vector<int> displs;
  if (comm.rank() == root)
    displs = detail::gather_layout(counts, comm.size(), root, send.size(), recv.size(), what).offsets;
  start.count_varies();
  start.agree_on_root(root);
  const int n = detail::mpi_count(send.size(), what);
  start.check_collective(comm.size());
  MPI_Request r;
  const auto type = detail::mpi_type(dtype_of<T>);
  check_mpi(MPI_Igatherv(send.data(), n, type, comm.rank() == root ? recv.data() : nullptr,
                         comm.rank() == root ? counts.data() : nullptr, displs.empty() ? nullptr : displs.data(),
                         type, root, comm.native(), &r),
            what);
  // MPI reads displs when the operation starts, but MPICH may keep the pointer: hold it.
  auto keep = std::make_shared<std::vector<int>>(std::move(displs));
  return detail::traced(start.finish(r, [keep] {}), "igatherv", comm);
}

template <class T>
mpi::request mpi::iallgather(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                             stream) {
  detail::mpi_op_start start(comm, "iallgather", send.size(), dtype_of<T>);
  const auto& what = start.what;
  detail::check_allgather_sizes(send.size(), recv.size(), comm.size(), what);
  const auto type = detail::mpi_type(dtype_of<T>);
  const int n = detail::mpi_count(send.size(), what);
  start.check_collective(comm.size());
  MPI_Request r;
  check_mpi(MPI_Iallgather(send.data(), n, type, recv.data(), n, type, comm.native(), &r), what);
  return detail::traced(start.finish(r), "iallgather", comm);
}

template <class T>
mpi::request mpi::iallgatherv(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                              span<const int> counts, stream) {
  detail::mpi_op_start start(comm, "iallgatherv", send.size(), dtype_of<T>);
  const auto& what = start.what;
  auto displs = std::make_shared<std::vector<int>>(
      detail::allgatherv_layout(counts, comm.size(), comm.rank(), send.size(), recv.size(), what).offsets);
  start.count_varies();
  start.agree_on_counts(counts);
  const int n = detail::mpi_count(send.size(), what);
  start.check_collective(comm.size());
  MPI_Request r;
  const auto type = detail::mpi_type(dtype_of<T>);
  check_mpi(MPI_Iallgatherv(send.data(), n, type, recv.data(), counts.data(), displs->data(), type, comm.native(), &r),
            what);
  return detail::traced(start.finish(r, [displs] {}), "iallgatherv", comm);
}

template <class T>
mpi::request mpi::ireduce_scatter(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                                  span<const int> counts, op o, stream) {
  detail::mpi_op_start start(comm, "ireduce_scatter", send.size(), dtype_of<T>, name_of(o), -1, -1,
                             cat(", ", name_of(o)));
  const auto& what = start.what;
  const auto mine = detail::reduce_scatter_share(counts, comm.size(), comm.rank(), send.size(), recv.size(), what);
  start.agree_on(o);
  start.agree_on_counts(counts);
  start.check_collective(comm.size());
  MPI_Request r;
  check_mpi(MPI_Ireduce_scatter(send.data(), recv.data(), counts.data(), detail::mpi_type(dtype_of<T>),
                                detail::mpi_op(o, dtype_of<T>), comm.native(), &r),
            what);
  auto then = detail::average_epilogue(o, recv.subspan(0, mine), comm.size());
  return detail::traced(start.finish(r, std::move(then)), "ireduce_scatter", comm);
}

}  // namespace flexcomm
