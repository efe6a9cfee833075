// README.md's "From the baseline to the streamlined pipeline", compiled and run as it is printed
// there (tests/snippets/check.py holds every C++ block of README.md and docs/ to the files of
// this folder). Built twice: STREAMLINED=0 takes the baseline's two lines, 1 the streamlined's;
// the code "unchanged below" is the same text in both.
#include <flexcomm/flexcomm.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fc = flexcomm;

namespace {

// The README's trainer stands for any model; this one is a test's: one weight per input
// position, a gradient that depends on the batch, an SGD step.
class Model {
 public:
  explicit Model(int member) : weights_(16, 0.1f * static_cast<float>(member + 1)), grad_(16) {}

  template <class Ready>
  void forward_backward(fc::span<const std::byte> input, Ready&& ready) {
    for (std::size_t i = 0; i < grad_.size(); ++i)
      grad_[i] = weights_[i] * static_cast<float>(input[i % input.size()]) / 255.f;
    ready(0, fc::span<float>(grad_));
  }
  void step() {
    for (std::size_t i = 0; i < weights_.size(); ++i) weights_[i] -= 0.01f * grad_[i];
  }
  std::vector<float> predict(const std::vector<float>& images) const {
    std::vector<float> out(images.size());
    for (std::size_t i = 0; i < images.size(); ++i) out[i] = images[i] * weights_[i % weights_.size()];
    return out;
  }

 private:
  std::vector<float> weights_, grad_;
};

}  // namespace

int main(int argc, char** argv) {
  fc::environment env{argc, argv};
#if STREAMLINED
  // streamlined: one producer broadcasts each batch, gradients averaged while backprop runs
  using Preset = fc::presets::single_broadcast<fc::overlapped_ring>;
  auto layout = fc::ensemble_layout::parse("producers=1 members=2,2,1,1 aggregator=1");
#else
  // baseline: every trainer preprocesses its own batches, gradients averaged after backward
  using Preset = fc::presets::baseline<>;
  auto layout = fc::ensemble_layout::parse("members=2,2,1,1");
#endif
  Preset::options options;
  options.feed.steps = 12;
  options.feed.shard_capacity = 32;
  auto loader = [](std::int64_t step, int shard, fc::span<std::byte> out) {
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::byte>((step * 31 + shard * 7 + i) % 251);
    return out.size();
  };
  const std::vector<float> my_slice_of_the_test_set(8, 0.5f);
  bool gathered_every_member = true;
  auto report = [&](const fc::gathered<float>& each) { gathered_every_member = each.member_counts.size() == 4; };

  // unchanged below
  Preset::pipeline pipe{env.world(), layout, Preset::configure(options)};
  pipe.run(loader,
           [&](auto& ctx) {                       // trainers
             Model model{ctx.member()};
             while (auto batch = ctx.feed().next()) {
               model.forward_backward(batch->bytes(), [&](int i, fc::span<float> g) { ctx.sync().ready(i, g); });
               ctx.sync().finish();
               model.step();
             }
             ctx.collect().submit(model.predict(my_slice_of_the_test_set));
           },
           [&](auto& ctx) {                       // the aggregator
             auto each = ctx.collect().template gather<float>();  // every member's predictions
             report(each);
           });

  return gathered_every_member ? 0 : 1;
}
