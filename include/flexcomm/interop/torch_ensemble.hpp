// An ensemble of libtorch members trained under a preset named at run time, in one call: the
// layout, the pipeline, each trainer's batches as a DataLoader, its module's gradients averaged
// within backward(), and the members' outputs on an evaluation set gathered to the aggregator.
// The trainer function is plain libtorch code, compiled once whatever the preset:
//
//   fi::train_ensemble(env.world(), {"single_broadcast", 3}, fi::dataset_of(train_set, 64), test.images,
//       [&](fi::trainer& ctx, const torch::Tensor& images) {   // on every trainer rank
//         Net model;  ctx.average_gradients(model);  auto loader = ctx.loader();
//         for (auto& batch : *loader) {...}                    // one epoch per loop over *loader
//         return model.forward(images);                        // its slice of test.images
//       },
//       [&](const std::vector<torch::Tensor>& members) {...});  // on the aggregator
//
// MPI and CPU tensors (the presets' default backend). For options this does not take (bucket
// sizes, feed depth), build the pipeline with presets::visit and wrap its context in a trainer.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../backend/mpi.hpp"
#include "../backend/mpi/environment.hpp"
#include "../core/error.hpp"
#include "../core/layout.hpp"
#include "../core/settings.hpp"
#include "../pipeline/presets.hpp"
#include "torch.hpp"

namespace flexcomm::interop {

// What a trainer function gets: which member it trains, its batches, and the member's Sync, the
// same type under every preset (a pipeline context of any preset, type-erased).
class trainer {
 public:
  template <class Context>
  explicit trainer(Context& ctx)
      : member_(ctx.member()),
        rank_in_member_(ctx.rank_in_member()),
        member_size_(ctx.member_size()),
        members_(ctx.members()),
        comm_(&ctx.comm()),
        next_([&ctx] { return ctx.batches().next(); }),
        attach_([&ctx](torch::nn::Module& module, handover how) -> std::unique_ptr<gradients> {
          return std::make_unique<gradient_sync<std::decay_t<decltype(ctx.sync())>>>(ctx.sync(), module, how);
        }) {}

  int member() const noexcept { return member_; }
  int rank_in_member() const noexcept { return rank_in_member_; }
  int member_size() const noexcept { return member_size_; }
  int members() const noexcept { return members_; }
  // The member's communicator, for what the trainer does on its own.
  const mpi::communicator& comm() const noexcept { return *comm_; }

  // This trainer's share of every batch, as torch::data::make_data_loader gives a dataset: each
  // range-for over *loader walks the next epoch (fi::data_loader).
  std::unique_ptr<data_loader> loader() const { return std::make_unique<data_loader>(next_); }

  // Attaches the member's Sync to the module's parameters (gradient_sync); by default each
  // backward() leaves the member's average in every p.grad() (handover::within_backward), so the
  // training loop does not change. Once per trainer (the Sync numbers one module's parameters);
  // the hooks stay until the trainer function returns.
  gradients& average_gradients(torch::nn::Module& module, handover how = handover::within_backward) {
    check(!attached_, "interop::trainer", "average_gradients() attaches one module per trainer; it was called twice");
    attached_ = attach_(module, how);
    return *attached_;
  }

 private:
  int member_, rank_in_member_, member_size_, members_;
  const mpi::communicator* comm_;
  std::function<std::optional<typed_batch>()> next_;
  std::function<std::unique_ptr<gradients>(torch::nn::Module&, handover)> attach_;
  std::unique_ptr<gradients> attached_;
};

struct ensemble_options {
  std::string preset = "single_broadcast";  // presets::names
  int members = 1;
  std::string sync = "allreduce";  // or "ring" (overlapped_ring); the baseline's is allreduce
};

// The layout train_ensemble runs on: FLEXCOMM_LAYOUT when set (it must have o.members members),
// else o.members members spread over the ranks after the preset's producers, the first members
// taking one rank more where they do not divide, the first trainer aggregating. Then the
// preset's producers (Preset::layout_for).
template <class Preset>
ensemble_layout ensemble_layout_for(int world_size, const ensemble_options& o) {
  const char* what = "interop::train_ensemble";
  check(o.members > 0, what, cat("an ensemble of ", o.members, " members"));
  if (const char* text = setting("FLEXCOMM_LAYOUT")) {
    auto layout = ensemble_layout::parse(text);
    check(layout.members() == o.members, what,
          cat("FLEXCOMM_LAYOUT '", text, "' has ", layout.members(), " members; the trainer asks for ", o.members));
    return Preset::layout_for(layout);
  }
  const int producers = Preset::min_producers, trainers = world_size - producers;
  check(trainers >= o.members, what,
        cat(world_size, " ranks, less ", Preset::name, "'s producers (", producers, "), leave ", trainers,
            " to train, fewer than the ", o.members, " members (start ", producers + o.members,
            " ranks or more, or set FLEXCOMM_LAYOUT)"));
  std::vector<int> sizes;
  for (int m = 0; m < o.members; ++m) sizes.push_back(trainers / o.members + (m < trainers % o.members ? 1 : 0));
  return ensemble_layout(producers, sizes, producers);
}

// Trains the ensemble, collectively over `world`: producers load, each trainer runs
// train(trainer, its slice of `evaluation`) (evaluation_slice: the member's ranks split the
// samples along dimension 0) and returns its outputs on that slice, samples along dimension 0;
// then the aggregator runs aggregate(members): per member its ranks' outputs concatenated, as
// float32 of shape [samples of `evaluation`, -1] (view() them for more dimensions). A trainer
// whose output has other rows, or none, is an error on the aggregator too, naming it.
inline void train_ensemble(const mpi::communicator& world, const ensemble_options& o, dataset data,
                           const torch::Tensor& evaluation,
                           const std::function<torch::Tensor(trainer&, const torch::Tensor&)>& train,
                           const std::function<void(const std::vector<torch::Tensor>&)>& aggregate) {
  const char* what = "interop::train_ensemble";
  check(evaluation.defined() && evaluation.dim() > 0 && evaluation.size(0) > 0, what,
        "the evaluation set is empty; the members' outputs on it are what the aggregator gets");
  const std::int64_t samples = evaluation.size(0);
  presets::visit(o.preset, o.sync, [&](auto preset) {
    using Preset = decltype(preset);
    typename Preset::pipeline pipe(world, ensemble_layout_for<Preset>(world.size(), o), Preset::configure({}));
    pipe.run(
        std::move(data),
        [&](auto& ctx) {
          torch::Tensor out;
          {
            trainer t(ctx);
            out = train(t, evaluation_slice(evaluation, ctx));
          }
          // Something goes to the aggregator whatever happened, so that it fails too, not waits.
          if (!out.defined()) {
            ctx.collect().submit(span<const float>());
            fail(what, cat("member ", ctx.member(), " rank ", ctx.rank_in_member(), ": train returned no tensor"));
          }
          submit(ctx.collect(), out.to(torch::kFloat32));
        },
        [&](auto& ctx) {
          auto round = ctx.collect().template gather<float>();
          std::vector<torch::Tensor> members;
          for (int m = 0; m < ctx.layout().members(); ++m) {
            const int ranks = ctx.layout().member_size(m);
            const std::size_t total = round.member(m).size();
            const auto per_sample = static_cast<std::int64_t>(total) / samples;
            for (int r = 0; r < ranks; ++r) {
              const auto rows = evaluation_slice(samples, r, ranks).size();
              check(per_sample > 0 && static_cast<std::int64_t>(round.trainer(m, r).size()) == rows * per_sample &&
                        static_cast<std::int64_t>(total) == samples * per_sample,
                    what,
                    cat("member ", m, " rank ", r, " returned ", round.trainer(m, r).size(), " values for ", rows,
                        " samples (the member ", total, " for ", samples, "): outputs go along dimension 0, one "
                        "row per sample of its evaluation slice"));
            }
            const span<const float> values(round.member(m).data(), total);
            members.push_back(detail::copied<float>(values, {samples, per_sample}));
          }
          aggregate(members);
        });
  });
}

}  // namespace flexcomm::interop
