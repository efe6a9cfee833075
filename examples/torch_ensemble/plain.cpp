// An ensemble of small CNNs on Fashion-MNIST in plain libtorch, shaped like PyTorch's C++ MNIST
// example: each member is trained in turn, on batches it decodes and augments itself, and the
// members' test-set probabilities are averaged into the ensemble's. ensemble.cpp is the same
// trainer ported to flexcomm; docs/porting.md shows the diff.
//
//   build/examples/torch_ensemble_plain --members 3 --epochs 1
#include <torch/torch.h>

#include <boost/program_options.hpp>

#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "common/fashion_mnist.hpp"

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
  int epochs = 1;
  std::int64_t batch_size = 64;
  std::size_t train_images = 0;  // 0: all 60000
};

// Members differ in seed and learning rate, so that their errors differ and averaging helps.
std::uint64_t seed_of(int member) { return 1000 + 7919 * static_cast<std::uint64_t>(member); }
double learning_rate_of(int member) { return 1e-3 * (1.0 + 0.25 * (member % 3)); }

// The training set, read on first use and kept deflated in blocks, as a record file would be.
const fm::packed_dataset& training_set(const Settings& s) {
  static const fm::packed_dataset data(fm::load(fm::split::train, fm::default_dir(), s.train_images));
  return data;
}

// Random crop (pad 1), flip and a mild elastic distortion: the costly part of each step.
fm::augment_options augmentation() {
  fm::augment_options a;
  a.pad = 1;
  a.max_rotation_degrees = 0;
  a.elastic_alpha = 1.5f;
  return a;
}

// Samples as fashion_mnist.hpp packs them (pixels, then the label) seen as an image batch and
// its targets, without a copy: the tensors are views of `samples`.
std::pair<torch::Tensor, torch::Tensor> as_tensors(const fm::sample* samples, std::int64_t n) {
  auto* first = const_cast<fm::sample*>(samples);
  const std::int64_t stride = fm::sample_bytes / sizeof(float);
  auto images = torch::from_blob(first->pixel, {n, 1, fm::rows, fm::cols}, {stride, fm::pixels, fm::cols, 1});
  auto labels = torch::from_blob(&first->label, {n}, {stride}, torch::kInt32);
  return {images, labels.to(torch::kInt64)};
}

struct TestSet {
  torch::Tensor images, labels;
};

TestSet test_set() {
  const auto raw = fm::load(fm::split::test);
  std::vector<fm::sample> samples(raw.count);
  for (std::size_t i = 0; i < raw.count; ++i) {
    fm::augment(raw.image(i), samples[i].pixel, 0, fm::augment_options{0, false, 0.0f});  // normalize only
    samples[i].label = raw.labels[i];
  }
  auto [images, labels] = as_tensors(samples.data(), static_cast<std::int64_t>(raw.count));
  return {images.contiguous(), labels};
}

// Trains member `member` and returns its class probabilities on `test_images`.
torch::Tensor train_member(int member, const Settings& s, const torch::Tensor& test_images) {
  torch::manual_seed(seed_of(member));
  Net model;
  torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(learning_rate_of(member)));
  const std::int64_t steps = s.epochs * (static_cast<std::int64_t>(training_set(s).count()) / s.batch_size);
  std::vector<fm::sample> samples(static_cast<std::size_t>(s.batch_size));
  model.train();
  for (std::int64_t step = 0; step < steps; ++step) {
    fm::make_samples(training_set(s), step, samples.size(), 0, samples.size(), samples.data(), augmentation());
    auto [data, target] = as_tensors(samples.data(), s.batch_size);
    optimizer.zero_grad();
    auto loss = torch::nll_loss(model.forward(data), target);
    loss.backward();
    optimizer.step();
    if ((step + 1) % 200 == 0)
      std::printf("member %d step %lld/%lld loss %.4f\n", member, static_cast<long long>(step + 1),
                  static_cast<long long>(steps), loss.item<double>());
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
    for (std::size_t i = 0; i < static_cast<std::size_t>(p.numel()) * sizeof(float); ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
    std::printf("member %zu: test accuracy %.2f%%, predictions %016llx\n", m,
                100 * p.argmax(1).eq(labels).to(torch::kFloat64).mean().item<double>(),
                static_cast<unsigned long long>(hash));
  }
  const auto ensemble = torch::stack(members).mean(0);
  std::printf("ensemble: test accuracy %.2f%%\n", 100 * ensemble.argmax(1).eq(labels).to(torch::kFloat64).mean().item<double>());
}

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  Settings s;
  po::options_description flags("an ensemble of CNNs on Fashion-MNIST");
  flags.add_options()("members", po::value(&s.members)->default_value(3), "members of the ensemble")(
      "epochs", po::value(&s.epochs)->default_value(1), "epochs")(
      "batch-size", po::value(&s.batch_size)->default_value(64), "images per step")(
      "train-images", po::value(&s.train_images)->default_value(0), "use the first N training images (0: all)");
  po::variables_map vm;
  po::store(po::parse_command_line(argc, argv, flags), vm);
  po::notify(vm);

  const auto test = test_set();
  std::vector<torch::Tensor> members;
  for (int member = 0; member < s.members; ++member) members.push_back(train_member(member, s, test.images));
  report(members, test.labels);
}
