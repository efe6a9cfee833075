// Allreduce on device buffers, every way flexcomm offers, against raw NCCL and against the copies
// that bound them, in one run on the same device, buffers and stream, in nccl-tests' format (flags
// -b -e -f -n -w -c; JSON beside the table). Per size, one line per way:
//   flexcomm::nccl   flexcomm's nccl backend                         vs ncclAllReduce
//   ncclAllReduce    plain NCCL on a blocking communicator of its own  vs the d2d copy (out of place)
//   staged           flexcomm's staged backend (pinned memory, MPI)   vs h2d+d2h
//   cuda_aware_mpi   device pointers to MPI; n/a where MPI is not CUDA-aware  vs ncclAllReduce
//   d2d copy         one device-to-device copy of the buffer
//   h2d copy, d2h copy  pinned host to device, device to pinned host, each alone
//   h2d+d2h          both at once on two streams: staged moves every byte down and back up, its
//                    chunks overlapping both ways, so this duplex copy is the most it can reach.
// `vs base` is the base's time over this way's (the fraction of the base's speed it reaches).
//   mpiexec.mpich -n 2 build/benchmarks/allreduce_nccl -b 8 -e 64M -f 4 -n 20 -w 5 -c 1
//
// Built twice from this one file, as device_host_cost is: by nvcc for the GPU, and as C++ against
// the device stand-in (allreduce_nccl_standin, -DFLEXCOMM_DEVICE_STANDIN), where the numbers mean
// nothing and the run checks the logic, the results and the output. Every device call goes
// through flexcomm::device, whose CUDA build forwards to cudaX and ncclX.
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
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

namespace fc = flexcomm;
namespace dv = flexcomm::device;
namespace po = boost::program_options;

namespace {
void sync(dv::stream_t s) { fc::check_cuda(dv::stream_synchronize(s), "allreduce_nccl: stream synchronize"); }

// One way of doing the operation: post() enqueues one, settle() finishes everything posted (both
// timed), tidy() lets go of what settle() left finished (untimed: the nccl backend's requests,
// waited in batches as a trainer would), wrong() counts the elements of the result, after one
// checked operation, that differ from what they must be.
struct way {
  std::function<void()> post, settle, tidy;
  std::function<std::int64_t()> wrong;
};

struct result {
  double us = 0;             // per operation, the slowest rank's
  std::int64_t wrong = -1;   // over every rank; -1: not checked
};

// Elements of `buf` (device or host) that are not `want`.
std::int64_t count_wrong(const float* buf, std::size_t n, float want) {
  std::vector<float> host(n);
  fc::check_cuda(dv::copy_sync(host.data(), buf, n * sizeof(float)), "check: download");
  return std::count_if(host.begin(), host.end(), [want](float x) { return x != want; });
}

// `prepare` gives the send buffer its values and the destinations others (so a way that writes
// nothing is counted wrong). Every rank starts the timed loop together.
result measure(const way& w, const std::function<void()>& prepare, int iters, int warmup, bool check,
               const fc::mpi::communicator& world) {
  prepare();
  for (int i = 0; i < warmup; ++i) w.post();
  w.settle();
  if (w.tidy) w.tidy();
  int go = 0;
  fc::mpi::iallreduce(world, fc::span<int>(&go, 1), fc::op::sum).wait();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) w.post();
  w.settle();
  double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / iters;
  if (w.tidy) w.tidy();
  std::int64_t wrong = 0;
  if (check) {
    prepare();
    w.post();
    w.settle();
    if (w.tidy) w.tidy();
    wrong = w.wrong();
  }
  fc::mpi::iallreduce(world, fc::span<double>(&us, 1), fc::op::max).wait();
  fc::mpi::iallreduce(world, fc::span<std::int64_t>(&wrong, 1), fc::op::sum).wait();
  return {us, check ? wrong : -1};
}

// The lines of each size, in the order printed.
enum : int { w_nccl, w_raw, w_staged, w_direct, w_d2d, w_h2d, w_d2h, w_duplex, way_count };

// One line of the table: a way, out of place and (allreduces) in place.
struct line {
  const char* name;
  bool allreduce = true;  // busbw and in place apply
  bool available = true;  // cuda_aware_mpi: false where the MPI is not CUDA-aware
  int base = -1;          // the line it is compared with; -1: none
  bool in_vs_base = true; // the in-place time is compared too (with the base's in place, or its only time)
  result out, in;
};

std::string cell(bool present, const char* format, double v) {
  char text[32];
  std::snprintf(text, sizeof text, format, v);
  return present ? text : "-";
}
std::string json_number(bool present, double v) { return present ? fc::cat(v) : "null"; }

// Prints one size's lines (rank 0) and returns their JSON rows.
std::string report(const std::vector<line>& lines, std::size_t n, double bus, bool first) {
  const std::size_t used = n * sizeof(float);
  std::string rows;
  for (const auto& l : lines) {
    const line* b = l.base >= 0 ? &lines[static_cast<std::size_t>(l.base)] : nullptr;
    const bool ok = l.available, in_place = ok && l.allreduce;
    const bool vs_out = ok && b && b->available, vs_in = vs_out && in_place && l.in_vs_base;
    const double r_out = vs_out ? b->out.us / l.out.us : 0;
    const double r_in = vs_in ? (b->allreduce ? b->in.us : b->out.us) / l.in.us : 0;
    const double alg_out = used / l.out.us / 1e3, alg_in = in_place ? used / l.in.us / 1e3 : 0;
    const bool out_checked = ok && l.out.wrong >= 0, in_checked = in_place && l.in.wrong >= 0;
    const auto out_wrong = static_cast<double>(l.out.wrong), in_wrong = static_cast<double>(l.in.wrong);
    std::printf("  %11zu %12zu %6s %6s %5d %-14s | %9s %8s %8s %8s | %9s %8s %8s %8s | %-14s %6s %6s\n", used, n,
                "float", "sum", -1, l.name, ok ? cell(true, "%.2f", l.out.us).c_str() : "n/a",
                cell(ok, "%.2f", alg_out).c_str(), cell(ok && l.allreduce, "%.2f", alg_out * bus).c_str(),
                cell(out_checked, "%.0f", out_wrong).c_str(), cell(in_place, "%.2f", l.in.us).c_str(),
                cell(in_place, "%.2f", alg_in).c_str(), cell(in_place, "%.2f", alg_in * bus).c_str(),
                cell(in_checked, "%.0f", in_wrong).c_str(), b ? b->name : "-", cell(vs_out, "%.3f", r_out).c_str(),
                cell(vs_in, "%.3f", r_in).c_str());
    rows += fc::cat(first && rows.empty() ? "" : ",\n", "  {\"size\": ", used, ", \"count\": ", n,
                    ", \"type\": \"float\", \"redop\": \"sum\", \"root\": -1, \"way\": \"", l.name,
                    "\", \"available\": ", ok ? "true" : "false", ", \"out_us\": ", json_number(ok, l.out.us),
                    ", \"out_algbw\": ", json_number(ok, alg_out),
                    ", \"out_busbw\": ", json_number(ok && l.allreduce, alg_out * bus),
                    ", \"out_wrong\": ", json_number(out_checked, out_wrong),
                    ", \"in_us\": ", json_number(in_place, l.in.us), ", \"in_algbw\": ", json_number(in_place, alg_in),
                    ", \"in_busbw\": ", json_number(in_place, alg_in * bus),
                    ", \"in_wrong\": ", json_number(in_checked, in_wrong),
                    ", \"base\": ", b ? fc::cat("\"", b->name, "\"") : "null",
                    ", \"out_vs_base\": ", json_number(vs_out, r_out),
                    ", \"in_vs_base\": ", json_number(vs_in, r_in), "}");
  }
  std::fflush(stdout);
  return rows;
}
}  // namespace

int main(int argc, char** argv) {
  fc::environment env(argc, argv);
  const auto& world = env.world();
  std::string json;
  std::size_t min_bytes = 0, max_bytes = 0;
  double factor = 2;
  int iters = 20, warmup = 5, check_result = 1;
  po::options_description opts(
      "allreduce_nccl: flexcomm's device allreduces against ncclAllReduce and the copies that bound them");
  opts.add_options()("help,h", "this text")("minbytes,b", benchmark_flags::bytes(&min_bytes, "8"), "smallest size")(
      "maxbytes,e", benchmark_flags::bytes(&max_bytes, "32M"), "largest size")(
      "stepfactor,f", benchmark_flags::above_one(&factor), "size multiplier")(
      "iters,n", counts::at_least<1>(&iters), "timed iterations")(
      "warmup_iters,w", counts::at_least<0>(&warmup), "warmup iterations")(
      "check,c", counts::at_least<0>(&check_result), "check results (#wrong)")(
      "json,J", po::value(&json)->default_value("allreduce_nccl.json"), "JSON output (rank 0)");
  if (const auto status = benchmark_flags::parse(argc, argv, opts, world.rank())) return *status;
  if (!fc::cuda_device_present()) {
    if (world.rank() == 0) std::puts("# no CUDA device: nothing to measure");
    return 0;
  }
  fc::cuda::use_local_device(world);
  const int rank = world.rank(), ranks = world.size();
  min_bytes = std::max<std::size_t>(min_bytes, 4);
  max_bytes = std::max(max_bytes, min_bytes);

  fc::nccl::communicator comm(world, "bench");
  fc::staged::communicator scomm(world, "bench staged");
  const bool cuda_aware = fc::mpi_is_cuda_aware();
  fc::cuda_aware_mpi::communicator dcomm;
  if (cuda_aware) dcomm = fc::cuda_aware_mpi::communicator(world, "bench cuda_aware_mpi");
  // The baseline: a plain NCCL communicator of its own (raw_nccl.hpp).
  const dv::nccl_comm_t plain = baseline::nccl_comm(world);
  // A raw NCCL call; the stand-in's communicator is nonblocking, and its first collective returns
  // ncclInProgress until every rank has issued one (as NCCL's does): polled, as NCCL requires.
  auto raw_nccl = [plain](dv::nccl_result_t rc) {
    while (rc == dv::nccl_in_progress)
      fc::check_nccl(dv::nccl_comm_get_async_error(plain, &rc), "ncclCommGetAsyncError");
    fc::check_nccl(rc, "ncclAllReduce");
  };
  dv::stream_t stream = nullptr, other = nullptr;  // other: the duplex copy's second direction
  fc::check_cuda(dv::stream_create(&stream, true), "cudaStreamCreate");
  fc::check_cuda(dv::stream_create(&other, true), "cudaStreamCreate");
  float *send = nullptr, *recv = nullptr, *pattern = nullptr, *landing = nullptr;
  fc::check_cuda(dv::malloc_device(reinterpret_cast<void**>(&send), max_bytes + 4), "cudaMalloc");
  fc::check_cuda(dv::malloc_device(reinterpret_cast<void**>(&recv), max_bytes + 4), "cudaMalloc");
  // Pinned host memory: `pattern` holds rank + 1 everywhere (the send buffer's values, and the
  // source of host-to-device copies); `landing` receives device-to-host copies.
  fc::check_cuda(dv::malloc_pinned(reinterpret_cast<void**>(&pattern), max_bytes + 4), "cudaMallocHost");
  fc::check_cuda(dv::malloc_pinned(reinterpret_cast<void**>(&landing), max_bytes + 4), "cudaMallocHost");
  std::fill(pattern, pattern + (max_bytes + 4) / sizeof(float), static_cast<float>(rank + 1));

  const double bus = ranks > 1 ? 2.0 * (ranks - 1) / ranks : 0.0;
  const float mine = static_cast<float>(rank + 1), sum = static_cast<float>(ranks) * (ranks + 1) / 2.0f;
  if (rank == 0) {
    std::printf("# flexcomm allreduce_nccl on %s: %d ranks, %d iters, %d warmup; cuda_aware_mpi: %s\n",
                dv::implementation, ranks, iters, warmup,
                cuda_aware ? "measured" : "n/a (this MPI is not CUDA-aware)");
    std::printf("# time: per operation, the slowest rank's; algbw = size / time; busbw = algbw x 2(ranks-1)/ranks"
                " (allreduces); #wrong: elements off the expected result, all ranks\n");
    std::printf("# vs base: the base's time / this time (1 = as fast; the in-place one against the base's in-place"
                " time, or its only one)\n");
    std::printf("# %11s %12s %6s %6s %5s %-14s | %-37s | %-37s | %-14s %13s\n", "", "", "", "", "", "",
                "             out-of-place", "               in-place", "", "vs base");
    std::printf("# %11s %12s %6s %6s %5s %-14s | %9s %8s %8s %8s | %9s %8s %8s %8s | %-14s %6s %6s\n", "size", "count",
                "type", "redop", "root", "way", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong",
                "base", "out", "in");
    std::printf("# %11s %12s %6s %6s %5s %-14s | %9s %8s %8s %8s | %9s %8s %8s %8s | %-14s %6s %6s\n", "(B)",
                "(elements)", "", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", "", "",
                "");
    std::fflush(stdout);
  }
  std::string rows;
  std::vector<line> last;
  std::size_t last_bytes = 0;
  for (std::size_t bytes = min_bytes; bytes <= max_bytes;
       bytes = std::max(bytes + 4, static_cast<std::size_t>(static_cast<double>(bytes) * factor))) {
    const std::size_t n = bytes / sizeof(float), used = n * sizeof(float);
    const fc::span<const float> in(send, n);
    const fc::span<float> out(recv, n), same(send, n);
    // The send buffer holds rank + 1; the destinations hold NaN (all bits set).
    auto prepare = [&] {
      fc::check_cuda(dv::copy_async(send, pattern, used, stream), "cudaMemcpyAsync");
      fc::check_cuda(dv::fill(recv, 0xff, used), "cudaMemset");
      std::memset(landing, 0xff, used);
      fc::check_cuda(dv::device_synchronize(), "cudaDeviceSynchronize");
    };
    std::vector<fc::nccl::request> nccl_pending;
    std::vector<fc::staged::request> staged_pending;
    std::vector<fc::cuda_aware_mpi::request> direct_pending;
    nccl_pending.reserve(static_cast<std::size_t>(std::max(iters, warmup)) + 1);
    auto wait_all = [](auto& pending) {
      for (auto& r : pending) r.wait();
      pending.clear();
    };
    auto on_stream = [&] { sync(stream); };
    auto wrong_in = [n](const float* buf, float want) { return [buf, n, want] { return count_wrong(buf, n, want); }; };
    // An allreduce way whose requests finish on the host (staged, cuda_aware_mpi).
    auto host_done = [&](auto& pending) { return [&, p = &pending] { wait_all(*p); sync(stream); }; };

    std::vector<line> lines(way_count);
    std::vector<std::pair<way, way>> ways(way_count);  // out of place, in place
    lines[w_nccl] = {"flexcomm::nccl", true, true, w_raw, true, {}, {}};
    ways[w_nccl] = {{[&] { nccl_pending.push_back(fc::nccl::iallreduce<float>(comm, in, out, fc::op::sum, stream)); },
                on_stream, [&] { wait_all(nccl_pending); }, wrong_in(recv, sum)},
               {[&] { nccl_pending.push_back(fc::nccl::iallreduce(comm, same, fc::op::sum, stream)); }, on_stream,
                [&] { wait_all(nccl_pending); }, wrong_in(send, sum)}};
    lines[w_raw] = {"ncclAllReduce", true, true, w_d2d, false, {}, {}};
    ways[w_raw] = {{[&] { raw_nccl(dv::nccl_allreduce(send, recv, n, fc::dtype::f32, fc::op::sum, plain, stream)); },
                on_stream, {}, wrong_in(recv, sum)},
               {[&] { raw_nccl(dv::nccl_allreduce(send, send, n, fc::dtype::f32, fc::op::sum, plain, stream)); },
                on_stream, {}, wrong_in(send, sum)}};
    lines[w_staged] = {"staged", true, true, w_duplex, true, {}, {}};
    ways[w_staged] = {{[&] {
                         staged_pending.push_back(fc::staged::iallreduce<float>(scomm, in, out, fc::op::sum, stream));
                       },
                host_done(staged_pending), {}, wrong_in(recv, sum)},
               {[&] { staged_pending.push_back(fc::staged::iallreduce(scomm, same, fc::op::sum, stream)); },
                host_done(staged_pending), {}, wrong_in(send, sum)}};
    lines[w_direct] = {"cuda_aware_mpi", true, cuda_aware, w_raw, true, {}, {}};
    ways[w_direct] = {{[&] {
                  direct_pending.push_back(fc::cuda_aware_mpi::iallreduce<float>(dcomm, in, out, fc::op::sum, stream));
                },
                host_done(direct_pending), {}, wrong_in(recv, sum)},
               {[&] { direct_pending.push_back(fc::cuda_aware_mpi::iallreduce(dcomm, same, fc::op::sum, stream)); },
                host_done(direct_pending), {}, wrong_in(send, sum)}};
    auto copy = [&](void* to, const void* from, dv::stream_t s) {
      fc::check_cuda(dv::copy_async(to, from, used, s), "cudaMemcpyAsync");
    };
    lines[w_d2d] = {"d2d copy", false, true, -1, false, {}, {}};
    ways[w_d2d].first = {[&] { copy(recv, send, stream); }, on_stream, {}, wrong_in(recv, mine)};
    lines[w_h2d] = {"h2d copy", false, true, -1, false, {}, {}};
    ways[w_h2d].first = {[&] { copy(recv, pattern, stream); }, on_stream, {}, wrong_in(recv, mine)};
    lines[w_d2h] = {"d2h copy", false, true, -1, false, {}, {}};
    ways[w_d2h].first = {[&] { copy(landing, send, stream); }, on_stream, {}, wrong_in(landing, mine)};
    lines[w_duplex] = {"h2d+d2h", false, true, -1, false, {}, {}};
    ways[w_duplex].first = {[&] {
                       copy(recv, pattern, stream);
                       copy(landing, send, other);
                     },
                     [&] {
                       sync(stream);
                       sync(other);
                     },
                     {},
                     [&] { return count_wrong(recv, n, mine) + count_wrong(landing, n, mine); }};

    for (std::size_t i = 0; i < lines.size(); ++i) {
      if (!lines[i].available) continue;
      lines[i].out = measure(ways[i].first, prepare, iters, warmup, check_result != 0, world);
      if (lines[i].allreduce) lines[i].in = measure(ways[i].second, prepare, iters, warmup, check_result != 0, world);
    }
    if (rank == 0) rows += report(lines, n, bus, rows.empty());
    last = lines;
    last_bytes = used;
  }
  if (rank == 0) {
    // The largest size in one line, for a summary (issue 52's target: staged at 64 MiB reaches 0.8
    // of h2d+d2h's speed at 1 and 2 ranks).
    const auto& staged = last[w_staged];
    const auto& ours = last[w_nccl];
    const auto& nccl = last[w_raw];
    std::printf("# at %zu B: staged %.3f (out of place) and %.3f (in place) of h2d+d2h's speed; flexcomm::nccl %.3f"
                " and %.3f of ncclAllReduce's\n", last_bytes, last[w_duplex].out.us / staged.out.us,
                last[w_duplex].out.us / staged.in.us, nccl.out.us / ours.out.us, nccl.in.us / ours.in.us);
    std::ofstream(json) << "{\"benchmark\": \"allreduce_nccl\", \"device\": \"" << dv::implementation
                        << "\", \"ranks\": " << ranks << ", \"iters\": " << iters << ", \"warmup\": " << warmup
                        << ", \"cuda_aware_mpi\": " << (cuda_aware ? "true" : "false") << ", \"busbw_factor\": " << bus
                        << ", \"rows\": [\n" << rows << "\n]}\n";
  }
  dv::free_device(send);
  dv::free_device(recv);
  dv::free_pinned(pattern);
  dv::free_pinned(landing);
  dv::stream_destroy(stream);
  dv::stream_destroy(other);
  dv::nccl_comm_destroy(plain);
  return 0;
}
