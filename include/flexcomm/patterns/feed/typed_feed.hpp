// typed_feed<Feed>: the typed, epoch-aware front end of every feed (local_feed, one_to_many<B>,
// all_shared<B>). The trainer describes its data (feed/dataset.hpp); flexcomm derives the
// stream (epochs x ceil(size / batch) steps), slices each batch over the layout's shards as
// evenly as DistributedSampler (any batch size, any layout; the short last batch; empty shards),
// sizes the shards, agrees all of it across ranks, and hands each trainer typed batches
// (typed_batch, below) that know their epoch. The byte feed runs underneath, unchanged:
//
//   fc::dataset data;
//   data.size = 60000; data.batch = 64; data.epochs = 3;
//   data.sample = fc::field::of<float>({1, 28, 28});
//   data.label = fc::field::of<std::int64_t>();
//   data.load_sample = [&](std::int64_t i, const fc::sample_slot& out) { decode(i, out.sample<float>()); ... };
//   fc::typed_feed<fc::one_to_many<fc::mpi>> feed(world, layout, data);   // collective over world
//   if (!feed.is_trainer()) feed.produce();
//   feed.on_epoch_end([&](std::int64_t epoch) { evaluate(epoch); });
//   while (auto batch = feed.next()) {
//     auto x = batch->as<float>();                       // {samples, 1, 28, 28}, 64-byte aligned
//     auto y = batch->labels<std::int64_t>();            // {samples}
//     train(x, y, batch->epoch(), batch->last_in_epoch());
//   }
//   // or, in generic code (a pipeline's [&](auto& ctx)), with the batch's type named:
//   for (const fc::typed_batch& batch : ctx.batches()) train(batch.as<float>(), ...);
//
// Each rank that loads (producers under one_to_many, each trainer otherwise) calls the loader for
// its shards; the others need only the dataset's size and shapes, never the data.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../../core/agreement.hpp"
#include "../../core/batching.hpp"
#include "../../core/cache_line.hpp"
#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/layout.hpp"
#include "../../core/reduce.hpp"
#include "../../core/span.hpp"
#include "dataset.hpp"
#include "step_source.hpp"
#include "vocabulary.hpp"

namespace flexcomm {

// Every tensor a typed_batch hands out starts on a boundary of this many bytes (a cache line,
// and enough for AVX-512 loads and for torch::from_blob's and Eigen's alignment wishes).
constexpr std::size_t batch_alignment = 64;

// A dense, row-major tensor over memory someone else owns: a pointer and a shape. Mutable, so
// a framework can wrap it without a cast (torch::from_blob(v.data(), v.shape())).
template <class T>
class tensor_view {
 public:
  tensor_view() = default;
  tensor_view(T* data, std::vector<std::int64_t> shape) : data_(data), shape_(std::move(shape)) {}

  T* data() const noexcept { return data_; }
  const std::vector<std::int64_t>& shape() const noexcept { return shape_; }
  int dim() const noexcept { return static_cast<int>(shape_.size()); }
  std::int64_t size(int d) const {
    check(d >= 0 && d < dim(), "tensor_view", cat("dimension ", d, " of a ", dim(), "-dimensional tensor"));
    return shape_[static_cast<std::size_t>(d)];
  }
  std::size_t numel() const noexcept {
    std::size_t n = 1;
    for (auto d : shape_) n *= static_cast<std::size_t>(d);
    return n;
  }
  span<T> flat() const noexcept { return {data_, numel()}; }
  T& operator[](std::size_t i) const noexcept { return data_[i]; }

 private:
  T* data_ = nullptr;
  std::vector<std::int64_t> shape_;
};

// typed_batch: one step as a trainer of a typed_feed sees it: its samples (and labels) as
// tensors of shape {samples, ...field shape}, contiguous and 64-byte aligned, the dataset
// index of each, and where the step sits in its epoch. Valid until the feed's next next().
// The tensors are this trainer's own copy, so they may be changed in place: the byte batch
// underneath can be a shared-memory slot that other members read too.
class typed_batch {
 public:
  // Built by typed_feed; `storage` points into buffers the feed owns.
  struct storage {
    std::byte* samples = nullptr;      // batch_alignment-aligned
    std::byte* labels = nullptr;       // batch_alignment-aligned, or null without a label field
    const std::int64_t* indices = nullptr;
  };
  typed_batch(const batch& bytes, const field& sample, const field* label, storage at, std::int64_t samples,
              std::int64_t first_sample, std::int64_t batch_samples, std::int64_t epoch, std::int64_t step_in_epoch,
              std::int64_t steps_in_epoch)
      : bytes_(bytes), sample_(&sample), label_(label), at_(at), samples_(samples), first_sample_(first_sample),
        batch_samples_(batch_samples), epoch_(epoch), step_in_epoch_(step_in_epoch), steps_in_epoch_(steps_in_epoch) {}

  std::int64_t step() const noexcept { return bytes_.step(); }  // in the whole stream
  std::int64_t epoch() const noexcept { return epoch_; }
  std::int64_t step_in_epoch() const noexcept { return step_in_epoch_; }
  std::int64_t steps_in_epoch() const noexcept { return steps_in_epoch_; }
  bool last_in_epoch() const noexcept { return step_in_epoch_ == steps_in_epoch_ - 1; }

  // This trainer's samples (0 is possible: a short last batch over many shards); they are
  // positions [first_sample(), first_sample() + samples()) of the step's batch of
  // batch_samples() (the whole member's; every member gets the same batch).
  std::int64_t samples() const noexcept { return samples_; }
  std::int64_t first_sample() const noexcept { return first_sample_; }
  std::int64_t batch_samples() const noexcept { return batch_samples_; }
  // The dataset index of each of this trainer's samples.
  span<const std::int64_t> indices() const noexcept { return {at_.indices, static_cast<std::size_t>(samples_)}; }

  // The samples as {samples(), ...sample shape}; T must be the sample field's element type.
  template <class T>
  tensor_view<T> as() const {
    return view<T>(at_.samples, *sample_, "typed_batch::as");
  }
  // The labels as {samples(), ...label shape}.
  template <class T>
  tensor_view<T> labels() const {
    check(label_ != nullptr, "typed_batch::labels", "the dataset has no label field");
    return view<T>(at_.labels, *label_, "typed_batch::labels");
  }
  bool has_labels() const noexcept { return label_ != nullptr; }
  const field& sample_field() const noexcept { return *sample_; }

  // The byte batch underneath (one record per shard: indices, samples, labels; see dataset.hpp).
  const batch& bytes_batch() const noexcept { return bytes_; }

 private:
  template <class T>
  tensor_view<T> view(std::byte* data, const field& f, const char* what) const {
    static_assert(is_element_v<T>, "typed_batch: T has no flexcomm dtype (float, double, int32, int64, uint8, half, "
                                   "bfloat16)");
    check(dtype_of<T> == f.type, what,
          cat("the field is ", f.str(), ", asked for ", name_of(dtype_of<T>), " elements"));
    std::vector<std::int64_t> shape{samples_};
    shape.insert(shape.end(), f.shape.begin(), f.shape.end());
    return {reinterpret_cast<T*>(data), std::move(shape)};
  }

  batch bytes_;
  const field* sample_;
  const field* label_;
  storage at_;
  std::int64_t samples_, first_sample_, batch_samples_, epoch_, step_in_epoch_, steps_in_epoch_;
};

namespace detail {

// What typed_feed's loader needs on a loading rank; shared with the loader the byte feed holds.
struct typed_loading {
  dataset data;
  batch_plan plan;
  shard_record record;
  epoch_order order;
  std::function<void()> between_steps;  // the pipeline's per-round collection, on loading producers
  std::int64_t last_polled = -1;
  std::exception_ptr poll_failure;      // rethrown by produce(), never shipped as the loader's
};

// Writes one shard of a step as a shard_record; the byte feed calls it once per (step, shard).
inline std::size_t load_shard(typed_loading& s, std::int64_t step, int shard, span<std::byte> out) {
  if (s.between_steps && step != s.last_polled) {
    s.last_polled = step;
    try {
      s.between_steps();
    } catch (...) {
      if (!s.poll_failure) s.poll_failure = std::current_exception();
    }
  }
  const sample_range r = s.plan.shard_samples(step, shard);
  const auto n = static_cast<std::size_t>(r.count);
  if (n == 0) return 0;
  const std::size_t bytes = s.record.bytes(n);
  check(bytes <= out.size(), "typed_feed", cat("step ", step, " shard ", shard, ": ", n, " samples take ", bytes,
                                               " bytes, the slot holds ", out.size()));
  std::memset(out.data(), 0, bytes);
  const std::int64_t epoch = s.plan.epoch_of(step), first = s.plan.first_in_epoch(step) + r.first;
  auto* indices = reinterpret_cast<std::int64_t*>(out.data());
  for (std::size_t i = 0; i < n; ++i) indices[i] = s.order.index(epoch, first + static_cast<std::int64_t>(i));
  const span<std::byte> samples(out.data() + s.record.samples_offset(n), n * s.record.sample_bytes);
  const span<std::byte> labels(out.data() + s.record.labels_offset(n), n * s.record.label_bytes);
  const field* label = s.data.label ? &*s.data.label : nullptr;
  if (s.data.load_batch) {
    s.data.load_batch(batch_slot(epoch, step, s.plan.step_in_epoch(step), r.first, span<const std::int64_t>(indices, n),
                                 s.data.sample, samples, label, labels));
  } else {
    check(static_cast<bool>(s.data.load_sample), "typed_feed",
          "this rank loads batches, but its dataset has neither load_sample nor load_batch");
    for (std::size_t i = 0; i < n; ++i)
      s.data.load_sample(indices[i], sample_slot(indices[i], epoch, step, r.first + static_cast<std::int64_t>(i),
                                                 s.data.sample, samples.subspan(i * s.record.sample_bytes, s.record.sample_bytes),
                                                 label, labels.subspan(i * s.record.label_bytes, s.record.label_bytes)));
  }
  return bytes;
}

// What is wrong with a dataset on its own, or "" (the same answer on every rank).
inline std::string dataset_problem(const dataset& d) {
  if (d.size < 0) return cat("dataset size must be >= 0, got ", d.size);
  if (d.batch <= 0) return cat("dataset batch must be > 0, got ", d.batch);
  if (d.epochs < 0) return cat("dataset epochs must be >= 0, got ", d.epochs);
  auto shape_problem = [](const field& f, const char* what) -> std::string {
    for (auto e : f.shape)
      if (e <= 0) return cat("the ", what, " field's shape ", f.str(), " has a dimension <= 0");
    if (f.bytes() > (std::size_t{1} << 28)) return cat("the ", what, " field ", f.str(), " exceeds 256 MiB per sample");
    return "";
  };
  if (auto p = shape_problem(d.sample, "sample"); !p.empty()) return p;
  if (d.label)
    if (auto p = shape_problem(*d.label, "label"); !p.empty()) return p;
  return "";
}

// The dataset's description as numbers a reduction can compare (loaders are not compared).
inline std::vector<std::int64_t> dataset_key(bool rejected, const dataset& d) {
  auto fp = [](const field& f) {
    fingerprint h;
    h.add(static_cast<std::uint64_t>(f.type));
    for (auto e : f.shape) h.add(static_cast<std::uint64_t>(e));
    return h.add(f.shape.size()).folded();
  };
  return {rejected ? 1 : 0, d.size, d.batch, d.epochs, d.drop_last ? 1 : 0, d.shuffle ? 1 : 0,
          d.shuffle ? fingerprint().add(d.seed).folded() : 0, fp(d.sample), d.label ? fp(*d.label) : -1};
}

// Collective over `world`: every rank refuses a dataset that any rank refused or that ranks
// describe differently, with the same verdict (one reduction, as feed/agreement.hpp does).
template <class B>
void agree_dataset(const typename B::communicator& world, const dataset& d, const std::string& local_problem,
                   const char* who) {
  agreement a(dataset_key(!local_problem.empty(), d));
  B::template iallreduce<std::int64_t>(world, a.buffer(), op::max).wait();
  if (!local_problem.empty()) fail(who, local_problem);
  check(a.highest(0) == 0, who, "another rank rejected the dataset");
  static const char* names[] = {"", "size", "batch", "epochs", "drop_last", "shuffle", "seed",
                                "sample field (type and shape)", "label field (type and shape)"};
  for (std::size_t i = 1; i < 9; ++i)
    check(a.agreed(i), who,
          cat("ranks disagree on the dataset's ", names[i],
              i == 7   ? cat(" (this rank: ", d.sample.str(), ")")
              : i == 8 ? cat(" (this rank: ", d.label ? d.label->str() : std::string("none"), ")")
                       : cat(": values range from ", a.lowest(i), " to ", a.highest(i))));
}

// Memory aligned to batch_alignment, allocated once.
class aligned_bytes {
 public:
  void resize(std::size_t n) {
    raw_.assign(n + batch_alignment, std::byte{0});
    const auto address = reinterpret_cast<std::uintptr_t>(raw_.data());
    data_ = raw_.data() + (batch_alignment - address % batch_alignment) % batch_alignment;
  }
  std::byte* data() const noexcept { return data_; }

 private:
  std::vector<std::byte> raw_;
  std::byte* data_ = nullptr;
};

}  // namespace detail

template <class Feed>
class typed_feed {
 public:
  using feed_type = Feed;
  static constexpr bool needs_producers = Feed::needs_producers;
  // Which ranks call the dataset's loader: producers for a feed that ships from them, else trainers.
  static constexpr bool loads_on_producers = Feed::needs_producers;

  // Collective over `world`, local_feed's too (the dataset is agreed in one reduction over it):
  // agrees the dataset across ranks, then makes the byte feed with the options derived from it.
  // `options` gives depth and flow; its steps and shard_capacity are derived (leave them 0).
  template <class Communicator>
  typed_feed(const Communicator& world, const ensemble_layout& layout, dataset data, feed_options options = {});
  // Batches and the loader point into it.
  typed_feed(const typed_feed&) = delete;
  typed_feed& operator=(const typed_feed&) = delete;

  // The byte feed's options for this dataset on this layout: steps = epochs x steps per epoch,
  // shard_capacity = one shard_record of ceil(batch / shards) samples.
  static feed_options options_for(const ensemble_layout& layout, const dataset& data, feed_options base = {});

  // On producer ranks: as Feed::produce(). Rethrows a failure of between_steps() once the stream is out.
  void produce();

  // On trainer ranks: the next step's samples of this trainer, or nothing at the end. Before it
  // waits for a batch, calls the epoch-end callback for every epoch whose last step was delivered.
  std::optional<typed_batch> next();

  // On trainers, the same as a range: for (const typed_batch& batch : feed) {...}. Naming the
  // type spares generic code (a pipeline's `auto& ctx`) the `template` keyword before as<T>().
  class iterator;
  iterator begin();
  iterator end() noexcept;

  // On trainers: f(epoch) once for each epoch, in order, as soon as the trainer asks for the batch
  // after that epoch's last step (and for every epoch left when the stream ends, so each trainer
  // sees every epoch's end exactly once, whatever it skipped).
  void on_epoch_end(std::function<void(std::int64_t epoch)> f) { epoch_end_ = std::move(f); }

  // Called once per step this rank handles: on trainers at each next(), on producers that load
  // once per step loaded. The pipeline collects rounds from here while training goes on.
  void between_steps(std::function<void()> f);

  const batch_plan& plan() const noexcept { return plan_; }
  const field& sample_field() const noexcept { return sample_; }
  const std::optional<field>& label_field() const noexcept { return label_; }
  std::int64_t skipped() const noexcept { return feed_->skipped(); }
  bool is_trainer() const noexcept { return feed_->is_trainer(); }
  // The byte feed underneath (its batches are shard_records; see dataset.hpp).
  Feed& bytes_feed() noexcept { return *feed_; }

 private:
  void end_epochs_through(std::int64_t epoch);

  batch_plan plan_;
  field sample_;
  std::optional<field> label_;
  detail::shard_record record_;
  std::shared_ptr<detail::typed_loading> loading_;
  std::optional<Feed> feed_;
  std::function<void(std::int64_t)> epoch_end_;
  std::function<void()> between_steps_;
  std::int64_t epochs_ended_ = 0, last_step_ = -1;
  int sized_for_ = 0;  // the shards per batch samples_, labels_ and indices_ hold
  detail::aligned_bytes samples_, labels_;
  std::vector<std::int64_t> indices_;
};

// An input iterator over the rest of the stream; each increment is a next().
template <class Feed>
class typed_feed<Feed>::iterator {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = typed_batch;
  using difference_type = std::ptrdiff_t;
  using pointer = const typed_batch*;
  using reference = const typed_batch&;

  iterator() = default;
  explicit iterator(typed_feed* feed) : feed_(feed) { ++*this; }
  const typed_batch& operator*() const { return *batch_; }
  const typed_batch* operator->() const { return &*batch_; }
  iterator& operator++() {
    batch_.reset();
    batch_ = feed_->next();
    if (!batch_) feed_ = nullptr;
    return *this;
  }
  bool operator==(const iterator& other) const noexcept { return feed_ == other.feed_; }
  bool operator!=(const iterator& other) const noexcept { return feed_ != other.feed_; }

 private:
  typed_feed* feed_ = nullptr;
  std::optional<typed_batch> batch_;
};

template <class Feed>
typename typed_feed<Feed>::iterator typed_feed<Feed>::begin() {
  return iterator(this);
}
template <class Feed>
typename typed_feed<Feed>::iterator typed_feed<Feed>::end() noexcept {
  return iterator();
}

// ---------------------------------------------------------------------------------------------

template <class Feed>
feed_options typed_feed<Feed>::options_for(const ensemble_layout& layout, const dataset& data, feed_options base) {
  const std::string problem = detail::dataset_problem(data);
  check(problem.empty(), "typed_feed", problem);
  const batch_plan plan(data.size, data.batch, data.epochs, layout.shards_per_step(), data.drop_last);
  const detail::shard_record record{data.sample.bytes(), data.label ? data.label->bytes() : 0};
  base.steps = plan.steps();
  base.shard_capacity = std::max<std::size_t>(record.bytes(static_cast<std::size_t>(plan.max_shard_samples())), 8);
  return base;
}

template <class Feed>
template <class Communicator>
typed_feed<Feed>::typed_feed(const Communicator& world, const ensemble_layout& layout, dataset data,
                             feed_options options)
    : sample_(data.sample), label_(data.label) {
  using B = typename Communicator::backend;
  std::string problem = detail::dataset_problem(data);
  feed_options derived = options;
  if (problem.empty()) {
    try {
      derived = options_for(layout, data, options);
      if (options.steps != 0 && options.steps != derived.steps)
        problem = cat("feed_options.steps is derived from the dataset (", data.epochs, " epochs x ",
                      derived.steps / std::max<std::int64_t>(data.epochs, 1), " steps); leave it 0, got ",
                      options.steps);
      else if (options.shard_capacity != 0 && options.shard_capacity != derived.shard_capacity)
        problem = cat("feed_options.shard_capacity is derived from the dataset (", derived.shard_capacity,
                      " bytes); leave it 0, got ", options.shard_capacity);
    } catch (const error& e) {
      problem = e.cause();
    }
  }
  // Whether this rank loads, where the layout already says who does what (a per-host layout is
  // placed by the feed; a rank of it that loads without a loader fails at its first shard).
  bool loads = false;
  try {
    if (problem.empty() && layout.is_placed() && layout.world_size() == world.size()) {
      const rank_role r = layout.role_of(world.rank());
      loads = (r.kind == role::producer) == loads_on_producers;
      if (loads && !data.load_sample && !data.load_batch)
        problem = cat("rank ", world.rank(), " loads batches (",
                      loads_on_producers ? "a producer" : "a trainer of a feed without producers",
                      ") but its dataset has neither load_sample nor load_batch");
    }
  } catch (const error& e) {
    problem = e.cause();
  }
  detail::agree_dataset<B>(world, data, problem, "typed_feed");

  plan_ = batch_plan(data.size, data.batch, data.epochs, layout.shards_per_step(), data.drop_last);
  record_ = {data.sample.bytes(), data.label ? data.label->bytes() : 0};
  loading_ = std::make_shared<detail::typed_loading>();
  loading_->plan = plan_;
  loading_->record = record_;
  loading_->order = epoch_order(data.size, data.shuffle, data.seed);
  loading_->data = std::move(data);
  auto state = loading_;
  loader load = [state](std::int64_t step, int shard, span<std::byte> out) {
    return detail::load_shard(*state, step, shard, out);
  };
  feed_.emplace(world, layout, std::move(load), derived);
}

// Trainers call it from next(), where a failure reaches them; producers from their loader, whose
// failures produce() rethrows (a trainer that loads never calls produce(), so not from there).
template <class Feed>
void typed_feed<Feed>::between_steps(std::function<void()> f) {
  if (feed_->is_trainer()) {
    between_steps_ = std::move(f);
  } else {
    loading_->between_steps = std::move(f);
  }
}

template <class Feed>
void typed_feed<Feed>::produce() {
  feed_->produce();
  if (loading_->poll_failure) std::rethrow_exception(std::exchange(loading_->poll_failure, nullptr));
}

template <class Feed>
void typed_feed<Feed>::end_epochs_through(std::int64_t epoch) {
  while (epochs_ended_ <= epoch && epochs_ended_ < plan_.epochs()) {
    const std::int64_t e = epochs_ended_++;
    if (epoch_end_) epoch_end_(e);
  }
}

template <class Feed>
std::optional<typed_batch> typed_feed<Feed>::next() {
  check(feed_->is_trainer(), "typed_feed", "next() is for trainer ranks; this rank is a producer");
  if (last_step_ >= 0 && plan_.last_in_epoch(last_step_)) end_epochs_through(plan_.epoch_of(last_step_));
  if (between_steps_) between_steps_();
  auto b = feed_->next();
  if (!b) {
    end_epochs_through(plan_.epochs() - 1);
    return std::nullopt;
  }
  const std::int64_t step = b->step();
  end_epochs_through(plan_.epoch_of(step) - 1);  // epochs whose ends were skipped (skip_ahead)
  last_step_ = step;
  // Unpack the shard_records into contiguous, aligned tensors, sized for the most samples this
  // trainer's shards can hold: once, and again where a hand-over gives it more shards.
  const sample_range mine = plan_.shards_samples(step, b->first_shard(), b->shards());
  if (b->shards() > sized_for_) {
    sized_for_ = b->shards();
    const auto most = static_cast<std::size_t>(plan_.max_shard_samples()) * static_cast<std::size_t>(b->shards());
    samples_.resize(detail::round_up(most * record_.sample_bytes, batch_alignment));
    if (label_) labels_.resize(detail::round_up(most * record_.label_bytes, batch_alignment));
    indices_.resize(std::max<std::size_t>(most, 1));
  }
  std::size_t at = 0;
  for (int i = 0; i < b->shards(); ++i) {
    const int shard = b->first_shard() + i;
    const auto n = static_cast<std::size_t>(plan_.shard_samples(step, shard).count);
    const span<const std::byte> bytes = b->shard(i);
    check(bytes.size() == (n == 0 ? 0 : record_.bytes(n)), "typed_feed",
          cat("step ", step, " shard ", shard, ": received ", bytes.size(), " bytes, ", n, " samples take ",
              n == 0 ? 0 : record_.bytes(n), " (do all ranks give the same dataset?)"));
    if (n == 0) continue;
    std::memcpy(indices_.data() + at, bytes.data(), n * sizeof(std::int64_t));
    std::memcpy(samples_.data() + at * record_.sample_bytes, bytes.data() + record_.samples_offset(n),
                n * record_.sample_bytes);
    if (label_)
      std::memcpy(labels_.data() + at * record_.label_bytes, bytes.data() + record_.labels_offset(n),
                  n * record_.label_bytes);
    at += n;
  }
  check(static_cast<std::int64_t>(at) == mine.count, "typed_feed",
        cat("step ", step, ": this trainer's shards hold ", at, " samples, the plan says ", mine.count));
  typed_batch::storage where{samples_.data(), label_ ? labels_.data() : nullptr, indices_.data()};
  return typed_batch(*b, sample_, label_ ? &*label_ : nullptr, where, mine.count, mine.first,
                     plan_.batch_samples(step), plan_.epoch_of(step), plan_.step_in_epoch(step),
                     plan_.steps_per_epoch());
}

}  // namespace flexcomm
