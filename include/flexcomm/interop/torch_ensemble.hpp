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
// Or, for a trainer that tests after each epoch (pytorch/examples' mnist.cpp), the members'
// outputs on each epoch's test go to a report on the aggregator (docs/porting.md):
//
//   fi::train_ensemble(env.world(), options, fi::dataset_of(train_dataset, 64, epochs),
//       [&](fi::trainer& ctx) {...  test(): fi::evaluated(output, targets); ...},
//       fi::print_accuracies);                                   // each epoch, on the aggregator
//
// A member's ranks start from its first rank's parameters and buffers (average_gradients
// broadcasts them, as DistributedDataParallel does; any number of modules, each with its own
// optimizer), keep its buffers at each step (ensemble_options::buffers), print once per member
// (quiet_replicas; each line "member m: " first where there are several: member_prefix), and an
// error ends the job on every rank with its flexcomm: rank N: message, exit status 1.
//
// Batches and outputs travel over MPI in host memory (the presets' feed and collect). A CPU
// module's gradients are averaged by the preset's Sync over MPI. A module on a CUDA device (a
// CUDA libtorch, a build with CUDA, and this file compiled by nvcc: interop/torch_cuda.hpp) gets
// a device Sync of the same kind, made when average_gradients() sees the module's device:
// subgroup_allreduce on NCCL (or staged: ensemble_options::device_backend), overlapped_ring on
// staged; its gradients are averaged in device memory, in the order of torch's current stream, and
// loader() delivers its batches into device memory. Each trainer rank then uses the GPU of its
// node-local rank (cuda::use_local_device; FLEXCOMM_DEVICE overrides), which torch::kCUDA names.
// So upstream's `torch::cuda::is_available() ? kCUDA : kCPU` trains on the GPU unchanged.
// For options this does not take (bucket sizes, feed depth), build the pipeline with
// presets::visit and wrap its context in a trainer.
#pragma once

#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../backend/mpi.hpp"
#include "../backend/mpi/environment.hpp"
#include "../core/error.hpp"
#include "../core/layout.hpp"
#include "../core/settings.hpp"
#include "../pipeline/member_costs.hpp"
#include "../pipeline/preset_layout.hpp"
#include "../pipeline/presets.hpp"
#include "torch.hpp"
#include "member_output.hpp"
#include "torch_buffers.hpp"
// A module on a GPU (torch.hpp sets FLEXCOMM_TORCH_CUDA, where nvcc compiles): each rank's
// device, and the device Syncs.
#if FLEXCOMM_TORCH_CUDA
#include "../backend/cuda/local_device.hpp"
#include "../backend/nccl.hpp"
#include "../backend/staged.hpp"
#endif

namespace flexcomm::interop {

namespace detail {
// The device of the parameters (those that require grad; the CPU when there are none).
inline torch::Device device_of(const std::vector<torch::Tensor>& parameters) {
  for (const auto& p : parameters)
    if (p.requires_grad()) return p.device();
  return torch::kCPU;
}

// What average_gradients returns for a module whose every parameter is frozen: nothing to average.
class no_gradients final : public gradients {
 public:
  explicit no_gradients(handover how) : how_(how) {}
  void finish() override {}
  handover mode() const noexcept override { return how_; }
  std::size_t parameters() const noexcept override { return 0; }

 private:
  handover how_;
};

template <class Sync>
struct is_ring : std::false_type {};
template <class B>
struct is_ring<overlapped_ring<B>> : std::true_type {};
template <class Sync, class = void>
struct has_options : std::false_type {};
template <class Sync>
struct has_options<Sync, std::void_t<decltype(std::declval<const Sync&>().options())>> : std::true_type {};

// While the members test between two epochs, torch's default CPU generator (which a test
// loader's RandomSampler draws its order from) runs from a seed every member shares: each member
// reads the test set in one order, as the report lines their outputs up sample by sample. The
// member's own state comes back when the next epoch starts, so its training draws stay its own.
class shared_test_order {
 public:
  static constexpr std::uint64_t seed = 0x7e57'0000;  // plus the epoch

  void enter(int epoch) {
    leave();
    auto generator = at::detail::getDefaultCPUGenerator();
    const std::lock_guard<std::mutex> lock(generator.mutex());
    saved_ = generator.get_state();
    generator.set_current_seed(seed + static_cast<std::uint64_t>(epoch));
  }
  void leave() {
    if (!saved_.defined()) return;
    auto generator = at::detail::getDefaultCPUGenerator();
    const std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(saved_);
    saved_ = torch::Tensor();
  }

 private:
  torch::Tensor saved_;  // the member's state, while the shared seed runs
};

// The backends a CUDA module's gradients can be averaged on (ensemble_options::device_backend).
inline void check_device_backend(const std::string& name) {
  check(name == "nccl" || name == "staged", "interop::train_ensemble",
        cat("unknown device_backend '", name, "' (known: nccl, staged)"));
}

// A Sync of its own for a module's parameters, and their gradient_sync on it.
template <class Sync>
class owning_gradients final : public gradients {
 public:
  owning_gradients(const typename Sync::backend::communicator& member, const sync_options& options,
                   const std::vector<torch::Tensor>& parameters, handover how)
      : sync_(member, options), grads_(sync_, parameters, how) {}
  void finish() override { grads_.finish(); }
  handover mode() const noexcept override { return grads_.mode(); }
  std::size_t parameters() const noexcept override { return grads_.parameters(); }

 private:
  Sync sync_;
  gradient_sync<Sync> grads_;  // after sync_: its hooks go first
};

// The member's Sync for a module on CUDA device `device`, made collectively over the member's
// ranks (each attaches its module at the same point, as the replicas' broadcast needs): a `ring`
// (overlapped_ring) on staged, NCCL matching messages in issue order; else subgroup_allreduce on
// `backend`.
inline std::unique_ptr<gradients> device_gradients(const mpi::communicator& member, const sync_options& options,
                                                   bool ring, const std::string& backend,
                                                   const std::vector<torch::Tensor>& module, handover how, int device) {
  check_device_backend(backend);
#if FLEXCOMM_TORCH_CUDA
  const c10::cuda::CUDAGuard on(static_cast<c10::DeviceIndex>(device));  // the communicators' and buffers' device
  if (ring) {
    const staged::communicator comm(member, cat(member.name(), " torch staged"));
    return std::make_unique<owning_gradients<overlapped_ring<staged>>>(comm, options, module, how);
  }
  if (backend == "staged") {
    const staged::communicator comm(member, cat(member.name(), " torch staged"));
    return std::make_unique<owning_gradients<subgroup_allreduce<staged>>>(comm, options, module, how);
  }
  const nccl::communicator comm(member, cat(member.name(), " torch nccl"));
  return std::make_unique<owning_gradients<subgroup_allreduce<nccl>>>(comm, options, module, how);
#else
  (void)member, (void)options, (void)ring, (void)module, (void)how;
  fail("interop::trainer: average_gradients",
       cat("the module is on cuda:", device, "; this build of the torch interop takes CPU modules (a module on the "
           "GPU needs a CUDA libtorch, a build with CUDA, FLEXCOMM_HAVE_CUDA, and nvcc compiling this file, nvcc -x "
           "cu: docs/cuda.md, \"libtorch on the GPU\")"));
#endif
}

// A module's gradients on the member's Sync where it takes the module's device, or (`own`: a
// trainer's second module and later, each stepping apart, with its own optimizer) on a Sync of
// the same kind and options of their own; a CUDA module of a Sync on a host backend (the
// presets' mpi) gets a device Sync of the same kind and options.
template <class Sync>
std::unique_ptr<gradients> attach(Sync& sync, const mpi::communicator& member, const std::vector<torch::Tensor>& module,
                                  handover how, const std::string& device_backend, bool own) {
  sync_options options;
  if constexpr (has_options<Sync>::value) options = sync.options();
  if constexpr (gradient_place_of<Sync>::value == gradient_place::host) {
    const torch::Device device = device_of(module);
    if (device.is_cuda())
      return device_gradients(member, options, is_ring<Sync>::value, device_backend, module, how,
                              device.has_index() ? device.index() : 0);
  }
  if (!own) return std::make_unique<gradient_sync<Sync>>(sync, module, how);
  if constexpr (std::is_constructible_v<Sync, const mpi::communicator&, const sync_options&>) {
    return std::make_unique<owning_gradients<Sync>>(member, options, module, how);
  } else {
    fail("interop::trainer: average_gradients",
         "this pipeline's Sync averages one module per trainer; attach a parent module holding them all");
  }
}
}  // namespace detail

// What a trainer function gets: which member it trains, its batches, and the member's Sync, the
// same type under every preset (a pipeline context of any preset, type-erased).
class trainer {
 public:
  // `evaluates`: the runner takes evaluated()'s rounds (train_ensemble with a report);
  // `device_backend`: what averages a CUDA module's gradients (ensemble_options::device_backend);
  // `keep`: how the modules' buffers stay equal within the member (ensemble_options::buffers).
  template <class Context>
  explicit trainer(Context& ctx, bool evaluates = false, std::string device_backend = "nccl",
                   buffers keep = buffers::broadcast)
      : member_(ctx.member()),
        rank_in_member_(ctx.rank_in_member()),
        member_size_(ctx.member_size()),
        members_(ctx.members()),
        evaluates_(evaluates),
        comm_(&ctx.comm()),
        next_([&ctx] { return ctx.batches().next(); }),
        attach_([&ctx, device_backend](const std::vector<torch::Tensor>& parameters, handover how, bool own) {
          return detail::attach(ctx.sync(), ctx.comm(), parameters, how, device_backend, own);
        }),
        submit_([&ctx](const torch::Tensor& t) {
          if (t.defined()) {
            interop::submit(ctx.collect(), t);
          } else {
            ctx.collect().submit(span<const float>());
          }
        }),
        buffers_(keep) {}

  int member() const noexcept { return member_; }
  int rank_in_member() const noexcept { return rank_in_member_; }
  int member_size() const noexcept { return member_size_; }
  int members() const noexcept { return members_; }
  // Whether this rank speaks for its member: its first rank. Its replicas hold the same model
  // (average_gradients), so what it prints or evaluates stands for theirs.
  bool reports() const noexcept { return rank_in_member_ == 0; }
  // The member's communicator, for what the trainer does on its own.
  const mpi::communicator& comm() const noexcept { return *comm_; }

  // This trainer's share of every batch, as torch::data::make_data_loader gives a dataset: each
  // range-for over *loader walks the next epoch (fi::data_loader); one more than the dataset's
  // epochs is an error, and so is returning before the last (the epochs are stated once). On the
  // device of the first module average_gradients() attached (the CPU before one is): a CUDA
  // module's batches arrive in device memory, copied while the previous step runs.
  std::unique_ptr<data_loader> loader() { return loader(module_device_); }
  std::unique_ptr<data_loader> loader(const torch::Device& device) {
    loader_made_ = true;
    return std::make_unique<data_loader>([this] { return next(); }, device, [this] { epoch_over(); });
  }

  // Makes the member's replicas equal, broadcasting the module's parameters and buffers from the
  // member's first rank (as DistributedDataParallel does at construction: a trainer seeded by
  // rank still trains one model per member), then attaches a Sync to its parameters that require
  // grad (gradient_sync; frozen ones cost nothing); by default each backward() leaves the
  // member's average in every p.grad() (handover::within_backward), so the training loop does not
  // change. The module's buffers stay equal within the member at each step (ensemble_options::
  // buffers). Once per module or parameter list, any number of them, each call before the
  // loader's first batch; the second and later get a Sync of their own, so each steps with its
  // own backward() and optimizer. The hooks stay until the trainer function returns.
  gradients& average_gradients(torch::nn::Module& module, handover how = handover::within_backward) {
    return attach(module.parameters(), module.buffers(), how);
  }
  // The same for parameters not held by one module (no buffers).
  gradients& average_gradients(const std::vector<torch::Tensor>& parameters, handover how = handover::within_backward) {
    return attach(parameters, {}, how);
  }

  // One batch of outputs on the evaluation set, and its targets (one per sample), in the test
  // after an epoch: the batches handed over between two epochs (and after the last) are that
  // epoch's, and the aggregator's report gets every member's. The
  // member's first rank (reports()) evaluates, its replicas may too or not (theirs are dropped:
  // the same model); every member at the same epochs, the same samples. Between epochs torch's
  // default generator runs from a seed all members share (shared_test_order), so a test loader's
  // RandomSampler gives each the samples in one order.
  void evaluated(const torch::Tensor& outputs, const torch::Tensor& targets) {
    const char* what = "interop::evaluated";
    check(evaluates_, what, "needs train_ensemble with a report(evaluation) to send the outputs to");
    check(epochs_ > 0, what,
          "called before the first epoch's last step: the report gets each epoch's test, after its training (call "
          "evaluated() after the loop over the loader)");
    check(outputs.defined() && targets.defined() && outputs.dim() > 0 && outputs.size(0) == targets.numel(), what,
          "outputs and targets: one row of outputs per target, samples along dimension 0");
    if (!reports()) return;
    torch::NoGradGuard plain;
    outputs_.push_back(outputs.detach().to(torch::kCPU).to(torch::kFloat32).reshape({outputs.size(0), -1}));
    targets_.push_back(targets.detach().to(torch::kCPU).to(torch::kFloat32).reshape({-1}));
  }

  // The runner's, after the trainer function: the last round, and the stream's end.
  void finish() {
    test_order_.leave();
    if (loader_made_ && !stream_over_)
      check(!next_(), "interop::trainer",
            "the trainer function returned before the dataset's last epoch: its loop ran fewer epochs than "
            "dataset_of(data, batch, epochs) gives (state the epochs once)");
    end_round();
  }

 private:
  std::optional<typed_batch> next() {
    started_ = true;
    if (epoch_starts_) {
      end_round();
      test_order_.leave();
    } else {
      buffers_.step();  // the previous step's forward moved them (the epoch's end did, after its last)
    }
    auto batch = next_();
    stream_over_ = !batch;
    epoch_starts_ = batch && batch->last_in_epoch();
    return batch;
  }

  // After each epoch's last step: the buffers kept, and the test's sample order shared.
  void epoch_over() {
    buffers_.step();
    ++epochs_;
    if (evaluates_) test_order_.enter(epochs_);
  }

  // Every epoch's end is two rounds on every trainer rank, whoever evaluated: outputs, then
  // targets (empty from replicas, and where the trainer evaluated nothing), so a member that
  // tests on its first rank alone stays in step with the collect.
  void end_round() {
    if (!evaluates_ || epochs_ == rounds_) return;
    rounds_ = epochs_;
    submit_(outputs_.empty() ? torch::Tensor() : torch::cat(outputs_));
    submit_(targets_.empty() ? torch::Tensor() : torch::cat(targets_));
    outputs_.clear();
    targets_.clear();
  }

  gradients& attach(const std::vector<torch::Tensor>& parameters, const std::vector<torch::Tensor>& module_buffers,
                    handover how) {
    const char* what = "interop::trainer: average_gradients";
    check(!started_, what,
          "called after training started (the loader has handed out a batch): the member's Syncs and buffers are "
          "set before the first step; call average_gradients() for every module or parameter list before it");
    std::vector<torch::Tensor> trained, state = parameters;
    for (std::size_t i = 0; i < parameters.size(); ++i) {
      check(parameters[i].defined(), what, cat("parameter ", i, " is undefined"));
      if (!parameters[i].requires_grad()) continue;  // frozen: no Sync space, no traffic
      check(averaged_.insert(parameters[i].unsafeGetTensorImpl()).second, what,
            cat("parameter ", i, " is averaged already (an earlier average_gradients() call attached it); attach "
                "each module or parameter once"));
      trained.push_back(parameters[i]);
    }
    state.insert(state.end(), module_buffers.begin(), module_buffers.end());
    const torch::Device device = detail::device_of(trained);
    agree(device, state);
    detail::broadcast_state<mpi>(*comm_, state, cat(what, " (the module's state)"));
    buffers_.add(*comm_, module_buffers);
    if (trained.empty()) {
      attached_.push_back(std::make_unique<detail::no_gradients>(how));
    } else {
      attached_.push_back(attach_(trained, how, sync_taken_));
      if (!sync_taken_) module_device_ = device;
      sync_taken_ = true;  // the pipeline's Sync is the first module's
    }
    return *attached_.back();
  }

  // A member's ranks attach the module on one kind of device, and modules of one size, or every
  // one of them fails (the Syncs they would make, or the broadcast, differ: a hang otherwise).
  void agree(const torch::Device& device, const std::vector<torch::Tensor>& state) const {
    if (member_size_ < 2) return;
    std::int64_t bytes = 0;
    for (const auto& t : state) bytes += t.numel() * t.element_size();
    const std::int64_t cuda = device.is_cuda() ? 1 : 0, tensors = static_cast<std::int64_t>(state.size());
    std::int64_t both[6] = {cuda, -cuda, tensors, -tensors, bytes, -bytes};  // max, and -min
    mpi::iallreduce(*comm_, span<std::int64_t>(both, 6), op::max).wait();
    const char* what = "interop::trainer: average_gradients";
    check(both[0] == -both[1], what,
          cat("the member's ranks hold the module on different kinds of device (this one on ", device.str(),
              "); every rank of a member trains on the CPU, or every one on a GPU"));
    check(both[2] == -both[3] && both[4] == -both[5], what,
          cat("the member's ranks attach different modules (this one ", tensors, " parameters and buffers of ", bytes,
              " bytes); every rank of a member attaches the same modules, in one order"));
  }

  int member_, rank_in_member_, member_size_, members_;
  bool evaluates_;
  const mpi::communicator* comm_;
  std::function<std::optional<typed_batch>()> next_;
  std::function<std::unique_ptr<gradients>(const std::vector<torch::Tensor>&, handover, bool own)> attach_;
  std::function<void(const torch::Tensor&)> submit_;
  detail::buffer_sync<mpi> buffers_;
  std::vector<std::unique_ptr<gradients>> attached_;
  std::unordered_set<const void*> averaged_;   // the parameters attached
  torch::Device module_device_{torch::kCPU};  // the first attached module's
  bool sync_taken_ = false;                  // the pipeline's Sync averages a module
  bool started_ = false, loader_made_ = false, stream_over_ = false, epoch_starts_ = true;
  int epochs_ = 0, rounds_ = 0;  // walked to their last step; of those, ended by their rounds
  detail::shared_test_order test_order_;
  std::vector<torch::Tensor> outputs_, targets_;
};

struct ensemble_options {
  // A name of presets::names; empty: FLEXCOMM_PRESET, else single_broadcast. Named here, it wins
  // over the setting, as `layout` wins over FLEXCOMM_LAYOUT: the settings fill what code leaves open.
  std::string preset{};
  int members = 0;                 // 0: the layout's; without one, 1 (one model, data-parallel)
  std::string sync = "allreduce";  // or "ring" (overlapped_ring); the baseline's is allreduce
  // "producers=1 members=2,1,1 aggregator=1" (ensemble_layout::parse); empty: FLEXCOMM_LAYOUT,
  // else the members spread over the ranks after the preset's producers (presets::choose: what
  // the preset adds, and plain data parallel on the baseline where the world has no room for it).
  std::string layout{};
  // Where the layout is "members=auto:N" (flexcomm sizes the members), each member's step cost,
  // relative (hints: seconds per step on one rank, or any unit): the ranks are split so that the
  // members step at an even pace (pipeline/member_costs.hpp), and rank 0 prints the plan.
  std::vector<double> member_costs{};
  // Stdout of a member's ranks but its first, and of the producers, goes to /dev/null while
  // train_ensemble runs: a member's prints come once (trainer::reports() says which rank prints).
  bool quiet_replicas = true;
  // Where there are several members, each line a member's first rank prints starts with
  // "member m: " (their progress and test lines share one terminal).
  bool member_prefix = true;
  // An error ends the job on every rank that has it: its message (flexcomm: rank N: ...) on
  // stderr, then MPI_Abort(1), instead of std::terminate. false: it is thrown (tests).
  bool end_job_on_error = true;
  // A module on a CUDA device (a CUDA libtorch and build, this file compiled by nvcc): the backend
  // that averages its gradients, "nccl" or "staged" (MPI through pinned memory, where NCCL cannot
  // run: ranks sharing a GPU, say). Sync "ring" runs on staged whatever this says (NCCL matches
  // messages in issue order, the ring needs tags).
  std::string device_backend = "nccl";
  // A member's module buffers (BatchNorm's running statistics), at each step and each epoch's
  // end: its first rank's broadcast (DistributedDataParallel's rule), averaged, or left alone.
  interop::buffers buffers = interop::buffers::broadcast;
};

// The preset and layout train_ensemble runs (presets::choose, which says what the preset adds
// and when the baseline runs instead): preset o.preset, else FLEXCOMM_PRESET, else
// single_broadcast; layout o.layout, else FLEXCOMM_LAYOUT (either must have o.members members
// when o.members is given), else o.members (or 1) members spread over the ranks after the
// preset's producers.
inline presets::choice ensemble_choice(int world_size, const ensemble_options& o) {
  const char* preset = setting("FLEXCOMM_PRESET");
  const char* layout = setting("FLEXCOMM_LAYOUT");
  return presets::choose(!o.preset.empty() ? o.preset : preset ? preset : "single_broadcast",
                         !o.layout.empty() ? o.layout : layout ? layout : "", o.members, world_size,
                         "interop::train_ensemble");
}

// What the report gets after each epoch's test, on the aggregator.
struct evaluation {
  int epoch = 0;                       // 1, 2, ...: the rounds of evaluated() outputs
  std::vector<torch::Tensor> members;  // per member, its outputs: float32 [samples, -1]
  torch::Tensor targets;               // the samples' targets: int64 [samples]
};

// The fraction of rows whose largest output is the target.
inline double accuracy(const torch::Tensor& outputs, const torch::Tensor& targets) {
  return outputs.argmax(1).eq(targets).to(torch::kFloat64).mean().item<double>();
}

// A report for classifiers whose outputs are log-probabilities (log_softmax, which nll_loss
// takes): each member's accuracy, and the ensemble's, of the members' probabilities averaged.
inline void print_accuracies(const evaluation& e) {
  std::string line = cat("Epoch ", e.epoch, ": members");
  char number[32];
  std::vector<torch::Tensor> probabilities;
  for (const auto& m : e.members) {
    std::snprintf(number, sizeof number, " %.3f", accuracy(m, e.targets));
    line += number;
    probabilities.push_back(m.exp());
  }
  std::snprintf(number, sizeof number, "%.3f", accuracy(torch::stack(probabilities).mean(0), e.targets));
  std::printf("\n%s | ensemble %s\n", line.c_str(), number);  // a line of its own, after a trainer's \r progress
  std::fflush(stdout);
}

namespace detail {
// How this trainer rank's stdout reads while its trainer function runs (member_output).
inline output output_of(const ensemble_options& o, const trainer& t) {
  if (!t.reports()) return o.quiet_replicas ? output::quiet : output::plain;
  return o.member_prefix && t.members() > 1 ? output::prefixed : output::plain;
}
inline std::string prefix_of(const trainer& t) { return cat("member ", t.member(), ": "); }

// The producers' stdout, quiet while they load (quiet_replicas), where this rank is one.
template <class Pipeline>
void quiet_producer(std::optional<member_output>& out, const Pipeline& pipe, const mpi::communicator& world,
                    const ensemble_options& o) {
  if (o.quiet_replicas && pipe.layout().role_of(world.rank()).kind == role::producer)
    out.emplace(output::quiet, std::string());
}

// The trainer whose function runs on this thread, for evaluated() in a test() that has no ctx.
inline trainer*& current_trainer() {
  thread_local trainer* t = nullptr;
  return t;
}
class running {
 public:
  explicit running(trainer& t) : before_(current_trainer()) { current_trainer() = &t; }
  running(const running&) = delete;
  running& operator=(const running&) = delete;
  ~running() { current_trainer() = before_; }

 private:
  trainer* before_;
};

// f(), or, with `end_job`, f() whose error ends the job: every rank that has one prints it
// (flexcomm: rank N: operation: cause) and leaves with status 1, none through std::terminate.
template <class F>
void ending_job_on_error(const mpi::communicator& world, bool end_job, F&& f) {
  if (!end_job) {
    f();
    return;
  }
  std::string message;
  try {
    f();
    return;
  } catch (const error& e) {
    message = e.what();
  } catch (const c10::Error& e) {
    message = error(world.rank(), "interop::train_ensemble", e.what_without_backtrace()).what();
  } catch (const std::exception& e) {
    message = error(world.rank(), "interop::train_ensemble", e.what()).what();
  }
  std::cout.flush();
  abort_job(message);
}

// Where libtorch sees a GPU, every trainer rank uses the one of its node-local rank from here on
// (torch::kCUDA names it): cuda::use_local_device, collective over `world` (FLEXCOMM_DEVICE
// overrides). Nothing elsewhere. A rank that sees no GPU takes none.
inline void use_local_device(const mpi::communicator& world, const ensemble_layout& layout) {
#if FLEXCOMM_TORCH_CUDA
  int sees = torch::cuda::is_available() ? 1 : 0, any = sees;
  mpi::iallreduce(world, span<int>(&any, 1), op::max).wait();
  if (!any) return;
  const bool trains = !layout.is_placed() || layout.role_of(world.rank()).kind != role::producer;
  cuda::use_local_device(world, trains && sees);
#else
  (void)world, (void)layout;
#endif
}

// ensemble_choice, its note (the baseline runs instead of the preset asked for) said once, by
// rank 0, on stderr.
inline presets::choice ensemble_choice_said(const mpi::communicator& world, const ensemble_options& o) {
  auto chosen = ensemble_choice(world.size(), o);
  if (world.rank() == 0 && !chosen.note.empty()) {
    std::fprintf(stderr, "flexcomm: rank 0: interop::train_ensemble: %s\n", chosen.note.c_str());
    std::fflush(stderr);
  }
  if (chosen.layout.is_planned()) return chosen;
  check(!o.member_costs.empty(), "interop::train_ensemble",
        cat("layout '", chosen.layout.str(), "' asks flexcomm to size its members: give ensemble_options::member_costs "
            "(each member's relative step cost), or plan it first (plan_from_hints, measure_and_plan) and pass the "
            "planned layout"));
  const auto plan = plan_from_hints(world, chosen.layout, o.member_costs);
  if (world.rank() == 0) {
    std::printf("%s", plan.text().c_str());
    std::fflush(stdout);
  }
  chosen.layout = plan.layout;
  return chosen;
}

// One epoch's evaluation from its two rounds (outputs, then targets), checked: the members
// evaluated the same samples in the same order. None where no member evaluated at that epoch.
inline std::optional<evaluation> evaluation_of(int epoch, gathered<float>& outputs, gathered<float>& targets) {
  const char* what = "interop::train_ensemble: evaluation";
  const int members = static_cast<int>(targets.member_counts.size());
  int evaluating = -1;  // a member that did
  for (int m = 0; m < members && evaluating < 0; ++m)
    if (!targets.member(m).empty()) evaluating = m;
  if (evaluating < 0) return std::nullopt;
  evaluation e;
  e.epoch = epoch;
  for (int m = 0; m < members; ++m) {
    const auto t = targets.member(m);
    const auto o = outputs.member(m);
    const auto rows = static_cast<std::int64_t>(t.size());
    check(rows > 0, what,
          cat("after epoch ", epoch, ": member ", m, " evaluated nothing on its "
              "first rank while member ", evaluating, " evaluated ", targets.member(evaluating).size(), " samples; "
              "every member calls evaluated() at the same epochs, on its first rank (trainer::reports()) at least"));
    auto member_targets = copied<float>(span<const float>(t.data(), t.size()), {rows}).to(torch::kInt64);
    check(o.size() % t.size() == 0, what,
          cat("epoch ", epoch, ": member ", m, " evaluated ", rows, " targets and ", o.size(), " outputs (one row of "
              "outputs per target, from the member's first rank)"));
    if (m == 0) {
      e.targets = member_targets;
    } else {
      check(torch::equal(member_targets, e.targets), what,
            cat("epoch ", epoch, ": member ", m, " evaluated other samples, or in another order, than member 0 (every "
                "member tests the same samples; a test loader's order comes from a sampler that draws on torch's "
                "default generator, or none: a generator of the trainer's own orders each member apart)"));
    }
    e.members.push_back(copied<float>(span<const float>(o.data(), o.size()),
                                      {rows, static_cast<std::int64_t>(o.size()) / rows}));
  }
  return e;
}
}  // namespace detail

// For test() functions that get no trainer: evaluated() of the trainer this rank runs.
inline void evaluated(const torch::Tensor& outputs, const torch::Tensor& targets) {
  trainer* t = detail::current_trainer();
  check(t != nullptr, "interop::evaluated", "called outside a train_ensemble trainer function");
  t->evaluated(outputs, targets);
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
  detail::ending_job_on_error(world, o.end_job_on_error, [&] {
    const char* what = "interop::train_ensemble";
    check(evaluation.defined() && evaluation.dim() > 0 && evaluation.size(0) > 0, what,
          "the evaluation set is empty; the members' outputs on it are what the aggregator gets");
    const std::int64_t samples = evaluation.size(0);
    detail::check_device_backend(o.device_backend);
    const auto chosen = detail::ensemble_choice_said(world, o);
    presets::visit(chosen.preset, o.sync, [&](auto preset) {
      using Preset = decltype(preset);
      const auto& layout = chosen.layout;
      typename Preset::pipeline pipe(world, layout, Preset::configure({}));
      detail::use_local_device(world, layout);
      std::optional<member_output> producing;
      detail::quiet_producer(producing, pipe, world, o);
      pipe.run(
          std::move(data),
          [&](auto& ctx) {
            torch::Tensor out;
            {
              trainer t(ctx, false, o.device_backend, o.buffers);
              member_output printing(detail::output_of(o, t), detail::prefix_of(t));
              out = train(t, evaluation_slice(evaluation, ctx));
              t.finish();
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
  });
}

// Trains the ensemble, collectively over `world`, reporting after each epoch: each trainer runs
// train(trainer) (a libtorch trainer's epochs of training and testing, its test handing its
// outputs to evaluated()); on the aggregator, report(evaluation) runs for each epoch's test, with
// every member's outputs, as they arrive (between its steps, or after its training).
inline void train_ensemble(const mpi::communicator& world, const ensemble_options& o, dataset data,
                           const std::function<void(trainer&)>& train,
                           const std::function<void(const evaluation&)>& report) {
  detail::ending_job_on_error(world, o.end_job_on_error, [&] {
    detail::check_device_backend(o.device_backend);
    const auto chosen = detail::ensemble_choice_said(world, o);
    presets::visit(chosen.preset, o.sync, [&](auto preset) {
      using Preset = decltype(preset);
      const auto& layout = chosen.layout;
      typename Preset::pipeline pipe(world, layout, Preset::configure({}));
      detail::use_local_device(world, layout);
      std::optional<member_output> printing;  // the producer's, or the trainer function's
      detail::quiet_producer(printing, pipe, world, o);
      std::optional<gathered<float>> outputs;      // the epoch's first round, until its targets come
      int rounds = 0;  // two per epoch
      pipe.template on_round<float>([&](auto, gathered<float>& round) {
        if (rounds++ % 2 == 0) {
          outputs = std::move(round);
          return;
        }
        const auto e = detail::evaluation_of(rounds / 2, *outputs, round);
        if (!e) return;  // no member evaluated after this epoch
        if (printing) printing->pause();  // the aggregator reports, whichever rank it is
        report(*e);
        if (printing) printing->resume();
      });
      pipe.run(
          std::move(data),
          [&](auto& ctx) {
            trainer t(ctx, true, o.device_backend, o.buffers);
            printing.emplace(detail::output_of(o, t), detail::prefix_of(t));
            {
              detail::running current(t);
              train(t);
            }
            t.finish();
            printing.reset();
          },
          [](auto&) {});
    });
  });
}

}  // namespace flexcomm::interop
