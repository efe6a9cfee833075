// Allreduce on device buffers: flexcomm's nccl backend against plain ncclAllReduce, in one run,
// on the same GPU stream, in nccl-tests' format (flags -b -e -f -n -w -c; JSON beside the table).
//   mpiexec -n 2 build/benchmarks/allreduce_nccl -b 8 -e 64M -f 4 -n 20 -w 5 -c 1
#include <boost/program_options.hpp>
#include <cuda_runtime.h>
#include <nccl.h>

#include <flexcomm/flexcomm.hpp>

#include "../examples/common/counts.hpp"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace fc = flexcomm;
namespace po = boost::program_options;

namespace {
__global__ void fill(float* x, std::size_t n, float v) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    x[i] = v;
}

struct result {
  double us = 0;
  long wrong = 0;
};

// Counts elements that differ from the sum of (rank + 1) over all ranks.
long count_wrong(const float* recv, std::size_t n, int ranks) {
  std::vector<float> host(n);
  fc::check_cuda(cudaMemcpy(host.data(), recv, n * sizeof(float), cudaMemcpyDeviceToHost), "check: download");
  const float want = static_cast<float>(ranks) * (ranks + 1) / 2.0f;
  long wrong = 0;
  for (float x : host) wrong += x != want;
  return wrong;
}

template <class Launch>
result measure(Launch&& launch, float* send, float* recv, std::size_t n, int rank, int ranks, int iters, int warmup,
               bool check_result, cudaStream_t stream, const fc::mpi::communicator& world) {
  result r;
  const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>((n + 255) / 256 + 1, 1024));
  fill<<<blocks, 256, 0, stream>>>(send, n, static_cast<float>(rank + 1));
  fc::check_cuda(cudaStreamSynchronize(stream), "fill");
  for (int i = 0; i < warmup; ++i) launch();
  fc::check_cuda(cudaStreamSynchronize(stream), "warmup");
  int go = 0;
  fc::mpi::iallreduce(world, fc::span<int>(&go, 1), fc::op::sum).wait();  // start together
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) launch();
  fc::check_cuda(cudaStreamSynchronize(stream), "timed loop");
  r.us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / iters;
  if (check_result) {
    fill<<<blocks, 256, 0, stream>>>(send, n, static_cast<float>(rank + 1));
    launch();
    fc::check_cuda(cudaStreamSynchronize(stream), "check run");
    r.wrong = count_wrong(recv, n, ranks);
  }
  return r;
}
}  // namespace

int main(int argc, char** argv) {
  fc::environment env(argc, argv);
  const auto& world = env.world();
  std::string min_text, max_text, json;
  double factor = 2;
  int iters = 20, warmup = 5, check_result = 1;
  po::options_description opts("allreduce_nccl: flexcomm nccl backend vs ncclAllReduce");
  opts.add_options()("help,h", "this text")("minbytes,b", po::value(&min_text)->default_value("8"), "smallest size")(
      "maxbytes,e", po::value(&max_text)->default_value("32M"), "largest size")(
      "stepfactor,f", po::value(&factor)->default_value(2), "size multiplier")(
      "iters,n", counts::at_least<1>(&iters), "timed iterations")(
      "warmup_iters,w", counts::at_least<0>(&warmup), "warmup iterations")(
      "check,c", counts::at_least<0>(&check_result), "check results (#wrong)")(
      "json,J", po::value(&json)->default_value("allreduce_nccl.json"), "JSON output (rank 0)");
  po::variables_map vm;
  po::store(po::parse_command_line(argc, argv, opts), vm);
  po::notify(vm);
  if (vm.count("help")) {
    if (world.rank() == 0) std::cout << opts << "\n";
    return 0;
  }
  if (!fc::cuda_device_present()) {
    if (world.rank() == 0) std::puts("# no CUDA device: nothing to measure");
    return 0;
  }
  fc::cuda::use_local_device(world);
  const int rank = world.rank(), ranks = world.size();

  fc::nccl::communicator comm(world, "bench");
  // The baseline: a plain blocking NCCL communicator, made the way NCCL's examples make it.
  std::vector<std::uint8_t> id_bytes(sizeof(ncclUniqueId));
  if (rank == 0) {
    ncclUniqueId id;
    fc::check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    std::memcpy(id_bytes.data(), &id, sizeof id);
  }
  fc::mpi::ibcast(world, fc::span<std::uint8_t>(id_bytes), 0).wait();
  ncclUniqueId id;
  std::memcpy(&id, id_bytes.data(), sizeof id);
  ncclComm_t plain = nullptr;
  fc::check_nccl(ncclCommInitRank(&plain, ranks, id, rank), "ncclCommInitRank");
  cudaStream_t stream = nullptr;
  fc::check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");

  const std::size_t min_bytes = std::max<std::size_t>(fc::parse_bytes(min_text, "-b"), 4), max_bytes = fc::parse_bytes(max_text, "-e");
  float *send = nullptr, *recv = nullptr;
  fc::check_cuda(cudaMalloc(&send, max_bytes + 4), "cudaMalloc");
  fc::check_cuda(cudaMalloc(&recv, max_bytes + 4), "cudaMalloc");

  const double bus = ranks > 1 ? 2.0 * (ranks - 1) / ranks : 0.0;
  if (rank == 0) {
    std::printf("# flexcomm allreduce_nccl: %d ranks, %d iters, %d warmup\n", ranks, iters, warmup);
    std::printf("# %11s %12s %6s %6s %5s | %-38s | %-38s | %7s\n", "", "", "", "", "",
                "       flexcomm::nccl out-of-place", "       ncclAllReduce out-of-place", "");
    std::printf("# %11s %12s %6s %6s %5s | %9s %8s %8s %8s | %9s %8s %8s %8s | %7s %7s\n", "size", "count", "type",
                "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong", "ratio",
                "inplace");
    std::printf("# %11s %12s %6s %6s %5s | %9s %8s %8s %8s | %9s %8s %8s %8s | %7s %7s\n", "(B)", "(elements)", "", "",
                "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", "fc/nccl", "fc/nccl");
  }
  std::string rows;
  for (std::size_t bytes = min_bytes; bytes <= max_bytes;
       bytes = std::max(bytes + 4, static_cast<std::size_t>(static_cast<double>(bytes) * factor))) {
    const std::size_t n = bytes / sizeof(float);
    const fc::span<const float> in(send, n);
    const fc::span<float> out(recv, n), same(send, n);
    std::vector<fc::nccl::request> pending;
    pending.reserve(static_cast<std::size_t>(std::max(iters, warmup)) + 1);
    auto flush = [&] {
      for (auto& r : pending) r.wait();
      pending.clear();
    };
    const auto ours = measure(
        [&] {
          pending.push_back(fc::nccl::iallreduce<float>(comm, in, out, fc::op::sum, stream));
          if (pending.size() == pending.capacity()) flush();
        },
        send, recv, n, rank, ranks, iters, warmup, check_result, stream, world);
    flush();
    const auto theirs = measure(
        [&] { fc::check_nccl(ncclAllReduce(send, recv, n, ncclFloat32, ncclSum, plain, stream), "ncclAllReduce"); },
        send, recv, n, rank, ranks, iters, warmup, check_result, stream, world);
    // In place: the same two, on one buffer (checked by the out-of-place runs above).
    const auto ours_in = measure(
        [&] { pending.push_back(fc::nccl::iallreduce(comm, same, fc::op::sum, stream)); if (pending.size() == pending.capacity()) flush(); },
        send, send, n, rank, ranks, iters, warmup, false, stream, world);
    flush();
    const auto theirs_in = measure(
        [&] { fc::check_nccl(ncclAllReduce(send, send, n, ncclFloat32, ncclSum, plain, stream), "ncclAllReduce"); },
        send, send, n, rank, ranks, iters, warmup, false, stream, world);
    const std::size_t used = n * sizeof(float);
    const double alg_ours = used / ours.us / 1e3, alg_theirs = used / theirs.us / 1e3;
    if (rank == 0) {
      std::printf("  %11zu %12zu %6s %6s %5d | %9.2f %8.2f %8.2f %8ld | %9.2f %8.2f %8.2f %8ld | %7.3f %7.3f\n", used, n,
                  "float", "sum", -1, ours.us, alg_ours, alg_ours * bus, ours.wrong, theirs.us, alg_theirs,
                  alg_theirs * bus, theirs.wrong, ours.us / theirs.us, ours_in.us / theirs_in.us);
      rows += fc::cat(rows.empty() ? "" : ",\n", "  {\"size\": ", used, ", \"count\": ", n,
                      ", \"type\": \"float\", \"redop\": \"sum\", \"root\": -1, \"flexcomm_us\": ", ours.us,
                      ", \"nccl_us\": ", theirs.us, ", \"flexcomm_inplace_us\": ", ours_in.us,
                      ", \"nccl_inplace_us\": ", theirs_in.us, ", \"flexcomm_wrong\": ", ours.wrong,
                      ", \"nccl_wrong\": ", theirs.wrong, ", \"busbw_factor\": ", bus, "}");
    }
    if (n == 0) break;
  }
  if (rank == 0) {
    std::ofstream(json) << "{\"benchmark\": \"allreduce_nccl\", \"ranks\": " << ranks << ", \"iters\": " << iters
                        << ", \"rows\": [\n" << rows << "\n]}\n";
  }
  cudaFree(send);
  cudaFree(recv);
  cudaStreamDestroy(stream);
  ncclCommDestroy(plain);
  return 0;
}
