// An ensemble of small MLPs trained on Fashion-MNIST through an ensemble_pipeline: members differ
// in seed and hyper-parameters, each is data-parallel over its ranks. The typed feed gives each
// trainer its samples as tensors (any batch size over any layout, the short last batch
// included) and says where epochs end; there every member sends its test-set class probabilities
// many_to_one to the aggregator, which scores every member and the ensemble as epochs finish.
// The same run repeats with the baseline preset and prints the CPU time of both.
// With --members-span wide the members' step costs differ some 16x; a layout "members=auto:N"
// then lets flexcomm give each member its ranks from a warm-up that times each member's own step.
// With --early-stop a member ends before the last epoch and its ranks join one still training.
//
//   mpiexec -n 7 build/examples/ensemble_fashion_mnist --layout "producers=1 members=2,2,1,1 aggregator=1"
//   mpiexec -n 9 build/examples/ensemble_fashion_mnist --members-span wide --layout "producers=1 members=auto:6 aggregator=1"
//   mpiexec -n 7 build/examples/ensemble_fashion_mnist --preset baseline --members-span wide --layout "members=auto:6 aggregator=0" --early-stop patience:1
#include <flexcomm/flexcomm.hpp>
#include <flexcomm/pipeline/presets.hpp>

#include <Eigen/Dense>
#include <boost/program_options.hpp>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <new>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/fashion_mnist.hpp"
#include "common/counts.hpp"

namespace fc = flexcomm;
namespace fm = fashion_mnist;
namespace po = boost::program_options;

namespace {

using matrix = Eigen::MatrixXf;
using vector = Eigen::VectorXf;
// A run of samples as the typed feed hands them over: a column of pixels per sample.
using sample_pixels = Eigen::Map<const matrix>;

struct settings {
  std::string layout, preset, sync;
  std::string members_span = "narrow";  // narrow: widths 24-64; wide: 32-512
  int epochs = 3;
  std::size_t batch = 64;
  std::size_t train_images = 0;  // 0: all
  std::size_t test_images = 0;   // 0: all
  int progress_every = 150;
  bool compare_baseline = true;
  float elastic_alpha = 1.5f;
  int slow_rank = -1;  // a world rank made slower on purpose, to find it in a trace
  int slow_ms = 0;
  std::string early_stop;  // "patience:P", "accuracy:A" or both, comma-separated; empty: off
};

// When a member stops before the last epoch (--early-stop), judged at each epoch's end on the
// whole test set: after `patience` epochs without a better accuracy than its best, or once its
// accuracy reaches `accuracy` percent (good enough). Its ranks then join a member still training.
struct stop_rule {
  int patience = 0;     // 0: no patience rule
  double accuracy = 0;  // percent; 0: no target
  bool on() const { return patience > 0 || accuracy > 0; }
};

stop_rule stop_rule_of(const std::string& text) {
  stop_rule r;
  std::size_t at = 0;
  while (at < text.size()) {
    const std::size_t end = std::min(text.find(',', at), text.size());
    const std::string part = text.substr(at, end - at);
    const std::size_t colon = part.find(':');
    const std::string name = part.substr(0, colon), value = colon == std::string::npos ? "" : part.substr(colon + 1);
    char* rest = nullptr;
    const double v = std::strtod(value.c_str(), &rest);
    const bool number = !value.empty() && rest && *rest == '\0';
    if (name == "patience" && number && v >= 1 && v == std::floor(v) && v < 1e6) {
      r.patience = static_cast<int>(v);
    } else if (name == "accuracy" && number && v > 0 && v <= 100) {
      r.accuracy = v;
    } else {
      fc::fail("ensemble_fashion_mnist",
               fc::cat("--early-stop: '", part, "' is not patience:P (P epochs without a better test accuracy, ",
                       "P >= 1) or accuracy:A (test accuracy A percent reached, 0 < A <= 100)"));
    }
    at = end + 1;
  }
  return r;
}

// Members differ in width, learning rate and seed, so their errors differ and averaging helps.
// A wide span is a heterogeneous ensemble, as a hyper-parameter search makes: the widest
// member's step costs some 16x the narrowest's.
struct member_config {
  int hidden;
  float learning_rate;
  std::uint64_t seed;
};

member_config config_of(int member, const settings& s) {
  static const int narrow[] = {32, 48, 40, 64, 56, 24};
  static const int wide[] = {32, 64, 128, 192, 320, 512};
  static const float rates[] = {0.01f, 0.008f, 0.012f, 0.006f, 0.01f, 0.007f};
  const int hidden = (s.members_span == "wide" ? wide : narrow)[member % 6];
  return {hidden, rates[member % 6], 1000u + static_cast<std::uint64_t>(member) * 7919u};
}

// Two layers, ReLU, softmax cross-entropy; SGD with momentum. The gradients live in memory the
// sync hands out (gradient_memory()), one matrix each: the sync averages them in place. On one
// host that memory is shared: a bucket of one gradient (FLEXCOMM_BUCKET_BYTES below its size) is
// reduced where backprop wrote it, and fused buckets stage there instead of in private memory.
class mlp {
 public:
  // The bytes of gradient memory a model of `c` needs: its four gradients, each on a cache line.
  static std::size_t gradient_bytes(const member_config& c) { return gradient_offset(c, 4) * sizeof(float); }

  // The gradients get their memory from use_gradients(), before the first step.
  explicit mlp(const member_config& c) : config_(c) {
    std::mt19937_64 rng(c.seed);
    auto init = [&](matrix& w, int fan_in) {
      std::normal_distribution<float> normal(0.0f, std::sqrt(2.0f / static_cast<float>(fan_in)));
      for (Eigen::Index i = 0; i < w.size(); ++i) w.data()[i] = normal(rng);
    };
    w1_ = matrix(c.hidden, fm::pixels);
    w2_ = matrix(fm::classes, c.hidden);
    init(w1_, fm::pixels);
    init(w2_, c.hidden);
    b1_ = vector::Zero(c.hidden);
    b2_ = vector::Zero(fm::classes);
    v_w1_ = matrix::Zero(w1_.rows(), w1_.cols());
    v_w2_ = matrix::Zero(w2_.rows(), w2_.cols());
    v_b1_ = vector::Zero(b1_.size());
    v_b2_ = vector::Zero(b2_.size());
  }

  // Where the gradients live from now on (a member's sync is made anew when other members'
  // ranks join it, with gradient memory of its own); each step writes them before reading.
  void use_gradients(fc::span<std::byte> memory) {
    // Eigen's way to re-point a Map: placement new over the old one.
    new (&g_w1_) Eigen::Map<matrix>(gradient(memory, 0), config_.hidden, fm::pixels);
    new (&g_b1_) Eigen::Map<vector>(gradient(memory, 1), config_.hidden);
    new (&g_w2_) Eigen::Map<matrix>(gradient(memory, 2), fm::classes, config_.hidden);
    new (&g_b2_) Eigen::Map<vector>(gradient(memory, 3), fm::classes);
  }

  // The parameters and the optimizer's momenta, as bytes: what a hand-over sends a member's
  // new ranks (the same parts and sizes on every rank of the member).
  std::vector<fc::span<std::byte>> state() {
    std::vector<fc::span<std::byte>> parts;
    for (matrix* m : {&w1_, &w2_, &v_w1_, &v_w2_})
      parts.emplace_back(reinterpret_cast<std::byte*>(m->data()), static_cast<std::size_t>(m->size()) * sizeof(float));
    for (vector* v : {&b1_, &b2_, &v_b1_, &v_b2_})
      parts.emplace_back(reinterpret_cast<std::byte*>(v->data()), static_cast<std::size_t>(v->size()) * sizeof(float));
    return parts;
  }

  // Class probabilities, one column per sample.
  matrix predict(const sample_pixels& x) const {
    matrix h = ((w1_ * x).colwise() + b1_).cwiseMax(0.0f);
    return softmax((w2_ * h).colwise() + b2_);
  }

  // Forward and backward over the local samples; hands each gradient to `ready` as soon as
  // backprop has it (output layer first). Returns the mean loss. `per_rank` is the step's samples
  // over the member's ranks: each rank's gradient is its sum over that, so the sync's average is
  // the step's mean even where ranks hold different counts (a split after a hand-over, a short
  // last batch); where counts are even it equals the rank's own mean.
  template <class Ready>
  float forward_backward(const sample_pixels& x, const std::int32_t* labels, float per_rank, Ready&& ready) {
    const auto n = x.cols();
    if (n == 0) {  // a short last batch left this rank no sample: it still takes part in the step
      for (auto* g : {&g_w1_, &g_w2_}) g->setZero();
      for (auto* g : {&g_b1_, &g_b2_}) g->setZero();
      ready(0, fc::span<float>(g_w2_.data(), static_cast<std::size_t>(g_w2_.size())));
      ready(1, fc::span<float>(g_b2_.data(), static_cast<std::size_t>(g_b2_.size())));
      ready(2, fc::span<float>(g_w1_.data(), static_cast<std::size_t>(g_w1_.size())));
      ready(3, fc::span<float>(g_b1_.data(), static_cast<std::size_t>(g_b1_.size())));
      return 0.0f;
    }
    std::optional<fc::trace::span> phase(std::in_place, fc::trace::names::forward);
    matrix h = ((w1_ * x).colwise() + b1_).cwiseMax(0.0f);
    matrix p = softmax((w2_ * h).colwise() + b2_);
    phase.emplace(fc::trace::names::backward);
    float loss = 0.0f;
    for (Eigen::Index j = 0; j < n; ++j) {
      loss -= std::log(std::max(p(labels[j], j), 1e-12f));
      p(labels[j], j) -= 1.0f;  // now dLoss/dlogits * n
    }
    p /= per_rank;
    g_w2_.noalias() = p * h.transpose();
    g_b2_ = p.rowwise().sum();
    ready(0, fc::span<float>(g_w2_.data(), static_cast<std::size_t>(g_w2_.size())));
    ready(1, fc::span<float>(g_b2_.data(), static_cast<std::size_t>(g_b2_.size())));
    matrix dh = (w2_.transpose() * p).cwiseProduct((h.array() > 0.0f).cast<float>().matrix());
    g_w1_.noalias() = dh * x.transpose();
    g_b1_ = dh.rowwise().sum();
    ready(2, fc::span<float>(g_w1_.data(), static_cast<std::size_t>(g_w1_.size())));
    ready(3, fc::span<float>(g_b1_.data(), static_cast<std::size_t>(g_b1_.size())));
    return loss / static_cast<float>(n);
  }

  // The optimizer step, on gradients the sync has averaged over the member's ranks.
  void step() {
    const float lr = config_.learning_rate, momentum = 0.9f;
    v_w1_ = momentum * v_w1_ + g_w1_;
    v_b1_ = momentum * v_b1_ + g_b1_;
    v_w2_ = momentum * v_w2_ + g_w2_;
    v_b2_ = momentum * v_b2_ + g_b2_;
    w1_ -= lr * v_w1_;
    b1_ -= lr * v_b1_;
    w2_ -= lr * v_w2_;
    b2_ -= lr * v_b2_;
  }

 private:
  // Where gradient `i` (w1, b1, w2, b2) starts, in floats: each after the last, on a cache line.
  static std::size_t gradient_offset(const member_config& c, int i) {
    const auto hidden = static_cast<std::size_t>(c.hidden);
    const std::size_t floats[] = {hidden * fm::pixels, hidden, fm::classes * hidden, fm::classes};
    std::size_t at = 0;
    for (int k = 0; k < i; ++k) at += (floats[k] + 15) / 16 * 16;
    return at;
  }
  float* gradient(fc::span<std::byte> memory, int i) const {
    if (memory.size() < gradient_bytes(config_)) throw std::invalid_argument("mlp: gradient memory too small");
    return reinterpret_cast<float*>(memory.data()) + gradient_offset(config_, i);
  }

  static matrix softmax(const matrix& z) {
    matrix e = (z.rowwise() - z.colwise().maxCoeff()).array().exp().matrix();
    return e.array().rowwise() / e.colwise().sum().array();
  }

  member_config config_;
  Eigen::Map<matrix> g_w1_{nullptr, 0, 0}, g_w2_{nullptr, 0, 0};
  Eigen::Map<vector> g_b1_{nullptr, 0}, g_b2_{nullptr, 0};
  matrix w1_, w2_, v_w1_, v_w2_;
  vector b1_, b2_, v_b1_, v_b2_;
};

// A member's model on this rank, and its early-stopping record: the best test accuracy so far
// (percent) and the epochs since it improved. The record goes with the model at a hand-over.
struct member_state {
  explicit member_state(const member_config& c) : model(c) {}
  mlp model;
  double record[2] = {-1, 0};
};

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// A barrier that sleeps while it waits (MPICH's own would spin on a shared core).
void barrier(const fc::mpi::communicator& comm) {
  int one = 1;
  fc::mpi::iallreduce(comm, fc::span<int>(&one, 1), fc::op::sum).wait();
}


struct outcome {
  double cpu = 0, wall = 0;  // CPU seconds summed over ranks, wall seconds
  double producer_cpu = 0, trainer_cpu = 0;
  double ensemble_accuracy = 0;
};

struct data_sets {
  std::optional<fm::packed_dataset> train;  // on ranks that preprocess
  fm::dataset test;                          // on trainers and the aggregator
  std::vector<float> test_pixels;            // normalized, a column of fm::pixels per image
};

// Random crop (pad 1), horizontal flip and a mild elastic distortion (--elastic-alpha pixels);
// rotation is left out, it costs these small, briefly trained members accuracy.
fm::augment_options augmentation_of(const settings& s) {
  fm::augment_options a;
  a.pad = 1;
  a.flip = true;
  a.max_rotation_degrees = 0;
  a.elastic_alpha = s.elastic_alpha;
  return a;
}

// One run of the ensemble under preset P, over `comm` laid out as `layout`.
template <class P>
outcome run_preset(const fc::mpi::communicator& comm, const fc::ensemble_layout& layout,
                   const std::vector<double>& costs, const settings& s, data_sets& data, std::size_t train_count) {
  using pipeline_type = typename P::pipeline;
  P::check_layout(layout, P::name);

  typename pipeline_type::options options;
  options = P::configure(options);
  options.feed.depth = 3;

  // The training set as the feed sees it: every rank knows its size and shapes; the ranks that
  // preprocess (they hold data.train) load, a shard of a step at a time.
  const auto augmentation = augmentation_of(s);
  fc::dataset images;
  images.size = static_cast<std::int64_t>(train_count);
  images.batch = static_cast<std::int64_t>(s.batch);
  images.epochs = s.epochs;
  images.sample = fc::field::of<float>({fm::rows, fm::cols});
  images.label = fc::field::of<std::int32_t>();
  if (data.train)
    images.load_batch = [&](const fc::batch_slot& out) {
      fm::make_samples_at(*data.train, out.step(), static_cast<std::size_t>(out.position()), out.indices().data(),
                          static_cast<std::size_t>(out.count()), out.samples<float>().data(),
                          out.labels<std::int32_t>().data(), augmentation);
    };

  barrier(comm);
  const double cpu_start = cpu_seconds();
  const auto wall_start = std::chrono::steady_clock::now();
  pipeline_type pipe(comm, layout, options);
  const bool slow = s.slow_ms > 0 && comm.world_rank_of(comm.rank()) == s.slow_rank;

  // The aggregator scores each epoch's round as it arrives, while training goes on.
  outcome result;
  auto accuracy = [&](fc::span<const float> p) {
    std::size_t right = 0;
    for (std::size_t i = 0; i < data.test.count; ++i) {
      const float* row = p.data() + i * fm::classes;
      right += static_cast<std::size_t>(std::max_element(row, row + fm::classes) - row) == data.test.labels[i];
    }
    return static_cast<double>(right) / static_cast<double>(data.test.count);
  };
  pipe.on_round([&](std::int64_t epoch, fc::gathered<float>& each) {
    const bool last = epoch + 1 == s.epochs;
    // Member lines come with the last epoch's scores, before its ensemble line.
    std::vector<float> averaged(each.member(0).size(), 0.0f);
    double best = 0;
    std::string line;
    for (int m = 0; m < layout.members(); ++m) {
      const auto p = each.member(m);
      for (std::size_t i = 0; i < averaged.size(); ++i) averaged[i] += p[i] / static_cast<float>(layout.members());
      const double a = accuracy(p);
      best = std::max(best, a);
      const auto c = config_of(m, s);
      if (last)
        std::printf("  member %d (%d ranks, hidden %3d, lr %.3f): test accuracy %.2f%%\n", m, layout.member_size(m),
                    c.hidden, static_cast<double>(c.learning_rate), 100 * a);
      char score[16];
      std::snprintf(score, sizeof score, "%s%.2f%%", m ? " " : "", 100 * a);
      line += score;
    }
    const double ensemble = accuracy(fc::span<const float>(averaged));
    std::printf("  epoch %lld: members %s, ensemble %.2f%%\n", static_cast<long long>(epoch + 1), line.c_str(),
                100 * ensemble);
    if (last) {
      result.ensemble_accuracy = ensemble;
      std::printf("  ensemble (averaged probabilities): test accuracy %.2f%% (%+.2f points over the best member)\n",
                  100 * ensemble, 100 * (ensemble - best));
    }
    std::fflush(stdout);
  });

  // Each member's model on this rank, and its early-stopping record: outside the trainer function,
  // which the pipeline calls again for the member a stopped member's ranks join (the joiners'
  // copy is made here, then overwritten by the member's state from its rank 0).
  const stop_rule rule = stop_rule_of(s.early_stop);
  std::map<int, member_state> models;
  auto model_of = [&](int m) -> member_state& { return models.try_emplace(m, config_of(m, s)).first->second; };
  if (rule.on())
    pipe.on_handover({[&](int m) {
                        auto& state = model_of(m);
                        auto parts = state.model.state();
                        parts.emplace_back(reinterpret_cast<std::byte*>(state.record), sizeof state.record);
                        return parts;
                      },
                      costs});
  // The member this rank was laid out in, whose slice of the test set it submits every epoch.
  const fc::rank_role own = layout.role_of(comm.rank());
  const std::int64_t steps_per_epoch =
      static_cast<std::int64_t>((train_count + s.batch - 1) / s.batch);  // the short last batch kept

  // At an epoch's end (after its last step): the round of this rank's own member, and whether the
  // member stops. Every rank of a member holds the same parameters (the syncs average to the same
  // bits on every rank: MPI's allreduce, the shared-memory reducer folding in rank order, the
  // ring; a joiner receives the member's state from its rank 0), and the same record, so each
  // rank scores the whole test set itself and all reach the same verdict at the same step, with
  // no message. A member that stops submits its last probabilities for every round left; its
  // ranks, wherever they go next, submit nothing more (every trainer submits each round once).
  auto epoch_end = [&](auto& ctx, member_state& state, std::int64_t epoch) {
    const auto total = static_cast<Eigen::Index>(data.test.count);
    const bool mine = ctx.member() == own.member;
    const auto from = total * own.rank_in_member / layout.member_size(own.member);
    const auto to = total * (own.rank_in_member + 1) / layout.member_size(own.member);
    bool stop = false;
    matrix probabilities;
    if (rule.on()) {
      probabilities = state.model.predict(sample_pixels(data.test_pixels.data(), fm::pixels, total));
      const auto size = static_cast<std::size_t>(probabilities.size());
      const double a = 100 * accuracy(fc::span<const float>(probabilities.data(), size));
      double& best = state.record[0];
      double& stale = state.record[1];
      stale = a > best ? 0 : stale + 1;
      best = std::max(best, a);
      stop = epoch + 1 < s.epochs && ((rule.patience > 0 && stale >= rule.patience) ||
                                      (rule.accuracy > 0 && a >= rule.accuracy));
    } else if (mine) {
      const sample_pixels x(data.test_pixels.data() + from * fm::pixels, fm::pixels, to - from);
      probabilities = state.model.predict(x);
    }
    if (!mine) return stop;
    const float* slice = probabilities.data() + (rule.on() ? from * fm::classes : 0);
    const fc::span<const float> round(slice, static_cast<std::size_t>((to - from) * fm::classes));
    for (std::int64_t e = epoch; e < (stop ? s.epochs : epoch + 1); ++e) ctx.collect().submit(round);
    return stop;
  };

  auto train = [&](auto& ctx) {
    const member_config config = config_of(ctx.member(), s);
    member_state& state = model_of(ctx.member());
    // Collective over the member, before its first step (and again when other ranks joined it).
    state.model.use_gradients(ctx.sync().gradient_memory(mlp::gradient_bytes(config)));
    int ranks = ctx.member_size();
    const bool report = ctx.is_aggregator();
    auto& feed = ctx.batches();
    const std::int64_t steps = feed.plan().steps();
    double loss_sum = 0;
    int loss_count = 0;
    std::int64_t images_seen = 0;
    auto last = std::chrono::steady_clock::now();
    for (const fc::typed_batch& batch : feed) {
      if (ctx.member_size() != ranks) {  // ranks joined: the new sync's memory, averaged in place
        ranks = ctx.member_size();
        state.model.use_gradients(ctx.sync().gradient_memory(mlp::gradient_bytes(config)));
      }
      const auto pixels = batch.as<float>();  // {samples, 28, 28}: a column of pixels per sample
      const sample_pixels x(pixels.data(), fm::pixels, static_cast<Eigen::Index>(batch.samples()));
      if (slow) {  // --slow-rank: a rank that computes longer, as one on a slower node would
        fc::trace::span delay("injected delay", batch.step());
        std::this_thread::sleep_for(std::chrono::milliseconds(s.slow_ms));
      }
      const float per_rank = static_cast<float>(batch.batch_samples()) / static_cast<float>(ctx.member_size());
      const float loss = state.model.forward_backward(x, batch.labels<std::int32_t>().data(), per_rank,
                                                      [&](int i, fc::span<float> g) { ctx.sync().ready(i, g); });
      ctx.sync().finish();
      {
        fc::trace::span update(fc::trace::names::update, batch.step());
        state.model.step();
      }
      if (batch.samples() > 0) {
        loss_sum += loss;
        ++loss_count;
      }
      images_seen += batch.batch_samples();
      const std::int64_t step = batch.step() + 1;
      if (report && (step % s.progress_every == 0 || step == steps)) {
        const auto now = std::chrono::steady_clock::now();
        const double seconds = std::chrono::duration<double>(now - last).count();
        // Every member sees every step's batch: the ensemble trains on members x batch images.
        const double rate = static_cast<double>(images_seen * ctx.members()) / seconds;
        std::printf("  step %6lld/%lld  epoch %lld  loss %.4f (member %d)  %8.0f images/s\n",
                    static_cast<long long>(step), static_cast<long long>(steps),
                    static_cast<long long>(batch.epoch() + 1), loss_count ? loss_sum / loss_count : 0.0,
                    ctx.member(), rate);
        std::fflush(stdout);
        loss_sum = 0;
        loss_count = 0;
        images_seen = 0;
        last = now;
      }
      // A step boundary: the member stops here, on all its ranks at once, or trains on.
      if (batch.last_in_epoch() && epoch_end(ctx, state, batch.epoch())) return ctx.finish_member();
    }
  };

  // Once, at the end, on the aggregator: how each member ended and who took its ranks.
  auto ends = [&](auto& ctx) {
    if (!rule.on()) return;
    std::printf("early stopping (%s): how the members ended\n", s.early_stop.c_str());
    for (const fc::handover_record& e : ctx.member_ends()) {
      if (e.ended_at < 0) {
        std::printf("  member %d trained to the end\n", e.member);
        continue;
      }
      const auto epochs = static_cast<long long>(e.ended_at / steps_per_epoch);
      if (e.joined < 0)
        std::printf("  member %d stopped after epoch %lld (step %lld); no member took its ranks\n", e.member, epochs,
                    static_cast<long long>(e.ended_at));
      else
        std::printf("  member %d stopped after epoch %lld (step %lld); its ranks joined member %d at its step %lld\n",
                    e.member, epochs, static_cast<long long>(e.ended_at), e.joined,
                    static_cast<long long>(e.joined_at));
    }
    std::fflush(stdout);
  };

  pipe.run(images, train, ends);
  barrier(comm);
  result.wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  const double mine = cpu_seconds() - cpu_start;
  const bool producer = layout.role_of(comm.rank()).kind == fc::role::producer;
  double split[2] = {producer ? mine : 0.0, producer ? 0.0 : mine};
  fc::mpi::iallreduce(comm, fc::span<double>(split, 2), fc::op::sum).wait();
  result.producer_cpu = split[0];
  result.trainer_cpu = split[1];
  result.cpu = split[0] + split[1];
  return result;
}

data_sets load_data(const fc::mpi::communicator& world, const fc::ensemble_layout& layout, const settings& s,
                    bool preprocesses) {
  data_sets d;
  const auto me = layout.role_of(world.rank());
  if (preprocesses) {
    const auto raw = fm::load(fm::split::train, fm::default_dir(), s.train_images);
    d.train.emplace(raw, 64, 1);
  }
  if (me.kind == fc::role::trainer || world.rank() == layout.aggregator()) {
    d.test = fm::load(fm::split::test, fm::default_dir(), s.test_images);
    d.test_pixels.resize(d.test.count * fm::pixels);
    const fm::augment_options plain{0, false, 0.0f};  // normalize only
    for (std::size_t i = 0; i < d.test.count; ++i)
      fm::augment(d.test.image(i), d.test_pixels.data() + i * fm::pixels, 0, plain);
  }
  return d;
}

// A "members=auto:N" layout planned from the members' measured steps: each trainer rank times
// one member's own model, built here for the warm-up and then dropped, on a few real training
// batches of the whole batch size, alone (no communication); the plan gives a costlier member
// more ranks. The aggregator prints the plan once; a layout with sizes is returned as written,
// without costs. The costs (the same on every rank) also pick where a stopped member's ranks go.
std::pair<fc::ensemble_layout, std::vector<double>> planned(const fc::mpi::communicator& world,
                                                             const fc::ensemble_layout& layout, const settings& s) {
  if (layout.is_planned()) return {layout, {}};
  // Ten timed steps: ranks that share a core take turns in slices of milliseconds, and a mean
  // over a few such slices is steadier than one over three steps of a narrow member.
  fc::measure_options measure;
  measure.timed_steps = 10;
  // Four batches, made before anyone times (a rank still decoding would slow the others' steps).
  const std::size_t batches = 4, samples = batches * s.batch;
  const auto images = fm::load(fm::split::train, fm::default_dir(),
                               s.train_images > 0 ? std::min(s.train_images, samples) : samples);
  std::vector<float> pixels(samples * fm::pixels);  // a column of pixels per sample
  std::vector<std::int32_t> labels(samples);
  for (std::size_t j = 0; j < samples; ++j) {
    fm::augment(images.image(j % images.count), pixels.data() + j * fm::pixels, fm::seed_of(0, j), augmentation_of(s));
    labels[j] = images.labels[j % images.count];
  }
  std::vector<float> gradients;
  std::optional<mlp> model;  // the member this rank measures; built in the untimed first step
  std::size_t calls = 0;
  auto step = [&](int member) {
    if (!model) {
      const member_config config = config_of(member, s);
      gradients.assign(mlp::gradient_bytes(config) / sizeof(float), 0.0f);
      model.emplace(config);
      model->use_gradients(fc::span<std::byte>(reinterpret_cast<std::byte*>(gradients.data()),
                                               gradients.size() * sizeof(float)));
    }
    const std::size_t first = (calls++ % batches) * s.batch;
    const sample_pixels x(pixels.data() + first * fm::pixels, fm::pixels, static_cast<Eigen::Index>(s.batch));
    model->forward_backward(x, labels.data() + first, static_cast<float>(s.batch), [](int, fc::span<float>) {});
    model->step();
  };
  const fc::layout_plan plan = fc::measure_and_plan(world, layout, step, measure);
  if (world.rank() == plan.layout.aggregator()) {
    std::printf("%s", plan.text().c_str());
    std::fflush(stdout);
  }
  return {plan.layout, plan.plan.costs};
}

}  // namespace

int main(int argc, char** argv) {
  fc::environment env(argc, argv);
  const auto& world = env.world();
  const bool root = world.rank() == 0;

  settings s;
  po::options_description flags("ensemble_fashion_mnist: an ensemble of MLPs on Fashion-MNIST through flexcomm");
  flags.add_options()("help,h", "this text")(
      "layout", po::value(&s.layout)->default_value("producers=1 members=2,2,1,1 aggregator=1"),
      "ranks per role (FLEXCOMM_LAYOUT overrides); members=auto:N sizes N members from a warm-up of each; "
      "the aggregator prints")(
      "members-span", po::value(&s.members_span)->default_value("narrow"),
      "narrow (hidden widths 24-64) or wide (32-512: step costs some 16x apart, for members=auto:N)")(
      "preset", po::value(&s.preset)->default_value("single_broadcast"),
      "baseline, single_broadcast, multi_broadcast, all_shared or adaptive")(
      "sync", po::value(&s.sync)->default_value("allreduce"), "allreduce (subgroup_allreduce) or ring (overlapped_ring)")(
      "epochs", counts::at_least<1>(&s.epochs), "passes over the training set")(
      "batch", counts::at_least<1>(&s.batch),
      "images per step and member (split over its ranks; any size, any layout)")(
      "train-images", counts::at_least<0>(&s.train_images), "use only the first N training images (0: all)")(
      "test-images", counts::at_least<0>(&s.test_images), "score on only the first N test images (0: all)")(
      "progress-every", counts::at_least<1>(&s.progress_every), "steps between progress lines")(
      "elastic-alpha", po::value(&s.elastic_alpha)->default_value(1.5f),
      "elastic distortion in pixels (0: off), the costly part of preprocessing")(
      "compare-baseline", po::value(&s.compare_baseline)->default_value(true),
      "run the baseline preset afterwards on the same members and compare CPU time")(
      "slow-rank", po::value(&s.slow_rank)->default_value(-1),
      "world rank that sleeps --slow-ms before each step's forward (a straggler for FLEXCOMM_TRACE to find)")(
      "slow-ms", counts::at_least<0>(&s.slow_ms), "milliseconds --slow-rank sleeps per step")(
      "early-stop", po::value(&s.early_stop)->default_value(""),
      "patience:P (a member ends after P epochs without a better test accuracy), accuracy:A (ends once at A "
      "percent), or both, comma-separated; its ranks then join a member still training (needs a preset whose "
      "feed hands ranks over: baseline)");
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, flags), vm);
    po::notify(vm);
  } catch (const std::exception& e) {
    if (root) std::cerr << e.what() << "\n" << flags;
    return 2;
  }
  if (vm.count("help")) {
    if (root) std::cout << flags;
    return 0;
  }
  // Early stopping hands a stopped member's ranks over, which not every preset's feed does yet:
  // refused in one line, before any rank starts, rather than failing mid-run.
  try {
    const auto hands_over = [&](std::string_view preset) {
      return fc::presets::visit(preset, s.sync, [](auto p) { return decltype(p)::pipeline::can_hand_over; });
    };
    std::string those;
    for (const char* name : fc::presets::names)
      if (hands_over(name)) those += fc::cat(those.empty() ? "" : ", ", name);
    fc::check(!stop_rule_of(s.early_stop).on() || hands_over(s.preset), "ensemble_fashion_mnist",
              fc::cat("--early-stop hands a stopped member's ranks to another member, which preset ", s.preset,
                      "'s feed does not do yet; use --preset ", those));
  } catch (const fc::error& e) {
    if (root) std::cerr << e.what() << "\n";
    return 2;
  }

  try {
    fc::check(s.members_span == "narrow" || s.members_span == "wide", "ensemble_fashion_mnist",
              fc::cat("--members-span is '", s.members_span, "'; it takes narrow or wide"));
    const auto plan = planned(world, fc::ensemble_layout::from_env(s.layout), s);  // members=auto:N
    const fc::ensemble_layout& parsed = plan.first;
    const std::vector<double>& costs = plan.second;
    parsed.validate(world.size());
    const auto layout = fc::placed_on_hosts(world, parsed);  // producers=per-host: on this job's hosts
    layout.validate(world.size());
    fc::check(s.epochs > 0 && s.batch > 0 && s.progress_every > 0, "ensemble_fashion_mnist",
              "epochs, batch and progress-every must be positive");
    const auto me = layout.role_of(world.rank());
    const bool shared_feed = s.preset == "single_broadcast" || s.preset == "multi_broadcast";
    const bool with_baseline = s.compare_baseline && s.preset != "baseline";
    // Ranks that run a loader in either run hold the packed training set (under adaptive, every one).
    const bool preprocesses = me.kind == fc::role::producer ? shared_feed || s.preset == "adaptive"
                                                            : !shared_feed || with_baseline;
    auto data = load_data(world, layout, s, preprocesses);
    // Every rank needs the training set's size, which its file's header tells; only the ranks
    // that preprocess read the images.
    const std::size_t train_count = fm::count(fm::split::train, fm::default_dir(), s.train_images);

    if (world.rank() == layout.aggregator())
      std::printf("flexcomm ensemble on Fashion-MNIST: %d members, layout '%s', preset %s, sync %s, %d epochs, "
                  "batch %zu, %zu training images\n",
                  layout.members(), layout.str().c_str(), s.preset.c_str(), s.sync.c_str(), s.epochs, s.batch,
                  train_count);
    std::fflush(stdout);  // the job's first line, out before set-up: a stall there follows it
    const outcome streamlined = fc::presets::visit(s.preset, s.sync, [&](auto preset) {
      return run_preset<decltype(preset)>(world, layout, costs, s, data, train_count);
    });
    if (world.rank() == layout.aggregator())
      std::printf("%s: %.1f s wall, %.1f s CPU summed over %d ranks (producers %.1f s, trainers %.1f s)\n",
                  s.preset.c_str(), streamlined.wall, streamlined.cpu, world.size(), streamlined.producer_cpu,
                  streamlined.trainer_cpu);

    if (with_baseline) {
      // The same members without producers, on the trainers only; producers wait asleep.
      const auto base_layout = fc::with_producers(layout, 0);
      const auto trainers = world.split(me.kind == fc::role::trainer ? 0 : fc::mpi::communicator::undefined,
                                        world.rank(), "trainers");
      const int base_aggregator = layout.producers() + base_layout.aggregator();
      if (world.rank() == base_aggregator) std::printf("baseline (local_feed, allreduce after backward) on the same members:\n");
      outcome base;
      if (trainers) base = run_preset<fc::presets::baseline<>>(trainers, base_layout, costs, s, data, train_count);
      barrier(world);
      if (world.rank() == base_aggregator) {
        std::printf("baseline: %.1f s wall, %.1f s CPU summed over %d ranks\n", base.wall, base.cpu, trainers.size());
        std::printf("CPU time: %s %.1f s, baseline %.1f s: baseline / %s = %.2f (wall %.2f)\n", s.preset.c_str(),
                    streamlined.cpu, base.cpu, s.preset.c_str(), base.cpu / streamlined.cpu,
                    base.wall / streamlined.wall);
      }
    }
  } catch (const fc::error& e) {
    fc::abort_job(e.what());  // the other ranks wait on this one
  }
  return 0;
}
