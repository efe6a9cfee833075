// The consistency check (FLEXCOMM_CHECK) of a communicator whose collectives are too cheap to
// carry one each (nccl): no round per operation. Each rank keeps its collectives' signatures and
// sends them in batches to the next rank of a ring, on the watchdog's side channel; each compares
// what the previous rank sent with its own, by collective number. A batch leaves when it is full,
// or when a wait on the communicator has been stuck for `stuck_after` with signatures unsent, so a
// mismatch that hangs is named within a few milliseconds, one that completes within a batch.
// Every rank agrees with its neighbour, so all agree. A rank that finds a difference sends its
// verdict round the ring, so every rank names it. Used under its owner's lock.
//
// Every message starts with the check's id, agreed by its ranks when it opens and above any id
// this process used before. A check closes with messages of its left rank unreceived (a batch
// it had no receive posted for, the verdict coming back round the ring to the rank that found
// it); MPI keeps them, and once the side channel is freed it may give its context to a later
// communicator's, whose check would take them as its own (issue 52). They name an older id there
// and are dropped.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "../../core/error.hpp"
#include "setup.hpp"
#include "watchdog.hpp"

namespace flexcomm::detail {

class batched_check {
 public:
  static constexpr int batch = 16;                       // signatures per message
  static constexpr std::uint64_t kept = 64;              // own signatures kept to compare with
  static constexpr int entry = 1 + mpi_signature::fields;  // collective number, then the signature
  static constexpr int header = 1;                          // the check's id, before the entries
  static constexpr int tag = 3;  // the side channel's: announce 1, signature 2, failure reports 4
  static constexpr std::chrono::milliseconds stuck_after{1};

  batched_check() = default;
  batched_check(const batched_check&) = delete;
  batched_check& operator=(const batched_check&) = delete;
  ~batched_check() { close(); }

  // When the communicator `what` is made, by all its ranks: they agree on the id (one small
  // allreduce, a setup collective: a rank that never comes fails it by name). Without a side
  // channel, or alone, nothing is checked.
  void open(MPI_Comm side, const std::string& what) {
    int rank = 0, size = 1;
    if (side == MPI_COMM_NULL || MPI_Comm_rank(side, &rank) != MPI_SUCCESS ||
        MPI_Comm_size(side, &size) != MPI_SUCCESS || size < 2 || !agree_on_id(side, what))
      return;
    side_ = side;
    rank_ = rank;
    right_ = (rank + 1) % size;
    left_ = (rank + size - 1) % size;
    wire_ = std::make_unique<buffers>();
    receive();
  }
  bool active() const noexcept { return wire_ != nullptr; }

  // Collective number `n` (counted alike on every rank) has signature `sig`.
  void add(std::uint64_t n, const mpi_signature& sig) {
    if (!wire_) return;
    auto& mine = wire_->mine[n % kept];
    mine.n = n;
    last_ = n;
    mine.sig = sig;
    if (filled_ == 0) oldest_unsent_ = std::chrono::steady_clock::now();
    long long* e = wire_->out[current_].data() + header + filled_ * entry;
    e[0] = static_cast<long long>(n);
    for (int i = 0; i < mpi_signature::fields; ++i) e[1 + i] = sig.value[static_cast<std::size_t>(i)];
    if (++filled_ == batch) send();
  }

  // From a test: compares what arrived; sends what is unsent once a wait is stuck. A
  // disagreement, found here or by a post, comes back as its description ("" when none).
  const std::string& poll(bool stuck) {
    if (!wire_) return verdict_;
    if (stuck && filled_ > 0 && std::chrono::steady_clock::now() - oldest_unsent_ >= stuck_after) send();
    compare();
    return verdict_;
  }

 private:
  struct own {
    std::uint64_t n = 0;
    mpi_signature sig;
  };
  // A verdict on the wire: the marker, the collective, the two ranks and their signatures.
  static constexpr int verdict_size = 4 + 2 * mpi_signature::fields;
  struct buffers {
    std::array<own, kept> mine{};
    std::array<std::array<long long, header + batch * entry>, 2> out{};
    std::array<long long, header + batch * entry> in{};
    std::array<long long, header + verdict_size> verdict{};
  };

  // Ids are handed out in order in this process; the ranks take the highest one, so that every
  // rank's later checks get higher ones, whatever communicators each rank made in between.
  static std::atomic<long long>& last_id() noexcept {
    static std::atomic<long long> last{0};
    return last;
  }
  bool agree_on_id(MPI_Comm side, const std::string& what) {
    // This rank's next id, then the agreed one; left to MPI if the wait fails (it may still write).
    auto ids = std::make_unique<std::array<long long, 2>>(std::array<long long, 2>{last_id().load() + 1, 0});
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Iallreduce(ids->data(), ids->data() + 1, 1, MPI_LONG_LONG, MPI_MAX, side, &request) != MPI_SUCCESS)
      return false;
    try {
      wait_setup(request, cat(what, ": agreeing on the consistency check's id"), side);
    } catch (...) {
      static_cast<void>(ids.release());
      throw;
    }
    const long long agreed = (*ids)[1];
    long long seen = last_id().load();
    while (seen < agreed && !last_id().compare_exchange_weak(seen, agreed)) {
    }
    id_ = agreed;
    return true;
  }

  void send() {
    auto& out = wire_->out[current_];
    out[0] = id_;
    MPI_Request& r = sends_[current_];
    if (MPI_Isend(out.data(), header + filled_ * entry, MPI_LONG_LONG, right_, tag, side_, &r) != MPI_SUCCESS)
      r = MPI_REQUEST_NULL;
    current_ ^= 1;
    filled_ = 0;
    // The other buffer's message (16 entries, sent eagerly) has left long ago.
    if (sends_[current_] != MPI_REQUEST_NULL) MPI_Wait(&sends_[current_], MPI_STATUS_IGNORE);
    compare();
  }

  void receive() {
    received_ = compared_ = 0;
    if (MPI_Irecv(wire_->in.data(), header + batch * entry, MPI_LONG_LONG, left_, tag, side_, &recv_) != MPI_SUCCESS)
      recv_ = MPI_REQUEST_NULL;
  }

  // The left rank's signatures against this rank's, as far as this rank has come; the first
  // difference, or one the left rank passes on, is the verdict.
  void compare() {
    while (verdict_.empty()) {
      if (recv_ != MPI_REQUEST_NULL) {
        int done = 0;
        MPI_Status status;
        if (MPI_Test(&recv_, &done, &status) != MPI_SUCCESS) {
          recv_ = MPI_REQUEST_NULL;  // no side channel: no check
          return;
        }
        if (!done) return;
        int count = 0;
        MPI_Get_count(&status, MPI_LONG_LONG, &count);
        if (count == header + verdict_size && wire_->in[0] == id_ && wire_->in[header] == -1) {
          decide(wire_->in.data() + header);
          return;
        }
        // A freed check's leftover, on a context MPI gave again: not this check's to compare.
        received_ = count >= header && wire_->in[0] == id_ ? (count - header) / entry : 0;
        compared_ = 0;
      }
      for (; compared_ < received_; ++compared_) {
        const long long* e = wire_->in.data() + header + compared_ * entry;
        const auto n = static_cast<std::uint64_t>(e[0]);
        if (n > last_) return;  // not there yet: compared once this rank gets there
        const own& mine = wire_->mine[n % kept];
        if (mine.n != n) continue;  // long gone from this rank's memory, or not checked here
        if (!std::equal(e + 1, e + entry, mine.sig.value.begin())) {
          long long found[verdict_size] = {-1, static_cast<long long>(n), left_, rank_};
          std::copy(e + 1, e + entry, found + 4);
          std::copy(mine.sig.value.begin(), mine.sig.value.end(), found + 4 + mpi_signature::fields);
          decide(found);
          return;
        }
      }
      if (recv_ == MPI_REQUEST_NULL) {
        receive();
        if (recv_ == MPI_REQUEST_NULL) return;
      }
    }
  }

  // The verdict, found here or passed on from the left, named and passed on to the right.
  void decide(const long long* found) {
    mpi_signature a, b;
    std::copy(found + 4, found + 4 + mpi_signature::fields, a.value.begin());
    std::copy(found + 4 + mpi_signature::fields, found + verdict_size, b.value.begin());
    verdict_ = cat("ranks disagree on collective #", found[1], ": rank ", found[2], ": ", a.str(), "; rank ",
                   found[3], ": ", b.str(), " (FLEXCOMM_CHECK)");
    wire_->verdict[0] = id_;
    std::copy(found, found + verdict_size, wire_->verdict.begin() + header);
    if (MPI_Isend(wire_->verdict.data(), header + verdict_size, MPI_LONG_LONG, right_, tag, side_, &verdict_send_) !=
        MPI_SUCCESS)
      verdict_send_ = MPI_REQUEST_NULL;
  }

  void close() noexcept {
    if (!wire_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) {
      static_cast<void>(wire_.release());  // MPI may own the buffers still
      return;
    }
    if (recv_ != MPI_REQUEST_NULL) {
      MPI_Cancel(&recv_);
      MPI_Wait(&recv_, MPI_STATUS_IGNORE);
    }
    bool pending = false;
    for (MPI_Request* s : {&sends_[0], &sends_[1], &verdict_send_}) {
      int done = 1;
      if (*s != MPI_REQUEST_NULL) MPI_Test(s, &done, MPI_STATUS_IGNORE);
      if (!done) {
        MPI_Request_free(s);  // it may still read its buffer
        pending = true;
      }
    }
    if (pending) static_cast<void>(wire_.release());
  }

  MPI_Comm side_ = MPI_COMM_NULL;
  int rank_ = -1, left_ = -1, right_ = -1;
  std::unique_ptr<buffers> wire_;
  int current_ = 0, filled_ = 0;
  std::chrono::steady_clock::time_point oldest_unsent_{};
  std::array<MPI_Request, 2> sends_{MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  MPI_Request recv_ = MPI_REQUEST_NULL, verdict_send_ = MPI_REQUEST_NULL;
  int received_ = 0, compared_ = 0;
  std::uint64_t last_ = 0;  // the last collective added
  long long id_ = 0;        // agreed at open(): on every message, so that none of a freed check is taken
  std::string verdict_;
};

}  // namespace flexcomm::detail
