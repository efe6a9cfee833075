// Fault-injection driver: runs a few training-like steps over the MPI backend and injects one
// fault on the last rank. Every rank that catches a flexcomm::error prints it, each line prefixed
// with "[rank R] ", together with the time from the start of the faulty step, and whether the
// guard words behind its buffers are intact. tests/fault/launch.py runs it under mpiexec and
// checks what each rank reports, the time to error and mpiexec's exit status.
//
//   mpiexec -n N fault <fault>     faults: none exit exit0 stall stall-engine stall-skew group-stall count dtype order layout
//                                  finalize-hang finalize-hang-status bad-wait bad-trace typo-setting
//                                  bad-<setting> (one per FLEXCOMM_ setting) idle-stage-chunk
#include <flexcomm/flexcomm.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "report.hpp"

namespace fc = flexcomm;
using fc::mpi;

namespace {

constexpr std::size_t count = 1000;
constexpr std::size_t guard = 64;
constexpr int fault_step = 3;
constexpr int steps = 6;

// A buffer of `n` elements followed by guard words no operation may touch.
template <class T>
struct guarded {
  explicit guarded(std::size_t n) : n(n), data(n + guard, T(7)) {}
  fc::span<T> span() { return fc::span<T>(data.data(), n); }
  bool intact() const {
    for (std::size_t i = n; i < data.size(); ++i)
      if (!(data[i] == T(7))) return false;
    return true;
  }
  std::size_t n;
  std::vector<T> data;
};

}  // namespace

int main(int argc, char** argv) {
  const std::string fault = argc > 1 ? argv[1] : "none";
  // Bad settings are read once, at start, and end the job there on every rank.
  if (fault == "bad-wait") setenv("FLEXCOMM_WAIT", "bogus", 1);
  // One bad value per setting (tests/fault/launch.py: BAD_SETTINGS), each named at start; and a
  // good value of a setting this program cannot use (no device backend), said once.
  struct bad_setting {
    const char *fault, *name, *value;
  };
  const bad_setting bad_settings[] = {
      {"bad-timeout", "FLEXCOMM_TIMEOUT", "abc"},
      {"bad-timeout-negative", "FLEXCOMM_TIMEOUT", "-1"},
      {"bad-check", "FLEXCOMM_CHECK", "maybe"},
      {"bad-finalize-timeout", "FLEXCOMM_FINALIZE_TIMEOUT", "soon"},
      {"bad-bucket-bytes", "FLEXCOMM_BUCKET_BYTES", "lots"},
      {"bad-segment-bytes", "FLEXCOMM_SEGMENT_BYTES", "1"},
      {"bad-hierarchical", "FLEXCOMM_HIERARCHICAL", "maybe"},
      {"bad-shm", "FLEXCOMM_SHM", "maybe"},
      {"bad-hosts", "FLEXCOMM_HOSTS", "2+x"},
      {"bad-layout", "FLEXCOMM_LAYOUT", "members="},
      {"bad-preset", "FLEXCOMM_PRESET", "fast"},
      {"bad-stage-chunk", "FLEXCOMM_STAGE_CHUNK", "0"},
      {"bad-pinned-bytes", "FLEXCOMM_PINNED_BYTES", "1K"},
      {"bad-standin-latency", "FLEXCOMM_STANDIN_LATENCY", "-5"},
      {"bad-standin-devices", "FLEXCOMM_STANDIN_DEVICES", "0"},
      {"bad-device", "FLEXCOMM_DEVICE", "gpu1"},
      {"idle-stage-chunk", "FLEXCOMM_STAGE_CHUNK", "4096"},
  };
  for (const auto& b : bad_settings)
    if (fault == b.fault) setenv(b.name, b.value, 1);
  if (fault == "bad-trace") setenv("FLEXCOMM_TRACE", "/proc/flexcomm-trace", 1);
  // A misspelled setting is named at start; the job runs on.
  if (fault == "typo-setting") setenv("FLEXCOMM_TIMOUT", "2", 1);
  // The hang MPICH 4.0.2 + UCX can show in MPI_Finalize, made certain: the guard must end it.
  if (fault.rfind("finalize-hang", 0) == 0) setenv("FLEXCOMM_FINALIZE_TIMEOUT", "1", 0);
  fc::environment env(argc, argv);
  const auto& world = env.world();
  const int rank = world.rank(), size = world.size();
  const bool faulty = rank == size - 1 && size > 1;
  if (faulty && fault.rfind("finalize-hang", 0) == 0) {
    report(rank, "injected: MPI_Finalize will never return");
    fc::detail::finalize_call() = [] {
      for (;;) pause();
    };
  }
  guarded<float> grad(count), recv(count);
  guarded<double> wide(count);
  guarded<float> longer(count + 1);
  guarded<int> flag(1);
  auto start = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  int status = 0;
  try {
    if (fault == "layout") {
      // Five ranks' worth of layout on a world of another size: every rank must say so.
      const auto layout = fc::ensemble_layout::parse(size == 5 ? "producers=1 members=2x2 aggregator=9"
                                                               : "producers=1 members=2x2");
      layout.validate(size);
    }
    if (fault == "group-stall") {
      // MPI_Comm_create_group blocks inside MPI: the ranks on time are held there, where only the
      // guard thread of backend/mpi/setup.hpp can end the job.
      if (faulty) {
        report(rank, "injected: stalling before a communicator of every rank");
        std::this_thread::sleep_for(fc::default_timeout() * 4 + std::chrono::seconds(2));
      }
      std::vector<int> everyone(static_cast<std::size_t>(size));
      for (int r = 0; r < size; ++r) everyone[static_cast<std::size_t>(r)] = r;
      world.group(everyone, 0, "every rank");
    }
    for (int step = 0; step < steps; ++step) {
      if (step == fault_step) start = std::chrono::steady_clock::now();
      if (faulty && step == fault_step) {
        if (fault == "exit") {  // dies as a crash does: no exit handlers, no MPI_Finalize
          report(rank, "injected: exiting mid-step");
          std::_Exit(1);
        }
        if (fault == "exit0") {  // a library calling exit(0) mid-step
          report(rank, "injected: exit(0) mid-step");
          std::exit(0);
        }
        if (fault == "stall" || fault == "stall-engine" || fault == "stall-skew") {
          report(rank, "injected: stalling outside flexcomm");
          std::this_thread::sleep_for(fc::default_timeout() * 4 + std::chrono::seconds(2));
        }
      }
      if (fault == "stall-skew" && rank == 0 && step == fault_step)
        std::this_thread::sleep_for(fc::watchdog::grace(fc::default_timeout()) * 7 / 5);  // enters late
      const bool odd = faulty && step == fault_step;
      if (odd && fault == "count") {
        mpi::iallreduce(world, longer.span(), fc::op::sum).wait();
      } else if (odd && fault == "dtype") {
        mpi::iallreduce(world, wide.span(), fc::op::sum).wait();
      } else if (odd && fault == "order") {
        // Hands its two collectives over in the other order.
        auto b = mpi::ibcast(world, flag.span(), 0);
        auto a = mpi::iallreduce(world, grad.span(), fc::op::sum);
        b.wait();
        a.wait();
      } else if (fault == "stall-engine") {
        // As the adapters do: the progress engine drives the request, this thread waits on the
        // completion with atomics only.
        auto a = std::make_shared<mpi::request>(mpi::iallreduce(world, grad.span(), fc::op::sum));
        fc::progress_engine::instance().submit([a] { return a->test(); }, fc::cat("gradient step ", step))->wait();
      } else {
        auto a = mpi::iallreduce(world, grad.span(), fc::op::sum);
        auto b = mpi::ibcast(world, flag.span(), 0);
        a.wait();
        b.wait();
      }
    }
    report(rank, "finished every step");
  } catch (const fc::error& e) {
    report(rank, fc::cat("caught after ", seconds(), " s: ", e.what()));
    status = 1;
  }
  const bool intact = grad.intact() && recv.intact() && wide.intact() && longer.intact() && flag.intact();
  report(rank, intact ? "guards intact" : "GUARD BROKEN: an operation wrote past its buffer");
  if (fault == "finalize-hang-status" && status == 0) status = 3;  // a program leaving with 3
  env.set_exit_status(status);
  return status;  // ~environment ends the job with MPI_Abort when operations were abandoned
}
