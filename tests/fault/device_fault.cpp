// Device fault driver: a few training-like steps over the nccl backend on the device stand-in
// (built with FLEXCOMM_DEVICE_STANDIN: no GPU needed), with one device fault on the last rank,
// injected through the stand-in's test hooks (tests/standin/flexcomm_standin/device.hpp). It
// reports as fault.cpp does: each line "[rank R] ...", and "caught after T s: <error>" from the
// start of the faulty step; tests/fault/launch.py checks every rank's report and the time.
//
//   mpiexec -n N device_fault_driver <fault>
//     device-none          no fault
//     nccl-remote-error    ncclRemoteError on the last rank's communicator before its step-3
//                          allreduce is enqueued (the enqueue returns it, as ncclCommEnsureReady does)
//     nccl-system-error    ncclSystemError while its step-3 allreduce is in flight
//                          (ncclCommGetAsyncError finds it)
//     cuda-sticky          a kernel of the last rank faults before step 3 (cudaErrorIllegalAddress):
//                          its context is poisoned
//     nccl-init-missing    the last rank stalls instead of making the NCCL communicator
//     nccl-split-missing   the last rank stalls instead of taking part in an ncclCommSplit
//     nccl-finalize-stuck  the other ranks enqueue an allreduce the last rank never joins (it stalls),
//                          then destroy the communicator: ncclCommFinalize cannot finish
#include <flexcomm/backend/cuda/device_buffer.hpp>
#include <flexcomm/backend/nccl.hpp>
#include <flexcomm/flexcomm.hpp>

#include <chrono>
#include <cstdio>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "report.hpp"

namespace fc = flexcomm;
using fc::nccl;

namespace {

constexpr std::size_t count = 1000;
constexpr int fault_step = 3;
constexpr int steps = 6;

// Outside flexcomm for 4x the timeout, as a rank under SIGSTOP: the others must not wait for it.
void stall(int rank) {
  report(rank, "injected: stalling outside flexcomm");
  std::this_thread::sleep_for(fc::default_timeout() * 4 + std::chrono::seconds(2));
}

}  // namespace

int main(int argc, char** argv) {
  const std::string fault = argc > 1 ? argv[1] : "device-none";
  fc::environment env(argc, argv);
  const auto& world = env.world();
  const int rank = world.rank(), size = world.size();
  const bool faulty = rank == size - 1 && size > 1;
  auto start = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  int status = 0;
  try {
    if (faulty && fault == "nccl-init-missing") {
      stall(rank);
      env.set_exit_status(1);
      return 1;
    }
    std::optional<nccl::communicator> comm(std::in_place, world, "world");
    fc::cuda::device_buffer<float> grad(count), flag(1);
    fc::device::fill(grad.data(), 0, count * sizeof(float));
    fc::device::fill(flag.data(), 0, sizeof(float));
    fc::device::device_synchronize();
    const fc::span<float> g(grad.data(), count), f(flag.data(), 1);
    for (int step = 0; step < steps; ++step) {
      if (step == fault_step) start = std::chrono::steady_clock::now();
      const bool here = faulty && step == fault_step;
      if (here && fault == "nccl-remote-error") {
        report(rank, "injected: ncclRemoteError on this rank's communicator");
        fc::device::standin::inject_async_error(comm->native(), fc::device::nccl_remote_error);
      }
      if (here && fault == "cuda-sticky") {
        const auto rc = fc::device::standin::inject_kernel_fault(comm->own_stream());
        report(rank, fc::cat("injected: a kernel faulted: ", fc::device::error_name(rc)));
      }
      if (step == fault_step && fault == "nccl-split-missing") {
        if (faulty) stall(rank);
        else comm->split(0, rank, "all but the last");
      }
      if (step == fault_step && fault == "nccl-finalize-stuck") {
        if (faulty) {
          stall(rank);
        } else {
          fc::check_nccl(fc::device::nccl_allreduce(g.data(), g.data(), count, fc::dtype::f32, fc::op::sum,
                                                    comm->native(), comm->own_stream()),
                         "a trainer's own ncclAllReduce");
          comm.reset();  // ncclCommFinalize waits for that allreduce, which waits for the last rank
          report(rank, fc::cat("destroyed its communicator after ", seconds(), " s"));
        }
        break;
      }
      auto a = nccl::iallreduce(*comm, g, fc::op::sum);
      auto b = nccl::ibcast(*comm, f, 0);
      if (here && fault == "nccl-system-error") {
        report(rank, "injected: ncclSystemError on this rank's communicator, its allreduce in flight");
        fc::device::standin::inject_async_error(comm->native(), fc::device::nccl_system_error);
      }
      a.wait();
      b.wait();
    }
    if (fault != "nccl-finalize-stuck") report(rank, "finished every step");
  } catch (const fc::error& e) {
    report(rank, fc::cat("caught after ", seconds(), " s: ", e.what()));
    status = 1;
  }
  env.set_exit_status(status);
  return status;
}
