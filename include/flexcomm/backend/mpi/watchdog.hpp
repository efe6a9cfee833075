// The MPI side of the watchdog (core/watchdog.hpp): each communicator's private side channel,
// the arrival protocol that names the ranks that did not arrive, and the collective signatures.
// The MPI backend's communicators keep it, and so does nccl's control communicator.
//
// Every flexcomm MPI communicator owns a duplicate of itself, the side channel, that carries only
// watchdog traffic, so none of it can match the communicator's own messages or collectives:
//  - arrival: a rank whose wait timed out sends its state (oldest operation in flight, last
//    enqueued and completed sequence numbers) to every peer of every communicator it has, then
//    listens for the peers' states on the communicator it waited on, for a grace period. Peers
//    that are waiting too time out at about the same time and answer; a rank that stalls outside
//    flexcomm, or died, never does, and one that answers with a lower sequence number is behind.
//  - failure: a rank whose side of a communicator failed by itself (a device backend's: NCCL's
//    asynchronous error, a poisoned CUDA context) sends its cause to every peer; their long waits
//    poll for it, so that they end naming that rank at once rather than timing out.
//  - consistency (FLEXCOMM_CHECK): beside every collective, a nonblocking MIN allreduce of
//    (signature, -signature) on the side channel, i.e. the minimum and maximum of each field; when
//    they differ, the ranks swap signatures point-to-point so that each names who disagrees.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../../core/agreement.hpp"
#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/reduce.hpp"
#include "../../core/stall.hpp"
#include "../../core/wait.hpp"
#include "../../core/hosts.hpp"
#include "../../core/watchdog.hpp"
#include "setup.hpp"

namespace flexcomm::detail {

// Operation names as numbers on the wire; the order is fixed (new names go at the end). The
// last two are the NCCL backend's setup collectives, recorded so that a timeout there names ranks.
inline const char* const mpi_op_names[] = {"isend",      "irecv",           "ibcast",     "iallreduce",
                                           "ireduce",    "igatherv",        "iallgather", "iallgatherv",
                                           "ireduce_scatter", "ncclCommInitRank", "ncclCommSplit"};
inline constexpr int mpi_op_codes = sizeof mpi_op_names / sizeof *mpi_op_names;
inline int mpi_op_code(const char* op) {
  for (int i = 0; i < mpi_op_codes; ++i)
    if (std::strcmp(mpi_op_names[i], op) == 0) return i;
  return -1;
}
inline const char* mpi_op_name(long long code) { return code >= 0 && code < mpi_op_codes ? mpi_op_names[code] : "?"; }

// What a collective looks like to one rank; every rank of the communicator must agree on it.
struct mpi_signature {
  enum field { kind, type, count, redop, root, counts_hash, label, fields };
  std::array<long long, fields> value{};

  std::string str() const {
    std::string s = cat(mpi_op_name(value[kind]), " ");
    if (value[count] >= 0) s += cat(value[count], " x ");
    s += name_of(static_cast<dtype>(value[type]));
    if (value[redop] >= 0) s += cat(" ", name_of(static_cast<op>(value[redop])));
    if (value[root] >= 0) s += cat(" root ", value[root]);
    if (value[counts_hash] != 0) s += cat(" counts#", value[counts_hash] % 100000);
    if (value[label] >= 0) s += cat(" label ", value[label]);
    return s;
  }
};

inline long long hash_counts(const int* counts, std::size_t n) {
  fingerprint f;
  for (std::size_t i = 0; i < n; ++i) f.add(static_cast<std::uint32_t>(counts[i]));
  return static_cast<long long>(f.folded() | 1);  // positive and never 0, so that -h cannot overflow
}

class mpi_comm_state final : public watched {
 public:
  static constexpr int announce_tag = 1;
  static constexpr int signature_tag = 2;
  static constexpr int announce_fields = 8;
  static constexpr int failure_tag = 4;  // 3 is the batched consistency check's (batched_check.hpp)
  static constexpr int failure_bytes = 1024;

  mpi_comm_state(MPI_Comm comm, std::string name) : name_(std::move(name)) {
    MPI_Comm_rank(comm, &rank_);
    MPI_Comm_size(comm, &size_);
    world_ranks_.resize(static_cast<std::size_t>(size_));
    MPI_Group mine, world;
    MPI_Comm_group(comm, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    std::vector<int> ranks(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) ranks[static_cast<std::size_t>(r)] = r;
    MPI_Group_translate_ranks(mine, size_, ranks.data(), world, world_ranks_.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&world);
    // Without a side channel the watchdog only names this rank's own stall: not worth failing for.
    try {
      side_ = duplicate_of(comm, cat(name_, ": the watchdog's side channel"));
      MPI_Comm_set_errhandler(side_, MPI_ERRORS_RETURN);
    } catch (const error&) {
      side_ = MPI_COMM_NULL;
    }
  }

  ~mpi_comm_state() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (side_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&side_);
  }

  mpi_comm_state(const mpi_comm_state&) = delete;
  mpi_comm_state& operator=(const mpi_comm_state&) = delete;

  const std::string& name() const override { return name_; }
  const flight_recorder& recorder() const override { return recorder_; }
  flight_recorder& recorder() { return recorder_; }
  MPI_Comm side() const noexcept { return side_; }
  int world_rank(int r) const { return r >= 0 && r < size_ ? world_ranks_[static_cast<std::size_t>(r)] : -1; }
  std::string who(int r) const { return cat(r, " (world ", world_rank(r), on_host(world_rank(r)), ")"); }

  // The per-communicator timeout; unset: FLEXCOMM_TIMEOUT's.
  timeout_limit limit;
  std::chrono::milliseconds timeout() const { return limit.get(); }

  bool poisoned() const noexcept { return poisoned_.load(std::memory_order_acquire); }
  std::string poison_reason() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return poison_reason_;
  }
  void poison(const std::string& why) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (poisoned_.load(std::memory_order_relaxed)) return;
      poison_reason_ = why;
    }
    poisoned_.store(true, std::memory_order_release);
    watchdog::instance().must_end();
  }

  void announce() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (announced_.load(std::memory_order_relaxed) || side_ == MPI_COMM_NULL || size_ < 2) return;
    announced_.store(true, std::memory_order_release);
    // Sent once and never freed: the send may outlive this communicator (its peer may be dead),
    // and the job is ending anyway.
    auto* msg = new long long[announce_fields];
    const std::uint64_t oldest = recorder_.oldest_in_flight();
    const op_record r = oldest ? recorder_.find(oldest) : op_record{};
    msg[0] = world_rank(rank_);
    msg[1] = static_cast<long long>(oldest);
    msg[2] = oldest ? mpi_op_code(r.op) : -1;
    msg[3] = static_cast<long long>(r.count);
    msg[4] = static_cast<long long>(recorder_.last_enqueued());
    msg[5] = static_cast<long long>(recorder_.last_completed());
    msg[6] = static_cast<long long>(recorder_.in_flight());
    msg[7] = 0;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      MPI_Request req;
      if (MPI_Isend(msg, announce_fields, MPI_LONG_LONG, p, announce_tag, side_, &req) == MPI_SUCCESS)
        MPI_Request_free(&req);
    }
  }

  // This rank's side of the communicator failed by itself (a device backend's: an asynchronous
  // NCCL error, a poisoned CUDA context), and the backend cancelled its operations: the peers are
  // told at once, on the side channel, so that their waits end naming this rank and its cause
  // rather than timing out. Once; never blocks.
  void report_failure(const std::string& cause) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (reported_ || side_ == MPI_COMM_NULL || size_ < 2) return;
    reported_ = true;
    auto* text = new char[failure_bytes]();  // may outlive this communicator: see announce()
    cause.copy(text, failure_bytes - 1);
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      MPI_Request req;
      if (MPI_Isend(text, failure_bytes, MPI_CHAR, p, failure_tag, side_, &req) == MPI_SUCCESS) MPI_Request_free(&req);
    }
  }

  // A peer's report_failure, once one came: "rank R (world W) failed: <its cause>"; "" until then.
  // The flag is one atomic load; polling for the report is poll_failures(), from long waits.
  bool peer_failed() const noexcept { return peer_failed_.load(std::memory_order_acquire); }
  std::string peer_failure() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return peer_causes_.empty() ? std::string() : cat("rank ", who(peer_causes_.begin()->first), " failed: ",
                                                      peer_causes_.begin()->second);
  }
  // Receives the peers' failure reports that have come (matched probes: safe from any thread).
  void poll_failures() {
    if (side_ == MPI_COMM_NULL || size_ < 2) return;
    for (;;) {
      int flag = 0;
      MPI_Message message;
      MPI_Status status;
      if (MPI_Improbe(MPI_ANY_SOURCE, failure_tag, side_, &flag, &message, &status) != MPI_SUCCESS || !flag) return;
      std::vector<char> text(failure_bytes, '\0');
      if (MPI_Mrecv(text.data(), failure_bytes, MPI_CHAR, &message, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
      text.back() = '\0';
      std::lock_guard<std::mutex> lock(mutex_);
      peer_causes_.emplace(status.MPI_SOURCE, text.data());
      peer_failed_.store(true, std::memory_order_release);
    }
  }

  void answer_queries() override {
    poll_failures();
    if (announced_.load(std::memory_order_acquire) || side_ == MPI_COMM_NULL || size_ < 2) return;
    int flag = 0;
    // Probe only: the peer's message stays queued for this rank's own diagnose().
    if (MPI_Iprobe(MPI_ANY_SOURCE, announce_tag, side_, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) announce();
  }

  std::string diagnose(std::uint64_t seq, std::chrono::milliseconds grace) override {
    std::lock_guard<std::mutex> lock(diagnose_mutex_);
    if (!diagnosis_.empty()) return diagnosis_;  // the peers answer once
    const op_record waiting = recorder_.find(seq);
    std::string s = cat("  on '", name_, "' (rank ", rank_, " of ", size_, ", world ", world_rank(rank_), "): ");
    s += waiting.seq ? cat("waiting in ", waiting.str()) : cat("waiting in #", seq);
    s += cat("; this rank last enqueued #", recorder_.last_enqueued(), ", last completed #",
             recorder_.last_completed(), ", ", recorder_.in_flight(), " in flight");
    std::vector<std::array<long long, announce_fields>> answers;
    const auto answered = gather(announce_tag, nullptr, answers, grace);
    std::vector<std::string> missing;
    std::string peers;
    poll_failures();
    const auto causes = failed_peers();
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const auto& a = answers[static_cast<std::size_t>(p)];
      if (const auto failed = causes.find(p); !answered[static_cast<std::size_t>(p)] && failed != causes.end()) {
        missing.push_back(who(p));
        peers += cat("\n    rank ", who(p), ": its side of the communicator failed: ", failed->second);
        continue;
      }
      if (!answered[static_cast<std::size_t>(p)]) {
        missing.push_back(who(p));
        silent_.push_back(world_rank(p));
        peers += cat("\n    rank ", who(p), ": no answer within ", grace.count(),
                     " ms: not waiting in flexcomm (stalled, busy elsewhere or dead)");
        continue;
      }
      const auto enqueued = static_cast<std::uint64_t>(a[4]);
      std::string where = a[1] > 0 ? cat("waiting in #", a[1], " ", mpi_op_name(a[2]), " (", a[3], " elements)")
                                   : std::string("nothing in flight here");
      if (enqueued < seq) {
        missing.push_back(who(p));
        behind_.push_back(world_rank(p));
        peers += cat("\n    rank ", who(p), ": behind, last enqueued #", a[4], ", last completed #", a[5], ", ",
                     where);
      } else {
        peers += cat("\n    rank ", who(p), ": arrived, last enqueued #", a[4], ", last completed #", a[5], ", ",
                     where);
      }
    }
    if (size_ > 1) {
      if (missing.empty()) {
        s += "\n  every rank arrived";
      } else {
        s += cat("\n  ranks that did not arrive: ");
        for (std::size_t i = 0; i < missing.size(); ++i) s += cat(i ? ", " : "", missing[i]);
      }
    }
    s += peers;
    s += "\n" + recorder_.dump(cat("'", name_, "'"));
    diagnosis_ = s;
    return s;
  }

  void late(std::vector<int>& silent, std::vector<int>& behind) const override {
    std::lock_guard<std::mutex> lock(diagnose_mutex_);
    silent.insert(silent.end(), silent_.begin(), silent_.end());
    behind.insert(behind.end(), behind_.begin(), behind_.end());
  }

  // The fields of `mine` vs everyone's: every rank calls it once the MIN/MAX allreduce showed a
  // difference. Names the groups of ranks that agree.
  std::string disagreement(const mpi_signature& mine, std::chrono::milliseconds grace) {
    std::vector<std::array<long long, announce_fields>> answers;
    std::array<long long, announce_fields> out{};
    std::copy(mine.value.begin(), mine.value.end(), out.begin());
    const auto answered = gather(signature_tag, out.data(), answers, grace);
    std::map<std::array<long long, mpi_signature::fields>, std::vector<int>> groups;
    std::vector<int> silent;
    for (int p = 0; p < size_; ++p) {
      mpi_signature sig = mine;
      if (p != rank_) {
        if (!answered[static_cast<std::size_t>(p)]) { silent.push_back(p); continue; }
        std::copy(answers[static_cast<std::size_t>(p)].begin(),
                  answers[static_cast<std::size_t>(p)].begin() + mpi_signature::fields, sig.value.begin());
      }
      groups[sig.value].push_back(p);
    }
    std::string s = "ranks disagree:";
    for (const auto& [value, ranks] : groups) {
      mpi_signature sig;
      sig.value = value;
      s += cat(" rank", ranks.size() > 1 ? "s " : " ");
      for (std::size_t i = 0; i < ranks.size(); ++i) s += cat(i ? "," : "", ranks[i]);
      s += cat(": ", sig.str(), value == mine.value ? " (this rank);" : ";");
    }
    if (!silent.empty()) {
      s += " no signature from rank";
      for (int p : silent) s += cat(" ", p);
      s += ";";
    }
    s.pop_back();
    return s;
  }

 private:
  std::map<int, std::string> failed_peers() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return peer_causes_;
  }

  // Sends `out` (when given) to every peer on the side channel with `tag`, and receives one
  // message from each, for up to `grace`. Buffers are leaked on purpose where a receive could not
  // be cancelled: MPI may still write into them.
  std::vector<bool> gather(int tag, const long long* out, std::vector<std::array<long long, announce_fields>>& in,
                           std::chrono::milliseconds grace) {
    const auto n = static_cast<std::size_t>(size_);
    std::vector<bool> answered(n, false);
    in.assign(n, {});
    if (side_ == MPI_COMM_NULL || size_ < 2) return answered;
    auto* box = new std::array<long long, announce_fields>[n];
    std::vector<MPI_Request> recvs(n, MPI_REQUEST_NULL);
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      if (MPI_Irecv(box[p].data(), announce_fields, MPI_LONG_LONG, p, tag, side_, &recvs[static_cast<std::size_t>(p)]) !=
          MPI_SUCCESS)
        recvs[static_cast<std::size_t>(p)] = MPI_REQUEST_NULL;
      if (out) {
        auto* msg = new long long[announce_fields];  // may outlive this call: see announce()
        std::memcpy(msg, out, sizeof(long long) * announce_fields);
        MPI_Request req;
        if (MPI_Isend(msg, announce_fields, MPI_LONG_LONG, p, tag, side_, &req) == MPI_SUCCESS) MPI_Request_free(&req);
      }
    }
    const auto deadline = std::chrono::steady_clock::now() + grace;
    for (unsigned round = 0;; ++round) {
      bool all = true;
      for (std::size_t p = 0; p < n; ++p) {
        if (recvs[p] == MPI_REQUEST_NULL) continue;
        int flag = 0;
        if (MPI_Test(&recvs[p], &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
          recvs[p] = MPI_REQUEST_NULL;  // a dead peer: no answer
          continue;
        }
        if (flag) answered[p] = true;
        else all = false;
      }
      if (all || std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::microseconds(round < 10 ? 10 : 500));
    }
    bool leak = false;
    for (std::size_t p = 0; p < n; ++p) {
      if (recvs[p] == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&recvs[p]);
      MPI_Request_free(&recvs[p]);
      leak = true;
    }
    for (std::size_t p = 0; p < n; ++p)
      if (answered[p]) in[p] = box[p];
    if (!leak) delete[] box;
    return answered;
  }

  std::string name_;
  int rank_ = -1, size_ = 0;
  std::vector<int> world_ranks_;
  MPI_Comm side_ = MPI_COMM_NULL;
  flight_recorder recorder_;
  mutable std::mutex mutex_;
  mutable std::mutex diagnose_mutex_;
  std::vector<int> silent_, behind_;  // world ranks, as the diagnosis found them
  std::atomic<bool> poisoned_{false};
  std::string poison_reason_;
  std::atomic<bool> announced_{false};
  std::string diagnosis_;
  bool reported_ = false;                   // under mutex_
  std::map<int, std::string> peer_causes_;  // under mutex_: peers' failure reports, by rank
  std::atomic<bool> peer_failed_{false};
};

// The consistency check riding beside one collective: MIN over (signature, -signature) gives the
// minimum and maximum of every field across the ranks in one small allreduce.
struct mpi_signature_check {
  mpi_signature mine;
  std::array<long long, 2 * mpi_signature::fields> in{}, out{};
  MPI_Request req = MPI_REQUEST_NULL;

  bool post(MPI_Comm side) {
    for (int i = 0; i < mpi_signature::fields; ++i) {
      in[static_cast<std::size_t>(i)] = mine.value[static_cast<std::size_t>(i)];
      in[static_cast<std::size_t>(i + mpi_signature::fields)] = -mine.value[static_cast<std::size_t>(i)];
    }
    return MPI_Iallreduce(in.data(), out.data(), 2 * mpi_signature::fields, MPI_LONG_LONG, MPI_MIN, side, &req) ==
           MPI_SUCCESS;
  }
  bool agreed() const {
    for (int i = 0; i < mpi_signature::fields; ++i)
      if (out[static_cast<std::size_t>(i)] != -out[static_cast<std::size_t>(i + mpi_signature::fields)]) return false;
    return true;
  }
};

// The question of core/stall.hpp over a duplicate of MPI_COMM_WORLD, whose ranks are the world's:
// a question is {asker, reply tag}; the reply, where this rank stands as text (its waits' world
// ranks, the operations, its newest operation started and completed). Each ask has its own tag,
// so a late reply to an ask given up never answers a later one. Buffers that MPI may still use
// when their peer is gone are leaked on purpose: the job is ending.
// Besides the long waits, a thread of its own answers every `every`: a rank busy outside
// flexcomm, or blocked in a call that does not answer (MPI_Comm_create_group), still says where
// it stands, so that the ranks that give no answer are the ones stopped or dead.
class mpi_stall_channel final : public stall_channel {
 public:
  static constexpr int question_tag = 1;
  static constexpr int reply_bytes = 1024;
  static constexpr std::chrono::milliseconds every{50};

  mpi_stall_channel() {
    comm_ = duplicate_of(MPI_COMM_WORLD, "the watchdog's stall channel");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    answering_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(stop_mutex_);
      while (!stop_wake_.wait_for(lock, every, [&] { return stop_; })) {
        lock.unlock();
        answer();
        lock.lock();
      }
    });
  }
  ~mpi_stall_channel() override {
    hush();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
  mpi_stall_channel(const mpi_stall_channel&) = delete;
  mpi_stall_channel& operator=(const mpi_stall_channel&) = delete;

  void answer() override {
    std::unique_lock<std::mutex> lock(answer_mutex_, std::try_to_lock);
    if (!lock.owns_lock()) return;
    for (;;) {
      int flag = 0;
      MPI_Message message = MPI_MESSAGE_NULL;
      MPI_Status status;
      if (MPI_Improbe(MPI_ANY_SOURCE, question_tag, comm_, &flag, &message, &status) != MPI_SUCCESS || !flag) return;
      int question[2] = {-1, -1};
      if (MPI_Mrecv(question, 2, MPI_INT, &message, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
      const std::string text = reply_text();
      auto* out = new char[reply_bytes]();  // may outlive this call: the asker may be gone
      std::memcpy(out, text.data(), std::min(text.size(), static_cast<std::size_t>(reply_bytes - 1)));
      MPI_Request req;
      if (MPI_Isend(out, reply_bytes, MPI_CHAR, status.MPI_SOURCE, question[1], comm_, &req) == MPI_SUCCESS)
        MPI_Request_free(&req);
    }
  }

  void hush() noexcept override {
    {
      std::lock_guard<std::mutex> lock(stop_mutex_);
      stop_ = true;
    }
    stop_wake_.notify_one();
    if (answering_.joinable() && answering_.get_id() != std::this_thread::get_id()) answering_.join();
  }

  void ask(int world_rank) override {
    auto& a = asks_[world_rank];
    a.tag = 2 + static_cast<int>(next_tag_++ % 30000);
    a.box = new char[reply_bytes]();
    if (MPI_Irecv(a.box, reply_bytes, MPI_CHAR, world_rank, a.tag, comm_, &a.recv) != MPI_SUCCESS) a.recv = MPI_REQUEST_NULL;
    auto* question = new int[2]{rank_, a.tag};  // may outlive this call: see answer()
    MPI_Request req;
    if (MPI_Isend(question, 2, MPI_INT, world_rank, question_tag, comm_, &req) == MPI_SUCCESS) MPI_Request_free(&req);
  }

  bool poll(int world_rank, stall_answer& out) override {
    const auto it = asks_.find(world_rank);
    out = stall_answer{};
    if (it == asks_.end() || it->second.recv == MPI_REQUEST_NULL) return true;
    int flag = 0;
    if (MPI_Test(&it->second.recv, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
      asks_.erase(it);  // a dead peer: no answer (its box stays with MPI)
      return true;
    }
    if (!flag) return false;
    out = parse(std::string(it->second.box, strnlen(it->second.box, reply_bytes)));
    delete[] it->second.box;
    asks_.erase(it);
    return true;
  }

  void give_up() override {
    for (auto& [rank, a] : asks_) {
      static_cast<void>(rank);
      if (a.recv == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&a.recv);
      MPI_Request_free(&a.recv);
    }
    asks_.clear();
  }

 private:
  struct open_ask {
    int tag = 0;
    char* box = nullptr;
    MPI_Request recv = MPI_REQUEST_NULL;
  };

  // "5,7\n<waiting in>\n<last started>\n<last completed>"
  static std::string reply_text() {
    const stall_answer here = stall_registry::instance().where();
    const auto [started, completed] = watchdog::instance().last_operations();
    std::string ranks;
    for (int r : here.waits_on) ranks += cat(ranks.empty() ? "" : ",", r);
    auto one_line = [](std::string t) {
      for (char& c : t)
        if (c == '\n') c = ' ';
      return t.substr(0, 300);
    };
    return cat(ranks, "\n", one_line(here.waiting_in), "\n", one_line(started), "\n", one_line(completed));
  }
  static stall_answer parse(const std::string& text) {
    stall_answer a;
    a.answered = true;
    std::vector<std::string> lines(1);
    for (char c : text) {
      if (c == '\n') lines.emplace_back();
      else lines.back() += c;
    }
    lines.resize(4);
    for (std::size_t i = 0; i < lines[0].size();) {
      const std::size_t end = std::min(lines[0].find(',', i), lines[0].size());
      a.waits_on.push_back(std::atoi(lines[0].substr(i, end - i).c_str()));
      i = end + 1;
    }
    a.waiting_in = lines[1];
    a.last_started = lines[2];
    a.last_completed = lines[3];
    return a;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = -1;
  std::mutex answer_mutex_;           // one thread answers at a time
  std::map<int, open_ask> asks_;      // the following thread's (stall_registry holds one at a time)
  unsigned next_tag_ = 0;
  std::mutex stop_mutex_;
  std::condition_variable stop_wake_;
  bool stop_ = false;
  std::thread answering_;
};

}  // namespace flexcomm::detail
