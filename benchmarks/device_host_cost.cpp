// The host time flexcomm's device backends add to each operation over the library call they wrap
// (issue 31, item 1: at most 1 us). Per operation kind and size, in one run: the time to post an
// operation (host enqueue alone) and to post and wait for it, through flexcomm (nccl, staged) and
// through the raw calls beneath, on the same device, buffers and stream; once with the settings as
// the environment gives them and once with the checks and the timeout off (FLEXCOMM_CHECK=0
// FLEXCOMM_TIMEOUT=0). nccl-tests' flags (-b -e -f -n -w) and a JSON file beside the table.
//
// Built twice from this one file: on the GPU (benchmarks/device_host_cost, a copy compiled by nvcc)
// and on the device layer's host stand-in (device_host_cost_standin, -DFLEXCOMM_DEVICE_STANDIN),
// where the raw calls cost almost nothing and the difference is flexcomm's own host work. The raw
// calls go through flexcomm::device, whose CUDA build is inline forwards to cudaX and ncclX.
//   mpiexec -n 1 build/benchmarks/device_host_cost -b 8 -e 64K -f 8 -n 200 -w 20
//
// Raw baselines:
//   nccl    the same NCCL call on a blocking communicator of its own (as DDP makes them), and on
//           flexcomm's communicator, which is nonblocking: there every call returns
//           ncclInProgress and NCCL's own launch must be polled for (ncclCommGetAsyncError), as
//           NCCL requires before the next call ("raw-nb").
//   staged  what a hand-written staged operation does at the call: the device-to-host copy and
//           an event after it (post); then the MPI operation on pinned memory and the copy back
//           (post + wait).
#include <boost/program_options.hpp>
#include <mpi.h>

#include <flexcomm/flexcomm.hpp>
#include <flexcomm/backend/cuda/runtime.hpp>

#include "../examples/common/counts.hpp"
#include "flags.hpp"
#include "raw_nccl.hpp"

#include <algorithm>
#include <chrono>
#include <ctime>
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
using clock_type = std::chrono::steady_clock;

void sync(dv::stream_t s) { fc::check_cuda(dv::stream_synchronize(s), "device_host_cost: stream synchronize"); }

// One way of doing an operation: post() enqueues one (host time measured), settle() finishes
// everything posted so far (not measured).
struct way {
  std::function<void()> post, settle;
};

struct timing {
  double post_us = 0, post_cpu_us = 0, round_us = 0, calls = 0;  // per operation; calls: device-layer calls per post
};

// This thread's CPU time: what a post costs the host itself, whatever else the cores were doing
// (a post that sleeps on a lock held by a stream's worker pays nothing here, and its wall time
// says so).
double thread_cpu_us() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e6 + static_cast<double>(t.tv_nsec) / 1e3;
}

// The median: a post that a busy core or a stream's worker delayed says nothing of the work it does.
double median_us(std::vector<double>& us) {
  std::nth_element(us.begin(), us.begin() + static_cast<std::ptrdiff_t>(us.size() / 2), us.end());
  return us[us.size() / 2];
}

// Per operation, the median over `iters` of: the host time of one post among `iters` in a row
// (settled afterwards, untimed), and of one post-then-settle round; and the mean CPU time of the
// posts. Every rank runs the same
// sequence, started together.
timing measure(const way& w, int iters, int warmup, const fc::mpi::communicator& world) {
  for (int i = 0; i < warmup; ++i) w.post();
  w.settle();
  int go = 0;
  fc::mpi::iallreduce(world, fc::span<int>(&go, 1), fc::op::sum).wait();
  timing t;
  std::vector<double> us(static_cast<std::size_t>(iters));
  const auto calls_before = dv::calls();
  const double cpu_before = thread_cpu_us();
  for (auto& u : us) {
    const auto start = clock_type::now();
    w.post();
    u = std::chrono::duration<double, std::micro>(clock_type::now() - start).count();
  }
  t.post_cpu_us = (thread_cpu_us() - cpu_before) / iters;
  t.calls = static_cast<double>(dv::calls() - calls_before) / iters;
  t.post_us = median_us(us);
  w.settle();
  fc::mpi::iallreduce(world, fc::span<int>(&go, 1), fc::op::sum).wait();
  for (auto& u : us) {
    const auto start = clock_type::now();
    w.post();
    w.settle();
    u = std::chrono::duration<double, std::micro>(clock_type::now() - start).count();
  }
  t.round_us = median_us(us);
  return t;
}

template <class Request>
struct pending {
  std::vector<Request> requests;
  void settle() {
    for (auto& r : requests) r.wait();
    requests.clear();
  }
};
}  // namespace

int main(int argc, char** argv) {
  fc::environment env(argc, argv);
  const auto& world = env.world();
  std::string json;
  std::size_t min_bytes = 0, max_bytes = 0;
  double factor = 8;
  int iters = 200, warmup = 20;
  po::options_description opts("device_host_cost: flexcomm's host time per device operation over the raw calls");
  opts.add_options()("help,h", "this text")("minbytes,b", benchmark_flags::bytes(&min_bytes, "8"), "smallest size")(
      "maxbytes,e", benchmark_flags::bytes(&max_bytes, "64K"), "largest size")(
      "stepfactor,f", benchmark_flags::above_one(&factor), "size multiplier")(
      "iters,n", counts::at_least<1>(&iters), "operations timed per row")(
      "warmup_iters,w", counts::at_least<0>(&warmup), "warmup operations per row")(
      "json,J", po::value(&json)->default_value("device_host_cost.json"), "JSON output (rank 0)");
  if (const auto status = benchmark_flags::parse(argc, argv, opts, world.rank())) return *status;
  if (!fc::cuda_device_present()) {
    if (world.rank() == 0) std::puts("# no CUDA device: nothing to measure");
    return 0;
  }
  fc::cuda::use_local_device(world);
  const int rank = world.rank(), ranks = world.size();
  min_bytes = std::max<std::size_t>(min_bytes, 4);
  const int to = (rank + 1) % ranks, from = (rank + ranks - 1) % ranks;

  fc::nccl::communicator comm(world, "bench");
  fc::staged::communicator scomm(world, "bench staged");
  // The baseline: a plain NCCL communicator of its own (raw_nccl.hpp).
  const dv::nccl_comm_t plain = baseline::nccl_comm(world);
  dv::stream_t stream = nullptr;
  fc::check_cuda(dv::stream_create(&stream, true), "cudaStreamCreate");
  float *a = nullptr, *b = nullptr, *host = nullptr;
  fc::check_cuda(dv::malloc_device(reinterpret_cast<void**>(&a), max_bytes + 4), "cudaMalloc");
  fc::check_cuda(dv::malloc_device(reinterpret_cast<void**>(&b), max_bytes + 4), "cudaMalloc");
  fc::check_cuda(dv::malloc_pinned(reinterpret_cast<void**>(&host), 2 * (max_bytes + 4)), "cudaMallocHost");
  fc::check_cuda(dv::fill(a, 0, max_bytes + 4), "cudaMemset");
  fc::check_cuda(dv::fill(b, 0, max_bytes + 4), "cudaMemset");
  fc::check_cuda(dv::device_synchronize(), "cudaDeviceSynchronize");
  dv::event_t staged_event = nullptr;
  fc::check_cuda(dv::event_create(&staged_event), "cudaEventCreate");

  // Polls a nonblocking NCCL communicator until its last call is enqueued.
  auto settle_nb = [](dv::nccl_comm_t c) {
    dv::nccl_result_t state = dv::nccl_in_progress;
    while (state == dv::nccl_in_progress) fc::check_nccl(dv::nccl_comm_get_async_error(c, &state), "ncclCommGetAsyncError");
    fc::check_nccl(state, "nccl");
  };
  // A raw NCCL call followed by the event a caller records to know when it is done, as flexcomm
  // records one per operation: the comparison is of like with like.
  dv::event_t raw_event = nullptr;
  fc::check_cuda(dv::event_create(&raw_event), "cudaEventCreate");
  auto nccl_call = [&](dv::nccl_result_t rc, dv::nccl_comm_t c, bool nonblocking) {
    fc::check_nccl(rc, "raw nccl");
    if (nonblocking && rc == dv::nccl_in_progress) settle_nb(c);
    fc::check_cuda(dv::event_record(raw_event, stream), "cudaEventRecord");
  };
  // The MPI half of a raw staged operation, on pinned memory, waited for.
  auto mpi_wait = [](MPI_Request r) { MPI_Wait(&r, MPI_STATUS_IGNORE); };

  struct row {
    std::string backend, kind, settings, baseline;
    std::size_t bytes;
    timing ours, raw;
  };
  std::vector<row> rows;
  // flexcomm keeps what an operation needs (launch records, events, pinned buffers) for the next
  // ones, as many as were ever in flight at once: posting `iters` of each kind in a row once, before
  // any row, leaves every timed post with what it needs, as a trainer's steady state does.
  {
    const std::size_t n = max_bytes / sizeof(float);
    std::vector<fc::nccl::request> nr;
    std::vector<fc::staged::request> sr;
    for (int i = 0; i < iters; ++i) {
      nr.push_back(fc::nccl::iallreduce(comm, fc::span<float>(a, n), fc::op::sum, stream));
      nr.push_back(fc::nccl::isend(comm, fc::span<const float>(b, n), to, 0, stream));
      nr.push_back(fc::nccl::irecv(comm, fc::span<float>(a, n), from, 0, stream));
      sr.push_back(fc::staged::iallreduce(scomm, fc::span<float>(a, n), fc::op::sum, stream));
    }
    for (auto& r : nr) r.wait();
    for (auto& r : sr) r.wait();
    sync(stream);
  }
  const char* settings_names[] = {"env", "off"};
  const bool env_checks = fc::checks_enabled();
  const auto env_timeout = fc::default_timeout();

  for (int setting = 0; setting < 2; ++setting) {
    fc::set_checks(setting == 0 ? env_checks : false);
    fc::set_default_timeout(setting == 0 ? env_timeout : std::chrono::milliseconds{0});
    for (std::size_t bytes = min_bytes; bytes <= max_bytes;
         bytes = std::max(bytes + 4, static_cast<std::size_t>(static_cast<double>(bytes) * factor))) {
      const std::size_t n = bytes / sizeof(float);
      const fc::span<float> sa(a, n), sb(b, n);
      const auto nc = comm.native();
      pending<fc::nccl::request> np;
      pending<fc::staged::request> sp;
      auto nccl_settle = [&] {
        np.settle();
        sync(stream);
      };
      auto raw_settle = [&] { sync(stream); };
      auto add = [&](const char* backend, const char* kind, const char* baseline, const way& ours, const way& raw) {
        row r{backend, kind, settings_names[setting], baseline, n * sizeof(float), {}, {}};
        r.ours = measure(ours, iters, warmup, world);
        r.raw = measure(raw, iters, warmup, world);
        rows.push_back(r);
      };
      // nccl: allreduce out of place and in place, a send/receive pair, a broadcast.
      const way nccl_ar{[&] { np.requests.push_back(fc::nccl::iallreduce<float>(comm, sb, sa, fc::op::sum, stream)); },
                        nccl_settle};
      const way nccl_ar_in{[&] { np.requests.push_back(fc::nccl::iallreduce(comm, sa, fc::op::sum, stream)); },
                           nccl_settle};
      const way nccl_p2p{[&] {
                           np.requests.push_back(fc::nccl::isend(comm, fc::span<const float>(sb), to, 0, stream));
                           np.requests.push_back(fc::nccl::irecv(comm, sa, from, 0, stream));
                         },
                         nccl_settle};
      const way nccl_bc{[&] { np.requests.push_back(fc::nccl::ibcast(comm, sa, 0, stream)); }, nccl_settle};
      for (const bool nb : {false, true}) {
        const dv::nccl_comm_t c = nb ? nc : plain;
        const char* baseline = nb ? "raw-nb" : "raw";
        add("nccl", "allreduce", baseline, nccl_ar,
            {[&, c, nb] { nccl_call(dv::nccl_allreduce(b, a, n, fc::dtype::f32, fc::op::sum, c, stream), c, nb); },
             raw_settle});
        add("nccl", "allreduce_inplace", baseline, nccl_ar_in,
            {[&, c, nb] { nccl_call(dv::nccl_allreduce(a, a, n, fc::dtype::f32, fc::op::sum, c, stream), c, nb); },
             raw_settle});
        add("nccl", "sendrecv", baseline, nccl_p2p,
            {[&, c, nb] {
               fc::check_nccl(dv::nccl_group_start(), "ncclGroupStart");
               fc::check_nccl(dv::nccl_send(b, n, fc::dtype::f32, to, c, stream), "ncclSend");
               fc::check_nccl(dv::nccl_recv(a, n, fc::dtype::f32, from, c, stream), "ncclRecv");
               nccl_call(dv::nccl_group_end(), c, nb);
             },
             raw_settle});
        add("nccl", "bcast", baseline, nccl_bc,
            {[&, c, nb] { nccl_call(dv::nccl_broadcast(a, a, n, fc::dtype::f32, 0, c, stream), c, nb); }, raw_settle});
      }
      // staged: the same four, against the copies and MPI calls a hand-written one makes.
      const MPI_Comm mc = scomm.native();
      float* h = host;
      float* h2 = host + n;
      auto staged_settle = [&] {
        sp.settle();
        sync(stream);
      };
      auto stage_down = [&](const float* from_device, float* to_host) {
        fc::check_cuda(dv::copy_async(to_host, from_device, n * sizeof(float), stream), "cudaMemcpyAsync");
        fc::check_cuda(dv::event_record(staged_event, stream), "cudaEventRecord");
      };
      // A raw round: down, MPI, up. `post_only` stops after the copy down.
      auto raw_staged = [&](std::function<MPI_Request()> mpi_op, bool up) {
        return way{[&, mpi_op, up] { stage_down(b, h); },
                   [&, mpi_op, up] {
                     sync(stream);
                     mpi_wait(mpi_op());
                     if (up) fc::check_cuda(dv::copy_async(a, h2, n * sizeof(float), stream), "cudaMemcpyAsync");
                     sync(stream);
                   }};
      };
      const int count = static_cast<int>(n);
      add("staged", "allreduce", "raw",
          {[&] { sp.requests.push_back(fc::staged::iallreduce<float>(scomm, sb, sa, fc::op::sum, stream)); }, staged_settle},
          raw_staged([&] {
            MPI_Request r;
            MPI_Iallreduce(h, h2, count, MPI_FLOAT, MPI_SUM, mc, &r);
            return r;
          }, true));
      add("staged", "allreduce_inplace", "raw",
          {[&] { sp.requests.push_back(fc::staged::iallreduce(scomm, sa, fc::op::sum, stream)); }, staged_settle},
          raw_staged([&] {
            MPI_Request r;
            MPI_Iallreduce(MPI_IN_PLACE, h, count, MPI_FLOAT, MPI_SUM, mc, &r);
            return r;
          }, true));
      add("staged", "sendrecv", "raw",
          {[&] {
             sp.requests.push_back(fc::staged::isend(scomm, fc::span<const float>(sb), to, 0, stream));
             sp.requests.push_back(fc::staged::irecv(scomm, sa, from, 0, stream));
           },
           staged_settle},
          raw_staged([&] {
            MPI_Request r[2];
            MPI_Irecv(h2, count, MPI_FLOAT, from, 0, mc, &r[1]);
            MPI_Isend(h, count, MPI_FLOAT, to, 0, mc, &r[0]);
            MPI_Wait(&r[0], MPI_STATUS_IGNORE);
            return r[1];
          }, true));
      add("staged", "bcast", "raw",
          {[&] { sp.requests.push_back(fc::staged::ibcast(scomm, sa, 0, stream)); }, staged_settle},
          raw_staged([&] {
            MPI_Request r;
            MPI_Ibcast(h, count, MPI_FLOAT, 0, mc, &r);
            return r;
          }, true));
      if (n == 0) break;
    }
  }
  fc::set_checks(env_checks);
  fc::set_default_timeout(env_timeout);

  if (rank == 0) {
    std::printf("# flexcomm device_host_cost on %s: %d ranks, %d iters, %d warmup; settings env = checks %s, "
                "timeout %lld ms; off = FLEXCOMM_CHECK=0 FLEXCOMM_TIMEOUT=0\n",
                dv::implementation, ranks, iters, warmup, env_checks ? "on" : "off",
                static_cast<long long>(env_timeout.count()));
    std::printf("# host time per operation (us): post = enqueue only (wall, median); cpu = the posting thread's CPU time"
                " per post (mean); round = post then wait (wall, median); added = flexcomm - raw; calls = device-layer"
                " calls per post (stand-in only)\n");
    std::printf("# %7s %-17s %3s %6s %7s | %8s %8s %7s | %8s %8s %7s | %5s %5s | %9s %9s\n", "backend", "operation",
                "set", "base", "size(B)", "fc post", "raw post", "added", "fc cpu", "raw cpu", "added", "calls", "raw",
                "fc round", "raw round");
    std::string json_rows;
    for (const auto& r : rows) {
      std::printf("  %7s %-17s %3s %6s %7zu | %8.2f %8.2f %7.2f | %8.2f %8.2f %7.2f | %5.1f %5.1f | %9.1f %9.1f\n",
                  r.backend.c_str(), r.kind.c_str(), r.settings.c_str(), r.baseline.c_str(), r.bytes, r.ours.post_us,
                  r.raw.post_us, r.ours.post_us - r.raw.post_us, r.ours.post_cpu_us, r.raw.post_cpu_us,
                  r.ours.post_cpu_us - r.raw.post_cpu_us, r.ours.calls, r.raw.calls, r.ours.round_us, r.raw.round_us);
      json_rows += fc::cat(json_rows.empty() ? "" : ",\n", "  {\"backend\": \"", r.backend, "\", \"operation\": \"",
                           r.kind, "\", \"settings\": \"", r.settings, "\", \"baseline\": \"", r.baseline,
                           "\", \"size\": ", r.bytes, ", \"flexcomm_post_us\": ", r.ours.post_us,
                           ", \"raw_post_us\": ", r.raw.post_us, ", \"flexcomm_post_cpu_us\": ", r.ours.post_cpu_us,
                           ", \"raw_post_cpu_us\": ", r.raw.post_cpu_us, ", \"flexcomm_round_us\": ", r.ours.round_us,
                           ", \"raw_round_us\": ", r.raw.round_us, ", \"flexcomm_calls_per_post\": ", r.ours.calls,
                           ", \"raw_calls_per_post\": ", r.raw.calls, "}");
    }
    std::ofstream(json) << "{\"benchmark\": \"device_host_cost\", \"device\": \"" << dv::implementation
                        << "\", \"ranks\": " << ranks << ", \"iters\": " << iters << ", \"checks\": "
                        << (env_checks ? "true" : "false") << ", \"timeout_ms\": " << env_timeout.count()
                        << ", \"rows\": [\n" << json_rows << "\n]}\n";
  }
  dv::event_destroy(staged_event);
  dv::event_destroy(raw_event);
  dv::free_device(a);
  dv::free_device(b);
  dv::free_pinned(host);
  dv::stream_destroy(stream);
  dv::nccl_comm_destroy(plain);
  return 0;
}
