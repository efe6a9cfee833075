// An ensemble of small CNNs on Fashion-MNIST in libtorch, shaped like PyTorch's C++ MNIST example:
// every member trains on every batch, and the members' test-set probabilities are averaged into
// the ensemble's. plain.cpp trains the members one after another; ensemble.cpp is the same trainer
// ported to flexcomm, its members training at once (docs/porting.md shows the diff).
//
//   build/examples/torch_ensemble_plain --epochs 1
//   mpiexec -n 5 build/examples/torch_ensemble --preset single_broadcast --epochs 1
//   (the members spread over the ranks after the preset's producers, the first trainer aggregating:
//   2,1,1 on 5 ranks with single_broadcast's producer, on 4 with the baseline's and all_shared's
//   none, on 6 with multi_broadcast's two; FLEXCOMM_LAYOUT gives another layout)
#include <flexcomm/interop/torch_ensemble.hpp>
#include <torch/torch.h>

#include <boost/program_options.hpp>

#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "common/counts.hpp"
#include "common/fashion_mnist.hpp"

namespace fi = flexcomm::interop;
namespace fm = fashion_mnist;
namespace po = boost::program_options;

struct Net : torch::nn::Module {
  Net()
      : conv1(torch::nn::Conv2dOptions(1, 10, /*kernel_size=*/5)),
        conv2(torch::nn::Conv2dOptions(10, 20, /*kernel_size=*/5)),
        fc1(320, 50),
        fc2(50, 10) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv2_drop", conv2_drop);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }

  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1->forward(x), 2));
    x = torch::relu(torch::max_pool2d(conv2_drop->forward(conv2->forward(x)), 2));
    x = x.view({-1, 320});
    x = torch::relu(fc1->forward(x));
    x = torch::dropout(x, /*p=*/0.5, /*training=*/is_training());
    x = fc2->forward(x);
    return torch::log_softmax(x, /*dim=*/1);
  }

  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Dropout2d conv2_drop;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};

struct Settings {
  int members = 3;
  std::string preset;
  int epochs = 1;
  std::int64_t batch_size = 64;
  std::size_t train_images = 0;  // 0: all 60000
};

// Members differ in seed and learning rate, so that their errors differ and averaging helps.
std::uint64_t seed_of(int member) { return 1000 + 7919 * static_cast<std::uint64_t>(member); }
double learning_rate_of(int member) { return 1e-3 * (1.0 + 0.25 * (member % 3)); }

// Random crop (pad 1), flip and a mild elastic distortion: the costly part of loading.
fm::augment_options augmentation() {
  fm::augment_options a;
  a.pad = 1;
  a.max_rotation_degrees = 0;
  a.elastic_alpha = 1.5f;
  return a;
}

// Fashion-MNIST's training images as a torch::data dataset: image `index` normalized and
// augmented, its augmentation drawn from the index, so it is the same wherever it is loaded.
class FashionMNIST : public torch::data::datasets::Dataset<FashionMNIST> {
 public:
  explicit FashionMNIST(std::size_t limit) : data_(fm::load(fm::split::train, fm::default_dir(), limit)) {}

  torch::data::Example<> get(std::size_t index) override {
    auto image = torch::empty({1, fm::rows, fm::cols});
    fm::augment(data_.image(index), image.data_ptr<float>(), fm::seed_of(0, index), augmentation());
    return {image, torch::tensor(static_cast<std::int64_t>(data_.labels[index]))};
  }
  torch::optional<std::size_t> size() const override { return data_.count; }

 private:
  fm::dataset data_;
};

struct TestSet {
  torch::Tensor images, labels;
};

TestSet test_set() {
  const auto raw = fm::load(fm::split::test);
  const auto count = static_cast<std::int64_t>(raw.count);
  TestSet test{torch::empty({count, 1, fm::rows, fm::cols}), torch::empty({count}, torch::kInt64)};
  for (std::int64_t i = 0; i < count; ++i) {
    const fm::augment_options normalize_only{0, false, 0.0f};
    fm::augment(raw.image(i), test.images[i].data_ptr<float>(), 0, normalize_only);
    test.labels[i] = static_cast<std::int64_t>(raw.labels[i]);
  }
  return test;
}

// Trains member `member` on every batch and returns its class probabilities on `test_images`.
torch::Tensor train_member(int member, fi::trainer& ctx, const Settings& s, const torch::Tensor& test_images) {
  torch::manual_seed(seed_of(member));
  Net model;
  torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(learning_rate_of(member)));
  ctx.average_gradients(model);
  auto loader = ctx.loader();
  model.train();
  for (int epoch = 1; epoch <= s.epochs; ++epoch) {
    std::int64_t step = 0;
    for (auto& batch : *loader) {
      auto data = batch.data, target = batch.target;
      optimizer.zero_grad();
      torch::Tensor loss = torch::nll_loss(model.forward(data), target);
      loss.backward();
      optimizer.step();
      if (++step % 200 == 0)
        std::printf("member %d epoch %d step %lld loss %.4f\n", member, epoch, static_cast<long long>(step),
                    loss.item<double>());
    }
  }
  model.eval();
  torch::NoGradGuard no_grad;
  return torch::exp(model.forward(test_images));
}

// Each member's accuracy and a fingerprint of its predictions (equal fingerprints: the same
// member), then the ensemble's: the members' probabilities averaged.
void report(const std::vector<torch::Tensor>& members, const torch::Tensor& labels) {
  for (std::size_t m = 0; m < members.size(); ++m) {
    const auto p = members[m].contiguous();
    std::uint64_t hash = 14695981039346656037ull;
    const auto* bytes = static_cast<const unsigned char*>(p.data_ptr());
    for (std::size_t i = 0; i < static_cast<std::size_t>(p.nbytes()); ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
    std::printf("member %zu: test accuracy %.2f%%, predictions %016llx\n", m,
                100 * p.argmax(1).eq(labels).to(torch::kFloat64).mean().item<double>(),
                static_cast<unsigned long long>(hash));
  }
  const auto ensemble = torch::stack(members).mean(0);
  const double accuracy = ensemble.argmax(1).eq(labels).to(torch::kFloat64).mean().item<double>();
  std::printf("ensemble: test accuracy %.2f%%\n", 100 * accuracy);
}

int main(int argc, char** argv) {
  flexcomm::environment env(argc, argv);
  torch::set_num_threads(1);
  Settings s;
  po::options_description flags("an ensemble of CNNs on Fashion-MNIST");
  flags.add_options()("members", counts::at_least<1>(&s.members), "members of the ensemble")(
      "epochs", counts::at_least<1>(&s.epochs), "epochs")(
      "preset", po::value(&s.preset)->default_value("single_broadcast"), "pipeline preset")(
      "batch-size", counts::at_least<1>(&s.batch_size), "images per step")(
      "train-images", counts::at_least<0>(&s.train_images), "use the first N training images (0: all)");
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, flags), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    std::cerr << e.what() << "\n" << flags;
    return 2;
  }

  FashionMNIST train_set(s.train_images);
  const auto test = test_set();
  fi::train_ensemble(env.world(), {s.preset, s.members}, fi::dataset_of(train_set, s.batch_size, s.epochs), test.images,
      [&](fi::trainer& ctx, const torch::Tensor& images) { return train_member(ctx.member(), ctx, s, images); },
      [&](const std::vector<torch::Tensor>& members) { report(members, test.labels); });
}
