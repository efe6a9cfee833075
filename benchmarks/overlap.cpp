// overlap: a synthetic backprop over the real per-layer parameter counts of ResNet-50 and VGG-16
// (scaled down), compute per layer proportional to its size, gradients handed to a Sync as each
// layer finishes. OSU-style columns: Overall, Compute, Pure-Comm, Overlap(%).
//   mpiexec -n 2 build/benchmarks/overlap --scale 64 -n 10 -w 3 -j overlap.json
// Overlap(%) = 100 * (1 - (Overall - Compute) / Pure-Comm), clamped to [0, 100], as OSU's
// nonblocking-collective benchmarks define it: the share of communication hidden behind compute.
// Hidden(%) uses the communication sync-after-backward exposes (its Overall - Compute) instead of
// Pure-Comm: on an oversubscribed node the isolated Pure-Comm loop is scheduled differently.
// Each model runs twice: backward as CPU work on the trainer thread, and backward with the host
// idle for as long (what a trainer whose accelerator computes looks like to the CPU).
// Every adapter runs twice, timed one right after the other: with the intra-host shared-memory
// path off (the backend's allreduce, or the ring), and with it automatic ("shm" rows: on one
// host the buckets go through one shared-memory segment, as a user gets them by default).
// FLEXCOMM_SHM is overridden for both. An shm row's Hidden(%) is against the shm sync after
// backward (what that path exposes); its speedup against sync after backward with shm off (what
// a user had without it); shm/off is its Overall over the same adapter's with shm off.
// Overall - Compute is a small difference of two large, separately timed means (idle backward:
// sleeps whose wake-ups jitter), so each row also times what backward leaves: Tail(us), the mean
// time the trainer spends in finish() once its last gradient is handed over, on the same steps;
// Tail-hidden(%) = 100 (1 - Tail / the same path's sync-after-backward Tail). The idle
// backward sleeps with a 1 us timer slack (see main).
// With --trace-dir, overlapped_ring's row (shm off) runs again with tracing on, between two runs
// with it off, and the ratio says what FLEXCOMM_TRACE costs a step; with the host idle,
// overlapped_ring shm is traced too, into <dir>/<model>_ring_shm_idle (each bucket's reduction
// from post to result, its copy back, finish()).
// With --gradient-memory, every adapter keeps the gradients in its own gradient_memory() (on one
// host: shared memory, where a bucket of one gradient is reduced in place), as a trainer that
// adopts it would; without, in the trainer's own vectors.
#include <boost/program_options.hpp>

#include <flexcomm/flexcomm.hpp>

#include "../examples/common/counts.hpp"
#include "flags.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace fc = flexcomm;
namespace po = boost::program_options;
using fc::mpi;

namespace {

// A ratio as the tables print it: two decimals.
std::string two_places(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", x);
  return text;
}

// torchvision's resnet50: every parameter tensor (conv weights, batch-norm weight and bias, fc),
// in forward order. 25,557,032 parameters.
std::vector<std::size_t> resnet50() {
  std::vector<std::size_t> p;
  auto conv = [&](std::size_t in, std::size_t out, std::size_t k) { p.push_back(in * out * k * k); };
  auto bn = [&](std::size_t c) { p.push_back(c); p.push_back(c); };
  conv(3, 64, 7);
  bn(64);
  std::size_t inplanes = 64;
  const std::size_t planes[] = {64, 128, 256, 512}, blocks[] = {3, 4, 6, 3};
  for (int layer = 0; layer < 4; ++layer)
    for (std::size_t b = 0; b < blocks[layer]; ++b) {
      const std::size_t width = planes[layer], out = planes[layer] * 4;
      conv(inplanes, width, 1); bn(width);
      conv(width, width, 3); bn(width);
      conv(width, out, 1); bn(out);
      if (b == 0) { conv(inplanes, out, 1); bn(out); }  // downsample
      inplanes = out;
    }
  p.push_back(2048 * 1000);
  p.push_back(1000);
  return p;
}

// torchvision's vgg16 (no batch norm): 13 convolutions and 3 linear layers, weights and biases.
// 138,357,544 parameters.
std::vector<std::size_t> vgg16() {
  std::vector<std::size_t> p;
  std::size_t in = 3;
  for (int c : {64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0}) {
    if (c == 0) continue;  // max pool
    p.push_back(in * static_cast<std::size_t>(c) * 9);
    p.push_back(static_cast<std::size_t>(c));
    in = static_cast<std::size_t>(c);
  }
  for (auto [i, o] : {std::pair<std::size_t, std::size_t>{25088, 4096}, {4096, 4096}, {4096, 1000}}) {
    p.push_back(i * o);
    p.push_back(o);
  }
  return p;
}

// "Backward" of one layer: `work` dependent multiply-adds per parameter, written as its gradient.
void compute_gradient(fc::span<float> g, int work, int step) {
  for (std::size_t i = 0; i < g.size(); ++i) {
    float x = static_cast<float>((i + static_cast<std::size_t>(step)) % 7) * 0.125f;
    for (int k = 0; k < work; ++k) x = x * 0.999f + 0.001f;
    g[i] = x;
  }
}

// The same backward with the host thread idle, as when an accelerator computes: after layer l
// the thread sleeps until `share` of `total` has passed since `start`, share being the layers'
// parameters so far. The values written are the same as compute_gradient's at work 0.
void idle_gradient(fc::span<float> g, int step, std::chrono::steady_clock::time_point start,
                   std::chrono::duration<double, std::micro> total, double share) {
  compute_gradient(g, 0, step);
  std::this_thread::sleep_until(start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(total * share));
}

double max_over_ranks(const mpi::communicator& comm, double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, comm.native());
  return v;
}

// Mean step time in microseconds (slowest rank) over n steps after w warmup steps.
double time_steps(const mpi::communicator& comm, int warmup, int iters, const std::function<void(int)>& step) {
  for (int i = 0; i < warmup; ++i) step(i);
  MPI_Barrier(comm.native());
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) step(warmup + i);
  const double us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / iters;
  return max_over_ranks(comm, us);
}

double overlap_percent(double overall, double compute, double comm) {
  if (comm <= 0) return 0;
  return std::clamp(100.0 * (1.0 - (overall - compute) / comm), 0.0, 100.0);
}

}  // namespace

int main(int argc, char** argv) {
  fc::environment env(argc, argv);
  const auto& world = env.world();
  std::string models, json, bucket_text, last_bucket_text, trace_dir;
  bool in_gradient_memory = false;
  double scale;
  int iters = 10, warmup = 3, work = 16;
  po::options_description opts("overlap");
  opts.add_options()("help,h", "this help")
      ("models,m", po::value(&models)->default_value("resnet50,vgg16"), "resnet50, vgg16 or both")
      ("scale", po::value(&scale)->default_value(64), "divide every layer's parameter count by this")
      ("bucket,b", po::value(&bucket_text)->default_value(""), "bucket bytes (default: 25 MiB / scale)")
      ("last-bucket", po::value(&last_bucket_text)->default_value(""),
       "bytes of the bucket that fills last (sync_options::last_bucket_bytes; default: the library's; 0: none)")
      ("work,k", counts::at_least<1>(&work), "multiply-adds per parameter in backward")
      ("iters,n", counts::at_least<1>(&iters), "timed steps")
      ("warmup_iters,w", counts::at_least<0>(&warmup), "warmup steps (the first plans the buckets)")
      ("json,j", po::value(&json), "write results as JSON here (rank 0)")
      ("trace-dir", po::value(&trace_dir), "also time overlapped_ring with tracing on, writing traces here")
      ("gradient-memory", po::bool_switch(&in_gradient_memory),
       "every adapter keeps the gradients in its gradient_memory() (shared memory on one host)");
  if (const auto status = benchmark_flags::parse(argc, argv, opts, world.rank())) return *status;
  const bool root = world.rank() == 0;
  // The idle backward's sleeps end within a microsecond of their deadline, as a host woken by an
  // accelerator's completion would, not up to the default 50 us timer slack later.
  fc::detail::tighten_timer_slack();
  if (root)
    std::printf("# flexcomm overlap: %d ranks, %d per node, %u cores, wait %s, scale 1/%g, %d multiply-adds/param\n",
                world.size(), env.ranks_on_node(), std::thread::hardware_concurrency(),
                fc::name_of(env.wait().kind), scale, work);
  std::string records;
  bool shm_rows_used = true;  // every shm row went through shared memory
  for (const char* name : {"resnet50", "vgg16"}) {
    const std::string model = name;
    if (models.find(model) == std::string::npos) continue;
    const auto full = model == "resnet50" ? resnet50() : vgg16();
    std::vector<std::vector<float>> grads;
    for (std::size_t n : full) grads.emplace_back(std::max<std::size_t>(1, static_cast<std::size_t>(std::llround(n / scale))));
    const std::size_t params = std::accumulate(full.begin(), full.end(), std::size_t{0});
    std::size_t scaled = 0;
    for (auto& g : grads) scaled += g.size();
    fc::sync_options options;
    options.bucket_bytes = bucket_text.empty() ? std::max<std::size_t>(4096, static_cast<std::size_t>(fc::default_bucket_bytes / scale))
                                               : fc::parse_bytes(bucket_text, "--bucket");
    if (!last_bucket_text.empty())
      options.last_bucket_bytes = last_bucket_text == "0" ? 0 : fc::parse_bytes(last_bucket_text, "--last-bucket");
    const int layers = static_cast<int>(grads.size());
    // Backprop runs from the last layer to the first. `idle` > 0: the host waits out that many
    // microseconds instead of computing (an accelerator's backward), spread over the layers.
    double idle = 0;
    // Time in finish() over the timed steps (step >= warmup) of the current measurement.
    double tail_us = 0;
    // Where each gradient lies: the trainer's vectors, or (--gradient-memory) an adapter's memory.
    using placement = std::vector<fc::span<float>>;
    placement own;
    for (auto& g : grads) own.emplace_back(g);
    auto place = [&](auto& sync) {
      if (!in_gradient_memory) return own;
      std::size_t floats = 0;
      for (const auto& g : grads) floats += (g.size() + 15) / 16 * 16;  // each on its own cache lines
      const auto memory = sync.gradient_memory(floats * sizeof(float));  // collective: same order everywhere
      placement at;
      float* next = reinterpret_cast<float*>(memory.data());
      for (const auto& g : grads) {
        at.emplace_back(next, g.size());
        next += (g.size() + 15) / 16 * 16;
      }
      return at;
    };
    auto backward = [&](int step, auto* sync, const placement& at) {
      const auto start = std::chrono::steady_clock::now();
      std::size_t done = 0;
      for (int l = layers - 1; l >= 0; --l) {
        const fc::span<float> g = at[static_cast<std::size_t>(l)];
        done += g.size();
        if (idle > 0)
          idle_gradient(g, step, start, std::chrono::duration<double, std::micro>(idle),
                        static_cast<double>(done) / static_cast<double>(scaled));
        else
          compute_gradient(g, work, step);
        if (sync) sync->ready(l, g);
      }
      if (!sync) return;
      const auto handed = std::chrono::steady_clock::now();
      sync->finish();
      if (step >= warmup) tail_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - handed).count();
    };
    auto comm_only = [&](auto* sync, const placement& at) {
      for (int l = layers - 1; l >= 0; --l) sync->ready(l, at[static_cast<std::size_t>(l)]);
      sync->finish();
    };
    // Each adapter with shared memory off (the path of any host layout: the backend's allreduce,
    // or the ring) and automatic (one segment on one host; off across hosts). Built in the same
    // order on every rank: construction is collective.
    options.shared_memory = fc::shared_memory_use::off;
    fc::sync_options shm_options = options;
    shm_options.shared_memory = fc::shared_memory_use::automatic;
    fc::sync_options early_options = options, early_shm_options = shm_options;
    early_options.launch_when_full = early_shm_options.launch_when_full = true;
    fc::subgroup_allreduce<mpi> after(world, options), after_shm(world, shm_options);
    fc::subgroup_allreduce<mpi> early(world, early_options), early_shm(world, early_shm_options);
    fc::overlapped_ring<mpi> ring(world, options), ring_shm(world, shm_options);
    const placement at_after = place(after), at_after_shm = place(after_shm), at_early = place(early),
                    at_early_shm = place(early_shm), at_ring = place(ring), at_ring_shm = place(ring_shm);
    const double cpu_compute =
        time_steps(world, warmup, iters, [&](int s) { backward(s, static_cast<fc::overlapped_ring<mpi>*>(nullptr), own); });
    for (const char* mode : {"cpu", "idle"}) {
    idle = std::string(mode) == "idle" ? cpu_compute : 0;
    const double compute = idle > 0 ? time_steps(world, warmup, iters, [&](int s) {
      backward(s, static_cast<fc::overlapped_ring<mpi>*>(nullptr), own); }) : cpu_compute;
    struct row {
      std::string name;
      bool shm;       // shared memory allowed (automatic)
      bool shm_used;  // and the adapter took it (the member is on one host)
      double overall, comm, tail;
      std::size_t buckets;
    };
    auto measure = [&](std::string name, auto& sync, bool shm, const placement& at) {
      row r{std::move(name), shm, sync.shared_memory(), 0, 0, 0, 0};
      tail_us = 0;
      r.overall = time_steps(world, warmup, iters, [&](int s) { backward(s, &sync, at); });
      r.tail = max_over_ranks(world, tail_us / iters);
      r.comm = time_steps(world, warmup, iters, [&](int) { comm_only(&sync, at); });
      r.buckets = sync.plan().buckets().size();  // planned at the first step
      return r;
    };
    // Off then shm for each adapter, back to back, so the busy machine drifts little between the
    // two rows the ratio compares. A braced list is evaluated in order.
    const std::vector<row> rows{
        measure("subgroup_allreduce (sync after backward)", after, false, at_after),
        measure("subgroup_allreduce shm (sync after backward)", after_shm, true, at_after_shm),
        measure("subgroup_allreduce (launch when full)", early, false, at_early),
        measure("subgroup_allreduce shm (launch when full)", early_shm, true, at_early_shm),
        measure("overlapped_ring", ring, false, at_ring),
        measure("overlapped_ring shm", ring_shm, true, at_ring_shm),
    };
    // Hidden: the share of the communication that sync after backward on the same path exposes
    // (its Overall - Compute, measured under the same scheduling) that this adapter hides.
    const auto hidden = [&](std::size_t i) {
      return overlap_percent(rows[i].overall, compute, rows[rows[i].shm ? 1 : 0].overall - compute);
    };
    // The share of the same path's sync-after-backward tail that this row's tail does not leave.
    const auto tail_hidden = [&](std::size_t i) { return overlap_percent(rows[i].tail, 0, rows[rows[i].shm ? 1 : 0].tail); };
    // shm rows: Overall over that of the off row just before (the same adapter).
    const auto shm_over_off = [&](std::size_t i) { return rows[i].overall / rows[i - 1].overall; };
    for (const auto& r : rows) shm_rows_used = shm_rows_used && (!r.shm || r.shm_used);
    if (root) {
      std::printf("# %s: %d tensors, %zu parameters (full model), %zu after scaling = %.2f MiB of float gradients, "
                  "buckets of %zu bytes\n",
                  model.c_str(), layers, params, scaled, static_cast<double>(scaled * 4) / (1 << 20),
                  options.bucket_bytes);
      std::printf("# gradients: %s\n", in_gradient_memory ? "in each adapter's gradient_memory()" : "in the trainer's vectors");
      std::printf("# backward: %s\n", idle > 0 ? "host idle for as long as the CPU backward took (an accelerator computes)"
                                              : "CPU multiply-adds on the trainer thread");
      std::printf("# %-44s %8s %8s %12s %12s %13s %11s %10s %8s %8s %9s %15s %13s\n", "adapter", "shm", "buckets",
                  "Overall(us)", "Compute(us)", "Pure-Comm(us)", "Overlap(%)", "Hidden(%)", "speedup", "shm/off",
                  "Tail(us)", "Tail-hidden(%)", "Overall/Comp");
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const auto& r = rows[i];
        const char* shm = !r.shm ? "off" : r.shm_used ? "used" : "unused";
        const std::string ratio = r.shm ? two_places(shm_over_off(i)) : "";
        std::printf("  %-44s %8s %8zu %12.0f %12.0f %13.0f %11.1f %10.1f %8.2f %8s %9.1f %15.1f %13.3f\n",
                    r.name.c_str(), shm, r.buckets, r.overall, compute, r.comm,
                    overlap_percent(r.overall, compute, r.comm), hidden(i), rows[0].overall / r.overall, ratio.c_str(),
                    r.tail, tail_hidden(i), r.overall / compute);
        records += fc::cat(records.empty() ? "" : ",\n", "  {\"model\": \"", model, "\", \"backward\": \"", mode,
                           "\", \"gradient_memory\": ", in_gradient_memory ? "true" : "false", ", \"adapter\": \"", r.name, "\", \"shared_memory\": \"", r.shm ? "auto" : "off",
                           "\", \"shared_memory_used\": ", r.shm_used ? "true" : "false",
                           ", \"ranks\": ", world.size(), ", \"scale\": ", scale, ", \"parameters\": ", scaled,
                           ", \"buckets\": ", r.buckets, ", \"overall_us\": ", r.overall, ", \"compute_us\": ", compute,
                           ", \"pure_comm_us\": ", r.comm, ", \"tail_us\": ", r.tail,
                           ", \"tail_hidden_percent\": ", tail_hidden(i), ", \"overall_over_compute\": ", r.overall / compute,
                           ", \"overlap_percent\": ",
                           overlap_percent(r.overall, compute, r.comm), ", \"hidden_vs_after_backward_percent\": ",
                           hidden(i), ", \"hidden_baseline\": \"", rows[r.shm ? 1 : 0].name,
                           "\", \"speedup_vs_after_backward_shm_off\": ", rows[0].overall / r.overall,
                           r.shm ? fc::cat(", \"overall_shm_over_off\": ", shm_over_off(i)) : "", "}");
      }
      // The hidden share with shared memory, beside the one without, for the two adapters that
      // overlap (sync after backward hides nothing by construction).
      std::printf("# shm off -> on: hidden %.1f%% -> %.1f%% (launch when full), %.1f%% -> %.1f%% (overlapped_ring); "
                  "Overall shm/off %.2f, %.2f, %.2f (sync after backward, launch when full, overlapped_ring)\n",
                  hidden(2), hidden(3), hidden(4), hidden(5), shm_over_off(1), shm_over_off(3), shm_over_off(5));
      std::printf("# tail hidden shm off -> on: %.1f%% -> %.1f%% (launch when full), %.1f%% -> %.1f%% (overlapped_ring)\n",
                  tail_hidden(2), tail_hidden(3), tail_hidden(4), tail_hidden(5));
      std::fflush(stdout);
    }
    if (!trace_dir.empty()) {
      // Off, on, off again in a row: the two off runs bound the drift of the machine meanwhile.
      const auto ring_step = [&](int s) { backward(s, &ring, at_ring); };
      const double off_before = time_steps(world, warmup, iters, ring_step);
      fc::trace::start(world, trace_dir);
      const double on = time_steps(world, warmup, iters, ring_step);
      fc::trace::stop();
      const double off_after = time_steps(world, warmup, iters, ring_step);
      if (idle > 0) {
        fc::trace::start(world, fc::cat(trace_dir, "/", model, "_ring_shm_idle"));
        time_steps(world, warmup, iters, [&](int s) { backward(s, &ring_shm, at_ring_shm); });
        fc::trace::stop();
      }
      const double off = (off_before + off_after) / 2;
      if (root) {
        std::printf("  %-44s %8s %8zu %12.0f %12s %13s %11s %10s %8s\n", "overlapped_ring, tracing off (mean of 2)",
                    "off", ring.plan().buckets().size(), off, "", "", "", "", "");
        std::printf("  %-44s %8s %8zu %12.0f %12s %13s %11s %10s %8.3f\n", "overlapped_ring, tracing on", "off",
                    ring.plan().buckets().size(), on, "", "", "", "", on / off);
        std::printf("# tracing on/off: %.3f (off %.0f and %.0f us around on %.0f us)\n", on / off, off_before,
                    off_after, on);
        if (idle > 0) std::printf("# overlapped_ring shm traced into %s/%s_ring_shm_idle\n", trace_dir.c_str(), model.c_str());
        records += fc::cat(",\n  {\"model\": \"", model, "\", \"backward\": \"", mode,
                           "\", \"adapter\": \"overlapped_ring\", \"tracing\": true, \"ranks\": ", world.size(),
                           ", \"overall_off_before_us\": ", off_before, ", \"overall_on_us\": ", on,
                           ", \"overall_off_after_us\": ", off_after, ", \"on_over_off\": ", on / off, "}");
        std::fflush(stdout);
      }
    }
    }
  }
  if (root)
    std::printf("# the shm rows went through shared memory: %s\n", shm_rows_used ? "yes" : "no (ranks on several hosts, or one rank)");
  if (root && !json.empty()) {
    std::ofstream out(json);
    out << "{\"benchmark\": \"overlap\", \"ranks\": " << world.size() << ", \"work\": " << work << ", \"results\": [\n"
        << records << "\n]}\n";
    fc::check(static_cast<bool>(out), "overlap", "cannot write " + json);
  }
  return 0;
}
