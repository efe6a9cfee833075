// docs/tracing.md's blocks, compiled as they are printed (tests/snippets/check.py).
#include <flexcomm/flexcomm.hpp>
namespace trace = flexcomm::trace;

template <class Model, class Feed, class Sync>
void train(const flexcomm::mpi::communicator& world, Model& model, Feed& feed, Sync& sync) {
  trace::start(world, "trace-out");              // collective: aligns clocks to rank 0
  while (auto batch = feed.next()) {
    const auto step = batch->step();
    { trace::span s(trace::names::forward, step);  model.forward(batch->bytes()); }
    { trace::span s(trace::names::backward, step); model.backward(sync); sync.finish(); }
    { trace::span s(trace::names::update, step);   model.step(); }
  }
  trace::stop();                                  // writes this rank's file (trace::flush() writes and goes on)
}

#include <flexcomm/core/gaps.hpp>

#include <cstddef>
#include <vector>

namespace {

struct tiny_model {
  void forward(flexcomm::span<const std::byte>) {}
  template <class Sync>
  void backward(Sync& sync) {
    sync.ready(0, flexcomm::span<float>(grad));
  }
  void step() {}
  std::vector<float> grad = std::vector<float>(4, 1.f);
};

void checkpoint_in_gaps(std::vector<float>& host_copy, const std::vector<float>& params, std::size_t bytes,
                        void (*train_one_step)()) {
  auto checkpoint = flexcomm::copy_in_gaps(host_copy.data(), params.data(), bytes);  // 64 KiB chunks
  train_one_step();       // forward, backward, sync.finish(): flexcomm's waits run the copy's chunks
  checkpoint->finish();   // before the parameters change: runs whatever is left, here, now
}

}  // namespace

template void train<tiny_model, flexcomm::one_to_many<flexcomm::mpi>, flexcomm::overlapped_ring<flexcomm::mpi>>(
    const flexcomm::mpi::communicator&, tiny_model&, flexcomm::one_to_many<flexcomm::mpi>&,
    flexcomm::overlapped_ring<flexcomm::mpi>&);

int main() {
  std::vector<float> params(1000, 1.f), host_copy(1000);
  checkpoint_in_gaps(host_copy, params, params.size() * sizeof(float), [] {});
  return host_copy == params ? 0 : 1;
}
