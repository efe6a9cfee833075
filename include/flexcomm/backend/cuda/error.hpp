// CUDA return codes as flexcomm::error, and the few RAII handles the device backends share
// (events, streams, pinned host memory), so no CUDA failure passes unchecked or leaks. Written
// over the device layer (runtime.hpp): the same on a GPU and on the host stand-in.
#pragma once

#include <cstddef>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/mutex.hpp"
#include "../../core/progress.hpp"
#include "runtime.hpp"

namespace flexcomm {

// Turns a CUDA runtime return code into a flexcomm::error naming the operation, given as one
// piece or several that are joined (cat) only on failure: the calls of every operation check
// their codes, and a name formatted for each of them would cost more than the call.
template <class... Operation>
void check_cuda(device::error_t code, const Operation&... operation) {
  if (code != device::success) fail(cat(operation...), cat(device::error_name(code), ": ", device::error_string(code)));
}

// True when this process sees at least one CUDA device (false without a driver, too).
inline bool cuda_device_present() {
  int devices = 0;
  if (device::device_count(&devices) != device::success) {
    device::last_error();  // clear the sticky "no device" state for later calls
    return false;
  }
  return devices > 0;
}

namespace cuda {

// Makes `device` current on this thread for the guard's life, and then the previous one again,
// but only where that one's context is open: a thread that never chose a device reads device 0,
// and setting it back would open a context there (cudaSetDevice does since CUDA 12), on a GPU
// this process does not use. PyTorch's device guards keep the same rule.
class device_guard {
 public:
  device_guard(int device, const std::string& what) {
    check_cuda(device::get_device(&previous_), what, ": cudaGetDevice");
    if (previous_ != device) check_cuda(device::set_device(device), what, ": cudaSetDevice(", device, ")");
    else previous_ = -1;
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() {
    bool open = false;
    if (previous_ >= 0 && device::has_context(previous_, &open) == device::success && open)
      device::set_device(previous_);
  }

 private:
  int previous_ = -1;
};

// The device current on this thread (a new thread's is device 0).
inline int current_device(const std::string& what) {
  int d = 0;
  check_cuda(device::get_device(&d), what, ": cudaGetDevice");
  return d;
}

// Puts the progress engine's thread on `device`, where a backend made on this thread runs its
// work: the engine drives that backend's operations, kernels and copies, and a thread's device is
// device 0 until it sets one. With one device per process (one rank per GPU) this is every
// device call the engine makes; each operation also guards its own communicator's device.
inline void engine_on_device(int device) {
  progress_engine::instance().submit(
      [device] {
        int now = -1;
        if (device::get_device(&now) == device::success && now != device) device::set_device(device);
        return true;
      },
      cat("progress engine: work on device ", device));
}

// Move-only owner of one runtime handle (an event, a stream), destroyed with `Destroy`.
// Destroyed on the device it was made on, whichever thread lets it go (the progress engine's,
// often): a destroy runs on the current device's context and would open one there.
template <class Handle, device::error_t (*Destroy)(Handle)>
class owned_handle {
 public:
  owned_handle() = default;
  owned_handle(owned_handle&& o) noexcept : handle_(std::exchange(o.handle_, nullptr)), device_(o.device_) {}
  owned_handle& operator=(owned_handle&& o) noexcept {
    std::swap(handle_, o.handle_);
    std::swap(device_, o.device_);
    return *this;
  }
  owned_handle(const owned_handle&) = delete;
  owned_handle& operator=(const owned_handle&) = delete;
  ~owned_handle() {
    if (!handle_) return;
    try {
      device_guard guard(device_, "destroy a CUDA handle");
      Destroy(handle_);
    } catch (...) {  // the device is gone: nothing left to free
    }
  }
  Handle get() const noexcept { return handle_; }
  explicit operator bool() const noexcept { return handle_ != nullptr; }

 protected:
  Handle handle_ = nullptr;
  int device_ = 0;  // current when it was made
};

// A timing-free event: the cheapest marker of "the stream got this far".
class event : public owned_handle<device::event_t, &device::event_destroy> {
 public:
  static event create(const std::string& what) {
    event e;
    e.device_ = current_device(what);
    check_cuda(device::event_create(&e.handle_), what, ": cudaEventCreate");
    return e;
  }

  void record(device::stream_t stream, const std::string& what) {
    check_cuda(device::event_record(handle_, stream), what, ": cudaEventRecord");
  }
  // True once reached; a failure of the work before it is an error.
  bool done(const std::string& what) const {
    const device::error_t rc = device::event_query(handle_);
    if (rc == device::not_ready) return false;
    check_cuda(rc, what, ": cudaEventQuery");
    return true;
  }
};

// An owned stream. By default it is ordered with the legacy default stream, so a trainer that
// never names a stream still sees communication ordered with its kernels.
class stream_handle : public owned_handle<device::stream_t, &device::stream_destroy> {
 public:
  // non_blocking: not ordered with the legacy default stream (cudaStreamNonBlocking).
  static stream_handle create(const std::string& what, bool non_blocking = false) {
    stream_handle s;
    s.device_ = current_device(what);
    check_cuda(device::stream_create(&s.handle_, non_blocking), what, ": cudaStreamCreate");
    return s;
  }
};

// Reached events, kept for the next operations of a communicator: an event created and destroyed
// per operation costs runtime calls (and microseconds) each time, a reused one nothing. Only an
// event whose work is done is given back; recording it again captures the new point. Every event
// given back is kept: the pool holds as many as were ever in flight at once, so a burst of
// operations creates events once, not at every burst.
class event_pool {
 public:
  event take(const std::string& what) {
    {
      std::lock_guard<flexcomm::mutex> lock(mutex_);
      if (!spare_.empty()) {
        event e = std::move(spare_.back());
        spare_.pop_back();
        return e;
      }
    }
    return event::create(what);
  }
  void give_back(event& e) {
    if (!e) return;
    std::lock_guard<flexcomm::mutex> lock(mutex_);
    spare_.push_back(std::move(e));
  }

 private:
  flexcomm::mutex mutex_;
  std::vector<event> spare_;
};

}  // namespace cuda
}  // namespace flexcomm
