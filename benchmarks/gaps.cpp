// gaps: what an asynchronous checkpoint copy costs a training step when it runs in the gaps
// (run_in_gaps) versus synchronously, and what tracing costs (FLEXCOMM_TRACE on vs off).
// Each step: forward, a backward that posts one allreduce per gradient bucket (progressed by
// the engine while backward goes on), finish (wait for the averages), update. Ranks compute
// for slightly different times each step, as real ranks do, so the fast ones wait in finish.
//   mpiexec -n 2 build/benchmarks/gaps -b 1M -e 16M -f 4 -n 40 -w 5
#include <boost/program_options.hpp>

#include <flexcomm/flexcomm.hpp>

#include "../examples/common/counts.hpp"
#include "flags.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace fc = flexcomm;
namespace po = boost::program_options;
using fc::mpi;
using clock_type = std::chrono::steady_clock;

namespace {

struct settings {
  std::size_t min_bytes = 1 << 20, max_bytes = 16 << 20, factor = 4;
  int iters = 40, warmup = 5, check = 1, repeats = 3;
  double compute_us = 4000, jitter = 0.3;
  std::size_t grad_floats = 1 << 18, buckets = 4;
  std::string json = "gaps.json", trace_dir = "gaps-trace";
};

// Busy compute for `us` microseconds: stands in for forward/backward kernels on the CPU.
void compute(double us) {
  const auto until = clock_type::now() + std::chrono::nanoseconds(static_cast<long long>(us * 1000));
  volatile double x = 1.0;
  while (clock_type::now() < until)
    for (int i = 0; i < 200; ++i) x = x * 1.0000001 + 1e-9;
}

enum class variant { base, sync_copy, gap_copy, traced };
struct outcome {
  double step_us = 0;
  std::size_t chunks_in_gaps = 0, chunks_total = 0;
  long wrong = 0;
};

// One run of `steps` steps of `v`; returns the mean step time of the slowest rank.
outcome run(const fc::mpi::communicator& world, const settings& s, variant v, std::vector<float>& params,
            std::vector<float>& checkpoint, std::vector<float>& grad, int steps, unsigned seed) {
  const int rank = world.rank();
  std::mt19937 rng(seed * 7919u + static_cast<unsigned>(rank));
  std::uniform_real_distribution<double> spread(0.0, s.jitter);
  const std::size_t bucket = grad.size() / s.buckets;
  const std::size_t bytes = params.size() * sizeof(float);
  outcome out;
  std::shared_ptr<fc::gap_task> pending;
  std::vector<float> ready(1, 0.0f);
  mpi::iallreduce(world, fc::span<float>(ready), fc::op::sum).wait();  // start together
  const auto begin = clock_type::now();
  for (int step = 0; step < steps; ++step) {
    const double work = s.compute_us * (1.0 + spread(rng));
    {
      fc::trace::span t(fc::trace::names::forward, step);
      compute(work / 3);
    }
    std::vector<std::shared_ptr<fc::completion>> reductions;
    {
      fc::trace::span t(fc::trace::names::backward, step);
      for (std::size_t b = 0; b < s.buckets; ++b) {
        compute(2 * work / 3 / static_cast<double>(s.buckets));
        auto req = std::make_shared<mpi::request>(
            mpi::iallreduce(world, fc::span<float>(grad.data() + b * bucket, bucket), fc::op::avg));
        reductions.push_back(fc::progress_engine::instance().submit([req] { return req->test(); }, "bucket"));
      }
      fc::trace::span f(fc::trace::names::finish, step, "step", "sync");
      for (auto& r : reductions) r->wait();
    }
    {
      fc::trace::span t(fc::trace::names::update, step);
      // The checkpoint of the previous step must be complete before the parameters change.
      if (pending) {
        pending->finish();
        out.chunks_in_gaps += pending->chunks_in_gaps();
        out.chunks_total += pending->chunks_in_gaps() + pending->chunks_in_finish();
        pending.reset();
      }
      for (auto& p : params) p += 1.0f;
      compute(work / 20);
    }
    if (v == variant::sync_copy) {
      fc::trace::span t("checkpoint copy", step, "step", "gaps");
      std::memcpy(checkpoint.data(), params.data(), bytes);
    } else if (v == variant::gap_copy) {
      pending = fc::copy_in_gaps(checkpoint.data(), params.data(), bytes);
    }
    if (s.check && (v == variant::sync_copy) && checkpoint[params.size() / 2] != params[params.size() / 2])
      ++out.wrong;
  }
  if (pending) {
    pending->finish();
    out.chunks_in_gaps += pending->chunks_in_gaps();
    out.chunks_total += pending->chunks_in_gaps() + pending->chunks_in_finish();
  }
  if (s.check && v != variant::base && v != variant::traced)
    out.wrong += !std::equal(params.begin(), params.end(), checkpoint.begin());
  double mine = std::chrono::duration<double, std::micro>(clock_type::now() - begin).count() / steps;
  mpi::iallreduce(world, fc::span<double>(&mine, 1), fc::op::max).wait();
  mpi::iallreduce(world, fc::span<long>(&out.wrong, 1), fc::op::sum).wait();
  out.step_us = mine;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  settings s;
  po::options_description opts("gaps [options]");
  opts.add_options()("help,h", "this help")("minbytes,b", benchmark_flags::bytes(&s.min_bytes, "1M"),
                                            "smallest checkpoint (K, M, G suffixes)")(
      "maxbytes,e", benchmark_flags::bytes(&s.max_bytes, "16M"), "largest checkpoint")(
      "stepfactor,f", counts::at_least<2>(&s.factor), "size multiplier between rows")(
      "iters,n", counts::at_least<1>(&s.iters), "steps timed per variant and repeat")(
      "warmup_iters,w", counts::at_least<0>(&s.warmup), "steps before timing")(
      "check,c", counts::at_least<0>(&s.check), "verify the checkpoint copies")(
      "repeats,r", counts::at_least<1>(&s.repeats), "round-robin repeats; the best counts")(
      "compute-us", po::value(&s.compute_us)->default_value(s.compute_us), "compute per step (us)")(
      "jitter", po::value(&s.jitter)->default_value(s.jitter), "per-rank, per-step extra compute, up to this share")(
      "grad", counts::at_least<1>(&s.grad_floats), "gradient floats per step")(
      "json,J", po::value(&s.json)->default_value(s.json), "JSON results file")(
      "trace-dir", po::value(&s.trace_dir)->default_value(s.trace_dir), "where the traced variant writes");
  // Before MPI starts: every rank would say it, as every rank parses the same.
  if (const auto status = benchmark_flags::parse(argc, argv, opts, 0)) return *status;

  fc::environment env(argc, argv);
  const auto& world = env.world();
  const bool root = world.rank() == 0;
  std::vector<float> grad(s.grad_floats, 1.0f);
  if (root)
    std::printf("# gaps: checkpoint copy per step, synchronous vs run_in_gaps; tracing on vs off\n"
                "# ranks %d, compute %.0f us/step (+0..%.0f%% per rank), gradient %zu floats in %zu buckets, "
                "%d steps x %d repeats (best)\n"
                "%12s %10s %6s %6s %5s %10s %10s %10s %10s %9s %9s %9s %8s %7s\n",
                world.size(), s.compute_us, 100 * s.jitter, s.grad_floats, s.buckets, s.iters, s.repeats, "size",
                "count", "type", "redop", "root", "base_us", "sync_us", "gaps_us", "trace_us", "sync/base",
                "gaps/base", "trace/base", "in_gaps%", "#wrong");
  std::ofstream json;
  if (root) json.open(s.json);
  if (root) json << "{\"benchmark\":\"gaps\",\"ranks\":" << world.size() << ",\"rows\":[";
  bool first_row = true;
  const variant order[] = {variant::base, variant::sync_copy, variant::gap_copy, variant::traced};
  for (std::size_t bytes = s.min_bytes; bytes <= s.max_bytes; bytes *= s.factor) {
    std::vector<float> params(bytes / sizeof(float), 0.5f), checkpoint(params.size(), 0.0f);
    double best[4] = {1e300, 1e300, 1e300, 1e300};
    outcome gap_outcome;
    long wrong = 0;
    for (int rep = 0; rep < s.repeats; ++rep)
      for (variant v : order) {
        if (v == variant::traced) fc::trace::start(world, s.trace_dir);
        run(world, s, v, params, checkpoint, grad, s.warmup, 1000u + static_cast<unsigned>(rep));
        const outcome o = run(world, s, v, params, checkpoint, grad, s.iters, static_cast<unsigned>(rep));
        if (v == variant::traced) fc::trace::stop();
        auto& b = best[static_cast<int>(v)];
        b = std::min(b, o.step_us);
        if (v == variant::gap_copy) gap_outcome.chunks_in_gaps += o.chunks_in_gaps,
                                    gap_outcome.chunks_total += o.chunks_total;
        wrong += o.wrong;
      }
    const double in_gaps = gap_outcome.chunks_total
                               ? 100.0 * static_cast<double>(gap_outcome.chunks_in_gaps) / gap_outcome.chunks_total
                               : 0.0;
    if (root) {
      std::printf("%12zu %10zu %6s %6s %5d %10.1f %10.1f %10.1f %10.1f %9.3f %9.3f %9.3f %8.1f %7ld\n", bytes,
                  params.size(), "float", "avg", -1, best[0], best[1], best[2], best[3], best[1] / best[0],
                  best[2] / best[0], best[3] / best[0], in_gaps, wrong);
      json << (first_row ? "" : ",") << "\n{\"size\":" << bytes << ",\"count\":" << params.size()
           << ",\"type\":\"float\",\"redop\":\"avg\",\"root\":-1,\"base_us\":" << best[0]
           << ",\"sync_us\":" << best[1] << ",\"gaps_us\":" << best[2] << ",\"trace_us\":" << best[3]
           << ",\"in_gaps_percent\":" << in_gaps << ",\"wrong\":" << wrong << "}";
      first_row = false;
    }
  }
  if (root) json << "\n]}\n";
  return 0;
}
