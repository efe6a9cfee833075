// flexcomm::environment: brings MPI up with the thread support the progress engine needs,
// picks the process's wait policy from how crowded the node is, and shuts both down in order.
// The one core header that calls MPI: MPI is how every backend (NCCL included) bootstraps.
#pragma once

#include <mpi.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/setting_values.hpp"
#include "../../core/settings.hpp"
#include "../../core/progress.hpp"
#include "../../core/wait.hpp"
#include "../../core/watchdog.hpp"
#include "../mpi.hpp"
#include "abort.hpp"
#include "implementation.hpp"
#include "trace.hpp"

namespace flexcomm {

namespace detail {
// For the cluster suite's exit measurement (tests/cluster/run.sh --exit-times): with
// FLEXCOMM_TEST_EXIT_STAMP set, each rank appends "<world rank> <wall-clock ns>" to that file once
// the shutdown barrier has proved every rank done; the harness takes the time from the last of
// these to the job's end. (FLEXCOMM_TEST_ variables are the test harness's own.)
inline void stamp_shutdown_barrier() noexcept {
  const char* path = std::getenv("FLEXCOMM_TEST_EXIT_STAMP");
  if (!path || !*path) return;
  timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);
  if (FILE* f = std::fopen(path, "a")) {
    std::fprintf(f, "%d %lld\n", process_rank(), static_cast<long long>(now.tv_sec) * 1000000000LL + now.tv_nsec);
    std::fclose(f);
  }
}

// What shutdown calls to finalize MPI; the fault tests put a finalize that never returns here.
inline void (*&finalize_call())() {
  static void (*call)() = [] { MPI_Finalize(); };
  return call;
}

// The rank whose MPI_Finalize hangs is still closing its UCX endpoints, while its peers already
// wait in MPICH's PMI barrier for it (MPICH removed that barrier after 4.0.2). Under Hydra, whose
// PMI-1 wire protocol is a line of text on the socket in PMI_FD, this rank can enter the barrier
// and finalize PMI on its own behalf: the peers then finish, and mpiexec sees every rank leave
// cleanly. Returns false where there is no such socket or Hydra does not answer in time.
inline bool pmi_leave(std::chrono::milliseconds limit, bool barrier = true) {
  const int fd = mpi_implementation::launcher_pmi_fd();
  if (fd < 0) return false;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  auto send_line = [&](const char* line) {
    for (std::size_t done = 0, n = std::strlen(line); done < n;) {
      const auto wrote = ::write(fd, line + done, n - done);
      if (wrote <= 0) return false;
      done += static_cast<std::size_t>(wrote);
    }
    return true;
  };
  auto await_line = [&](const char* expected) {
    std::string line;
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      char c = 0;
      if (::read(fd, &c, 1) != 1) return false;
      if (c != '\n') {
        line += c;
        continue;
      }
      if (line.find(expected) != std::string::npos) return true;
      line.clear();
    }
    return false;
  };
  if (barrier && !(send_line("cmd=barrier_in\n") && await_line("cmd=barrier_out"))) return false;
  return send_line("cmd=finalize\n") && await_line("cmd=finalize_ack");
}

// True when thread `tid` of this process sits in read() on `fd` (sampled a few times): a rank
// whose MPI_Finalize waits in the PMI barrier for a peer, rather than one that hangs itself.
inline bool thread_reads(long tid, int fd, int samples = 1) {
  for (int sample = 0; sample < samples; ++sample) {
    std::FILE* f = std::fopen(cat("/proc/self/task/", tid, "/syscall").c_str(), "r");
    if (!f) return false;
    long number = -1;
    unsigned long first = 0;
    const int got = std::fscanf(f, "%ld %lx", &number, &first);
    std::fclose(f);
    if (got != 2 || number != SYS_read || static_cast<long>(first) != fd) return false;
    if (sample + 1 < samples) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  return true;
}

// What finalize_within's guard watches: whether MPI_Finalize has returned.
struct finalize_watch {
  std::mutex mutex;
  std::condition_variable returned;
  bool done = false;
};

// The guard of a rank seen in the PMI barrier: it waits there for a peer that hangs, and that
// peer's guard lets this rank go. Once let out, a finalize that works returns within
// milliseconds; one that does not hangs closing its UCX endpoint to the peer the guard parked:
// 100 ms after leaving the barrier is enough to tell (waiting a further `limit` here made the
// usual hang cost twice the guard's time). True once MPI_Finalize returned, false once let out
// without it; a rank still in the barrier `limit` from now leaves with `status` here.
template <class Returned>
bool await_pmi_barrier(Returned& returned, long tid, int pmi_fd, std::chrono::milliseconds limit, int rank,
                       std::chrono::steady_clock::time_point began, int status) {
  const auto start = std::chrono::steady_clock::now();
  std::optional<std::chrono::steady_clock::time_point> let_out;
  for (;;) {
    if (returned(std::chrono::milliseconds{20})) return true;
    const auto now = std::chrono::steady_clock::now();
    if (pmi_fd >= 0 && thread_reads(tid, pmi_fd)) {
      if (now - start < limit) continue;
      if (!thread_reads(tid, pmi_fd, 5)) continue;
      std::fprintf(stderr, "flexcomm: rank %d: MPI_Finalize still waits in the launcher's PMI barrier %.1f s after "
                   "every rank passed the shutdown barrier; all flexcomm work is done, leaving with status %d\n",
                   rank, std::chrono::duration<double>(now - began).count(), status);
      std::fflush(stderr);
      std::_Exit(status);
    }
    if (!let_out) let_out = now;
    if (now - *let_out >= std::chrono::milliseconds{100}) return false;
  }
}

// The guard's end of a finalize that hangs: says so, stands in for the finalizing thread at the
// launcher (with PMI_FD; `barrier_needed` where that thread never reached the PMI barrier) and
// leaves with `status`.
[[noreturn]] inline void abandon_finalize(int rank, std::chrono::steady_clock::time_point began, int status, int pmi_fd,
                                          bool barrier_needed, pthread_t finalizer) {
  std::fprintf(stderr,
               "flexcomm: rank %d: MPI_Finalize has not returned %.1f s after every rank passed the shutdown "
               "barrier (FLEXCOMM_FINALIZE_TIMEOUT; %s); all flexcomm work is done, leaving with status %d\n",
               rank, std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count(),
               mpi_implementation::finalize_hang_note, status);
  std::fflush(stderr);
  if (pmi_fd >= 0) {
    // Park the finalizing thread first, so that it cannot talk to the launcher while the guard
    // stands in for it.
    struct sigaction park{};
    park.sa_handler = [](int) {
      for (;;) ::pause();
    };
    sigemptyset(&park.sa_mask);
    if (::sigaction(SIGRTMIN + 3, &park, nullptr) == 0) ::pthread_kill(finalizer, SIGRTMIN + 3);
    if (!pmi_leave(std::chrono::seconds{5}, barrier_needed))
      std::fprintf(stderr, "flexcomm: rank %d: could not leave the launcher's PMI barrier (PMI_FD); mpiexec may "
                   "report this rank as failed\n", rank);
  }
  std::fflush(stderr);
  std::_Exit(status);
}

// finalize_within's guard thread: returns once MPI_Finalize (on thread `tid`, `finalizer`)
// returns within `limit`, else ends the process.
inline void guard_finalize(finalize_watch& state, std::chrono::milliseconds limit, int status, int rank, long tid,
                           pthread_t finalizer) {
  std::unique_lock<std::mutex> lock(state.mutex);
  auto returned = [&](std::chrono::milliseconds t) { return state.returned.wait_for(lock, t, [&] { return state.done; }); };
  // Watch where the finalizing thread waits: once seen in the PMI barrier, this rank is not the
  // one that hangs, and must not enter the barrier a second time.
  const int pmi_fd = mpi_implementation::launcher_pmi_fd();
  bool in_pmi_barrier = false;
  const auto began = std::chrono::steady_clock::now();
  const auto deadline = began + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (returned(std::chrono::milliseconds{100})) return;
    if (pmi_fd >= 0 && !in_pmi_barrier) in_pmi_barrier = thread_reads(tid, pmi_fd);
  }
  if (pmi_fd >= 0 && !in_pmi_barrier) in_pmi_barrier = thread_reads(tid, pmi_fd);
  const bool barrier_needed = !in_pmi_barrier;
  // Let out of the barrier, it hangs further on (closing UCX): PMI needs only its finalize.
  if (in_pmi_barrier && await_pmi_barrier(returned, tid, pmi_fd, limit, rank, began, status)) return;
  abandon_finalize(rank, began, status, pmi_fd, barrier_needed, finalizer);
}

// Calls MPI_Finalize on this (the main) thread, which must be the thread that finalizes: from
// another thread the hang below is far more frequent (docs/reliability.md). A guard thread
// waits up to `limit` (zero: forever); if MPI_Finalize has not returned by then, the guard says
// so and ends the process with `status`, the status the program leaves with.
inline void finalize_within(std::chrono::milliseconds limit, int status) {
  if (limit.count() == 0) {
    finalize_call()();
    return;
  }
  auto state = std::make_shared<finalize_watch>();
  std::thread guard([state, limit, status, rank = process_rank(), tid = static_cast<long>(::syscall(SYS_gettid)),
                     finalizer = ::pthread_self()] { guard_finalize(*state, limit, status, rank, tid, finalizer); });
  finalize_call()();
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    state->done = true;
  }
  state->returned.notify_one();
  guard.join();
}

}  // namespace detail

// One per process, made before and destroyed after every flexcomm object that communicates.
// MPI comes up with MPI_THREAD_MULTIPLE (the progress engine calls MPI from its own thread); if
// the program or a framework brought MPI up already, flexcomm uses it, requires
// MPI_THREAD_MULTIPLE of it, and leaves MPI_Finalize to whoever started it.
class environment {
 public:
  // Where main's argc/argv are not at hand (inside a library, a Python extension): MPI allows
  // MPI_Init_thread(nullptr, nullptr).
  environment() : environment(nullptr, nullptr) {}
  // argc and argv go to MPI_Init_thread.
  environment(int& argc, char**& argv) : environment(&argc, &argv) {}

  environment(const environment&) = delete;
  environment& operator=(const environment&) = delete;

  // Leaving must not hang (see docs/reliability.md, "Shutdown"):
  //   1. after a timeout or a disagreement between ranks, MPI holds operations that cannot
  //      finish: the job ends with MPI_Abort once the surviving ranks have reported;
  //   2. the progress engine finishes what it was handed, then stops; an operation still in
  //      flight after that is a request outliving the environment: reported, and the job ends;
  //   3. a world barrier, bounded by FLEXCOMM_TIMEOUT and named by the watchdog if a rank
  //      never arrives, proves every rank done with flexcomm;
  //   4. MPI_Finalize, under a guard thread: MPICH 4.0.2 over UCX's TCP transport sometimes
  //      never returns from it. If it has not returned FLEXCOMM_FINALIZE_TIMEOUT seconds after
  //      the barrier, this rank says so and leaves with the exit status the program gives.
  ~environment() {
    alive().store(false);
    if (!owns_mpi_) {
      release_without_finalize();
      return;
    }
    const auto limit = default_timeout();
    std::string why;
    if (!watchdog::instance().job_must_end()) why = quiesce(limit);
    if (!why.empty() || watchdog::instance().job_must_end()) end_job(why);
    stop_tracing_and_engine();
    try {
      int token = 0;
      auto done = mpi::iallreduce(*world_, span<int>(&token, 1), op::max);
      done.wait(default_wait(), limit);
    } catch (const std::exception& e) {
      end_job(cat("shutdown barrier: ", e.what()));
    }
    detail::stamp_shutdown_barrier();
    stall_registry::instance().set_channel(nullptr);
    world_.reset();
    node_.reset();
    detail::finalize_within(finalize_timeout(), exit_status());
  }

  // The status this process will leave with, for the one case where shutdown must end it itself
  // (MPI_Finalize never returning). By default 0, or 1 when an exception is unwinding the stack;
  // a program that ends main with another status says so first (the test fixture does).
  void set_exit_status(int status) noexcept { exit_status_ = status; }
  int exit_status() const noexcept {
    return exit_status_ >= 0 ? exit_status_ : std::uncaught_exceptions() > 0 ? 1 : 0;
  }

  // A misspelled setting would otherwise do nothing, silently: rank 0 names it (a warning, since
  // scripts around a trainer may keep FLEXCOMM_ variables of their own).
  static void warn_unknown_settings() {
    const auto unknown = unknown_settings();
    if (unknown.empty()) return;
    std::string known;
    for (const auto& s : known_settings) known += cat(known.empty() ? "" : ", ", s.name);
    for (const auto& name : unknown)
      std::fprintf(stderr, "flexcomm: rank 0: settings: %s is not a flexcomm setting and is ignored (known: %s)\n",
                   name.c_str(), known.c_str());
    std::fflush(stderr);
  }

  // How long MPI_Finalize may take once every rank is known to be done: FLEXCOMM_FINALIZE_TIMEOUT
  // seconds; 0 waits forever. By default 0.5 on MPICH, well above a finalize that works, to bound
  // what its finalize hang over UCX costs a job; 10 on Open MPI, whose finalize has not hung and
  // whose mpirun reports a rank that leaves without it as failed (docs/reliability.md, "Shutdown").
  static std::chrono::milliseconds finalize_timeout() {
    const char* text = setting("FLEXCOMM_FINALIZE_TIMEOUT");
    if (!text) return mpi_implementation::default_finalize_timeout;
    return parse_seconds("FLEXCOMM_FINALIZE_TIMEOUT", text);
  }

  // flexcomm's private duplicate of MPI_COMM_WORLD.
  const mpi::communicator& world() const { return *world_; }
  int ranks_on_node() const noexcept { return ranks_on_node_; }
  const wait_policy& wait() const noexcept { return wait_; }

 private:
  environment(int* argc, char*** argv) {
    const int rank = start_mpi(argc, argv);
    // Every FLEXCOMM_ setting is parsed here, before any of them is used, so that a bad value
    // ends the job at start with the setting's name on every rank, never an uncaught exception
    // wherever it is first read (FLEXCOMM_TIMEOUT is, by the world's duplicate just below).
    try {
      const auto idle = check_settings();
      if (rank == 0)
        for (const auto& why : idle) std::fprintf(stderr, "flexcomm: rank 0: settings: %s; ignored\n", why.c_str());
    } catch (const std::exception& e) {
      end_at_start(e, rank);
    }
    make_world_and_node(rank);
    apply_settings(rank);
    // A rank that calls exit() mid-step would otherwise leave its peers waiting, and Hydra may
    // even report success: end the job instead.
    alive().store(true);
    static const bool hooked = std::atexit(&exit_while_alive) == 0;
    static_cast<void>(hooked);
  }

  // MPI up with MPI_THREAD_MULTIPLE (or found up, and checked to provide it); returns this rank.
  int start_mpi(int* argc, char*** argv) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = MPI_THREAD_SINGLE;
    if (!initialized) {
      mpi_implementation::prepare_init();
      check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "environment: MPI_Init_thread");
      owns_mpi_ = true;
      // MPICH reports a failed MPI_Test (a truncated receive, say) through MPI_COMM_WORLD's handler:
      // make that a return code flexcomm turns into an error, not an abort. A trainer that brought
      // MPI up itself keeps the handlers it chose.
      MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
      MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
    } else {
      MPI_Query_thread(&provided);  // the trainer brought MPI up itself
    }
    int rank = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    detail::process_rank_slot().store(rank);
    if (provided < MPI_THREAD_MULTIPLE) {
      if (owns_mpi_) MPI_Finalize();
      fail("environment", cat("MPI provides thread level ", provided, ", flexcomm's progress engine needs ",
                              "MPI_THREAD_MULTIPLE (", MPI_THREAD_MULTIPLE, ")"));
    }
    return rank;
  }

  // flexcomm's duplicate of the world, the node's communicator, and what hosts the ranks are on.
  void make_world_and_node(int rank) {
    world_.emplace(mpi::communicator::duplicate(MPI_COMM_WORLD, "world"));
    // Peers whose waits time out ask this rank, through it, whom it waits on (core/stall.hpp).
    stall_registry::instance().set_channel(std::make_shared<detail::mpi_stall_channel>());
    MPI_Comm node = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(world_->native(), MPI_COMM_TYPE_SHARED, world_->rank(), MPI_INFO_NULL, &node),
              "environment: split by node");
    node_.emplace(node, "node");
    ranks_on_node_ = node_->size();
    // Learnt once: the host's first rank, so that the host checks of adapters made later need no
    // split of their own, and the processes here, which a stall report looks up (core/stall.hpp).
    const int mine[2] = {rank, static_cast<int>(::getpid())};
    std::vector<int> here(2 * static_cast<std::size_t>(ranks_on_node_));
    check_mpi(MPI_Allgather(mine, 2, MPI_INT, here.data(), 2, MPI_INT, node_->native()),
              "environment: the ranks and processes on this host");
    std::map<int, int> processes;
    for (std::size_t i = 0; i < here.size(); i += 2) processes[here[i]] = here[i + 1];
    detail::host_key_slot().store(processes.begin()->first, std::memory_order_release);
    stall_registry::instance().set_local_processes(std::move(processes));
    learn_host_names();
  }

  // Every FLEXCOMM_ setting is read here, once, so that a bad value ends the job at start with
  // the same message on every rank, never an uncaught exception later.
  void apply_settings(int rank) {
    try {
      wait_ = wait_policy::automatic(ranks_on_node_);
      set_default_wait(wait_);
      static_cast<void>(default_timeout());
      static_cast<void>(finalize_timeout());
      static_cast<void>(checks_enabled());
      progress_engine::instance().restart();
      if (trace::start_from_environment(*world_)) trace::name_thread("trainer");
      if (rank == 0) warn_unknown_settings();
    } catch (const std::exception& e) {
      end_at_start(e, rank);
    }
  }

  // Every rank's host name, once: reports name the host of a rank that did not arrive when the
  // job spans more than one (core/hosts.hpp: on_host).
  void learn_host_names() {
    const int size = world_->size();
    std::vector<char> names(static_cast<std::size_t>(size) * MPI_MAX_PROCESSOR_NAME, '\0');
    int length = 0;
    char* mine = &names[static_cast<std::size_t>(world_->rank()) * MPI_MAX_PROCESSOR_NAME];
    MPI_Get_processor_name(mine, &length);
    check_mpi(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, names.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR,
                            world_->native()),
              "environment: host names");
    std::vector<std::string> all;
    for (int r = 0; r < size; ++r) all.emplace_back(&names[static_cast<std::size_t>(r) * MPI_MAX_PROCESSOR_NAME]);
    const bool several = std::any_of(all.begin(), all.end(), [&](const std::string& n) { return n != all.front(); });
    detail::world_host_names() = several ? std::move(all) : std::vector<std::string>{};
  }

  [[noreturn]] static void end_at_start(const std::exception& e, int rank) {
    detail::process_rank_slot().store(rank);
    abort_job(e.what());
  }

  // Steps 1-2 of shutdown; returns why the job must end instead, or "".
  std::string quiesce(std::chrono::milliseconds limit) {
    std::string left;
    if (!progress_engine::instance().quiesce(limit, &left))
      return cat("shutdown: the progress engine did not finish within ", limit.count(),
                 " ms (FLEXCOMM_TIMEOUT): ", left);
    if (const auto report = watchdog::instance().in_flight_report(); !report.empty())
      return cat("shutdown: operations still in flight (a request outlives the environment):\n", report);
    return {};
  }

  [[noreturn]] void end_job(const std::string& why) {
    std::fprintf(stderr, "flexcomm: rank %d: ending the job with MPI_Abort(1): %s (%zu abandoned)\n",
                 process_rank(), why.empty() ? "a timeout or a disagreement between ranks left operations "
                                               "that cannot finish" : why.c_str(),
                 watchdog::instance().abandoned());
    std::fflush(stderr);
    // Two grace periods: ranks whose waits started a little later still time out and report,
    // and this rank tells those that follow a stall through it whom it waited on (stall.hpp).
    detail::answer_stall_questions_for(2 * watchdog::grace(default_timeout()));
    abort_mpi_job(1);
    std::_Exit(1);
  }

  void stop_tracing_and_engine() noexcept {
    progress_engine::instance().stop();
    try {
      trace::stop();  // writes this rank's trace file, when tracing
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
    }
  }

  // The trainer brought MPI up and will finalize it: flexcomm only lets go of its own state.
  void release_without_finalize() noexcept {
    if (watchdog::instance().job_must_end()) end_job("");
    stop_tracing_and_engine();
    stall_registry::instance().set_channel(nullptr);
    world_.reset();
    node_.reset();
  }

  static std::atomic<bool>& alive() {
    static std::atomic<bool> flag{false};
    return flag;
  }
  static void exit_while_alive() {
    if (!alive().load()) return;
    std::fprintf(stderr, "flexcomm: rank %d: exit() called while flexcomm's environment is alive (mid-step?); "
                 "ending the job with MPI_Abort(1)\n", process_rank());
    detail::before_abort();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) abort_mpi_job(1);
  }

  bool owns_mpi_ = false;
  int exit_status_ = -1;
  std::optional<mpi::communicator> world_;
  std::optional<mpi::communicator> node_;
  int ranks_on_node_ = 1;
  wait_policy wait_;
};

}  // namespace flexcomm
