// A CUDA trainer for an ensemble of MLPs on Fashion-MNIST, written once. Its baseline and
// streamlined pipelines, and its MPI (staged) and NCCL variants, differ only in the pipeline's
// template arguments (the four `using` lines below; see docs/cuda.md for the diff).
//
//   mpiexec -n 5 build/examples/cuda_trainer --pipeline streamlined --backend nccl
//           --layout "producers=1 members=2x2" --steps 200
//
// Each member's first rank prints its step time and the share of it spent waiting for data;
// --preprocess-us makes preprocessing as costly as a real input pipeline's, which is where the
// streamlined pipeline (a producer preprocesses each step once, ahead) beats the baseline (every
// trainer preprocesses for itself, between its steps).
//
// Its device calls go through flexcomm's device layer (fc::device), so the same source also
// builds as C++ against the device stand-in (FLEXCOMM_DEVICE_STANDIN: examples/meson.build's
// cuda_trainer_standin), with the model in host code (cuda/mlp_host.hpp), and runs without a GPU.
#include <boost/program_options.hpp>

#include <flexcomm/flexcomm.hpp>

#include "common/fashion_mnist.hpp"
#include "common/counts.hpp"
#if defined(FLEXCOMM_DEVICE_STANDIN)
#include "cuda/mlp_host.hpp"
#else
#include "cuda/mlp.cuh"
#endif

#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace fc = flexcomm;
namespace fm = fashion_mnist;
namespace po = boost::program_options;

// The only lines that change between variants: the pipeline's template arguments, and whether
// buckets leave during backward (the streamlined designs) or after it (the baseline), as
// flexcomm's presets do. Batches travel on the host (MPI) and reach the GPU through
// cuda::device_feed; gradients are averaged on the device (staged MPI or NCCL); predictions go to
// a host aggregator (MPI). The streamlined NCCL variant reduces each bucket with NCCL's allreduce
// as soon as it fills (NCCL point-to-point has no tags, see docs/cuda.md); the streamlined MPI
// variant runs flexcomm's own overlapped ring.
template <class Pipeline, bool Overlap>
struct variant {
  using pipeline = Pipeline;
  static constexpr bool overlap = Overlap;
};
using baseline_mpi = variant<
    fc::ensemble_pipeline<fc::local_feed, fc::subgroup_allreduce<fc::staged>, fc::many_to_one<fc::mpi>>, false>;
using streamlined_mpi = variant<
    fc::ensemble_pipeline<fc::one_to_many<fc::mpi>, fc::overlapped_ring<fc::staged>, fc::many_to_one<fc::mpi>>, true>;
using baseline_nccl = variant<
    fc::ensemble_pipeline<fc::local_feed, fc::subgroup_allreduce<fc::nccl>, fc::many_to_one<fc::mpi>>, false>;
using streamlined_nccl = variant<
    fc::ensemble_pipeline<fc::one_to_many<fc::mpi>, fc::subgroup_allreduce<fc::nccl>, fc::many_to_one<fc::mpi>>, true>;

struct settings {
  std::string layout = "producers=1 members=2x1";
  std::int64_t steps = 100;
  std::size_t batch = 64;  // samples per step and member, split over the member's ranks
  int hidden = 128;
  float lr = 0.1f;
  std::size_t train_images = 0, test_images = 2000;
  int log_every = 20;
  std::chrono::microseconds preprocess{0};  // CPU work added to each sample's preprocessing
  double min_accuracy = 0;  // the job fails if a member's or the ensemble's test accuracy is lower
};

namespace {
// The data, loaded once per process by whichever role first needs it.
const fm::packed_dataset& train_set(const settings& s) {
  static std::once_flag once;
  static std::unique_ptr<fm::packed_dataset> data;
  std::call_once(once, [&] { data = std::make_unique<fm::packed_dataset>(fm::load(fm::split::train, fm::default_dir(), s.train_images)); });
  return *data;
}

// The extra preprocessing of --preprocess-us: passes of a 3x3 blur over the sample, as a costlier
// augmentation would make, until `cost` has passed. Real work on a core, not a sleep, since what
// the pipelines differ in is who spends the CPU; the sample itself is left as it was, so every
// variant still trains on the same data.
void spend_preprocessing(const fm::sample& x, std::chrono::microseconds cost) {
  if (cost.count() == 0) return;
  const auto until = std::chrono::steady_clock::now() + cost;
  float blurred[fm::pixels] = {};
  float total = 0;
  do {
    for (int r = 1; r < fm::rows - 1; ++r)
      for (int c = 1; c < fm::cols - 1; ++c) {
        float sum = 0;
        for (int dr = -1; dr <= 1; ++dr)
          for (int dc = -1; dc <= 1; ++dc) sum += x.pixel[(r + dr) * fm::cols + c + dc];
        blurred[r * fm::cols + c] = sum / 9;
      }
    total += blurred[fm::pixels / 2];
  } while (std::chrono::steady_clock::now() < until);
  volatile float keep = total;  // the passes must not be optimized away
  static_cast<void>(keep);
}

// The trainer: the same code for every pipeline type.
template <class Variant>
int train(const fc::environment& env, const settings& s) {
  using Pipeline = typename Variant::pipeline;
  auto layout = fc::ensemble_layout::from_env(s.layout);
  layout.validate(env.world().size());
  layout = fc::placed_on_hosts(env.world(), layout);
  const int shards = layout.shards_per_step();
  fc::check(s.batch % static_cast<std::size_t>(shards) == 0, "cuda_trainer",
            fc::cat("batch ", s.batch, " must split into the layout's ", shards, " shards per step"));
  const std::size_t per_shard = s.batch / static_cast<std::size_t>(shards);

  typename Pipeline::options opt;
  opt.feed.steps = s.steps;
  opt.feed.shard_capacity = per_shard * fm::sample_bytes;
  opt.sync.bucket_bytes = 64 << 10;   // the last layer's gradients fuse; W1 travels alone
  opt.sync.launch_when_full = Variant::overlap;  // buckets leave during backward, or in finish()
  // A GPU of its node for each trainer, before the pipeline makes its NCCL communicators on the
  // current device; producers never touch one, so they take none.
  const bool trainer = layout.role_of(env.world().rank()).kind == fc::role::trainer;
  fc::cuda::use_local_device(env.world(), trainer);
  Pipeline pipe(env.world(), layout, opt);

  // Shard k of step t: samples [k * per_shard, (k + 1) * per_shard) of the step's batch.
  auto loader = [&](std::int64_t step, int shard, fc::span<std::byte> out) {
    auto* samples = reinterpret_cast<fm::sample*>(out.data());
    const std::size_t bytes = fm::make_samples(train_set(s), step, s.batch, static_cast<std::size_t>(shard) * per_shard,
                                               per_shard, samples);
    for (std::size_t j = 0; j < per_shard; ++j) spend_preprocessing(samples[j], s.preprocess);
    return bytes;
  };

  bool accurate = true;  // on the aggregator: every member and the ensemble reached --min-accuracy
  pipe.run(
      loader,
      [&](auto& ctx) {
        // The legacy default stream: the backends' own streams are ordered with it, so every
        // gradient handed to ready() is complete before communication reads it, and the optimizer
        // step after finish() sees the averages.
        fc::device::stream_t compute = nullptr;
        const int max_batch = static_cast<int>(s.batch);
        cuda_mlp::mlp model(fm::pixels, s.hidden, fm::classes, std::max(max_batch, 256), 1000u + ctx.member(), compute);
        auto& feed = ctx.feed();
        fc::cuda::device_feed<std::remove_reference_t<decltype(feed)>> device(feed, s.batch * fm::sample_bytes, compute);
        constexpr int stride = static_cast<int>(fm::sample_bytes / sizeof(float));  // a sample is 785 words
        // Waiting for data is the host's time blocked in next(): device_feed orders each batch on
        // the compute stream itself, so timing it needs no synchronization that would change the step.
        using clock = std::chrono::steady_clock;
        clock::duration waiting{};
        auto next_batch = [&] {
          const auto asked = clock::now();
          auto b = device.next();
          waiting += clock::now() - asked;
          return b;
        };
        const auto start = clock::now();
        model.reset_stats();
        std::size_t seen = 0;
        std::int64_t steps = 0;
        while (auto b = next_batch()) {
          const int n = static_cast<int>(b->bytes().size() / fm::sample_bytes);
          const float* x = b->template as<float>();
          const auto* labels = reinterpret_cast<const std::int32_t*>(x + fm::pixels);
          model.train_step(x, stride, labels, stride, n, [&](int part, fc::span<float> grad) { ctx.sync().ready(part, grad); });
          ctx.sync().finish();
          model.step(s.lr);
          ++steps;
          seen += static_cast<std::size_t>(n);
          if (s.log_every > 0 && (b->step() + 1) % s.log_every == 0 && ctx.rank_in_member() == 0) {
            const auto [loss, correct] = model.stats();
            std::printf("member %d step %lld: loss %.4f, train accuracy %.3f\n", ctx.member(),
                        static_cast<long long>(b->step() + 1), loss / static_cast<double>(seen),
                        correct / static_cast<double>(seen));
            model.reset_stats();
            seen = 0;
          }
        }
        fc::check_cuda(fc::device::stream_synchronize(compute), "cuda_trainer: end of training");
        const auto trained = clock::now() - start;
        if (ctx.rank_in_member() == 0 && steps > 0)
          std::printf("member %d: %lld steps, %.3f ms/step, waiting for data %.0f %% of the step\n", ctx.member(),
                      static_cast<long long>(steps),
                      std::chrono::duration<double, std::milli>(trained).count() / static_cast<double>(steps),
                      100.0 * std::chrono::duration<double>(waiting).count() / std::chrono::duration<double>(trained).count());

        // This rank's slice of the test set: class probabilities, one column of 10 per image.
        const auto test = fm::load(fm::split::test, fm::default_dir(), s.test_images);
        const std::size_t first = test.count * static_cast<std::size_t>(ctx.rank_in_member()) /
                                  static_cast<std::size_t>(ctx.member_size());
        const std::size_t last = test.count * static_cast<std::size_t>(ctx.rank_in_member() + 1) /
                                 static_cast<std::size_t>(ctx.member_size());
        std::vector<float> probs((last - first) * fm::classes);
        fm::augment_options plain;
        plain.pad = 0;
        plain.flip = false;
        plain.max_rotation_degrees = 0;
        std::vector<float> pixels(256 * fm::pixels);
        fc::cuda::device_buffer<float> images(pixels.size());
        fc::cuda::device_buffer<float> predicted(256 * fm::classes);
        for (std::size_t i = first; i < last; i += 256) {
          const auto n = std::min<std::size_t>(256, last - i);
          for (std::size_t j = 0; j < n; ++j) fm::augment(test.image(i + j), &pixels[j * fm::pixels], 0, plain);
          fc::check_cuda(fc::device::copy_async(images.data(), pixels.data(), n * fm::pixels * sizeof(float), compute),
                         "cuda_trainer: upload test images");
          model.predict(images.data(), fm::pixels, static_cast<int>(n), predicted.data());
          fc::check_cuda(fc::device::copy_async(&probs[(i - first) * fm::classes], predicted.data(),
                                                n * fm::classes * sizeof(float), compute),
                         "cuda_trainer: download predictions");
          fc::check_cuda(fc::device::stream_synchronize(compute), "cuda_trainer: predict");
        }
        ctx.collect().submit(fc::span<const float>(probs));
      },
      [&](auto& ctx) {
        // Each member's probabilities over the test set, and the ensemble's average of them.
        const auto all = ctx.collect().template gather<float>();
        const auto test = fm::load(fm::split::test, fm::default_dir(), s.test_images);
        std::vector<float> ensemble(test.count * fm::classes, 0.f);
        auto accuracy = [&](fc::span<const float> p) {
          std::size_t correct = 0;
          for (std::size_t i = 0; i < test.count; ++i) {
            int best = 0;
            for (int c = 1; c < fm::classes; ++c)
              if (p[i * fm::classes + c] > p[i * fm::classes + best]) best = c;
            correct += best == test.labels[i];
          }
          return static_cast<double>(correct) / static_cast<double>(test.count);
        };
        auto report = [&](const std::string& who, double a) {
          std::printf("%s: test accuracy %.4f\n", who.c_str(), a);
          if (a >= s.min_accuracy) return;
          std::fprintf(stderr, "cuda_trainer: %s's test accuracy %.4f is below --min-accuracy %.4f\n", who.c_str(), a,
                       s.min_accuracy);
          accurate = false;
        };
        for (int m = 0; m < ctx.members(); ++m) {
          const auto p = all.member(m);
          fc::check(p.size() == ensemble.size(), "cuda_trainer",
                    fc::cat("member ", m, " sent ", p.size(), " probabilities, expected ", ensemble.size()));
          report(fc::cat("member ", m), accuracy(p));
          for (std::size_t i = 0; i < ensemble.size(); ++i) ensemble[i] += p[i] / static_cast<float>(ctx.members());
        }
        report(fc::cat("ensemble of ", ctx.members()), accuracy(fc::span<const float>(ensemble)));
      });
  return accurate ? 0 : 1;
}
}  // namespace

int main(int argc, char** argv) {
  fc::environment env(argc, argv);
  settings s;
  std::string pipeline = "streamlined", backend = "nccl";
  long preprocess_us = 0;
  po::options_description opts("cuda_trainer: an ensemble of MLPs on Fashion-MNIST, on GPUs");
  opts.add_options()("help,h", "this text")("pipeline", po::value(&pipeline)->default_value(pipeline),
                                            "baseline | streamlined")(
      "backend", po::value(&backend)->default_value(backend), "mpi (staged through pinned memory) | nccl")(
      "layout", po::value(&s.layout)->default_value(s.layout), "ensemble layout (FLEXCOMM_LAYOUT overrides)")(
      "steps", counts::at_least<1>(&s.steps), "training steps")(
      "batch", counts::at_least<1>(&s.batch), "samples per step and member")(
      "hidden", counts::at_least<1>(&s.hidden), "hidden units")(
      "lr", po::value(&s.lr)->default_value(s.lr), "learning rate")(
      "train-images", counts::at_least<0>(&s.train_images), "use the first N training images (0: all)")(
      "test-images", counts::at_least<1>(&s.test_images), "test images to evaluate")(
      "log-every", counts::at_least<1>(&s.log_every), "steps between progress lines")(
      "preprocess-us", counts::at_least<0>(&preprocess_us),
      "CPU work added to each sample's preprocessing, in microseconds (real work, in the loader)")(
      "min-accuracy", po::value(&s.min_accuracy)->default_value(s.min_accuracy),
      "exit non-zero if a member's or the ensemble's test accuracy is below this (0-1; tests)");
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, opts), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    if (env.world().rank() == 0) std::cerr << e.what() << "\n" << opts;
    return 2;
  }
  if (vm.count("help")) {
    if (env.world().rank() == 0) std::cout << opts << "\n";
    return 0;
  }
  s.preprocess = std::chrono::microseconds(preprocess_us);
  if (!fc::cuda_device_present()) {
    if (env.world().rank() == 0) std::puts("cuda_trainer: no CUDA device");
    return 77;
  }
  try {
    if (pipeline == "baseline" && backend == "mpi") return train<baseline_mpi>(env, s);
    if (pipeline == "streamlined" && backend == "mpi") return train<streamlined_mpi>(env, s);
    if (pipeline == "baseline" && backend == "nccl") return train<baseline_nccl>(env, s);
    if (pipeline == "streamlined" && backend == "nccl") return train<streamlined_nccl>(env, s);
    fc::fail("cuda_trainer", fc::cat("unknown --pipeline '", pipeline, "' / --backend '", backend,
                                     "' (baseline|streamlined, mpi|nccl)"));
  } catch (const fc::error& e) {
    fc::abort_job(e.what());  // the other ranks wait on this one
  }
  return 1;
}
