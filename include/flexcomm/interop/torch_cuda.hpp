// libtorch's CUDA tensors in flexcomm: gradients averaged on the device in the order of torch's
// current stream, and a typed feed's batches delivered into device memory while torch still
// computes on the previous one. Included by interop/torch.hpp, which takes CUDA tensors where
// this header is on (FLEXCOMM_TORCH_CUDA is 1): the build has CUDA (FLEXCOMM_HAVE_CUDA), nvcc
// compiles the translation unit (the device layer and the device Syncs carry kernels; `nvcc -x cu`
// takes a .cpp as it is), and libtorch is a CUDA build (its generated
// c10/cuda/impl/cuda_cmake_macros.h is there; Debian's CPU libtorch ships c10/cuda's other headers
// without it). Define FLEXCOMM_TORCH_CUDA 0 to leave it out.
//
// Streams. flexcomm's device backends run on streams ordered with the legacy default stream
// (docs/cuda.md, "Streams"); torch computes on its current stream, which may be one of its own,
// not ordered with it. Before a gradient is handed over, the legacy default stream waits for
// torch's current stream (an event, on the GPU: the host does not block); after the Sync's
// finish(), torch's current stream waits for the legacy default stream, behind which every
// average has landed. Where torch's current stream is the legacy default one (libtorch's default)
// nothing is recorded.
#pragma once

#if !defined(FLEXCOMM_TORCH_CUDA)
#if defined(FLEXCOMM_HAVE_CUDA) && defined(__CUDACC__) && !defined(FLEXCOMM_DEVICE_STANDIN) && defined(__has_include)
#if __has_include(<c10/cuda/CUDAStream.h>) && __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#define FLEXCOMM_TORCH_CUDA 1
#endif
#endif
#endif
#if !defined(FLEXCOMM_TORCH_CUDA)
#define FLEXCOMM_TORCH_CUDA 0
#endif

#if FLEXCOMM_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "../backend/cuda/device_batch.hpp"
#include "../backend/cuda/error.hpp"
#include "../core/cache_line.hpp"
#include "../core/error.hpp"
#include "../core/span.hpp"
#include "../patterns/feed/typed_feed.hpp"

namespace flexcomm::interop {

// The device a tensor lies on, as the device layer numbers devices.
inline int device_index(const torch::Tensor& t) { return t.device().index() < 0 ? 0 : t.device().index(); }

// flexcomm's device work after the work torch's current stream on `device` holds so far, and
// torch's after flexcomm's: the two halves of handing a CUDA tensor to a Sync (see above).
inline void flexcomm_after_torch(int device);
inline void torch_after_flexcomm(int device);

// A typed feed's batches in device memory, on `device`, through cuda::device_feed: each step's
// samples (float) and labels (int64) of this trainer are packed into one pinned host buffer and
// copied on device_feed's copy stream while the trainer's previous step may still run; torch's
// current stream (as it was at the first next()) waits for the copy on the GPU. Two device slots
// alternate, so a batch's tensors hold their values until the next next() but one; like the host
// views, use them until the next next().
class device_batches {
 public:
  using source = std::function<std::optional<typed_batch>()>;
  device_batches(source next, torch::Device device);
  device_batches(const device_batches&) = delete;
  device_batches& operator=(const device_batches&) = delete;

  // The next typed batch (its host tensors, its step and epoch), its copy to the device enqueued;
  // nothing at the end of the stream.
  std::optional<typed_batch> next();
  // The batch next() returned, as tensors on the device: samples [n, ...] float, labels [n, ...]
  // int64 (what samples<float>() and labels<std::int64_t>() view on the host).
  const torch::data::Example<>& example() const noexcept { return example_; }

 private:
  // device_feed's view of a packed batch: step() and bytes() (pinned host memory).
  struct packed {
    std::int64_t at_step;
    span<const std::byte> packed_bytes;
    std::int64_t step() const noexcept { return at_step; }
    span<const std::byte> bytes() const noexcept { return packed_bytes; }
  };
  struct packer {
    device_batches* owner;
    std::optional<packed> next() { return owner->pack(); }
  };
  std::optional<packed> pack();

  source source_;
  int device_;
  std::optional<typed_batch> pending_, batch_;  // the first batch, taken to size the slots; the current one
  struct free_pinned {
    void operator()(std::byte* p) const noexcept { device::free_pinned(p); }
  };
  std::unique_ptr<std::byte, free_pinned> pinned_;  // one step's share, packed
  std::size_t labels_at_ = 0, capacity_ = 0;  // where the labels start in a slot; a slot's bytes
  std::int64_t most_ = 0;                      // the samples a slot holds
  std::vector<std::int64_t> sample_shape_, label_shape_;
  packer packer_{this};
  std::optional<cuda::device_feed<packer>> feed_;  // after packer_: it holds a reference to it
  torch::data::Example<> example_;
};

// ---------------------------------------------------------------------------------------------

namespace detail {
// This thread's event on `device` for the waits below (an event's wait takes the record of the
// moment it is issued, so one event serves every wait in turn).
inline device::event_t ordering_event(int device) {
  thread_local std::map<int, cuda::event> events;
  auto found = events.find(device);
  if (found == events.end()) found = events.emplace(device, cuda::event::create("interop: stream order")).first;
  return found->second.get();
}

// `waiter` waits on the GPU for the work `first` holds so far; nothing when they are one stream.
inline void stream_after(device::stream_t waiter, device::stream_t first, int device, const char* what) {
  if (waiter == first) return;
  const c10::cuda::CUDAGuard on(static_cast<c10::DeviceIndex>(device));
  const device::event_t e = ordering_event(device);
  check_cuda(device::event_record(e, first), what, ": cudaEventRecord");
  check_cuda(device::stream_wait(waiter, e), what, ": cudaStreamWaitEvent");
}

inline device::stream_t torch_stream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

// The stream flexcomm's device backends are ordered with when given none: the legacy default one.
inline constexpr device::stream_t flexcomm_order = nullptr;

inline std::vector<std::int64_t> trailing(const std::vector<std::int64_t>& shape) {
  return {shape.begin() + (shape.empty() ? 0 : 1), shape.end()};
}
inline std::size_t elements_of(const std::vector<std::int64_t>& shape) {
  std::size_t n = 1;
  for (auto d : shape) n *= static_cast<std::size_t>(d);
  return n;
}
constexpr std::size_t device_alignment = 256;  // as cudaMalloc and torch's caching allocator align
}  // namespace detail

inline void flexcomm_after_torch(int device) {
  detail::stream_after(detail::flexcomm_order, detail::torch_stream(device), device,
                       "interop: order flexcomm after torch's current stream");
}

inline void torch_after_flexcomm(int device) {
  detail::stream_after(detail::torch_stream(device), detail::flexcomm_order, device,
                       "interop: order torch's current stream after flexcomm");
}

inline device_batches::device_batches(source next, torch::Device device)
    : source_(std::move(next)), device_(device.index() < 0 ? -1 : device.index()) {
  check(device.is_cuda(), "interop::device_batches", cat("batches go to a CUDA device, not ", device.str()));
  if (device_ < 0) device_ = c10::cuda::current_device();
}

inline std::optional<typed_batch> device_batches::next() {
  const c10::cuda::CUDAGuard on(static_cast<c10::DeviceIndex>(device_));
  if (!feed_) {
    // The slots hold the largest share this trainer gets: the whole member's batch at most (the
    // first step's is the full one; only an epoch's last may be shorter).
    pending_ = source_();
    if (!pending_) return std::nullopt;
    const auto samples = pending_->as<float>().shape(), labels = pending_->labels<std::int64_t>().shape();
    most_ = pending_->batch_samples();
    const auto most = static_cast<std::size_t>(most_);
    labels_at_ = flexcomm::detail::round_up(most * detail::elements_of(detail::trailing(samples)) * sizeof(float),
                                            detail::device_alignment);
    capacity_ = labels_at_ + most * detail::elements_of(detail::trailing(labels)) * sizeof(std::int64_t);
    void* pinned = nullptr;
    check_cuda(device::malloc_pinned(&pinned, capacity_ ? capacity_ : 1), "interop::device_batches: cudaMallocHost(",
               capacity_, " bytes)");
    pinned_.reset(static_cast<std::byte*>(pinned));
    feed_.emplace(packer_, capacity_, detail::torch_stream(device_));
  }
  const auto on_device = feed_->next();
  if (!on_device) {
    batch_.reset();
    example_ = {};
    return std::nullopt;
  }
  const auto options = torch::TensorOptions().device(torch::kCUDA, static_cast<c10::DeviceIndex>(device_));
  auto* base = const_cast<std::byte*>(on_device->bytes().data());
  example_ = {torch::from_blob(base, sample_shape_, options.dtype(torch::kFloat32)),
              torch::from_blob(base + labels_at_, label_shape_, options.dtype(torch::kInt64))};
  return batch_;
}

inline std::optional<device_batches::packed> device_batches::pack() {
  batch_ = pending_ ? std::exchange(pending_, std::nullopt) : source_();
  if (!batch_) return std::nullopt;
  const auto samples = batch_->as<float>();
  const auto labels = batch_->labels<std::int64_t>();
  const std::size_t sample_bytes = samples.numel() * sizeof(float), label_bytes = labels.numel() * sizeof(std::int64_t);
  const std::size_t total = labels_at_ + label_bytes;
  check(sample_bytes <= labels_at_ && total <= capacity_, "interop::device_batches",
        cat("step ", batch_->step(), ": ", batch_->samples(),
            " samples; the device slots hold the first step's batch of ", most_));
  std::byte* out = pinned_.get();
  if (sample_bytes) std::memcpy(out, samples.data(), sample_bytes);
  if (label_bytes) std::memcpy(out + labels_at_, labels.data(), label_bytes);
  sample_shape_ = samples.shape();
  label_shape_ = labels.shape();
  return packed{batch_->step(), span<const std::byte>(out, total)};
}

}  // namespace flexcomm::interop
#endif  // FLEXCOMM_TORCH_CUDA
