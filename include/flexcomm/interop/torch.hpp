// libtorch interop: a libtorch trainer hands its tensors to flexcomm's adapters without data_ptr/numel
// arithmetic: a torch::data dataset to a typed feed, its batches back as tensors (views, no copy),
// gradients to a Sync (one tensor, or every parameter of a module at once), predictions to a
// Collect, and a rank's slice of an evaluation set. Opt-in (not in flexcomm.hpp): including it
// costs a libtorch compile, and it needs libtorch (Debian's libtorch-dev) on the include path.
//
//   fc::interop::gradient_sync grads(ctx.sync(), model);   // hooks every parameter
//   loss.backward();                                        // gradients handed over as they come
//   grads.finish();                                         // averages now in each p.grad()
//   optimizer.step();
//
// With handover::within_backward backward() itself leaves the averages in p.grad(), as
// DistributedDataParallel does; interop/torch_ensemble.hpp runs a whole ensemble that way.
//
// CPU tensors go to Syncs on host backends (mpi). CUDA tensors, where libtorch and the build have
// CUDA and nvcc compiles (interop/torch_cuda.hpp, FLEXCOMM_TORCH_CUDA), go to Syncs on device
// backends (nccl, staged) by their device pointers, ordered with torch's current stream, and
// batches can be delivered into device memory (make_data_loader(feed, torch::kCUDA)).
#pragma once

#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../backend/contract.hpp"
#include "../core/cache_line.hpp"
#include "../core/datatype.hpp"
#include "../core/error.hpp"
#include "../core/reduce.hpp"
#include "../core/span.hpp"
#include "../patterns/feed/dataset.hpp"
#include "../patterns/collect/many_to_one.hpp"
#include "../patterns/feed/typed_feed.hpp"
#include "torch_cuda.hpp"

namespace flexcomm::interop {

// The tensor's elements as a span of T: a defined, contiguous CPU tensor of T's dtype, or an error
// naming `what` and what is wrong (a span over a strided or device tensor would be read wrongly).
template <class T>
span<T> elements(const torch::Tensor& t, const std::string& what);

// Calls f(T{}) with the element type of `t` (float, double, int32, int64, uint8).
template <class F>
decltype(auto) visit_scalar_type(const torch::Tensor& t, const std::string& what, F&& f);

// A typed batch's samples and labels as tensors of shape {samples, ...field shape} that view the
// feed's memory: no copy, and, like the batch, valid until the feed's next next() (clone() to keep).
// T is the field's element type (an error otherwise); int64 labels are what nll_loss takes.
template <class T = float>
torch::Tensor samples(const typed_batch& batch);
template <class T = std::int64_t>
torch::Tensor labels(const typed_batch& batch);

// The dataset a typed feed needs, from a torch::data dataset of Examples of data and target
// tensors (every sample of one shape and type, read from sample 0 on every rank): a Dataset's
// get(i), or a mapped one's get_batch({i}) (MNIST(root).map(Normalize<>(...)).map(Stack<>()):
// the transforms run where the sample is loaded, on the producers under a broadcast preset; a
// Stack's batch of one loses its batch dimension). The feed loads sample i on the ranks that
// load and copies its tensors into its batch: `data` must outlive the run, and give the same
// sample for i wherever it runs. In index order, the short last batch delivered, as torch::data's
// SequentialSampler does; set the result's `shuffle` (and `seed`) for each epoch in a permutation
// drawn from (seed, epoch), the same for every member, as a RandomSampler would shuffle. `epochs`
// is the stream's length: a data_loader refuses an epoch more.
template <class Dataset>
dataset dataset_of(Dataset& data, std::int64_t batch, std::int64_t epochs = 1);

namespace detail {
// Where an epoch's batches come from: a typed feed's next(), whatever the feed's type.
using next_batch = std::function<std::optional<typed_batch>()>;
// ... and the tensors of each: views of the host batch (tensors empty), or its copy on a device.
struct batch_source {
  next_batch next;
  std::function<torch::data::Example<>(const typed_batch&)> tensors;
  std::function<void()> epoch_over;  // where set, after each epoch's last step (the trainer's buffers)
};
// A source of batches on `device`: the host batches as they are, or copied to a CUDA device
// (device_batches) where the interop has CUDA.
inline batch_source source_on(next_batch next, const torch::Device& device);

// Walks one epoch: Examples of samples<float>() and labels<std::int64_t>() (views, valid until
// the walk moves on, on the source's device), ending after the epoch's last step, or with the stream.
class epoch_iterator {
 public:
  epoch_iterator() = default;
  // A walk that finds the stream over is refused: a loop of more epochs than the dataset's would
  // otherwise get empty ones, silently.
  explicit epoch_iterator(batch_source* next) : next_(next) {
    advance();
    check(next_ != nullptr, "interop::data_loader",
          "every epoch of the dataset has been walked: the loop asks for one more than the feed's dataset has "
          "(state the epochs once: the dataset's, as dataset_of(data, batch, epochs) gives them)");
  }
  torch::data::Example<>& operator*() noexcept { return example_; }
  torch::data::Example<>* operator->() noexcept { return &example_; }
  epoch_iterator& operator++() {
    if (batch_ && batch_->last_in_epoch()) {
      batch_.reset();  // the next epoch's first batch stays in the feed
      if (next_->epoch_over) next_->epoch_over();
      next_ = nullptr;
    } else {
      advance();
    }
    return *this;
  }
  bool operator==(const epoch_iterator& other) const noexcept { return next_ == other.next_; }
  bool operator!=(const epoch_iterator& other) const noexcept { return next_ != other.next_; }

 private:
  void advance();
  batch_source* next_ = nullptr;
  std::optional<typed_batch> batch_;
  torch::data::Example<> example_;
};
}  // namespace detail

// One epoch of a typed feed's batches as torch::data's DataLoader gives them, so that a libtorch
// loop keeps its shape: for (auto& batch : fi::epoch(ctx.batches())) { batch.data; batch.target; }
// Each batch is an Example of samples<float>() and labels<std::int64_t>() (views, valid until
// the loop moves on); the loop ends after the epoch's last step. An epoch past the stream's last
// is an error.
template <class TypedFeed>
class epoch {
 public:
  explicit epoch(TypedFeed& feed) : next_{[&feed] { return feed.next(); }, {}, {}} {}
  detail::epoch_iterator begin() { return detail::epoch_iterator(&next_); }
  detail::epoch_iterator end() { return {}; }

 private:
  detail::batch_source next_;
};

// A typed feed as torch::data::make_data_loader gives a dataset: every range-for over *loader
// walks the next epoch, so a libtorch trainer's epoch loop keeps its shape, loader line aside:
//   auto loader = fi::make_data_loader(ctx.batches());     // or trainer::loader()
//   for (int epoch = 1; epoch <= epochs; ++epoch)
//     for (auto& batch : *loader) { batch.data; batch.target; }
// Not tied to the feed's type: a trainer compiled once serves every preset. On a CUDA `device`
// (where the interop has CUDA) each batch arrives in device memory (device_batches: copied while
// the previous step runs, torch's current stream waiting for the copy on the GPU). `epoch_over`,
// where given, runs after each epoch's last step, before the loop ends.
class data_loader {
 public:
  explicit data_loader(std::function<std::optional<typed_batch>()> next, const torch::Device& device = torch::kCPU,
                       std::function<void()> epoch_over = {})
      : next_(detail::source_on(std::move(next), device)) {
    next_.epoch_over = std::move(epoch_over);
  }
  detail::epoch_iterator begin() { return detail::epoch_iterator(&next_); }
  detail::epoch_iterator end() { return {}; }

 private:
  detail::batch_source next_;
};
template <class TypedFeed>
std::unique_ptr<data_loader> make_data_loader(TypedFeed& feed, const torch::Device& device = torch::kCPU) {
  return std::make_unique<data_loader>([&feed] { return feed.next(); }, device);
}

// sync.ready(index, grad) for a tensor: the average lands in `grad` itself by sync.finish(), so
// the tensor must stay alive, and not be reallocated, until then. A CPU tensor goes to a Sync on a
// host backend; a CUDA tensor (where the interop has CUDA) to one on a device backend, by its
// device pointer, once the Sync's device work is ordered after torch's current stream; after
// sync.finish(), averages_ready(grad) orders torch's current stream after the averages.
template <class Sync>
void ready(Sync& sync, int index, const torch::Tensor& grad);
// After sync.finish(): torch's current stream waits for the averages of CUDA gradients handed over
// with ready() (nothing for a CPU tensor: finish() returned with the averages in place).
inline void averages_ready(const torch::Tensor& grad);

// How gradient_sync hands a module's gradients over.
enum class handover {
  // A hook on every parameter hands its gradient over the moment backward produces it, so a Sync
  // that launches buckets as they fill averages the first while backward computes the rest.
  // One backward() per finish() (gradient accumulation over several: use after_backward).
  during_backward,
  // finish() hands over each parameter's .grad(), last parameter first (backprop's order),
  // in place: no copy, any number of backward() calls per step.
  after_backward,
  // As during_backward, and backward() finishes the step itself, as DistributedDataParallel
  // does: the first hook queues a callback that autograd runs when the backward pass ends, so
  // the averages are in every p.grad() when backward() returns; no finish() to call. Each
  // backward() is a step of the Sync (accumulating over two averages their sum: the same
  // gradients, one more exchange). A backward() that reaches no parameter does not step: on a
  // member's every rank or on none, or the ranks that step wait for the others.
  within_backward,
};

// A module attached to a Sync, whatever the Sync's type (what trainer::average_gradients
// returns): finish() after backward, unless the handover is within_backward.
class gradients {
 public:
  virtual ~gradients() = default;
  virtual void finish() = 0;
  virtual handover mode() const noexcept = 0;
  virtual std::size_t parameters() const noexcept = 0;
};

// Attaches a Sync to a module's parameters, or to a list of parameters: parameter i (in
// module.parameters() order, or the list's; those that do not require grad, frozen, are skipped:
// no staging memory, no traffic) is gradient i of the Sync. After finish(), every p.grad()
// holds the average over the member's ranks, ready for optimizer.step().
//
// Why hooks stage: a hook sees the gradient this backward contributes, before autograd adds it to
// p.grad(). The hook writes old p.grad() + contribution (what p.grad() is about to become) into a
// staging tensor of its own and hands that over; finish() copies the average into p.grad(). A
// parameter backward did not reach (unused this step) is handed over by finish(), as its
// p.grad() or zeros, so every rank hands over every parameter, as the Sync requires.
template <class Sync>
class gradient_sync final : public gradients {
 public:
  gradient_sync(Sync& sync, torch::nn::Module& module, handover how = handover::during_backward)
      : gradient_sync(sync, module.parameters(), how) {}
  gradient_sync(Sync& sync, const std::vector<torch::Tensor>& parameters, handover how = handover::during_backward);
  gradient_sync(const gradient_sync&) = delete;
  gradient_sync& operator=(const gradient_sync&) = delete;
  // Removes the hooks: the parameters outlive this object in most trainers.
  ~gradient_sync() override;

  // After backward, before optimizer.step(): averages every parameter's gradient over the member.
  // Refused under within_backward, where backward() has done it.
  void finish() override;

  handover mode() const noexcept override { return how_; }
  std::size_t parameters() const noexcept override { return params_.size(); }

 private:
  void stage(std::size_t i, const torch::Tensor& contribution);
  void step();

  Sync& sync_;
  handover how_;
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> staging_;  // during_backward: per parameter, what its grad becomes
  std::vector<unsigned> hooks_;
  std::vector<char> staged_;  // per parameter: handed over in this step
  std::string twice_;         // a parameter whose hook ran twice in one step
  // within_backward: alive while a backward's step is queued with autograd. The callback holds
  // it; autograd drops the callback unrun when that backward fails, and the token with it.
  std::weak_ptr<void> queued_;
};

// Submits a tensor's elements (any shape; contiguous or not: submit copies) as one round.
template <class Collect>
void submit(Collect& collect, const torch::Tensor& tensor) {
  const torch::Tensor flat = tensor.detach().to(torch::kCPU).contiguous();
  visit_scalar_type(flat, "interop::submit", [&](auto element) {
    using T = decltype(element);
    collect.submit(span<const T>(elements<T>(flat, "interop::submit")));
  });
}

// On the aggregator: one gathered round as one tensor per member, each shaped [-1, trailing...]
// (e.g. {10} for class probabilities: [samples, 10]).
template <class T = float, class Collect>
std::vector<torch::Tensor> gather(Collect& collect, std::vector<std::int64_t> trailing = {});

// On the aggregator: one round combined over members with `o`, shaped [-1, trailing...].
template <class T = float, class Collect>
torch::Tensor reduce(Collect& collect, op o, std::vector<std::int64_t> trailing = {});

// The part of an evaluation set of `size` samples that rank `rank` of `ranks` evaluates:
// [begin, end), contiguous, in rank order, sizes differing by at most one. many_to_one
// concatenates a member's submissions in rank order, so the member's slices make the whole set.
struct slice {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const noexcept { return end - begin; }
};
inline slice evaluation_slice(std::int64_t size, int rank, int ranks) {
  check(size >= 0, "interop::evaluation_slice", cat("an evaluation set of ", size, " samples"));
  check(ranks > 0 && rank >= 0 && rank < ranks, "interop::evaluation_slice",
        cat("rank ", rank, " of ", ranks, " ranks"));
  return {size * rank / ranks, size * (rank + 1) / ranks};
}
// The same for a trainer of an ensemble_pipeline (its rank among its member's ranks).
template <class Context>
slice evaluation_slice(std::int64_t size, const Context& ctx) {
  check(ctx.member() >= 0, "interop::evaluation_slice", "a producer evaluates nothing; trainers only");
  return evaluation_slice(size, ctx.rank_in_member(), ctx.member_size());
}

// The trainer's part of an evaluation set held as one tensor (samples along dimension 0): a view.
template <class Context>
torch::Tensor evaluation_slice(const torch::Tensor& set, const Context& ctx) {
  const slice part = evaluation_slice(set.size(0), ctx);
  return set.slice(0, part.begin, part.end);
}

// ---------------------------------------------------------------------------------------------

namespace detail {
template <class Sync, class = void>
struct has_gradient_memory : std::false_type {};
template <class Sync>
struct has_gradient_memory<Sync, std::void_t<decltype(std::declval<Sync&>().gradient_memory(std::size_t{}))>>
    : std::true_type {};

template <class T> struct scalar_type_of;
template <> struct scalar_type_of<float> { static constexpr auto value = torch::kFloat32; };
template <> struct scalar_type_of<double> { static constexpr auto value = torch::kFloat64; };
template <> struct scalar_type_of<std::int32_t> { static constexpr auto value = torch::kInt32; };
template <> struct scalar_type_of<std::int64_t> { static constexpr auto value = torch::kInt64; };
template <> struct scalar_type_of<std::uint8_t> { static constexpr auto value = torch::kUInt8; };

// Where a Sync takes gradients: its backend's memory space, or either for a Sync without a
// backend (a trainer's own of ready/finish).
enum class gradient_place { host, device, either };
template <class Sync, class = void>
struct gradient_place_of : std::integral_constant<gradient_place, gradient_place::either> {};
template <class Sync>
struct gradient_place_of<Sync, std::void_t<decltype(Sync::backend::memory)>>
    : std::integral_constant<gradient_place, Sync::backend::memory == memory_space::device ? gradient_place::device
                                                                                           : gradient_place::host> {};

// What a Sync needs of a device, and what this build offers: an error naming the way out.
inline void check_place(gradient_place place, const torch::Device& device, const std::string& what) {
  if (device.is_cuda()) {
    if (!FLEXCOMM_TORCH_CUDA)
      fail(what, cat("the tensor is on ", device.str(), "; this build of the torch interop takes CPU tensors (CUDA "
                     "tensors need a CUDA libtorch, a build with CUDA, FLEXCOMM_HAVE_CUDA, and nvcc compiling this "
                     "file, nvcc -x cu: docs/cuda.md, \"libtorch on the GPU\")"));
    if (place == gradient_place::host)
      fail(what, cat("the tensor is on ", device.str(), " and this Sync's backend keeps gradients in host memory: use "
                     "a device Sync (subgroup_allreduce<nccl>, subgroup_allreduce<staged>, overlapped_ring<staged>), "
                     "or train_ensemble, which makes one for a CUDA module"));
  } else if (!device.is_cpu()) {
    fail(what, cat("the tensor is on ", device.str(), "; the torch interop takes CPU and CUDA tensors"));
  } else if (place == gradient_place::device) {
    fail(what, "the tensor is on the CPU and this Sync's backend keeps gradients in device memory: move the module "
               "to its GPU (module.to(torch::kCUDA)), or use a Sync on a host backend (mpi)");
  }
}

// A gradient's elements for a Sync: a CPU tensor's as elements() reads them, a CUDA tensor's by its
// device pointer, once flexcomm's device work is ordered after torch's current stream.
template <class T>
span<T> gradient_elements(const torch::Tensor& t, gradient_place place, const std::string& what) {
  check(t.defined(), what, "the tensor is undefined (a gradient before any backward?)");
  check_place(place, t.device(), what);
  if (!t.is_cuda()) return elements<T>(t, what);
#if FLEXCOMM_TORCH_CUDA
  check(t.scalar_type() == scalar_type_of<T>::value, what,
        cat("the tensor holds ", c10::toString(t.scalar_type()), ", expected ",
            c10::toString(scalar_type_of<T>::value)));
  check(t.is_contiguous(), what, "the tensor is not contiguous; .contiguous() makes a copy that is");
  flexcomm_after_torch(device_index(t));
  return {static_cast<T*>(t.data_ptr()), static_cast<std::size_t>(t.numel())};
#else
  return {};  // refused by check_place
#endif
}

// [count / (product of trailing), trailing...]; an error when trailing does not divide count.
inline std::vector<std::int64_t> shape_of(std::size_t count, const std::vector<std::int64_t>& trailing,
                                          const char* what) {
  std::int64_t inner = 1;
  for (auto d : trailing) {
    check(d > 0, what, cat("trailing dimensions must be positive, got ", d));
    inner *= d;
  }
  const auto n = static_cast<std::int64_t>(count);
  check(n % inner == 0, what, cat(n, " elements do not divide into rows of ", inner));
  std::vector<std::int64_t> shape{n / inner};
  shape.insert(shape.end(), trailing.begin(), trailing.end());
  return shape;
}

// A tensor of its own holding a copy of `values`.
template <class T>
torch::Tensor copied(span<const T> values, const std::vector<std::int64_t>& shape) {
  auto t = torch::empty(shape, torch::dtype(scalar_type_of<T>::value));
  std::copy(values.begin(), values.end(), static_cast<T*>(t.data_ptr()));
  return t;
}

// A tensor over a typed batch's memory, no copy.
template <class T>
torch::Tensor view_of(const tensor_view<T>& v) {
  return torch::from_blob(v.data(), v.shape(), torch::dtype(scalar_type_of<T>::value));
}

inline dtype dtype_of_tensor(const torch::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return dtype::f32;
    case torch::kFloat64: return dtype::f64;
    case torch::kInt32: return dtype::i32;
    case torch::kInt64: return dtype::i64;
    case torch::kUInt8: return dtype::u8;
    default:
      fail(what, cat("tensors of ", c10::toString(t.scalar_type()),
                     " are not supported (float32, float64, int32, int64, uint8)"));
  }
}

// The field a tensor fills, and its bytes copied into a slot of that field.
inline field field_of(const torch::Tensor& t, const char* what) {
  return {dtype_of_tensor(t, what), t.sizes().vec()};
}
inline void copy_into(span<std::byte> out, const torch::Tensor& t, const field& f, std::int64_t index) {
  check(t.defined() && t.device().is_cpu() && dtype_of_tensor(t, "interop::dataset_of") == f.type &&
            t.sizes().vec() == f.shape,
        "interop::dataset_of",
        cat("sample ", index, " is not a CPU tensor of ", f.str(), " like sample 0 (one shape and type for all)"));
  const torch::Tensor dense = t.contiguous();
  std::memcpy(out.data(), dense.data_ptr(), f.bytes());
}
}  // namespace detail

template <class T>
torch::Tensor samples(const typed_batch& batch) {
  return detail::view_of(batch.as<T>());
}

template <class T>
torch::Tensor labels(const typed_batch& batch) {
  return detail::view_of(batch.labels<T>());
}

namespace detail {
template <class D, class = void>
struct has_get : std::false_type {};
template <class D>
struct has_get<D, std::void_t<decltype(std::declval<D&>().get(std::size_t{}))>> : std::true_type {};

// Sample i of a torch::data dataset: get(i), or a batch of that one index.
template <class Dataset>
torch::data::Example<> example_of(Dataset& data, std::size_t i) {
  if constexpr (has_get<Dataset>::value) {
    return data.get(i);
  } else {
    const std::vector<std::size_t> one{i};
    auto batch = data.get_batch(one);
    if constexpr (std::is_same_v<decltype(batch), torch::data::Example<>>) {
      return {batch.data[0], batch.target[0]};  // stacked: [1, ...]
    } else {
      check(batch.size() == 1, "interop::dataset_of", cat("a batch of sample ", i, " holds ", batch.size(), " samples"));
      return batch[0];
    }
  }
}
}  // namespace detail

template <class Dataset>
dataset dataset_of(Dataset& data, std::int64_t batch, std::int64_t epochs) {
  const auto size = data.size();
  check(size.has_value() && *size > 0, "interop::dataset_of", "the dataset has no size, or none to train on");
  const auto first = detail::example_of(data, 0);
  dataset d;
  d.size = static_cast<std::int64_t>(*size);
  d.batch = batch;
  d.epochs = epochs;
  d.sample = detail::field_of(first.data, "interop::dataset_of: data");
  d.label = detail::field_of(first.target, "interop::dataset_of: target");
  d.load_sample = [&data, sample = d.sample, label = *d.label](std::int64_t i, const sample_slot& out) {
    auto example = detail::example_of(data, static_cast<std::size_t>(i));
    detail::copy_into(out.sample_bytes(), example.data, sample, i);
    detail::copy_into(out.label_bytes(), example.target, label, i);
  };
  return d;
}

template <class T>
span<T> elements(const torch::Tensor& t, const std::string& what) {
  check(t.defined(), what, "the tensor is undefined (a gradient before any backward?)");
  check(t.device().is_cpu(), what,
        cat("the tensor is on ", t.device().str(), "; flexcomm's torch interop takes CPU tensors"));
  check(t.scalar_type() == detail::scalar_type_of<std::remove_const_t<T>>::value, what,
        cat("the tensor holds ", c10::toString(t.scalar_type()), ", expected ",
            c10::toString(detail::scalar_type_of<std::remove_const_t<T>>::value)));
  check(t.is_contiguous(), what, "the tensor is not contiguous; .contiguous() makes a copy that is");
  return {static_cast<T*>(t.data_ptr()), static_cast<std::size_t>(t.numel())};
}

template <class F>
decltype(auto) visit_scalar_type(const torch::Tensor& t, const std::string& what, F&& f) {
  check(t.defined(), what, "the tensor is undefined");
  switch (t.scalar_type()) {
    case torch::kFloat32: return f(float{});
    case torch::kFloat64: return f(double{});
    case torch::kInt32: return f(std::int32_t{});
    case torch::kInt64: return f(std::int64_t{});
    case torch::kUInt8: return f(std::uint8_t{});
    default:
      fail(what, cat("tensors of ", c10::toString(t.scalar_type()),
                     " are not supported (float32, float64, int32, int64, uint8)"));
  }
}

inline void detail::epoch_iterator::advance() {
  batch_ = next_->next();
  if (!batch_) {
    next_ = nullptr;
    return;
  }
  example_ = next_->tensors ? next_->tensors(*batch_)
                            : torch::data::Example<>{samples<float>(*batch_), labels<std::int64_t>(*batch_)};
}

inline detail::batch_source detail::source_on(next_batch next, const torch::Device& device) {
  if (device.is_cpu()) return {std::move(next), {}, {}};
  check_place(gradient_place::either, device, "interop::data_loader");  // a CUDA device, and the interop has CUDA
#if FLEXCOMM_TORCH_CUDA
  auto batches = std::make_shared<device_batches>(std::move(next), device);
  return {[batches] { return batches->next(); }, [batches](const typed_batch&) { return batches->example(); }, {}};
#else
  return {};
#endif
}

template <class Sync>
void ready(Sync& sync, int index, const torch::Tensor& grad) {
  visit_scalar_type(grad, "interop::ready", [&](auto element) {
    using T = decltype(element);
    sync.ready(index, detail::gradient_elements<T>(grad, detail::gradient_place_of<Sync>::value,
                                                   cat("interop::ready: gradient ", index)));
  });
}

inline void averages_ready(const torch::Tensor& grad) {
#if FLEXCOMM_TORCH_CUDA
  if (grad.defined() && grad.is_cuda()) torch_after_flexcomm(device_index(grad));
#else
  (void)grad;
#endif
}

template <class Sync>
gradient_sync<Sync>::gradient_sync(Sync& sync, const std::vector<torch::Tensor>& parameters, handover how)
    : sync_(sync), how_(how) {
  for (auto& p : parameters)
    if (p.defined() && p.requires_grad()) params_.push_back(p);
  check(!params_.empty(), "interop::gradient_sync", "no parameter of the module (or list) requires grad");
  // One device for all, and one the Sync takes: a CUDA module goes to a device Sync.
  for (std::size_t i = 0; i < params_.size(); ++i) {
    check(params_[i].device() == params_[0].device(), "interop::gradient_sync",
          cat("parameter ", i, " is on ", params_[i].device().str(), ", parameter 0 on ", params_[0].device().str(),
              "; one Sync averages the parameters of one device"));
    detail::check_place(detail::gradient_place_of<Sync>::value, params_[i].device(),
                        cat("interop::gradient_sync: parameter ", i));
  }
  staged_.assign(params_.size(), 0);
  if (how_ == handover::after_backward) return;
#if FLEXCOMM_TORCH_CUDA
  // The staging memory belongs to the parameters' device (gradient_memory() allocates on the
  // current one).
  std::optional<c10::cuda::CUDAGuard> on;
  if (params_[0].is_cuda()) on.emplace(params_[0].device());
#endif
  // The staging tensors lie in the Sync's gradient_memory() where it has one (the library's do;
  // collective over the member: every rank attaches the same module), each on a cache line: on
  // one host, shared memory, where a bucket of one parameter is reduced where the hook wrote it
  // and fused ones stage there.
  std::vector<std::size_t> at;
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    at.push_back(bytes);
    bytes += flexcomm::detail::round_up(static_cast<std::size_t>(params_[i].numel() * params_[i].element_size()));
  }
  span<std::byte> memory;
  if constexpr (detail::has_gradient_memory<Sync>::value) memory = sync_.gradient_memory(bytes);
  staging_.resize(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    staging_[i] = memory.empty() ? torch::empty_like(params_[i], torch::MemoryFormat::Contiguous)
                                 : torch::from_blob(memory.data() + at[i], params_[i].sizes(), params_[i].options());
    hooks_.push_back(params_[i].register_hook([this, i](const torch::Tensor& g) { stage(i, g); }));
  }
}

template <class Sync>
gradient_sync<Sync>::~gradient_sync() {
  for (std::size_t i = 0; i < hooks_.size(); ++i) params_[i].remove_hook(hooks_[i]);
}

template <class Sync>
void gradient_sync<Sync>::stage(std::size_t i, const torch::Tensor& contribution) {
  if (how_ == handover::within_backward && queued_.expired()) {
    // A backward that failed after handing some gradients over left its step half done: the
    // Sync holds part of it, and the member's other ranks may wait for the rest.
    check(std::none_of(staged_.begin(), staged_.end(), [](char c) { return c != 0; }), "interop::gradient_sync",
          "an earlier backward() failed after handing some gradients over; its step cannot finish, and the "
          "member's exchange is out of step (start the member's training again)");
    // Runs after every AccumulateGrad of this backward, before backward() returns; an error in
    // it leaves backward() as the error.
    auto token = std::make_shared<char>();
    queued_ = token;
    torch::autograd::Engine::get_default_engine().queue_callback([this, token] {
      queued_.reset();
      step();
    });
  }
  // A second backward() before finish(): the first contribution is already on its way. Refused
  // in finish(), on every rank that did it; the Sync still gets each gradient once.
  if (staged_[i]) {
    if (twice_.empty()) twice_ = cat("parameter ", i);
    return;
  }
  torch::NoGradGuard plain;
  const torch::Tensor& before = params_[i].grad();
  if (before.defined())
    torch::add_out(staging_[i], before, contribution);
  else
    staging_[i].copy_(contribution);
  staged_[i] = 1;
  ready(sync_, static_cast<int>(i), staging_[i]);
}

template <class Sync>
void gradient_sync<Sync>::finish() {
  check(how_ != handover::within_backward, "interop::gradient_sync: finish",
        "handover::within_backward finishes each step in backward(); finish() would step the Sync once more");
  step();
}

template <class Sync>
void gradient_sync<Sync>::step() {
  torch::NoGradGuard plain;
  // Backprop order: the last parameters' gradients come first.
  for (std::size_t k = params_.size(); k-- > 0;) {
    if (staged_[k]) continue;
    auto& p = params_[k];
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p, torch::MemoryFormat::Contiguous);
    if (how_ != handover::after_backward) {
      staging_[k].copy_(p.grad());
      ready(sync_, static_cast<int>(k), staging_[k]);
    } else {
      if (!p.grad().is_contiguous()) p.mutable_grad() = p.grad().contiguous();
      ready(sync_, static_cast<int>(k), p.grad());
    }
  }
  // The next step starts afresh even if the Sync fails this one.
  std::fill(staged_.begin(), staged_.end(), 0);
  const std::string which = std::move(twice_);
  twice_.clear();
  sync_.finish();
  averages_ready(params_[0]);  // on a GPU, torch's current stream waits for the averages
  if (how_ != handover::after_backward)
    for (std::size_t k = 0; k < params_.size(); ++k) params_[k].mutable_grad().copy_(staging_[k]);
  if (!which.empty()) {
    fail("interop::gradient_sync: finish",
         cat(which, " received two gradients before finish() (two backward() calls in one step?); "
                    "handover::during_backward takes one backward() per finish(), after_backward and within_backward "
                    "any number"));
  }
}

template <class T, class Collect>
std::vector<torch::Tensor> gather(Collect& collect, std::vector<std::int64_t> trailing) {
  const auto round = collect.template gather<T>();
  std::vector<torch::Tensor> members;
  for (std::size_t m = 0; m < round.member_counts.size(); ++m) {
    const auto part = round.member(static_cast<int>(m));
    members.push_back(detail::copied<T>(part, detail::shape_of(part.size(), trailing, "interop::gather")));
  }
  return members;
}

template <class T, class Collect>
torch::Tensor reduce(Collect& collect, op o, std::vector<std::int64_t> trailing) {
  const auto combined = collect.template reduce<T>(o);
  return detail::copied<T>(span<const T>(combined.data(), combined.size()),
                           detail::shape_of(combined.size(), trailing, "interop::reduce"));
}

}  // namespace flexcomm::interop
