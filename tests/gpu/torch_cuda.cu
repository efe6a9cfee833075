// flexcomm/interop/torch.hpp on CUDA tensors (interop/torch_cuda.hpp): the two stream orders a
// handover needs; a CUDA module's gradients averaged over each member's ranks (members of
// different sizes) by subgroup_allreduce<nccl>, subgroup_allreduce<staged> and
// overlapped_ring<staged>, in place on the device, with torch on its default stream or on one of
// its own; typed batches delivered into device memory and intact while the GPU lags behind; and
// train_ensemble making the device Sync for a CUDA module. Built by nvcc against a CUDA libtorch
// (tests/gpu/torch_cuda.sh, or Meson's -Dtorch_cuda=PATH); exits 77 where no GPU is present.
// Two ranks sharing a GPU run it through tests/gpu/nccl_env.sh.
#define BOOST_TEST_MODULE gpu_torch_cuda
#include "gpu_fixture.hpp"

#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <flexcomm/interop/torch.hpp>
#include <flexcomm/interop/torch_ensemble.hpp>

#include <boost/mpl/list.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "../errors.hpp"

static_assert(FLEXCOMM_TORCH_CUDA, "build against a CUDA libtorch with FLEXCOMM_HAVE_CUDA=1 (tests/gpu/torch_cuda.sh)");

namespace fc = flexcomm;
namespace fi = flexcomm::interop;
using fc::testing::all_ranks;
using fc::testing::contains;
using fc::testing::error_of;
using fc::testing::world;

namespace {

// About 0.05 s of a spinning kernel at 2 GHz: the stream it runs on lags behind the host.
constexpr std::int64_t lag = 100'000'000;

int member_of(int rank, int n) { return rank < (n + 1) / 2 ? 0 : 1; }

torch::Device gpu() { return {torch::kCUDA, c10::cuda::current_device()}; }

// Two layers with a parameter that no forward uses when `skip` (as tests/mpi/torch.cpp).
struct net : torch::nn::Module {
  net() {
    first = register_module("first", torch::nn::Linear(5, 4));
    second = register_module("second", torch::nn::Linear(4, 3));
    spare = register_parameter("spare", torch::ones({2}));
  }
  torch::Tensor forward(const torch::Tensor& x, bool skip) {
    auto y = second->forward(torch::tanh(first->forward(x)));
    return skip ? y : y + spare.sum();
  }
  torch::nn::Linear first{nullptr}, second{nullptr};
  torch::Tensor spare;
};

void copy_parameters(net& to, const net& from) {
  torch::NoGradGuard plain;
  auto t = to.parameters();
  auto f = from.parameters();
  for (std::size_t i = 0; i < t.size(); ++i) t[i].copy_(f[i]);
}

// Rank r's input and target at a step, on the model's device.
torch::Tensor loss_of(net& model, int rank, int step, bool skip) {
  auto generator = torch::make_generator<at::CPUGeneratorImpl>(1000 * rank + 10 * step);
  const auto device = model.first->weight.device();
  const auto x = torch::randn({6, 5}, generator).to(device);
  const auto target = torch::randn({6, 3}, generator).to(device);
  return torch::mse_loss(model.forward(x, skip), target);
}

// The member's mean gradient at a step from weights `start`, computed on the CPU for every rank.
std::vector<torch::Tensor> expected(const net& start, const std::vector<int>& ranks, int step, bool skip) {
  std::vector<torch::Tensor> sum;
  for (int r : ranks) {
    net copy;
    copy_parameters(copy, start);
    loss_of(copy, r, step, skip).backward();
    auto params = copy.parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      auto g = params[i].grad().defined() ? params[i].grad() : torch::zeros_like(params[i]);
      if (sum.size() <= i) sum.push_back(g.clone()); else sum[i] += g;
    }
  }
  for (auto& s : sum) s /= static_cast<double>(ranks.size());
  return sum;
}

// Four steps of SGD on a CUDA module whose gradients `Sync` averages over the member; true when
// every p.grad() holds the member's mean each step. `side`: torch runs on a stream of its own
// (not ordered with the legacy default stream), made to lag behind the host before each backward.
template <class Sync>
bool averaged_on_the_gpu(fi::handover how, bool launch_when_full, bool side) {
  const int n = world().size(), me = world().rank();
  const int member = member_of(me, n);
  std::vector<int> ranks;
  for (int r = 0; r < n; ++r)
    if (member_of(r, n) == member) ranks.push_back(r);
  auto comm = world().split(member, me, "member");
  fc::sync_options options;
  options.bucket_bytes = 48;  // several buckets, some fusing two parameters (device staging)
  options.launch_when_full = launch_when_full;
  Sync sync(comm, options);
  net model;
  {
    torch::NoGradGuard plain;
    auto generator = torch::make_generator<at::CPUGeneratorImpl>(7);
    for (auto& p : model.parameters()) p.copy_(torch::randn(p.sizes(), generator));
  }
  model.to(gpu());
  std::optional<c10::cuda::CUDAStreamGuard> on;
  if (side) on.emplace(c10::cuda::getStreamFromPool());
  fi::gradient_sync<Sync> grads(sync, model, how);
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.1));
  bool ok = grads.parameters() == 5;
  for (int step = 0; step < 4; ++step) {
    const bool skip = step % 2 == 1;  // the spare parameter unused every other step
    net start;
    {
      torch::NoGradGuard plain;
      auto to = start.parameters();
      auto from = model.parameters();
      for (std::size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i].cpu());
    }
    const auto want = expected(start, ranks, step, skip);
    optimizer.zero_grad();
    if (side) at::cuda::sleep(lag);
    loss_of(model, me, step, skip).backward();
    if (how != fi::handover::within_backward) grads.finish();
    auto params = model.parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const bool right = params[i].grad().defined() && params[i].grad().is_cuda() &&
                         torch::allclose(params[i].grad().cpu(), want[i], 1e-4, 1e-5);
      if (!right) BOOST_TEST_MESSAGE("step " << step << " parameter " << i << " is not the member's mean");
      ok = ok && right;
    }
    optimizer.step();
  }
  return ok;
}

using device_syncs = boost::mpl::list<fc::subgroup_allreduce<fc::nccl>, fc::subgroup_allreduce<fc::staged>,
                                      fc::overlapped_ring<fc::staged>>;

// Sample i is a 2x3 tensor of i, its target 10 i.
struct counting : torch::data::datasets::Dataset<counting> {
  torch::data::Example<> get(std::size_t i) override {
    return {torch::full({2, 3}, static_cast<float>(i)), torch::tensor(static_cast<std::int64_t>(10 * i))};
  }
  torch::optional<std::size_t> size() const override { return 11; }
};

// A Sync of ready/finish only, which records where each gradient lay.
struct recording_sync {
  template <class T>
  void ready(int, fc::span<T> g) {
    pointers.push_back(g.data());
  }
  void finish() {}
  std::vector<const void*> pointers;
};

}  // namespace

// Runs first: two ranks on one GPU need the test-only environment of tests/gpu/nccl_env.sh.
BOOST_AUTO_TEST_CASE(ranks_sharing_a_gpu_have_distinct_nccl_host_ids) {
  const auto problem = fc::testing::nccl_gpu_sharing_problem();
  BOOST_TEST_REQUIRE(all_ranks(problem.empty()), problem);
}

// flexcomm's device work waits for torch's current stream, and torch's for flexcomm's: each side
// writes after a spinning kernel on its own stream, and the other reads at once.
BOOST_AUTO_TEST_CASE(streams_are_ordered_both_ways) {
  const int device = c10::cuda::current_device();
  const std::int64_t n = 1 << 22;
  const auto floats = torch::TensorOptions().dtype(torch::kFloat32).device(gpu());
  auto t = torch::zeros({n}, floats), copy = torch::zeros({n}, floats), threes = torch::full({n}, 3.f, floats);
  torch::cuda::synchronize();
  const auto side = c10::cuda::getStreamFromPool();
  {  // torch -> flexcomm: the legacy default stream copies what torch's side stream wrote
    c10::cuda::CUDAStreamGuard on(side);
    at::cuda::sleep(lag);
    t.fill_(7.f);
    fi::flexcomm_after_torch(device);
  }
  fc::check_cuda(fc::device::copy_async(copy.data_ptr(), t.data_ptr(), n * sizeof(float), nullptr), "test: copy");
  fc::check_cuda(fc::device::stream_synchronize(nullptr), "test: synchronize");
  BOOST_TEST(copy.eq(7.f).all().item<bool>());
  // flexcomm -> torch: torch's side stream sums what the legacy default stream wrote after a lag
  torch::cuda::synchronize();
  {
    c10::cuda::CUDAStreamGuard on(c10::cuda::getDefaultCUDAStream());
    at::cuda::sleep(lag);
  }
  fc::check_cuda(fc::device::copy_async(t.data_ptr(), threes.data_ptr(), n * sizeof(float), nullptr), "test: write");
  double sum = 0;
  {
    c10::cuda::CUDAStreamGuard on(side);
    fi::torch_after_flexcomm(device);
    sum = t.sum().item<double>();
  }
  BOOST_TEST(sum == 3.0 * static_cast<double>(n));
}

BOOST_AUTO_TEST_CASE_TEMPLATE(cuda_gradients_are_the_member_mean, Sync, device_syncs) {
  for (bool side : {false, true}) {
    BOOST_TEST_INFO("torch on " << (side ? "a stream of its own" : "the default stream"));
    BOOST_TEST(all_ranks(averaged_on_the_gpu<Sync>(fi::handover::during_backward, true, side)));
    BOOST_TEST(all_ranks(averaged_on_the_gpu<Sync>(fi::handover::after_backward, false, side)));
    BOOST_TEST(all_ranks(averaged_on_the_gpu<Sync>(fi::handover::within_backward, true, side)));
  }
}

// No host copy: after backward, a Sync gets each p.grad() where it lies, in device memory.
BOOST_AUTO_TEST_CASE(gradients_are_handed_over_where_they_lie) {
  recording_sync sync;
  net model;
  model.to(gpu());
  fi::gradient_sync<recording_sync> grads(sync, model, fi::handover::after_backward);
  loss_of(model, 0, 0, false).backward();
  grads.finish();
  auto params = model.parameters();
  BOOST_TEST_REQUIRE(sync.pointers.size() == params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    BOOST_TEST(sync.pointers[params.size() - 1 - i] == params[i].grad().data_ptr());  // last parameter first
    bool on_device = false;
    fc::check_cuda(fc::device::is_device_memory(sync.pointers[i], &on_device), "test: cudaPointerGetAttributes");
    BOOST_TEST(on_device);
  }
}

// A tensor on the wrong side of a Sync is refused, saying which Sync to use.
BOOST_AUTO_TEST_CASE(tensors_on_the_wrong_device_are_refused) {
  fc::subgroup_allreduce<fc::mpi> host_sync(world());
  const auto on_gpu = torch::zeros({3}, torch::TensorOptions().device(gpu()));
  BOOST_TEST(contains(error_of([&] { fi::ready(host_sync, 0, on_gpu); }), "keeps gradients in host memory"));
  host_sync.finish();
  fc::subgroup_allreduce<fc::staged> device_sync(world());
  net model;  // on the CPU
  BOOST_TEST(contains(error_of([&] { fi::gradient_sync<fc::subgroup_allreduce<fc::staged>> g(device_sync, model); }),
                      "keeps gradients in device memory"));
  BOOST_TEST(contains(error_of([&] { fi::ready(device_sync, 0, torch::zeros({3})); }), "device memory"));
  device_sync.finish();
}

// A typed feed's batches on the device: every sample once per epoch, in order, in device memory,
// each batch intact although the feed rewrites its host buffers every step and torch's stream lags
// behind the host (what the stream saw is kept on the device and read only at the end).
BOOST_AUTO_TEST_CASE(batches_arrive_intact_in_device_memory) {
  const int n = world().size();
  std::vector<int> sizes = n == 1 ? std::vector<int>{1} : std::vector<int>{(n + 1) / 2, n / 2};
  const fc::ensemble_layout layout(0, sizes, 0);
  counting data;
  fc::typed_feed<fc::local_feed> feed(world(), layout, fi::dataset_of(data, 4, 2));
  bool ok = true;
  std::vector<torch::Tensor> samples, targets;  // per step, as the lagging stream read them
  {
    c10::cuda::CUDAStreamGuard on(c10::cuda::getStreamFromPool());
    auto loader = fi::make_data_loader(feed, gpu());
    for (int epoch = 0; epoch < 2; ++epoch)
      for (auto& batch : *loader) {
        ok = ok && batch.data.is_cuda() && batch.target.is_cuda() && batch.data.dim() == 3 &&
             batch.data.size(1) == 2 && batch.data.size(2) == 3 && batch.data.size(0) == batch.target.size(0) &&
             batch.target.scalar_type() == torch::kInt64;
        at::cuda::sleep(lag / 10);  // the next batches' copies must wait for what follows
        samples.push_back(batch.data.clone());
        targets.push_back(batch.target.clone());
      }
  }
  torch::cuda::synchronize();
  // Sample i holds i everywhere and has target 10 i; within an epoch a trainer's samples rise.
  std::int64_t seen = 0, sum = 0;
  ok = ok && samples.size() == 6;  // 3 steps an epoch for every trainer
  for (std::size_t k = 0; ok && k < samples.size(); ++k) {
    const auto x = samples[k].cpu(), y = targets[k].cpu();
    for (std::int64_t j = 0; ok && j < y.size(0); ++j) {
      const std::int64_t i = y[j].item<std::int64_t>() / 10;
      ok = y[j].item<std::int64_t>() == 10 * i && torch::equal(x[j], torch::full({2, 3}, static_cast<float>(i))) &&
           (j == 0 || i > y[j - 1].item<std::int64_t>() / 10);
      sum += i;
      ++seen;
    }
  }
  // Over the member: every sample of 2 epochs of 11, once each.
  std::int64_t counts[2] = {seen, sum};
  auto comm = world().split(layout.role_of(world().rank()).member, world().rank(), "member");
  fc::mpi::iallreduce(comm, fc::span<std::int64_t>(counts, 2), fc::op::sum).wait();
  BOOST_TEST(all_ranks(ok && counts[0] == 22 && counts[1] == 2 * 55));
}

// train_ensemble with a module on the GPU: the device Sync it makes averages within backward()
// (checked against the member's mean computed by hand, as tests/mpi/torch.cpp does on the CPU),
// loader() gives batches in device memory, and the outputs reach the aggregator; for each device
// backend and sync, under presets with and without producers.
BOOST_AUTO_TEST_CASE(an_ensemble_trains_on_the_gpu) {
  const int n = world().size();
  const auto evaluation = torch::arange(14, torch::kFloat32).view({7, 2});
  struct variant {
    const char *sync, *backend;
  };
  for (const variant v : {variant{"allreduce", "nccl"}, variant{"allreduce", "staged"}, variant{"ring", "staged"}})
    for (const char* preset : {"baseline", "single_broadcast", "adaptive"}) {
      const int producers = std::string(preset) == "single_broadcast" ? 1 : 0;
      if (n - producers < 1) continue;
      const int members = std::min(2, n - producers);
      counting data;
      bool ok = true, aggregated = false;
      fi::ensemble_options options{preset, members, v.sync};
      options.device_backend = v.backend;
      options.end_job_on_error = false;
      fi::train_ensemble(
          world(), options, fi::dataset_of(data, 4, 2), evaluation,
          [&](fi::trainer& ctx, const torch::Tensor& part) {
            torch::manual_seed(static_cast<std::uint64_t>(ctx.member()));
            torch::nn::Linear model(6, 2);
            model->to(torch::kCUDA);
            ctx.average_gradients(*model);
            auto loader = ctx.loader();  // on the module's device
            for (int epoch = 0; epoch < 2; ++epoch)
              for (auto& batch : *loader) {
                ok = ok && batch.data.is_cuda();
                const auto x = batch.data.view({-1, 6});
                auto mean = torch::cat({x.sum(0), torch::full({1}, static_cast<float>(x.size(0)), x.options())})
                                .cpu()
                                .contiguous();
                fc::mpi::iallreduce(ctx.comm(), fc::span<float>(mean.data_ptr<float>(), 7), fc::op::sum).wait();
                mean /= static_cast<float>(ctx.member_size());
                model->zero_grad();
                model->forward(x).sum().backward();
                ok = ok && model->weight.grad().is_cuda() &&
                     torch::allclose(model->weight.grad().cpu(), mean.slice(0, 0, 6).unsqueeze(0).expand({2, 6})) &&
                     torch::allclose(model->bias.grad().cpu(), torch::full({2}, mean[6].item<float>()));
              }
            const auto tag = torch::full({part.size(0), 1}, static_cast<double>(ctx.member()), torch::kFloat32);
            return torch::cat({part, tag}, 1).to(torch::kCUDA);
          },
          [&](const std::vector<torch::Tensor>& outputs) {
            aggregated = true;
            ok = ok && static_cast<int>(outputs.size()) == members;
            for (std::size_t m = 0; ok && m < outputs.size(); ++m)
              ok = torch::equal(outputs[m], torch::cat({evaluation, torch::full({7, 1}, static_cast<double>(m))}, 1));
          });
      int aggregators = aggregated ? 1 : 0;
      fc::mpi::iallreduce(world(), fc::span<int>(&aggregators, 1), fc::op::sum).wait();
      BOOST_TEST_INFO("preset " << preset << ", sync " << v.sync << " on " << v.backend);
      BOOST_TEST(all_ranks(ok && aggregators == 1));
    }
}

namespace {
// The largest difference over the member's ranks of any element of the tensors (0: equal).
double member_spread(const fc::mpi::communicator& comm, const std::vector<torch::Tensor>& tensors) {
  double apart = 0;
  for (const auto& t : tensors) {
    auto high = t.detach().to(torch::kCPU, torch::kFloat64).contiguous().clone(), low = -high;
    fc::mpi::iallreduce(comm, fc::span<double>(high.data_ptr<double>(), high.numel()), fc::op::max).wait();
    fc::mpi::iallreduce(comm, fc::span<double>(low.data_ptr<double>(), low.numel()), fc::op::max).wait();
    if (t.numel() > 0) apart = std::max(apart, (high + low).abs().max().item<double>());
  }
  return apart;
}
}  // namespace

// Two CUDA modules with two optimizers, the first holding BatchNorm: each module gets a device
// Sync of its own, the replicas (seeded apart) train as one, and the running statistics, kept
// by the first rank's broadcast at each step, end equal on every rank of a member; on each
// device backend.
BOOST_AUTO_TEST_CASE(two_cuda_modules_with_batchnorm_train_as_one_per_member) {
  for (const char* backend : {"nccl", "staged"}) {
    counting data;
    bool ok = true;
    fi::ensemble_options options{"baseline", world().size() >= 3 ? 2 : 1};
    options.device_backend = backend;
    options.end_job_on_error = false;
    fi::train_ensemble(
        world(), options, fi::dataset_of(data, 4, 2),
        [&](fi::trainer& ctx) {
          torch::manual_seed(static_cast<std::uint64_t>(400 + world().rank()));
          torch::nn::Sequential first(torch::nn::Linear(6, 4), torch::nn::BatchNorm1d(4));
          torch::nn::Linear second(4, 2);
          first->to(gpu());
          second->to(gpu());
          ok = ok && ctx.average_gradients(*first).parameters() == 4 &&
               ctx.average_gradients(*second).parameters() == 2;
          torch::optim::SGD first_step(first->parameters(), torch::optim::SGDOptions(0.1));
          torch::optim::SGD second_step(second->parameters(), torch::optim::SGDOptions(0.1).momentum(0.5));
          auto loader = ctx.loader();
          for (int epoch = 0; epoch < 2; ++epoch)
            for (auto& batch : *loader) {
              ok = ok && batch.data.is_cuda();
              first_step.zero_grad();
              second_step.zero_grad();
              second->forward(first->forward(batch.data.view({-1, 6}))).pow(2).mean().backward();
              first_step.step();
              second_step.step();
            }
          auto state = first->parameters();
          for (const auto& p : second->parameters()) state.push_back(p);
          const double parameters = member_spread(ctx.comm(), state);
          const double statistics = member_spread(ctx.comm(), first->buffers());
          ok = ok && parameters == 0 && statistics == 0;
        },
        [](const fi::evaluation&) {});
    BOOST_TEST_INFO("device backend " << backend);
    BOOST_TEST(all_ranks(ok));
  }
}
