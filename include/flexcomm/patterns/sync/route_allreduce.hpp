// The backend-allreduce route: each bucket is averaged by the backend's own nonblocking
// allreduce (NCCL's ring on nccl), subgroup_allreduce's flat route, and its leg across the host
// leaders when averaging in tiers.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "../../backend/contract.hpp"
#include "../../core/hosts.hpp"
#include "../../core/progress.hpp"
#include "../../core/reduce.hpp"
#include "../../core/span.hpp"
#include "flight.hpp"
#include "options.hpp"

namespace flexcomm::detail {

template <class B>
class allreduce_route {
 public:
  static constexpr flat_algorithm algorithm = flat_algorithm::backend_allreduce;

  static void check_options(const sync_options&, const std::string&) {}
  explicit allreduce_route(const sync_options&) {}

  // One bucket on `comm`, on stream `s` (device backends; unnamed: the communicator's own):
  // driven by the progress engine when launched as it fills (`on_engine`), else ended by the
  // trainer in finish().
  template <class T>
  flight<B> launch(const typename B::communicator& comm, T* data, std::size_t count, op o, bool on_engine,
                   typename B::stream s = {}) {
    flight<B> f;
    auto request = B::iallreduce(comm, span<T>(data, count), o, s);
    if (on_engine) {
      auto shared = std::make_shared<typename B::request>(std::move(request));
      f.task = progress_engine::instance().submit([shared] { return shared->test(); }, shared->what());
    } else {
      f.request.emplace(std::move(request));
    }
    return f;
  }

  // The leg across the host leaders (host_tiers' `across`): the allreduce is posted on the
  // engine's thread at its first poll, in bucket order, whether the bucket was launched when full
  // or in finish().
  template <class T>
  struct leg {
    const typename B::communicator* leaders;
    T* data;
    std::size_t count;
    op o;
    std::optional<typename B::request> across;
    bool poll() {
      if (!across) across.emplace(B::iallreduce(*leaders, span<T>(data, count), o));
      return across->test();
    }
  };
  template <class T>
  leg<T> cross(const typename B::communicator& leaders, bool, T* data, std::size_t count, op o) {
    return {&leaders, data, count, o, std::nullopt};
  }
};

}  // namespace flexcomm::detail
