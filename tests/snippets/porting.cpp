// docs/porting.md's "Other shapes": a data-parallel MPI trainer ported (main's body below), a
// trainer of two modules and two optimizers (two_modules), compiled and run at 1-4 ranks (suite
// mpi) as they are printed there (tests/snippets/check.py). Checked here: the data-parallel
// trainer learns (its members' last accuracy), and each member's first rank wrote its checkpoint.
#include <flexcomm/interop/torch_ensemble.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

namespace fi = flexcomm::interop;

namespace {

constexpr std::int64_t kBatch = 64;
constexpr int kEpochs = 3;

// Two classes of points in the plane, around (-1, -1) and (1, 1); sample i is the same wherever
// it is loaded (a producer, or each trainer).
struct Points : torch::data::datasets::Dataset<Points> {
  Points(std::size_t n, std::uint64_t seed) : n_(n), seed_(seed) {}
  torch::data::Example<> get(std::size_t i) override {
    auto generator = torch::make_generator<at::CPUGeneratorImpl>(seed_ * 1'000'003 + i);
    const auto label = static_cast<std::int64_t>(i % 2);
    return {torch::randn({2}, generator) * 0.7 + (label == 1 ? 1.0 : -1.0), torch::tensor(label)};
  }
  torch::optional<std::size_t> size() const override { return n_; }

 private:
  std::size_t n_;
  std::uint64_t seed_;
};

struct Net : torch::nn::Module {
  Net()
      : fc1(register_module("fc1", torch::nn::Linear(2, 16))), fc2(register_module("fc2", torch::nn::Linear(16, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::log_softmax(fc2->forward(torch::relu(fc1->forward(x))), 1);
  }
  torch::nn::Linear fc1, fc2;
};

double last_accuracy = 1;  // of the last test this rank ran

template <typename DataLoader>
void test(Net& model, DataLoader& loader, int epoch) {
  torch::NoGradGuard no_grad;
  std::int64_t correct = 0, samples = 0;
  for (const auto& batch : loader) {
    auto output = model.forward(batch.data);
    fi::evaluated(output, batch.target);
    correct += output.argmax(1).eq(batch.target).sum().template item<std::int64_t>();
    samples += batch.target.size(0);
  }
  last_accuracy = static_cast<double>(correct) / static_cast<double>(samples);
  std::printf("Test epoch %d: accuracy %.3f\n", epoch, last_accuracy);
}

// The trainer of two modules; true where this rank's member's checkpoint was written and reads back.
bool two_modules(const flexcomm::mpi::communicator& world) {
  auto train_set = Points(1024, 1).map(torch::data::transforms::Stack<>());
  fi::ensemble_options options;
  options.buffers = fi::buffers::broadcast;  // the default (DistributedDataParallel's rule); or average, or off
  fi::train_ensemble(world, options, fi::dataset_of(train_set, kBatch, kEpochs), [&](fi::trainer& ctx) {
    torch::manual_seed(1 + ctx.member());
    torch::nn::Sequential encoder(torch::nn::Linear(2, 16), torch::nn::BatchNorm1d(16), torch::nn::ReLU());
    torch::nn::Linear head(16, 2);
    ctx.average_gradients(*encoder);  // the member's Sync
    ctx.average_gradients(*head);     // a Sync of its own: head steps with its own optimizer
    torch::optim::Adam encoder_optimizer(encoder->parameters(), torch::optim::AdamOptions(1e-2));
    torch::optim::SGD head_optimizer(head->parameters(), torch::optim::SGDOptions(0.1));
    auto loader = ctx.loader();  // after every average_gradients()
    for (int epoch = 1; epoch <= kEpochs; ++epoch) {
      for (auto& batch : *loader) {
        encoder_optimizer.zero_grad();
        head_optimizer.zero_grad();
        torch::nll_loss(torch::log_softmax(head->forward(encoder->forward(batch.data)), 1), batch.target).backward();
        encoder_optimizer.step();
        head_optimizer.step();
      }
      if (ctx.reports()) torch::save(encoder, "encoder-" + std::to_string(ctx.member()) + ".pt");
    }
  }, [](const fi::evaluation&) {});
  // This rank's member (none on a producer); every checkpoint is written before any is read or removed.
  const auto role = fi::ensemble_choice(world.size(), options).layout.role_of(world.rank());
  const int member = role.kind == flexcomm::role::trainer ? role.member : -1;
  const std::string path = "encoder-" + std::to_string(member) + ".pt";
  MPI_Barrier(MPI_COMM_WORLD);
  bool ok = true;
  if (member >= 0) {
    torch::nn::Sequential read(torch::nn::Linear(2, 16), torch::nn::BatchNorm1d(16), torch::nn::ReLU());
    torch::load(read, path);
    ok = read->parameters().size() == 4;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (member >= 0 && role.rank_in_member == 0) std::filesystem::remove(path);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);  // ranks outnumber cores in CI
  flexcomm::environment env(argc, argv);  // MPI_Init here, MPI_Finalize when main returns
  auto train_set = Points(1024, 1).map(torch::data::transforms::Stack<>());
  auto data = fi::dataset_of(train_set, kBatch, kEpochs);
  data.shuffle = true;  // each epoch in an order drawn from (seed, epoch), the same for every member
  data.seed = 7;
  fi::ensemble_options options;  // preset and layout: FLEXCOMM_PRESET, FLEXCOMM_LAYOUT (or set here)
  fi::train_ensemble(env.world(), options, data, [&](fi::trainer& ctx) {
    torch::manual_seed(1 + ctx.member());  // one member: seed 1, as before
    Net model;
    ctx.average_gradients(model);  // the MPI_Allreduce loop's work, inside backward()
    torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.1));
    auto loader = ctx.loader();  // this rank's share of each of the member's batches
    auto test_loader = torch::data::make_data_loader(Points(256, 2).map(torch::data::transforms::Stack<>()), kBatch);
    for (int epoch = 1; epoch <= kEpochs; ++epoch) {
      for (auto& batch : *loader) {
        optimizer.zero_grad();
        torch::nll_loss(model.forward(batch.data), batch.target).backward();
        optimizer.step();
      }
      if (ctx.reports()) test(model, *test_loader, epoch);
    }
  }, fi::print_accuracies);

  const bool learned = last_accuracy > 0.8;  // the points are about 98% separable
  const bool saved = two_modules(env.world());
  if (!learned)
    std::fprintf(stderr, "rank %d: accuracy %.3f after %d epochs\n", env.world().rank(), last_accuracy, kEpochs);
  if (!saved) std::fprintf(stderr, "rank %d: no checkpoint of its member\n", env.world().rank());
  return learned && saved ? 0 : 1;
}
