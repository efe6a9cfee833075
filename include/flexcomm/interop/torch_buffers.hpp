// A member's module buffers (BatchNorm's running_mean, running_var, num_batches_tracked) kept
// equal over its ranks: each rank's forward updates them from its own share of the batch, so
// replicas drift apart unless a step makes them one again, as DistributedDataParallel's
// broadcast_buffers does before each forward. And the broadcast of a member's whole state (its
// parameters and buffers) from its first rank that makes the replicas equal before training.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "../backend/contract.hpp"
#include "../core/error.hpp"
#include "torch.hpp"

namespace flexcomm::interop {

// How a trainer keeps its modules' buffers equal within a member, at each step (before the
// step's forward) and at the end of each epoch (before its test): ensemble_options::buffers.
enum class buffers {
  broadcast,  // the member's first rank's (DistributedDataParallel's default)
  average,    // float32/float64 buffers averaged over the member's ranks; the others (counts) broadcast
  off,        // each rank keeps its own
};

namespace detail {
// Every tensor's elements from rank 0 of `member` (a communicator of host backend B), packed into
// one message (CUDA tensors through host memory); collective, each rank holding tensors of the
// same shapes and types in one order.
template <class B>
void broadcast_state(const typename B::communicator& member, const std::vector<torch::Tensor>& state,
                            const std::string& what) {
  if (member.size() < 2 || state.empty()) return;
  torch::NoGradGuard plain;
  std::vector<std::size_t> at;
  std::size_t total = 0;
  for (const auto& t : state) {
    at.push_back(total);
    total += (static_cast<std::size_t>(t.numel() * t.element_size()) + 7) / 8 * 8;  // each 8-aligned
  }
  auto bytes = torch::empty({static_cast<std::int64_t>(total)}, torch::kUInt8);
  auto* base = bytes.data_ptr<std::uint8_t>();
  if (member.rank() == 0) {
    for (std::size_t i = 0; i < state.size(); ++i) {
      const torch::Tensor host = state[i].to(torch::kCPU).contiguous();
      std::memcpy(base + at[i], host.data_ptr(), static_cast<std::size_t>(host.numel() * host.element_size()));
    }
  }
  B::ibcast(member, elements<std::uint8_t>(bytes, what), 0).wait();
  if (member.rank() == 0) return;
  for (std::size_t i = 0; i < state.size(); ++i)
    state[i].copy_(torch::from_blob(base + at[i], state[i].sizes(), state[i].options().device(torch::kCPU)));
}

// The mean over `member` of tensors of one floating type T, in one allreduce.
template <class B, class T>
void average_state(const typename B::communicator& member, const std::vector<torch::Tensor>& state, const std::string& what) {
  if (state.empty()) return;
  torch::NoGradGuard plain;
  std::vector<torch::Tensor> flat;
  for (const auto& t : state) flat.push_back(t.to(torch::kCPU).reshape({-1}));
  torch::Tensor sum = torch::cat(flat);
  B::iallreduce(member, elements<T>(sum, what), op::sum).wait();
  sum.div_(member.size());
  std::int64_t at = 0;
  for (const auto& t : state) {
    t.copy_(sum.narrow(0, at, t.numel()).view(t.sizes()));
    at += t.numel();
  }
}

// The buffers of a trainer's modules, made equal over the member at each step(): one broadcast
// of them all, or (buffers::average) one allreduce per floating type and one broadcast of the
// rest. Nothing at all for a member of one rank, modules without buffers, or buffers::off.
template <class B>
class buffer_sync {
 public:
  explicit buffer_sync(buffers how) : how_(how) {}

  // Collective over `member` (each rank adds the same modules' buffers in one order): the first
  // buffers make the private communicator the steps use. A buffer added before is skipped.
  void add(const typename B::communicator& member, const std::vector<torch::Tensor>& more) {
    if (how_ == buffers::off || member.size() < 2) return;
    for (const auto& b : more) {
      if (!b.defined() || !seen_.insert(b.unsafeGetTensorImpl()).second) continue;
      const auto type = b.scalar_type();
      if (how_ == buffers::average && b.is_floating_point()) {
        check(type == torch::kFloat32 || type == torch::kFloat64, "interop::trainer: average_gradients",
              cat("buffers::average averages float32 and float64 buffers; this module has one of ", c10::toString(type),
                  " (buffers::broadcast keeps it equal)"));
        (type == torch::kFloat32 ? floats_ : doubles_).push_back(b);
      } else {
        others_.push_back(b);
      }
    }
    if (!comm_ && !(floats_.empty() && doubles_.empty() && others_.empty()))
      comm_.emplace(member.dup(cat(member.name(), " torch buffers")));
  }

  // Collective over the member: its ranks' buffers equal again.
  void step() {
    if (!comm_) return;
    const std::string what = "interop::trainer: the modules' buffers";
    average_state<B, float>(*comm_, floats_, what);
    average_state<B, double>(*comm_, doubles_, what);
    broadcast_state<B>(*comm_, others_, what);
  }

 private:
  buffers how_;
  std::unordered_set<const void*> seen_;
  std::vector<torch::Tensor> floats_, doubles_, others_;  // others_: every buffer under broadcast
  // A duplicate of the member's: the trainer's own traffic on it never meets the buffers'.
  std::optional<typename B::communicator> comm_;
};
}  // namespace detail

}  // namespace flexcomm::interop
