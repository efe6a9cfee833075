// A ring step over NCCL point to point, flexcomm's against raw NCCL (issue 52, item 2: at most
// 1.1x a raw blocking send/receive ring). Per size, every rank sends the buffer to the next rank
// and receives as much from the previous one, in one group, and waits for both; the step is timed
// from the first call to its completion, the median over -n steps, the slowest rank's:
//   raw      ncclGroupStart, ncclSend, ncclRecv, ncclGroupEnd on a blocking communicator of its
//            own (raw_nccl.hpp, as DDP makes them), an event recorded after them and synchronized
//   flexcomm flexcomm::nccl's isend and irecv, both waited (launched together on its blocking
//            point-to-point child, with the same event)
// `ratio` is flexcomm's time over raw's (the target: at most 1.1); #wrong counts the received
// elements, after the timed steps, that are not the previous rank's. nccl-tests' flags (-b -e -f
// -n -w), JSON beside the table.
//   mpiexec.mpich -n 2 tests/gpu/nccl_env.sh build/benchmarks/device_p2p_ring -b 8 -e 64M -f 8
//
// Built by nvcc for the GPU, and as C++ against the device stand-in (device_p2p_ring_standin),
// where the numbers mean nothing and the run checks the logic, the results and the output.
#include <boost/program_options.hpp>
#include <mpi.h>

#include <flexcomm/flexcomm.hpp>
#include <flexcomm/backend/cuda/runtime.hpp>

#include "../examples/common/counts.hpp"
#include "flags.hpp"
#include "raw_nccl.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace fc = flexcomm;
namespace dv = flexcomm::device;
namespace po = boost::program_options;

namespace {
// The median over `iters` timed steps (after `warmup`), the slowest rank's, in microseconds.
double time_steps(const std::function<void()>& step, int iters, int warmup, const fc::mpi::communicator& world) {
  for (int i = 0; i < warmup; ++i) step();
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    MPI_Barrier(world.native());
    const auto start = std::chrono::steady_clock::now();
    step();
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(us.begin(), us.begin() + static_cast<std::ptrdiff_t>(us.size() / 2), us.end());
  double mine = us[us.size() / 2], slowest = 0;
  MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, world.native());
  return slowest;
}

// Received elements that are not `want`, over every rank.
std::int64_t wrong_elements(const float* device_buf, std::size_t n, float want, const fc::mpi::communicator& world) {
  std::vector<float> host(n);
  fc::check_cuda(dv::copy_sync(host.data(), device_buf, n * sizeof(float)), "device_p2p_ring: cudaMemcpy");
  std::int64_t mine = std::count_if(host.begin(), host.end(), [want](float x) { return x != want; }), all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT64_T, MPI_SUM, world.native());
  return all;
}
}  // namespace

int main(int argc, char** argv) {
  fc::environment env(argc, argv);
  const auto& world = env.world();
  std::string json;
  std::size_t min_bytes = 0, max_bytes = 0;
  double factor = 8;
  int iters = 20, warmup = 5;
  po::options_description opts("device_p2p_ring: a ring step over flexcomm's nccl sends and receives against raw NCCL");
  opts.add_options()("help,h", "this text")("minbytes,b", benchmark_flags::bytes(&min_bytes, "8"), "smallest size")(
      "maxbytes,e", benchmark_flags::bytes(&max_bytes, "16M"), "largest size")(
      "stepfactor,f", benchmark_flags::above_one(&factor), "size multiplier")(
      "iters,n", counts::at_least<1>(&iters), "timed steps")("warmup_iters,w", counts::at_least<0>(&warmup),
                                                             "warmup steps")(
      "json,J", po::value(&json)->default_value("device_p2p_ring.json"), "JSON output (rank 0)");
  if (const auto status = benchmark_flags::parse(argc, argv, opts, world.rank())) return *status;
  if (!fc::cuda_device_present()) {
    if (world.rank() == 0) std::puts("# no CUDA device: nothing to measure");
    return 0;
  }
  fc::cuda::use_local_device(world);
  const int rank = world.rank(), ranks = world.size(), next = (rank + 1) % ranks, prev = (rank + ranks - 1) % ranks;
  min_bytes = std::max<std::size_t>(min_bytes, 4);
  max_bytes = std::max(max_bytes, min_bytes);

  fc::nccl::communicator comm(world, "p2p ring");
  const dv::nccl_comm_t plain = baseline::nccl_comm(world);
  const dv::stream_t stream = comm.own_stream();
  dv::event_t done = nullptr;
  fc::check_cuda(dv::event_create(&done), "cudaEventCreate");
  float *send = nullptr, *recv = nullptr;
  fc::check_cuda(dv::malloc_device(reinterpret_cast<void**>(&send), max_bytes + 4), "cudaMalloc");
  fc::check_cuda(dv::malloc_device(reinterpret_cast<void**>(&recv), max_bytes + 4), "cudaMalloc");
  const std::vector<float> pattern((max_bytes + 4) / sizeof(float), static_cast<float>(rank + 1));
  fc::check_cuda(dv::copy_sync(send, pattern.data(), pattern.size() * sizeof(float)), "cudaMemcpy");

  if (rank == 0) {
    std::printf("# flexcomm device_p2p_ring on %s: %d ranks, %d steps, %d warmup; each rank sends to the next and"
                " receives from the previous, one group per step\n", dv::implementation, ranks, iters, warmup);
    std::printf("# time: per step, post to completion, median, the slowest rank's; ratio: flexcomm / raw (target"
                " <= 1.1); #wrong: received elements off, all ranks\n");
    std::printf("# %11s %12s %6s | %10s %10s | %7s %7s\n", "size", "count", "type", "raw us", "flexcomm", "ratio",
                "#wrong");
  }
  std::ostringstream rows;
  for (std::size_t bytes = min_bytes; bytes <= max_bytes;
       bytes = std::max(bytes + 1, static_cast<std::size_t>(static_cast<double>(bytes) * factor))) {
    const std::size_t n = bytes / sizeof(float);
    const double raw = time_steps(
        [&] {
          fc::check_nccl(dv::nccl_group_start(), "ncclGroupStart");
          fc::check_nccl(dv::nccl_send(send, n, fc::dtype::f32, next, plain, stream), "ncclSend");
          fc::check_nccl(dv::nccl_recv(recv, n, fc::dtype::f32, prev, plain, stream), "ncclRecv");
          fc::check_nccl(dv::nccl_group_end(), "ncclGroupEnd");
          fc::check_cuda(dv::event_record(done, stream), "cudaEventRecord");
          fc::check_cuda(dv::event_synchronize(done), "cudaEventSynchronize");
        },
        iters, warmup, world);
    const std::int64_t raw_wrong = wrong_elements(recv, n, static_cast<float>(prev + 1), world);
    fc::check_cuda(dv::fill(recv, 0, bytes), "cudaMemset");
    const double ours = time_steps(
        [&] {
          auto r = fc::nccl::irecv(comm, fc::span<float>(recv, n), prev, 0);
          auto s = fc::nccl::isend(comm, fc::span<const float>(send, n), next, 0);
          s.wait();
          r.wait();
        },
        iters, warmup, world);
    const std::int64_t wrong = raw_wrong + wrong_elements(recv, n, static_cast<float>(prev + 1), world);
    if (rank == 0) {
      std::printf("  %11zu %12zu %6s | %10.2f %10.2f | %7.3f %7lld\n", n * sizeof(float), n, "float", raw, ours,
                  ours / raw, static_cast<long long>(wrong));
      rows << (rows.tellp() > 0 ? ",\n" : "") << "  {\"bytes\": " << n * sizeof(float) << ", \"raw_us\": " << raw
           << ", \"flexcomm_us\": " << ours << ", \"ratio\": " << ours / raw << ", \"wrong\": " << wrong << "}";
    }
    if (bytes >= max_bytes) break;
  }
  if (rank == 0)
    std::ofstream(json) << "{\"benchmark\": \"device_p2p_ring\", \"device\": \"" << dv::implementation
                        << "\", \"ranks\": " << ranks << ", \"rows\": [\n" << rows.str() << "\n]}\n";
  dv::event_destroy(done);
  dv::nccl_comm_destroy(plain);
  dv::free_device(send);
  dv::free_device(recv);
  return 0;
}
