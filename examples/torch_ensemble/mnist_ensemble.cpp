// pytorch/examples' cpp/mnist/mnist.cpp, the upstream libtorch trainer, on Fashion-MNIST: a CNN,
// a mapped dataset (Normalize, Stack), SGD with momentum, a test DataLoader and a test after each
// epoch. mnist_ensemble.cpp is the same trainer ported to a flexcomm ensemble (docs/porting.md
// shows the diff). Upstream's code, except: the data directory, the epochs and the sizes come
// from the command line (CI trains on the first images: First), the lines are 120 columns, and
// the training set is read before the model (the port's producers load from it, build no model).
//
//   mkdir data; for f in /usr/share/datasets/fashion-mnist/*.gz; do gunzip -c $f > data/$(basename $f .gz); done
//   build/examples/torch_mnist --data data --epochs 1
#include <flexcomm/interop/torch_ensemble.hpp>
#include <torch/torch.h>

#include <boost/program_options.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "common/counts.hpp"

namespace fi = flexcomm::interop;
namespace po = boost::program_options;

// The batch size for training.
const int64_t kTrainBatchSize = 64;

// The batch size for testing.
const int64_t kTestBatchSize = 1000;

// After how many batches to log a new update with the loss value.
const int64_t kLogInterval = 10;

// Upstream's kDataRoot and kNumberOfEpochs, and how much of the data to use.
struct Settings {
  std::string data_root = "./data";  // Fashion-MNIST's idx files, gunzipped (MNIST's names)
  size_t epochs = 10;
  size_t train_images = 0, test_images = 0;  // the first N of each (0: all)
  fi::ensemble_options ensemble;
};

Settings settings(int argc, char** argv) {
  Settings s;
  po::options_description flags("pytorch/examples' MNIST trainer on Fashion-MNIST");
  flags.add_options()("data", po::value(&s.data_root), "the directory of the idx files")(
      "epochs", counts::at_least<1>(&s.epochs), "the number of epochs to train")(
      "train-images", counts::at_least<0>(&s.train_images), "train on the first N images (0: all)")(
      "test-images", counts::at_least<0>(&s.test_images), "test on the first N images (0: all)");
  flags.add_options()("preset", po::value(&s.ensemble.preset))("layout", po::value(&s.ensemble.layout));
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, flags), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    std::cerr << e.what() << "\n" << flags;
    std::exit(2);
  }
  return s;
}

// The first `count` examples of a dataset (0: all of them).
template <class Source>
class First : public torch::data::datasets::Dataset<First<Source>> {
 public:
  First(Source source, size_t count) : source_(std::move(source)), count_(count) {}
  torch::data::Example<> get(size_t index) override { return source_.get(index); }
  torch::optional<size_t> size() const override {
    const size_t all = source_.size().value();
    return count_ == 0 ? all : std::min(count_, all);
  }

 private:
  Source source_;
  size_t count_;
};

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

template <typename DataLoader>
void train(size_t epoch, Net& model, torch::Device device, DataLoader& data_loader,
           torch::optim::Optimizer& optimizer, size_t dataset_size) {
  model.train();
  size_t batch_idx = 0;
  for (auto& batch : data_loader) {
    auto data = batch.data.to(device), targets = batch.target.to(device);
    optimizer.zero_grad();
    auto output = model.forward(data);
    auto loss = torch::nll_loss(output, targets);
    AT_ASSERT(!std::isnan(loss.template item<float>()));
    loss.backward();
    optimizer.step();

    if (batch_idx++ % kLogInterval == 0) {
      std::printf("\rTrain Epoch: %ld [%5ld/%5ld] Loss: %.4f", epoch, batch_idx * kTrainBatchSize, dataset_size,
                  loss.template item<float>());
    }
  }
}

template <typename DataLoader>
void test(Net& model, torch::Device device, DataLoader& data_loader, size_t dataset_size) {
  torch::NoGradGuard no_grad;
  model.eval();
  double test_loss = 0;
  int32_t correct = 0;
  for (const auto& batch : data_loader) {
    auto data = batch.data.to(device), targets = batch.target.to(device);
    auto output = model.forward(data);
    fi::evaluated(output, targets);
    test_loss += torch::nll_loss(output, targets,
                                 /*weight=*/{}, torch::Reduction::Sum)
                     .template item<float>();
    auto pred = output.argmax(1);
    correct += pred.eq(targets).sum().template item<int64_t>();
  }

  test_loss /= dataset_size;
  std::printf("\nTest set: Average loss: %.4f | Accuracy: %.3f\n", test_loss,
              static_cast<double>(correct) / dataset_size);
}

auto main(int argc, char** argv) -> int {
  const Settings s = settings(argc, argv);
  flexcomm::environment env(argc, argv);
  auto train_dataset = First(torch::data::datasets::MNIST(s.data_root), s.train_images)
                           .map(torch::data::transforms::Normalize<>(0.1307, 0.3081))
                           .map(torch::data::transforms::Stack<>());
  const size_t train_dataset_size = train_dataset.size().value();
  fi::train_ensemble(env.world(), s.ensemble, fi::dataset_of(train_dataset, kTrainBatchSize, s.epochs), [&](auto& ctx) {

  torch::manual_seed(1 + ctx.member());

  torch::DeviceType device_type;
  if (torch::cuda::is_available()) {
    std::cout << "CUDA available! Training on GPU." << std::endl;
    device_type = torch::kCUDA;
  } else {
    std::cout << "Training on CPU." << std::endl;
    device_type = torch::kCPU;
  }
  torch::Device device(device_type);

  Net model;
  model.to(device);

  ctx.average_gradients(model);
  auto train_loader = ctx.loader();

  auto test_dataset = First(torch::data::datasets::MNIST(s.data_root, torch::data::datasets::MNIST::Mode::kTest),
                            s.test_images)
                          .map(torch::data::transforms::Normalize<>(0.1307, 0.3081))
                          .map(torch::data::transforms::Stack<>());
  const size_t test_dataset_size = test_dataset.size().value();
  auto test_loader = torch::data::make_data_loader(std::move(test_dataset), kTestBatchSize);

  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));

  for (size_t epoch = 1; epoch <= s.epochs; ++epoch) {
    train(epoch, model, device, *train_loader, optimizer, train_dataset_size);
    test(model, device, *test_loader, test_dataset_size);
  }
  }, fi::print_accuracies);
}
