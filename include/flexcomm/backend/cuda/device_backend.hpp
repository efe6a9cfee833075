// What the device backends over MPI ranks (nccl, staged) declare alike about themselves
// (contract.hpp): buffers and scratch space in device memory, local work as kernels on the stream,
// and the host backend beside them, which also says which ranks share a host.
#pragma once

#include <string>

#include "../../core/hosts.hpp"
#include "../contract.hpp"
#include "capture.hpp"
#include "device_buffer.hpp"
#include "local_work.hpp"

namespace flexcomm::cuda {

// A device backend derives from it, naming the host backend its communicators are built over.
template <class HostBackend>
struct device_backend : device_work {
  static constexpr memory_space memory = memory_space::device;
  // Carries an adapter's checks and a preset's feed and collect (contract.hpp: host_backend_t).
  using host_backend = HostBackend;
  // An adapter's own scratch space, in device memory like every buffer of the backend.
  template <class T>
  using buffer = device_buffer<T>;

  // CUDA graphs (contract.hpp): a stream may be capturing; whether a graph can replay the
  // backend's operations is its own to say (nccl can; staged, which goes through the host, not).
  static constexpr bool graph_capturable = false;
  static bool capturing(device::stream_t s, const std::string& what) { return cuda::capturing(s, what); }

  // Collective over `comm`: which of its ranks share a host, asked of its twin on the host backend.
  template <class Communicator>
  static host_map hosts(const Communicator& comm) {
    return host_backend::hosts(comm.control());
  }
};

}  // namespace flexcomm::cuda
