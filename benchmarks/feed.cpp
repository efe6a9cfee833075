// benchmarks/feed: what the shared feeds save an ensemble. K members train on the same stream of
// Fashion-MNIST batches; preprocessing (inflate + normalize + crop/flip/rotation/elastic
// augmentation) is CPU-heavy, training is light. For each feed in one run: total CPU time over
// all ranks (getrusage, all threads), the trainers' share of it, wall time, batches/s, and the
// totals as ratios to local_feed.
// one_to_many and all_shared run twice each, back to back: with their shared-memory path off (a
// message per trainer, an allgather per piece), and with it automatic ("one_to_many shm": on the
// producer's host the loader writes each step into a shared slot and the trainers read it in
// place; "all_shared shm": each member's turn is read in place by the others). An shm row's
// shm/off is its CPU time over the off row's, and a summary line gives the trainers' CPU, wall
// and batches/s the same way: the trainers' CPU is where copying a batch out of a message would
// show. Column shm says whether the path was taken (the feed's shared_memory() on every rank).
// FLEXCOMM_SHM is overridden for every feed; local_feed has no shared-memory path and runs off.
//
//   mpiexec -n 5 build/benchmarks/feed --wait backoff:20000     # layout producers=1 members=4x1
//
// Flags follow nccl-tests where they mean something here: -b/-e/-f images per step (min, max,
// factor), -n timed steps, -w warm-up steps, -c check (every feed's bytes against local_feed's).
// --feeds names the shm rows one_to_many_shm and all_shared_shm (flag values without a space).
#include <sys/resource.h>

#include <boost/program_options.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <flexcomm/flexcomm.hpp>

#include "../examples/common/counts.hpp"
#include "flags.hpp"
#include "job_clock.hpp"
#include "../examples/common/fashion_mnist.hpp"

namespace fc = flexcomm;
namespace fm = fashion_mnist;
namespace po = boost::program_options;

namespace {

// A ratio as the tables print it: two decimals.
std::string two_places(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", x);
  return text;
}

using namespace job_clock;  // cpu_seconds, now, barrier, reduce


// The light training step: one SGD step of a linear softmax classifier on the first few
// samples of the batch (the model of a member whose real compute would run on a GPU).
struct linear_model {
  std::vector<float> w = std::vector<float>(fm::classes * fm::pixels, 0.0f);
  float lr = 0.01f;
  void train(fc::span<const std::byte> bytes, std::size_t images) {
    const auto* samples = reinterpret_cast<const fm::sample*>(bytes.data());
    const std::size_t n = std::min(images, bytes.size() / fm::sample_bytes);
    for (std::size_t j = 0; j < n; ++j) {
      float logits[fm::classes], peak = -1e30f, sum = 0;
      for (int c = 0; c < fm::classes; ++c) {
        float acc = 0;
        for (int i = 0; i < fm::pixels; ++i) acc += w[c * fm::pixels + i] * samples[j].pixel[i];
        logits[c] = acc;
        peak = std::max(peak, acc);
      }
      for (float& l : logits) sum += l = std::exp(l - peak);
      for (int c = 0; c < fm::classes; ++c) {
        const float g = lr * (logits[c] / sum - (c == samples[j].label ? 1.0f : 0.0f));
        for (int i = 0; i < fm::pixels; ++i) w[c * fm::pixels + i] -= g * samples[j].pixel[i];
      }
    }
  }
};

// A cheap position-dependent checksum (Fletcher-style over 64-bit words), so that checking
// costs the trainers little next to what the feeds save.
std::uint64_t checksum(std::uint64_t h, fc::span<const std::byte> bytes) {
  std::uint64_t a = h, b = bytes.size();
  const std::size_t words = bytes.size() / 8;
  for (std::size_t i = 0; i < words; ++i) {
    std::uint64_t w;
    std::memcpy(&w, bytes.data() + i * 8, 8);
    a += w;
    b += a;
  }
  for (std::size_t i = words * 8; i < bytes.size(); ++i) b += a += static_cast<std::uint64_t>(bytes[i]);
  return a * 0x9E3779B97F4A7C15ull ^ b;
}

struct config {
  std::int64_t steps = 30, warmup = 2;
  std::size_t train_images = 8;
  int depth = 4;
  bool check = true;
  bool hand_over = false;  // feed_options.hand_over: as under pipe.on_handover(), with nobody handing over
  fm::augment_options augment;
};

struct measurement {
  double cpu = 0, wall = 0;
  double trainer_cpu = 0;  // the part of cpu spent by trainer ranks (producers excluded)
  int shm_ranks = 0;       // ranks that handed over or read steps through shared memory
  std::int64_t wrong = 0;
  std::uint64_t sum = 0;
};

// Whether the feed took its shared-memory path on this rank; feeds without one never do.
template <class Feed>
auto took_shared_memory(const Feed& feed, int) -> decltype(feed.shared_memory()) {
  return feed.shared_memory();
}
template <class Feed>
bool took_shared_memory(const Feed&, long) {
  return false;
}

template <class Feed>
measurement run(const fc::mpi::communicator& world, const fc::ensemble_layout& layout, const fm::packed_dataset& data,
                std::size_t images, const config& cfg, std::uint64_t expected_sum, fc::shared_memory_use shm) {
  const int shards = layout.shards_per_step();
  const std::size_t per_shard = images / static_cast<std::size_t>(shards);
  fc::loader load = [&](std::int64_t step, int shard, fc::span<std::byte> out) -> std::size_t {
    fc::check(out.size() >= per_shard * fm::sample_bytes, "feed benchmark", "slot too small");
    return fm::make_samples(data, step, images, static_cast<std::size_t>(shard) * per_shard, per_shard,
                            reinterpret_cast<fm::sample*>(out.data()), cfg.augment);
  };
  const auto role = layout.role_of(world.rank());
  auto stream = [&](std::int64_t steps, measurement* m) {
    fc::feed_options options;
    options.steps = steps;
    options.shard_capacity = per_shard * fm::sample_bytes;
    options.depth = cfg.depth;
    options.shared_memory = shm;  // set for every feed, so that FLEXCOMM_SHM changes no row
    options.hand_over = cfg.hand_over;
    Feed feed(world, layout, load, options);
    barrier(world);
    const double cpu0 = cpu_seconds(), t0 = now();
    std::uint64_t sum = 1469598103934665603ull;
    if (role.kind == fc::role::producer) {
      feed.produce();
    } else {
      linear_model model;
      while (auto batch = feed.next()) {
        model.train(batch->bytes(), cfg.train_images);
        if (cfg.check) sum = checksum(sum, batch->bytes());
      }
    }
    barrier(world);
    if (!m) return;
    if (std::getenv("FEED_BENCH_VERBOSE")) {
      rusage u{};
      getrusage(RUSAGE_SELF, &u);
      std::fprintf(stderr, "rank %d: cpu %.3f s wall %.3f s, context switches so far: %ld voluntary %ld involuntary\n",
                   world.rank(), cpu_seconds() - cpu0, now() - t0, u.ru_nvcsw, u.ru_nivcsw);
    }
    // Read both clocks before reducing: each reduction may sleep in the wait policy.
    const double cpu = cpu_seconds() - cpu0, wall = now() - t0;
    m->cpu = reduce(world, cpu, fc::op::sum);
    m->trainer_cpu = reduce(world, role.kind == fc::role::trainer ? cpu : 0.0, fc::op::sum);
    m->wall = reduce(world, wall, fc::op::max);
    m->shm_ranks = static_cast<int>(reduce(world, took_shared_memory(feed, 0) ? 1.0 : 0.0, fc::op::sum));
    m->sum = sum;
  };
  if (cfg.warmup > 0) stream(cfg.warmup, nullptr);
  measurement m;
  stream(cfg.steps, &m);
  // #wrong: trainers whose bytes differ from what local_feed delivered to them.
  const bool wrong = cfg.check && role.kind == fc::role::trainer && m.sum != expected_sum;
  m.wrong = static_cast<std::int64_t>(reduce(world, wrong ? 1.0 : 0.0, fc::op::sum));
  return m;
}

// Per-step costs measured alone on one rank, so the reader sees the regime the ratios come from.
std::pair<double, double> solo_costs(const fm::packed_dataset& data, std::size_t images, const config& cfg) {
  std::vector<fm::sample> batch(images);
  linear_model model;
  const int reps = 3;
  double t0 = cpu_seconds();
  for (int r = 0; r < reps; ++r) fm::make_samples(data, r, images, 0, images, batch.data(), cfg.augment);
  const double pre = (cpu_seconds() - t0) / reps;
  t0 = cpu_seconds();
  for (int r = 0; r < reps * 10; ++r)
    model.train(fc::span<const std::byte>(reinterpret_cast<const std::byte*>(batch.data()), images * fm::sample_bytes),
                cfg.train_images);
  return {pre, (cpu_seconds() - t0) / (reps * 10)};
}

}  // namespace

int main(int argc, char** argv) {
  fc::environment env(argc, argv);
  const auto& world = env.world();
  std::size_t min_images = 256, max_images = 256, factor = 2;
  config cfg;
  std::string layout_text, json_path, wait_text, feeds = "local_feed,one_to_many,one_to_many_shm,all_shared,all_shared_shm";
  int check = 1;
  po::options_description flags("benchmarks/feed options");
  flags.add_options()("help,h", "this text")
      ("minimages,b", counts::at_least<1>(&min_images), "images per step, smallest")
      ("maximages,e", counts::at_least<1>(&max_images), "images per step, largest")
      ("stepfactor,f", counts::at_least<2>(&factor), "factor between sizes")
      ("iters,n", counts::at_least<1>(&cfg.steps), "timed steps per feed")
      ("warmup_iters,w", counts::at_least<0>(&cfg.warmup), "warm-up steps per feed")
      ("depth,d", counts::at_least<1>(&cfg.depth), "feed depth (batches in flight)")
      ("check,c", counts::at_least<0>(&check), "compare every feed's bytes with local_feed's")
      ("hand-over", po::bool_switch(&cfg.hand_over), "every feed ready for hand-overs (feed_options.hand_over, as "
       "pipe.on_handover() sets it), nobody handing over: what readiness costs")
      ("train-images,t", counts::at_least<1>(&cfg.train_images), "images per SGD step")
      ("elastic", po::value(&cfg.augment.elastic_alpha)->default_value(2.0f), "elastic distortion alpha (0: off)")
      ("sigma", po::value(&cfg.augment.elastic_sigma)->default_value(4.0f), "elastic distortion smoothing (cost grows with it)")
      ("feeds", po::value(&feeds)->default_value(feeds),
       "feeds to run (ratios need local_feed; one_to_many_shm, all_shared_shm: with shared memory automatic, shm/off needs "
       "the same feed's off row too)")
      ("layout,L", po::value(&layout_text), "ensemble layout (default FLEXCOMM_LAYOUT, else producers=1 members=(n-1)x1)")
      ("wait", po::value(&wait_text), "wait policy for this run (spin, yield, backoff, backoff:<us>); default: flexcomm's")
      ("json,J", po::value(&json_path)->default_value("feed.json"), "JSON output file (rank 0)");
  if (const auto status = benchmark_flags::parse(argc, argv, flags, world.rank())) return *status;
  cfg.check = check != 0 && ("," + feeds + ",").find(",local_feed,") != std::string::npos;  // the reference
  if (!wait_text.empty()) fc::set_default_wait(fc::wait_policy::parse(wait_text));
  const auto parsed = layout_text.empty()
                          ? fc::ensemble_layout::from_env(fc::cat("producers=1 members=", std::max(1, world.size() - 1), "x1"))
                          : fc::ensemble_layout::parse(layout_text);
  parsed.validate(world.size());
  const auto layout = fc::placed_on_hosts(world, parsed);  // producers=per-host: on this job's hosts

  const fm::packed_dataset data(fm::load(fm::split::test), 64);
  const int shards = layout.shards_per_step();
  const auto wait = fc::default_wait();
  // Trainer CPU per batch a trainer takes: what receiving (or reading in place) and training cost it.
  const double trainers = reduce(world, layout.role_of(world.rank()).kind == fc::role::trainer ? 1.0 : 0.0, fc::op::sum);
  if (world.rank() == 0) {
    std::printf("# flexcomm feed benchmark on %s: layout '%s' (%d members, %d ranks, %d shards/step), %lld steps + %lld "
                "warm-up%s\n", fc::mpi_implementation::name, layout.str().c_str(), layout.members(), world.size(), shards,
                static_cast<long long>(cfg.steps),
                static_cast<long long>(cfg.warmup), cfg.hand_over ? ", ready for hand-overs" : "");
    std::printf("# wait policy %s (max sleep %lld us), %u cores, Fashion-MNIST test split (%zu images), elastic alpha %.1f sigma %.1f, "
                "train on %zu images/step\n",
                fc::name_of(wait.kind), static_cast<long long>(wait.max_sleep.count()), std::thread::hardware_concurrency(),
                data.count(), static_cast<double>(cfg.augment.elastic_alpha), static_cast<double>(cfg.augment.elastic_sigma), cfg.train_images);
    std::printf("#\n# %10s %8s %6s %6s %5s %16s %6s %10s %11s %11s %9s %14s %9s %10s %9s %10s %8s %7s\n", "size",
                "count", "type", "redop", "root", "feed", "shm", "time(ms)", "algbw(GB/s)", "busbw(GB/s)", "cpu(s)",
                "trainer_cpu(s)", "wall(s)", "batches/s", "cpu_ratio", "wall_ratio", "shm/off", "#wrong");
  }
  std::ostringstream json;
  json << "{\"benchmark\":\"feed\",\"layout\":\"" << layout.str() << "\",\"ranks\":" << world.size()
       << ",\"members\":" << layout.members() << ",\"steps\":" << cfg.steps << ",\"warmup\":" << cfg.warmup
       << ",\"hand_over\":" << (cfg.hand_over ? "true" : "false") << ",\"wait\":\"" << fc::name_of(wait.kind) << ":" << wait.max_sleep.count() << "\",\"results\":[";
  bool first_row = true;
  for (std::size_t images = min_images; images <= max_images; images *= std::max<std::size_t>(factor, 2)) {
    fc::check(images % static_cast<std::size_t>(shards) == 0, "feed benchmark",
              fc::cat(images, " images per step do not split into ", shards, " shards"));
    double costs[2] = {0, 0};
    if (world.rank() == 0) std::tie(costs[0], costs[1]) = solo_costs(data, images, cfg);
    fc::mpi::ibcast(world, fc::span<double>(costs, 2), 0).wait();
    const double pre = costs[0], train = costs[1];
    if (world.rank() == 0)
      std::printf("# %zu images/step: preprocessing %.2f ms, training %.3f ms (CPU, one rank alone)\n", images,
                  pre * 1e3, train * 1e3);
    auto wanted = [&](const char* name) { return ("," + feeds + ",").find(fc::cat(",", name, ",")) != std::string::npos; };
    const auto off = fc::shared_memory_use::off, automatic = fc::shared_memory_use::automatic;
    measurement base;
    if (wanted("local_feed")) base = run<fc::local_feed>(world, layout, data, images, cfg, 0, off);
    // local_feed's own checksums are the reference; its #wrong is 0 by definition.
    struct row {
      const char* name;
      measurement m;
      int root;
      bool shm;  // shared memory allowed (automatic); off otherwise
    };
    std::vector<row> rows;
    if (wanted("local_feed")) {
      rows.push_back({"local_feed", base, -1, false});
      rows.back().m.wrong = 0;
    }
    // Off, then automatic, back to back, so that the busy machine drifts little between the two.
    if (layout.producers() > 0 && wanted("one_to_many"))
      rows.push_back(
          {"one_to_many", run<fc::one_to_many<fc::mpi>>(world, layout, data, images, cfg, base.sum, off), 0, false});
    if (layout.producers() > 0 && wanted("one_to_many_shm"))
      rows.push_back(
          {"one_to_many shm", run<fc::one_to_many<fc::mpi>>(world, layout, data, images, cfg, base.sum, automatic), 0, true});
    if (wanted("all_shared"))
      rows.push_back(
          {"all_shared", run<fc::all_shared<fc::mpi>>(world, layout, data, images, cfg, base.sum, off), -1, false});
    if (wanted("all_shared_shm"))
      rows.push_back(
          {"all_shared shm", run<fc::all_shared<fc::mpi>>(world, layout, data, images, cfg, base.sum, automatic), -1, true});
    // What an shm row's ratios are against: the same feed's off row ("one_to_many shm" -> "one_to_many").
    const auto off_row_of = [&](const row& r) -> const measurement* {
      if (!r.shm) return nullptr;
      const std::string feed = std::string(r.name).substr(0, std::strlen(r.name) - std::strlen(" shm"));
      for (const auto& o : rows)
        if (!o.shm && feed == o.name) return &o.m;
      return nullptr;
    };
    const double bytes = static_cast<double>(images * fm::sample_bytes);
    const auto rate = [&](const measurement& m) { return static_cast<double>(cfg.steps) / m.wall; };
    const auto trainer_ms = [&](const measurement& m) {
      return m.trainer_cpu * 1e3 / (trainers * static_cast<double>(cfg.steps));
    };
    for (const auto& r : rows) {
      const double per_step = r.m.wall / static_cast<double>(cfg.steps);
      const double algbw = bytes / per_step / 1e9;
      // used: every rank took the path; a count where only some did (trainers on other hosts).
      const std::string shm = !r.shm ? "off"
                              : r.m.shm_ranks == world.size() ? "used"
                              : r.m.shm_ranks == 0            ? "unused"
                                                              : fc::cat(r.m.shm_ranks, "/", world.size());
      const measurement* off_row = off_row_of(r);
      const bool ratio = off_row != nullptr;
      if (world.rank() == 0)
        std::printf("  %10.0f %8zu %6s %6s %5d %16s %6s %10.3f %11.3f %11.3f %9.3f %14.3f %9.3f %10.1f %9.2f %10.2f %8s %7lld\n",
                    bytes, images, "float", "none", r.root, r.name, shm.c_str(), per_step * 1e3, algbw, algbw, r.m.cpu,
                    r.m.trainer_cpu, r.m.wall, rate(r.m), base.cpu / r.m.cpu, base.wall / r.m.wall,
                    ratio ? two_places(r.m.cpu / off_row->cpu).c_str() : "",
                    static_cast<long long>(r.m.wrong));
      json << (first_row ? "" : ",") << "{\"feed\":\"" << r.name << "\",\"size\":" << bytes << ",\"count\":" << images
           << ",\"preprocess_ms\":" << pre * 1e3 << ",\"train_ms\":" << train * 1e3 << ",\"cpu_s\":" << r.m.cpu
           << ",\"wall_s\":" << r.m.wall << ",\"batches_per_s\":" << rate(r.m)
           << ",\"cpu_ratio\":" << base.cpu / r.m.cpu << ",\"wall_ratio\":" << base.wall / r.m.wall
           << ",\"wrong\":" << r.m.wrong << ",\"trainer_cpu_s\":" << r.m.trainer_cpu
           << ",\"trainer_cpu_ms_per_batch\":" << trainer_ms(r.m)
           << ",\"producer_cpu_s\":" << r.m.cpu - r.m.trainer_cpu << ",\"shared_memory\":\"" << (r.shm ? "auto" : "off")
           << "\",\"shared_memory_ranks\":" << r.m.shm_ranks
           << ",\"shared_memory_used\":" << (r.m.shm_ranks == world.size() ? "true" : "false");
      if (ratio)
        json << ",\"cpu_shm_over_off\":" << r.m.cpu / off_row->cpu
             << ",\"trainer_cpu_shm_over_off\":" << r.m.trainer_cpu / off_row->trainer_cpu
             << ",\"wall_shm_over_off\":" << r.m.wall / off_row->wall
             << ",\"batches_per_s_shm_over_off\":" << rate(r.m) / rate(*off_row);
      json << "}";
      first_row = false;
    }
    for (const auto& r : rows)
      if (const measurement* off_row = off_row_of(r); off_row != nullptr && world.rank() == 0)
        std::printf("# %s/off: cpu %.2f, trainers' cpu %.2f (%.3f s -> %.3f s, %.3f -> %.3f ms per trainer "
                    "and batch), wall %.2f, batches/s %.2f; shared memory on %d of %d ranks\n",
                    r.name, r.m.cpu / off_row->cpu, r.m.trainer_cpu / off_row->trainer_cpu,
                    off_row->trainer_cpu, r.m.trainer_cpu, trainer_ms(*off_row), trainer_ms(r.m),
                    r.m.wall / off_row->wall, rate(r.m) / rate(*off_row), r.m.shm_ranks, world.size());
    if (images == max_images) break;
  }
  json << "]}\n";
  if (world.rank() == 0 && !json_path.empty()) std::ofstream(json_path) << json.str();
  return 0;
}
