#define BOOST_TEST_MODULE mpi_torch
// flexcomm/interop/torch.hpp: a module's gradients averaged over each member's ranks (members of
// different sizes, both Syncs, hooks, after- and within-backward), tensors collected, evaluation
// slices, batches as tensors, and whole ensembles under presets (train_ensemble).
#include "mpi_fixture.hpp"
#include "errors.hpp"

#include <flexcomm/interop/torch.hpp>
#include <flexcomm/interop/torch_ensemble.hpp>

#include <boost/mpl/list.hpp>

#include <algorithm>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

namespace fc = flexcomm;
namespace fi = flexcomm::interop;
using fc::mpi;
using fc::testing::all_ranks;
using fc::testing::contains;
using fc::testing::error_of;
using fc::testing::world;

namespace {

// Ranks 0..ceil(n/2)-1 train member 0, the others member 1: sizes differ at 3 ranks.
int member_of(int rank, int n) { return rank < (n + 1) / 2 ? 0 : 1; }

struct fixture_init {
  fixture_init() { torch::set_num_threads(1); }  // ranks outnumber cores
};

// Two layers with a parameter that no forward uses when `skip` (an unused parameter).
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

// Every member's model starts from the same weights; rank r's input and target are its own.
void initialize(net& model) {
  torch::NoGradGuard plain;
  auto generator = torch::make_generator<at::CPUGeneratorImpl>(7);
  for (auto& p : model.parameters()) p.copy_(torch::randn(p.sizes(), generator));
}
torch::Tensor loss_of(net& model, int rank, int step, int pass, bool skip) {
  auto generator = torch::make_generator<at::CPUGeneratorImpl>(1000 * rank + 10 * step + pass);
  const auto x = torch::randn({6, 5}, generator);
  const auto target = torch::randn({6, 3}, generator);
  return torch::mse_loss(model.forward(x, skip), target);
}

// What every parameter's gradient must be after finish(): the mean over the member's ranks of
// what each computes, from the same starting weights (computed here for every rank of the member).
std::vector<torch::Tensor> expected(const net& start, const std::vector<int>& ranks, int step, int passes, bool skip) {
  std::vector<torch::Tensor> sum;
  for (int r : ranks) {
    net copy;
    {
      torch::NoGradGuard plain;
      auto to = copy.parameters();
      auto from = start.parameters();
      for (std::size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
    }
    for (int pass = 0; pass < passes; ++pass) loss_of(copy, r, step, pass, skip).backward();
    auto params = copy.parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      auto g = params[i].grad().defined() ? params[i].grad() : torch::zeros_like(params[i]);
      if (sum.size() <= i) sum.push_back(g.clone()); else sum[i] += g;
    }
  }
  for (auto& s : sum) s /= static_cast<double>(ranks.size());
  return sum;
}

template <class Sync>
bool averaged_correctly(fi::handover how, bool launch_when_full, int passes, bool skip_some) {
  const int n = world().size(), me = world().rank();
  const int member = member_of(me, n);
  std::vector<int> ranks;
  for (int r = 0; r < n; ++r)
    if (member_of(r, n) == member) ranks.push_back(r);
  auto comm = world().split(member, me, "member");
  fc::sync_options options;
  options.bucket_bytes = 48;  // several buckets, some fusing two parameters
  options.launch_when_full = launch_when_full;
  Sync sync(comm, options);
  net model;
  initialize(model);
  fi::gradient_sync<Sync> grads(sync, model, how);
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.1));
  bool ok = grads.parameters() == 5;
  for (int step = 0; step < 4; ++step) {
    const bool skip = skip_some && step % 2 == 1;  // the spare parameter unused every other step
    net start;
    {
      torch::NoGradGuard plain;
      auto to = start.parameters();
      auto from = model.parameters();
      for (std::size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
    }
    const auto want = expected(start, ranks, step, passes, skip);
    optimizer.zero_grad();
    for (int pass = 0; pass < passes; ++pass) loss_of(model, me, step, pass, skip).backward();
    if (how != fi::handover::within_backward) grads.finish();  // within: backward() has finished
    auto params = model.parameters();
    for (std::size_t i = 0; i < params.size(); ++i)
      ok = ok && params[i].grad().defined() && torch::allclose(params[i].grad(), want[i], 1e-5, 1e-6);
    optimizer.step();
  }
  return ok;
}

using syncs = boost::mpl::list<fc::subgroup_allreduce<mpi>, fc::overlapped_ring<mpi>>;

}  // namespace

BOOST_GLOBAL_FIXTURE(fixture_init);

BOOST_AUTO_TEST_CASE_TEMPLATE(gradients_hooked_during_backward_are_the_member_mean, Sync, syncs) {
  for (bool early : {false, true})
    BOOST_TEST(all_ranks(averaged_correctly<Sync>(fi::handover::during_backward, early, 1, false)));
}

BOOST_AUTO_TEST_CASE_TEMPLATE(gradients_handed_after_backward_are_the_member_mean, Sync, syncs) {
  for (bool early : {false, true})
    BOOST_TEST(all_ranks(averaged_correctly<Sync>(fi::handover::after_backward, early, 1, false)));
}

BOOST_AUTO_TEST_CASE_TEMPLATE(an_unused_parameter_is_handed_over_all_the_same, Sync, syncs) {
  BOOST_TEST(all_ranks(averaged_correctly<Sync>(fi::handover::during_backward, true, 1, true)));
  BOOST_TEST(all_ranks(averaged_correctly<Sync>(fi::handover::after_backward, false, 1, true)));
}

// backward() alone leaves the averages in p.grad(), unused parameters included; two backward()
// calls are two steps, whose averages add up to the average of the sum.
BOOST_AUTO_TEST_CASE_TEMPLATE(gradients_finished_within_backward_are_the_member_mean, Sync, syncs) {
  for (bool early : {false, true})
    BOOST_TEST(all_ranks(averaged_correctly<Sync>(fi::handover::within_backward, early, 1, false)));
  BOOST_TEST(all_ranks(averaged_correctly<Sync>(fi::handover::within_backward, true, 1, true)));
  BOOST_TEST(all_ranks(averaged_correctly<Sync>(fi::handover::within_backward, false, 2, false)));
}

BOOST_AUTO_TEST_CASE(finish_is_refused_within_backward) {
  fc::subgroup_allreduce<mpi> sync(world());
  net model;
  fi::gradient_sync<fc::subgroup_allreduce<mpi>> grads(sync, model, fi::handover::within_backward);
  BOOST_TEST(contains(error_of([&] { grads.finish(); }), "within_backward finishes each step in backward()"));
}

namespace {
// A Sync whose every step fails, as a member's exchange that times out would; or whose
// ready() fails from the `refuse`th gradient on, in the middle of a backward.
struct failing_sync {
  template <class T>
  void ready(int, fc::span<T>) {
    if (refuse >= 0 && handed >= refuse) fc::fail("failing_sync: ready", "the bucket could not be sent");
    ++handed;
  }
  void finish() { fc::fail("failing_sync: finish", "the member's exchange failed"); }
  int handed = 0, refuse = -1;
};
}  // namespace

// A failure of the step that backward() runs leaves backward() as that flexcomm::error, and the
// next backward() steps again, every parameter handed over once per step.
BOOST_AUTO_TEST_CASE(an_error_finishing_within_backward_leaves_backward) {
  failing_sync sync;
  net model;
  fi::gradient_sync<failing_sync> grads(sync, model, fi::handover::within_backward);
  for (int step = 0; step < 2; ++step)
    BOOST_TEST(contains(error_of([&] { loss_of(model, 0, step, 0, false).backward(); }), "the member's exchange failed"));
  BOOST_TEST(sync.handed == 10);
}

// A backward() that fails half way through its step leaves no step to finish: the next
// backward() says so instead of stepping the Sync out of step with the member's other ranks.
BOOST_AUTO_TEST_CASE(a_backward_failing_half_way_is_not_followed_by_a_silent_step) {
  failing_sync sync;
  sync.refuse = 2;
  net model;
  fi::gradient_sync<failing_sync> grads(sync, model, fi::handover::within_backward);
  BOOST_TEST(contains(error_of([&] { loss_of(model, 0, 0, 0, false).backward(); }), "could not be sent"));
  BOOST_TEST(contains(error_of([&] { loss_of(model, 0, 1, 0, false).backward(); }), "an earlier backward() failed"));
}

// Hooks see a contribution before autograd adds it: what was already in p.grad() must count.
BOOST_AUTO_TEST_CASE(gradients_already_accumulated_count_under_hooks) {
  const int n = world().size(), me = world().rank();
  auto comm = world().split(member_of(me, n), me, "member");
  fc::subgroup_allreduce<mpi> sync(comm);
  net model;
  initialize(model);
  {  // p.grad() holds 1 before backward: the average must include it
    torch::NoGradGuard plain;
    for (auto& p : model.parameters()) p.mutable_grad() = torch::ones_like(p);
  }
  std::vector<int> ranks;
  for (int r = 0; r < n; ++r)
    if (member_of(r, n) == member_of(me, n)) ranks.push_back(r);
  auto want = expected(model, ranks, 0, 1, false);
  fi::gradient_sync<fc::subgroup_allreduce<mpi>> grads(sync, model);
  loss_of(model, me, 0, 0, false).backward();
  grads.finish();
  bool ok = true;
  auto params = model.parameters();
  for (std::size_t i = 0; i < params.size(); ++i) ok = ok && torch::allclose(params[i].grad(), want[i] + 1, 1e-5, 1e-6);
  BOOST_TEST(all_ranks(ok));
}

BOOST_AUTO_TEST_CASE(gradient_accumulation_after_backward_is_averaged) {
  BOOST_TEST(all_ranks(averaged_correctly<fc::subgroup_allreduce<mpi>>(fi::handover::after_backward, false, 2, false)));
}

BOOST_AUTO_TEST_CASE(two_backwards_under_hooks_are_refused_on_every_rank) {
  const int n = world().size(), me = world().rank();
  auto comm = world().split(member_of(me, n), me, "member");
  fc::subgroup_allreduce<mpi> sync(comm);
  net model;
  initialize(model);
  fi::gradient_sync<fc::subgroup_allreduce<mpi>> grads(sync, model);
  loss_of(model, me, 0, 0, false).backward();
  loss_of(model, me, 0, 1, false).backward();
  const auto message = error_of([&] { grads.finish(); });
  BOOST_TEST(all_ranks(contains(message, "two gradients before finish()") && contains(message, "after_backward")));
  // The sync is usable again: the next step averages normally.
  model.zero_grad();
  loss_of(model, me, 1, 0, false).backward();
  BOOST_TEST(all_ranks(error_of([&] { grads.finish(); }).empty()));
}

BOOST_AUTO_TEST_CASE(tensors_the_sync_cannot_read_are_refused) {
  fc::subgroup_allreduce<mpi> sync(world());
  const auto strided = torch::zeros({4, 4}).t();
  BOOST_TEST(contains(error_of([&] { fi::ready(sync, 0, strided); }), "not contiguous"));
  BOOST_TEST(contains(error_of([&] { fi::ready(sync, 0, torch::zeros({3}, torch::kBool)); }), "not supported"));
  const auto doubles = torch::zeros({3}, torch::kFloat64);
  BOOST_TEST(contains(error_of([&] { fi::elements<float>(doubles, "t"); }), "expected Float"));
  BOOST_TEST(contains(error_of([&] { fi::ready(sync, 0, torch::Tensor()); }), "undefined"));
  sync.finish();  // nothing was handed over: an empty step
}

BOOST_AUTO_TEST_CASE(tensors_are_gathered_and_reduced_per_member) {
  const int n = world().size(), me = world().rank();
  std::vector<int> sizes = n == 1 ? std::vector<int>{1} : std::vector<int>{(n + 1) / 2, n / 2};
  const fc::ensemble_layout layout(0, sizes, n - 1);
  fc::many_to_one<mpi> collect(world(), layout);
  const auto role = layout.role_of(me);
  // Member m's rank r submits its slice of a 7-row evaluation set: rows of value 100 m + row.
  const auto part = fi::evaluation_slice(7, role.rank_in_member, layout.member_size(role.member));
  const auto rows = torch::arange(part.begin, part.end, torch::kFloat32).unsqueeze(1).expand({part.size(), 3});
  fi::submit(collect, rows + 100 * role.member);  // not contiguous: submit copies
  fi::submit(collect, rows + 100 * role.member);
  bool ok = true;
  if (collect.is_aggregator()) {
    const auto members = fi::gather<float>(collect, {3});
    ok = members.size() == sizes.size();
    const auto whole = torch::arange(0, 7, torch::kFloat32).unsqueeze(1).expand({7, 3});
    for (std::size_t m = 0; ok && m < members.size(); ++m)
      ok = members[m].sizes() == torch::IntArrayRef({7, 3}) &&
           torch::equal(members[m], whole + 100 * static_cast<double>(m));
    const auto mean = fi::reduce<float>(collect, fc::op::avg, {3});
    ok = ok && torch::allclose(mean, whole + (n == 1 ? 0.0 : 50.0));
  }
  BOOST_TEST(all_ranks(ok));
}

BOOST_AUTO_TEST_CASE(evaluation_slices_cover_the_set_in_rank_order) {
  for (std::int64_t size : {0, 1, 7, 10000})
    for (int ranks = 1; ranks <= 5; ++ranks) {
      std::int64_t next = 0;
      for (int r = 0; r < ranks; ++r) {
        const auto s = fi::evaluation_slice(size, r, ranks);
        BOOST_TEST(s.begin == next);
        BOOST_TEST((s.size() == size / ranks || s.size() == size / ranks + 1));
        next = s.end;
      }
      BOOST_TEST(next == size);
    }
  BOOST_TEST(contains(error_of([] { fi::evaluation_slice(10, 3, 3); }), "rank 3 of 3"));
  BOOST_TEST(contains(error_of([] { fi::evaluation_slice(-1, 0, 1); }), "-1 samples"));
}

namespace {
// Sample i is a 2x3 tensor of i, its target 10 i.
struct counting : torch::data::datasets::Dataset<counting> {
  torch::data::Example<> get(std::size_t i) override {
    return {torch::full({2, 3}, static_cast<float>(i)), torch::tensor(static_cast<std::int64_t>(10 * i))};
  }
  torch::optional<std::size_t> size() const override { return 11; }
};
}  // namespace

// A torch::data dataset through a typed feed: every sample once per epoch, in order, each
// trainer's share of the batch as tensor views of the feed's memory.
BOOST_AUTO_TEST_CASE(a_torch_dataset_arrives_as_tensor_batches) {
  const int n = world().size();
  std::vector<int> sizes = n == 1 ? std::vector<int>{1} : std::vector<int>{(n + 1) / 2, n / 2};
  const fc::ensemble_layout layout(0, sizes, 0);
  counting data;
  fc::typed_feed<fc::local_feed> feed(world(), layout, fi::dataset_of(data, 4, 2));
  const auto role = layout.role_of(world().rank());
  // What this trainer must see, per step: its slice of positions of each batch of 4 (3 steps per epoch).
  bool ok = true;
  std::int64_t steps = 0, seen = 0;
  while (auto batch = feed.next()) {
    const auto x = fi::samples(*batch);
    const auto y = fi::labels(*batch);
    const auto step_in_epoch = batch->step_in_epoch();
    ok = ok && x.dim() == 3 && x.size(0) == batch->samples() && x.size(1) == 2 && x.size(2) == 3 &&
         y.dim() == 1 && y.size(0) == batch->samples() && batch->epoch() == steps / 3;
    for (std::int64_t j = 0; ok && j < batch->samples(); ++j) {
      const std::int64_t index = 4 * step_in_epoch + batch->first_sample() + j;
      ok = torch::equal(x[j], torch::full({2, 3}, static_cast<float>(index))) &&
           y[j].item<std::int64_t>() == 10 * index &&
           x.data_ptr<float>() == batch->as<float>().data();  // a view, not a copy
    }
    ok = ok && contains(error_of([&] { fi::samples<double>(*batch); }), "asked for");
    seen += batch->samples();
    ++steps;
  }
  // Over its member, this trainer's share of 2 epochs of 11 samples.
  std::int64_t member_seen = seen;
  auto comm = world().split(role.member, role.rank_in_member, "member");
  fc::mpi::iallreduce(comm, fc::span<std::int64_t>(&member_seen, 1), fc::op::sum).wait();
  BOOST_TEST(all_ranks(ok && steps == 6 && member_seen == 22));
}

// Walks `range` once as epoch `epoch` of the counting dataset (2 epochs of 11 samples in batches
// of 4): 3 steps and 11 samples over the world in each epoch; a walk after the last is refused.
template <class Range>
bool walks_epoch(Range&& range, std::int64_t epoch) {
  if (epoch >= 2) return contains(error_of([&] { range.begin(); }), "one more than the feed's dataset has");
  bool ok = true;
  std::int64_t steps = 0, samples = 0, first = -1;
  for (auto& batch : range) {
    if (batch.data.size(0) > 0 && first < 0) first = batch.target[0].template item<std::int64_t>();
    ok = ok && batch.data.size(0) == batch.target.size(0) && batch.target.scalar_type() == torch::kInt64;
    samples += batch.data.size(0);
    ++steps;
  }
  fc::mpi::iallreduce(world(), fc::span<std::int64_t>(&samples, 1), fc::op::sum).wait();
  ok = ok && steps == (epoch < 2 ? 3 : 0) && samples == (epoch < 2 ? 11 : 0);
  if (world().rank() == 0 && epoch < 2) ok = ok && first == 0;  // each epoch starts at sample 0
  return ok;
}

// fi::epoch: one epoch per range-for, as a DataLoader gives it; the next epoch's first batch is
// left in the feed, and a range after the last epoch is an error (not an empty epoch).
BOOST_AUTO_TEST_CASE(an_epoch_range_stops_at_the_end_of_each_epoch) {
  const fc::ensemble_layout layout(0, {world().size()}, 0);
  counting data;
  fc::typed_feed<fc::local_feed> feed(world(), layout, fi::dataset_of(data, 4, 2));
  bool ok = true;
  for (std::int64_t epoch = 0; epoch < 3; ++epoch) ok = walks_epoch(fi::epoch(feed), epoch) && ok;
  BOOST_TEST(all_ranks(ok));
}

// fi::data_loader: the same loader walks the next epoch at each range-for over *loader.
BOOST_AUTO_TEST_CASE(a_data_loader_walks_the_next_epoch_each_time) {
  const fc::ensemble_layout layout(0, {world().size()}, 0);
  counting data;
  fc::typed_feed<fc::local_feed> feed(world(), layout, fi::dataset_of(data, 4, 2));
  auto loader = fi::make_data_loader(feed);
  bool ok = true;
  for (std::int64_t epoch = 0; epoch < 3; ++epoch) ok = walks_epoch(*loader, epoch) && ok;
  BOOST_TEST(all_ranks(ok));
}

// train_ensemble under every preset the world has ranks for, members of different sizes: each
// trainer sees its member's share of every batch, one epoch per loop over *loader; backward()
// leaves the member's mean gradient (loss = sum of a Linear's outputs: dW = column sums of x,
// db = samples, computed here and averaged over the member by hand); the aggregator gets each
// member's outputs on the whole evaluation set, in member order, as float32 [7, 3].
BOOST_AUTO_TEST_CASE(an_ensemble_trains_and_gathers_under_every_preset) {
  const int n = world().size();
  const auto evaluation = torch::arange(14, torch::kFloat32).view({7, 2});
  for (const char* preset : fc::presets::names) {
    const int producers = std::string(preset) == "single_broadcast" ? 1 : std::string(preset) == "multi_broadcast" ? 2 : 0;
    if (n - producers < 1) continue;
    const int members = std::min(2, n - producers);
    counting data;
    bool ok = true, aggregated = false;
    fi::train_ensemble(
        world(), {preset, members}, fi::dataset_of(data, 4, 2), evaluation,
        [&](fi::trainer& ctx, const torch::Tensor& part) {
          torch::manual_seed(static_cast<std::uint64_t>(ctx.member()));
          torch::nn::Linear model(6, 2);
          ctx.average_gradients(*model);
          ok = ok && contains(error_of([&] { ctx.average_gradients(*model); }), "averaged already");
          auto loader = ctx.loader();
          std::int64_t seen = 0;
          for (int epoch = 0; epoch < 2; ++epoch) {
            std::int64_t steps = 0;
            for (auto& batch : *loader) {
              const auto x = batch.data.view({-1, 6});
              std::vector<float> mean(7);  // dW's row (6), then db's element
              auto local = x.sum(0);
              std::copy(local.data_ptr<float>(), local.data_ptr<float>() + 6, mean.begin());
              mean[6] = static_cast<float>(x.size(0));
              fc::mpi::iallreduce(ctx.comm(), fc::span<float>(mean), fc::op::sum).wait();
              for (auto& v : mean) v /= static_cast<float>(ctx.member_size());
              model->zero_grad();
              model->forward(x).sum().backward();
              const auto want_w = torch::from_blob(mean.data(), {1, 6}).expand({2, 6});
              ok = ok && torch::allclose(model->weight.grad(), want_w) &&
                   torch::allclose(model->bias.grad(), torch::full({2}, mean[6]));
              seen += x.size(0);
              ++steps;
            }
            ok = ok && steps == 3;
          }
          fc::mpi::iallreduce(ctx.comm(), fc::span<std::int64_t>(&seen, 1), fc::op::sum).wait();
          ok = ok && seen == 22 && ctx.members() == members && part.size(0) == fi::evaluation_slice(7, ctx).size();
          const auto tag = torch::full({part.size(0), 1}, static_cast<double>(ctx.member()), torch::kFloat32);
          return torch::cat({part, tag}, 1).to(torch::kFloat64);  // float32 on the aggregator
        },
        [&](const std::vector<torch::Tensor>& outputs) {
          aggregated = true;
          ok = ok && static_cast<int>(outputs.size()) == members;
          for (std::size_t m = 0; ok && m < outputs.size(); ++m)
            ok = outputs[m].scalar_type() == torch::kFloat32 &&
                 torch::equal(outputs[m], torch::cat({evaluation, torch::full({7, 1}, static_cast<double>(m))}, 1));
        });
    int aggregators = aggregated ? 1 : 0;
    fc::mpi::iallreduce(world(), fc::span<int>(&aggregators, 1), fc::op::sum).wait();
    BOOST_TEST_INFO("preset " << preset);
    BOOST_TEST(all_ranks(ok && aggregators == 1));
  }
}

// More members than ranks to train them: refused on every rank before anything is set up.
BOOST_AUTO_TEST_CASE(an_ensemble_without_ranks_for_its_members_is_refused) {
  const int n = world().size();
  counting data;
  fi::ensemble_options options{"baseline", n + 1};
  options.end_job_on_error = false;  // thrown, for the test to see
  const auto message = error_of([&] {
    fi::train_ensemble(world(), options, fi::dataset_of(data, 4), torch::zeros({3}),
                       [](fi::trainer&, const torch::Tensor& part) { return part; },
                       [](const std::vector<torch::Tensor>&) {});
  });
  BOOST_TEST(all_ranks(contains(message, "fewer than the " + std::to_string(n + 1) + " members")));
}

// A mapped and stacked dataset (Normalize, then Stack) through dataset_of; the replicas of a
// member, seeded by world rank, start and end equal (average_gradients broadcasts from the
// member's first rank); each epoch's test reaches the aggregator's report with every member's
// outputs; ctx.reports() is each member's first rank. Under every preset the world has ranks for.
BOOST_AUTO_TEST_CASE(replicas_seeded_apart_train_as_one_and_each_epoch_is_reported) {
  const int n = world().size();
  const auto evaluation = torch::arange(10, torch::kFloat32).view({5, 2}).repeat({1, 3});  // 5 samples of 6
  for (const char* preset : fc::presets::names) {
    const int producers = std::string(preset) == "single_broadcast" ? 1 : std::string(preset) == "multi_broadcast" ? 2 : 0;
    if (n - producers < 1) continue;
    const int members = std::min(2, n - producers);
    auto data = counting().map(torch::data::transforms::Normalize<>(0.5, 2.0)).map(torch::data::transforms::Stack<>());
    bool ok = true;
    std::vector<int> reported;
    fi::ensemble_options options{preset, members};
    options.end_job_on_error = false;
    fi::train_ensemble(
        world(), options, fi::dataset_of(data, 4, 2),
        [&](fi::trainer& ctx) {
          torch::manual_seed(static_cast<std::uint64_t>(100 + world().rank()));
          torch::nn::Linear model(6, 2);
          // The member's extremes of every parameter: apart before (seeds differ), equal after.
          const auto spread = [&] {
            float apart = 0;
            for (auto& p : model->parameters()) {
              auto high = p.detach().clone().contiguous(), low = -high;
              fc::mpi::iallreduce(ctx.comm(), fc::span<float>(high.data_ptr<float>(), high.numel()), fc::op::max).wait();
              fc::mpi::iallreduce(ctx.comm(), fc::span<float>(low.data_ptr<float>(), low.numel()), fc::op::max).wait();
              apart = std::max(apart, (high + low).abs().max().item<float>());
            }
            return apart;
          };
          ok = ok && (ctx.member_size() == 1 || spread() > 0) && ctx.reports() == (ctx.rank_in_member() == 0);
          ctx.average_gradients(*model);
          ok = ok && spread() == 0;
          torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.5));
          auto loader = ctx.loader();
          for (int epoch = 0; epoch < 2; ++epoch) {
            for (auto& batch : *loader) {
              // Normalize ran on the loading rank: sample i is (i - 0.5) / 2, its target 10 i.
              const auto x = batch.data.view({-1, 6});
              ok = ok && torch::allclose(x.select(1, 0), (batch.target.to(torch::kFloat32) / 10 - 0.5) / 2);
              optimizer.zero_grad();
              model->forward(x).pow(2).mean().backward();
              optimizer.step();
            }
            torch::NoGradGuard no_grad;
            fi::evaluated(model->forward(evaluation), torch::arange(5));
          }
          ok = ok && spread() == 0;
        },
        [&](const fi::evaluation& e) {
          reported.push_back(e.epoch);
          ok = ok && static_cast<int>(e.members.size()) == members && torch::equal(e.targets, torch::arange(5)) &&
               e.members[0].sizes().vec() == std::vector<std::int64_t>{5, 2};
        });
    int reports = static_cast<int>(reported.size());
    fc::mpi::iallreduce(world(), fc::span<int>(&reports, 1), fc::op::sum).wait();
    ok = ok && reports == 2 && (reported.empty() || reported == std::vector<int>{1, 2});
    BOOST_TEST_INFO("preset " << preset);
    BOOST_TEST(all_ranks(ok));
  }
}

namespace {
// The largest difference over the member's ranks of any element of the tensors (0: equal).
double member_spread(const fc::mpi::communicator& comm, const std::vector<torch::Tensor>& tensors) {
  double apart = 0;
  for (const auto& t : tensors) {
    auto high = t.detach().to(torch::kFloat64).contiguous().clone(), low = -high;
    fc::mpi::iallreduce(comm, fc::span<double>(high.data_ptr<double>(), high.numel()), fc::op::max).wait();
    fc::mpi::iallreduce(comm, fc::span<double>(low.data_ptr<double>(), low.numel()), fc::op::max).wait();
    if (t.numel() > 0) apart = std::max(apart, (high + low).abs().max().item<double>());
  }
  return apart;
}

// Members of at most two ranks, each rank at least one sample of every batch of 4 (the last: 3).
fi::ensemble_options small_members(int n) {
  fi::ensemble_options options{"baseline", n >= 3 ? 2 : 1};
  options.end_job_on_error = false;
  return options;
}
}  // namespace

// A trainer that tests on each member's first rank alone (trainer::reports()), after the second
// epoch only, with upstream's default test loader (a RandomSampler), its members seeded apart:
// the report comes once, for epoch 2, every member's outputs on the test set in one shuffled
// order (the shared test order), and the members' training draws stay their own.
BOOST_AUTO_TEST_CASE(members_testing_on_their_first_rank_with_a_shuffled_loader_are_reported) {
  counting data;
  const auto options = small_members(world().size());
  bool ok = true;
  std::vector<int> reported;
  fi::train_ensemble(
      world(), options, fi::dataset_of(data, 4, 2),
      [&](fi::trainer& ctx) {
        torch::manual_seed(static_cast<std::uint64_t>(300 + world().rank()));
        torch::nn::Linear model(6, 2);
        ctx.average_gradients(*model);
        torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
        auto tests = torch::data::make_data_loader(counting().map(torch::data::transforms::Stack<>()), 4);
        auto loader = ctx.loader();
        // Whether a draw is the same on the member's ranks (seeded apart): between epochs, the
        // shared seed's; in an epoch, each rank's own.
        const auto drawn_alike = [&] {
          float lowest = torch::rand({1}).item<float>(), highest = lowest;
          fc::mpi::iallreduce(ctx.comm(), fc::span<float>(&lowest, 1), fc::op::min).wait();
          fc::mpi::iallreduce(ctx.comm(), fc::span<float>(&highest, 1), fc::op::max).wait();
          return lowest == highest;
        };
        for (int epoch = 1; epoch <= 2; ++epoch) {
          bool first = true;
          for (auto& batch : *loader) {
            if (epoch == 2 && first && ctx.member_size() > 1) ok = ok && !drawn_alike();
            first = false;
            optimizer.zero_grad();
            model->forward(batch.data.view({-1, 6})).pow(2).mean().backward();
            optimizer.step();
          }
          if (epoch == 1) ok = ok && drawn_alike();
          if (epoch == 2 && ctx.reports()) {
            torch::NoGradGuard no_grad;
            for (auto& batch : *tests) fi::evaluated(model->forward(batch.data.view({-1, 6})), batch.target);
          }
        }
      },
      [&](const fi::evaluation& e) {
        reported.push_back(e.epoch);
        const auto samples = e.targets / 10;
        ok = ok && static_cast<int>(e.members.size()) == options.members && e.members[0].size(0) == 11 &&
             torch::equal(std::get<0>(samples.sort()), torch::arange(11)) && !torch::equal(samples, torch::arange(11));
      });
  int reports = static_cast<int>(reported.size());
  fc::mpi::iallreduce(world(), fc::span<int>(&reports, 1), fc::op::sum).wait();
  BOOST_TEST(all_ranks(ok && reports == 1 && (reported.empty() || reported == std::vector<int>{2})));
}

// dataset_of's result shuffled (its shuffle and seed): each epoch visits every sample once per
// member, in an order not the index order and not the previous epoch's, and every member gets
// the same batches in the same order (the first sample of each step's batch, seen by the
// member's first rank, agrees across members).
BOOST_AUTO_TEST_CASE(a_shuffled_dataset_gives_every_member_one_order_per_epoch) {
  counting samples;
  auto data = fi::dataset_of(samples, 4, 2);
  data.shuffle = true;
  data.seed = 5;
  bool ok = true;
  std::vector<std::int64_t> firsts;  // per step: the batch's first sample, from the member's first rank
  fi::train_ensemble(
      world(), small_members(world().size()), data,
      [&](fi::trainer& ctx) {
        auto loader = ctx.loader();
        std::vector<std::vector<std::int64_t>> orders(2);
        for (auto& order : orders) {
          std::vector<std::int64_t> seen(11, 0);
          for (auto& batch : *loader) {
            const auto t = (batch.target / 10).contiguous();
            if (ctx.reports()) firsts.push_back(t[0].item<std::int64_t>());
            for (std::int64_t i = 0; i < t.numel(); ++i) {
              order.push_back(t[i].item<std::int64_t>());
              ++seen[static_cast<std::size_t>(order.back())];
            }
          }
          fc::mpi::iallreduce(ctx.comm(), fc::span<std::int64_t>(seen.data(), seen.size()), fc::op::sum).wait();
          ok = ok && std::all_of(seen.begin(), seen.end(), [](std::int64_t c) { return c == 1; });
        }
        ok = ok && orders[0] != orders[1] && !std::is_sorted(orders[0].begin(), orders[0].end());
        firsts.resize(6);
        fc::mpi::ibcast(ctx.comm(), fc::span<std::int64_t>(firsts.data(), firsts.size()), 0).wait();
      },
      [](const fi::evaluation&) {});
  auto low = firsts, high = firsts;
  fc::mpi::iallreduce(world(), fc::span<std::int64_t>(low.data(), low.size()), fc::op::min).wait();
  fc::mpi::iallreduce(world(), fc::span<std::int64_t>(high.data(), high.size()), fc::op::max).wait();
  BOOST_TEST(all_ranks(ok && firsts.size() == 6 && low == high));
}

// A test before the first epoch has no epoch to be reported with: refused on every rank, saying
// where evaluated() goes.
BOOST_AUTO_TEST_CASE(evaluating_before_the_first_epoch_is_refused) {
  counting data;
  const auto message = error_of([&] {
    fi::train_ensemble(
        world(), small_members(world().size()), fi::dataset_of(data, 4),
        [](fi::trainer&) { fi::evaluated(torch::zeros({2, 3}), torch::zeros({2})); }, [](const fi::evaluation&) {});
  });
  BOOST_TEST(all_ranks(contains(message, "before the first epoch's last step") &&
                       contains(message, "after the loop over the loader")));
}

// The aggregator's view of an epoch boundary: nothing where no member evaluated, and a member
// that evaluated nothing while another did named, with the rule.
BOOST_AUTO_TEST_CASE(an_epoch_some_members_skipped_names_them) {
  const auto round = [](std::vector<float> first, std::vector<float> second) {
    fc::gathered<float> g;
    g.rank_counts = {first.size(), second.size()};
    g.member_counts = g.rank_counts;
    g.member_sizes = {1, 1};
    g.data = first;
    g.data.insert(g.data.end(), second.begin(), second.end());
    return g;
  };
  auto none = round({}, {});
  auto none_too = round({}, {});
  BOOST_TEST(!fi::detail::evaluation_of(3, none, none_too).has_value());
  auto outputs = round({0.5F, 0.25F}, {}), targets = round({1, 0}, {});
  const auto message = error_of([&] { fi::detail::evaluation_of(3, outputs, targets); });
  BOOST_TEST(contains(message, "after epoch 3: member 1 evaluated nothing"));
  BOOST_TEST(contains(message, "trainer::reports()"));
}

// Two modules, two optimizers (one backward through both, then one through the second alone):
// the second module, attached as a parameter list, has a Sync of its own; the replicas, seeded
// apart, end equal. A frozen parameter takes no part (the Sync counts it out), keeps its value
// and gets no gradient; a module all frozen is replicated, with nothing to average; attaching a
// parameter twice, or a module after the first batch, is refused naming average_gradients.
BOOST_AUTO_TEST_CASE(two_modules_with_two_optimizers_train_as_one_per_member) {
  counting data;
  bool ok = true;
  fi::train_ensemble(
      world(), small_members(world().size()), fi::dataset_of(data, 4, 2),
      [&](fi::trainer& ctx) {
        torch::manual_seed(static_cast<std::uint64_t>(200 + world().rank()));
        torch::nn::Linear first(6, 4), second(4, 2), still(2, 2);
        second->bias.set_requires_grad(false);
        for (auto& p : still->parameters()) p.set_requires_grad(false);
        ok = ok && ctx.average_gradients(*first).parameters() == 2;
        ok = ok && ctx.average_gradients(second->parameters()).parameters() == 1;
        ok = ok && ctx.average_gradients(*still).parameters() == 0;
        ok = ok && contains(error_of([&] { ctx.average_gradients({first->weight}); }), "averaged already");
        const auto frozen = second->bias.detach().clone();
        const auto all = [&] {
          auto p = first->parameters();
          for (auto& t : second->parameters()) p.push_back(t);
          for (auto& t : still->parameters()) p.push_back(t);
          return p;
        };
        const double start = member_spread(ctx.comm(), all());  // collectives on every rank, whatever ok is
        ok = ok && start == 0;
        torch::optim::SGD one(first->parameters(), torch::optim::SGDOptions(0.1).momentum(0.5));
        torch::optim::Adam two(std::vector<torch::Tensor>{second->weight}, torch::optim::AdamOptions(0.01));
        auto loader = ctx.loader();
        for (int epoch = 0; epoch < 2; ++epoch) {
          for (auto& batch : *loader) {
            const auto x = batch.data.view({-1, 6});
            one.zero_grad();
            two.zero_grad();
            second->forward(torch::tanh(first->forward(x))).pow(2).mean().backward();
            one.step();
            two.step();
            two.zero_grad();  // the second alone, on the first's outputs as they are
            second->forward(first->forward(x).detach()).sum().backward();
            two.step();
          }
        }
        const double end = member_spread(ctx.comm(), all());
        ok = ok && end == 0 && torch::equal(second->bias, frozen) &&
             !second->bias.grad().defined();
        const auto late = error_of([&] { ctx.average_gradients(*still); });
        ok = ok && contains(late, "average_gradients") && contains(late, "after training started");
      },
      [](const fi::evaluation&) {});
  BOOST_TEST(all_ranks(ok));
}

// A module of BatchNorm (running_mean, running_var, num_batches_tracked) and two buffers of its
// own its forward adds to (float64 `total` += the rank's samples' sum, int64 `steps` += 1), each
// rank of a member on its own share of every batch. buffers::broadcast (the default): every
// replica ends with the member's first rank's (its sum), the running statistics equal;
// buffers::average: the mean of the ranks' sums, the statistics equal, the count broadcast;
// buffers::off: each its own, the statistics apart.
namespace {
struct normed : torch::nn::Module {
  normed() {
    norm = register_module("norm", torch::nn::BatchNorm1d(2));
    out = register_module("out", torch::nn::Linear(6, 2));
    total = register_buffer("total", torch::zeros({1}, torch::kFloat64));
    steps = register_buffer("steps", torch::zeros({}, torch::kInt64));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // [samples, 2, 3]
    {
      torch::NoGradGuard plain;
      total.add_(x.sum().to(torch::kFloat64));
      steps.add_(1);
    }
    return out->forward(norm->forward(x).view({-1, 6}));
  }
  torch::nn::BatchNorm1d norm{nullptr};
  torch::nn::Linear out{nullptr};
  torch::Tensor total, steps;
};
}  // namespace

BOOST_AUTO_TEST_CASE(buffers_are_broadcast_averaged_or_left_within_a_member) {
  for (const auto how : {fi::buffers::broadcast, fi::buffers::average, fi::buffers::off}) {
    counting data;
    bool ok = true;
    auto options = small_members(world().size());
    if (how != fi::buffers::broadcast) options.buffers = how;
    fi::train_ensemble(
        world(), options, fi::dataset_of(data, 4, 2),
        [&](fi::trainer& ctx) {
          torch::manual_seed(static_cast<std::uint64_t>(300 + world().rank()));
          auto model = std::make_shared<normed>();
          ctx.average_gradients(*model);
          torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
          auto loader = ctx.loader();
          double mine = 0;
          std::int64_t steps = 0;
          for (int epoch = 0; epoch < 2; ++epoch) {
            for (auto& batch : *loader) {
              mine += batch.data.sum().item<double>();
              ++steps;
              optimizer.zero_grad();
              model->forward(batch.data).pow(2).mean().backward();
              optimizer.step();
            }
          }
          double first = mine, sum = mine;
          fc::mpi::ibcast(ctx.comm(), fc::span<double>(&first, 1), 0).wait();
          fc::mpi::iallreduce(ctx.comm(), fc::span<double>(&sum, 1), fc::op::sum).wait();
          const double want = how == fi::buffers::broadcast ? first
                              : how == fi::buffers::average ? sum / ctx.member_size()
                                                            : mine;
          const double statistics = member_spread(ctx.comm(), model->norm->buffers());
          const double parameters = member_spread(ctx.comm(), model->parameters());
          ok = ok && std::abs(model->total.item<double>() - want) < 1e-9 * (1 + std::abs(want)) &&
               model->steps.item<std::int64_t>() == steps && steps == 6 && parameters == 0 &&
               (how == fi::buffers::off ? ctx.member_size() == 1 || statistics > 0 : statistics == 0);
        },
        [](const fi::evaluation&) {});
    BOOST_TEST_INFO("buffers " << static_cast<int>(how));
    BOOST_TEST(all_ranks(ok));
  }
}

// A trainer function that walks fewer epochs than the dataset's is refused when it returns, on
// every rank: the epochs are stated once, in dataset_of.
BOOST_AUTO_TEST_CASE(a_loop_shorter_than_the_dataset_is_refused) {
  counting data;
  fi::ensemble_options options{"baseline", 1};
  options.end_job_on_error = false;
  const auto message = error_of([&] {
    fi::train_ensemble(
        world(), options, fi::dataset_of(data, 4, 2),
        [](fi::trainer& ctx) {
          auto loader = ctx.loader();
          for (auto& batch : *loader) (void)batch;  // one epoch of two
        },
        [](const fi::evaluation&) {});
  });
  BOOST_TEST(all_ranks(contains(message, "fewer epochs than")));
}

// Where the build has no CUDA (Debian's libtorch), batches asked on a CUDA device are refused,
// naming the way to a CUDA build; an unknown device backend is refused on every rank before
// anything is set up.
BOOST_AUTO_TEST_CASE(cuda_without_a_cuda_build_is_refused_saying_why) {
  if (!FLEXCOMM_TORCH_CUDA) {
    const auto none = [] { return std::optional<fc::typed_batch>(); };
    const auto message = error_of([&] { fi::data_loader(none, torch::kCUDA); });
    BOOST_TEST(contains(message, "libtorch on the GPU"));
  }
  counting data;
  fi::ensemble_options options{"baseline", 1};
  options.device_backend = "gloo";
  options.end_job_on_error = false;
  const auto message = error_of([&] {
    fi::train_ensemble(world(), options, fi::dataset_of(data, 4), [](fi::trainer&) {}, [](const fi::evaluation&) {});
  });
  BOOST_TEST(all_ranks(contains(message, "unknown device_backend 'gloo'")));
}

// The preset is chosen at run time too: FLEXCOMM_PRESET where the options name none, the options'
// own where they do (as `layout` wins over FLEXCOMM_LAYOUT), else single_broadcast. A run under
// the setting: all_shared has no producers, so every rank trains the one member.
BOOST_AUTO_TEST_CASE(the_preset_comes_from_the_setting_where_the_options_name_none) {
  const int n = world().size();
  fi::ensemble_options named{"baseline", 0};
  named.end_job_on_error = false;
  fi::ensemble_options open = named;
  open.preset.clear();
  setenv("FLEXCOMM_PRESET", "all_shared", 1);
  const auto from_setting = fi::ensemble_choice(n, open), from_code = fi::ensemble_choice(n, named);
  counting data;
  int trained = 0;
  bool ok = true;
  fi::train_ensemble(
      world(), open, fi::dataset_of(data, 4), [&](fi::trainer& ctx) {
        ok = ctx.members() == 1 && ctx.member_size() == n;
        auto loader = ctx.loader();
        for (auto& batch : *loader) (void)batch;
        trained = 1;
      },
      [](const fi::evaluation&) {});
  unsetenv("FLEXCOMM_PRESET");
  const auto by_default = fi::ensemble_choice(n, open);
  fc::mpi::iallreduce(world(), fc::span<int>(&trained, 1), fc::op::sum).wait();
  BOOST_TEST(all_ranks(ok && trained == n));
  BOOST_TEST((from_setting.preset == "all_shared" && from_code.preset == "baseline"));
  BOOST_TEST(by_default.preset == (n >= 2 ? "single_broadcast" : "baseline"));  // 1 rank: no room for its producer
}

// Plain data parallel: one member of every rank ("members=N", no producer, no aggregator) under
// single_broadcast, whose producer finds no room, trains on the baseline's feed, each rank a
// replica whose gradients are the member's mean. A layout the world cannot hold is refused
// quoting it, naming the preset and what the preset added.
BOOST_AUTO_TEST_CASE(plain_data_parallel_runs_under_a_preset_with_producers) {
  const int n = world().size();
  fi::ensemble_options options{"single_broadcast", 0};
  options.layout = "members=" + std::to_string(n);
  options.end_job_on_error = false;
  counting data;
  int trained = 0;
  bool ok = true;
  fi::train_ensemble(
      world(), options, fi::dataset_of(data, 4), [&](fi::trainer& ctx) {
        torch::manual_seed(3);
        torch::nn::Linear model(6, 1);
        ctx.average_gradients(*model);
        auto loader = ctx.loader();
        for (auto& batch : *loader) {
          model->zero_grad();
          model->forward(batch.data.view({-1, 6})).sum().backward();
          auto grad = model->bias.grad().clone(), high = grad.clone(), low = -grad;
          fc::mpi::iallreduce(ctx.comm(), fc::span<float>(high.data_ptr<float>(), 1), fc::op::max).wait();
          fc::mpi::iallreduce(ctx.comm(), fc::span<float>(low.data_ptr<float>(), 1), fc::op::max).wait();
          ok = ok && (high + low).item<float>() == 0;  // the same mean on every replica
        }
        ok = ok && ctx.members() == 1 && ctx.member_size() == n;
        trained = 1;
      },
      [](const fi::evaluation&) {});
  fc::mpi::iallreduce(world(), fc::span<int>(&trained, 1), fc::op::sum).wait();
  BOOST_TEST(all_ranks(ok && trained == n));
  options.layout = "members=" + std::to_string(n + 1);
  const auto message = error_of([&] {
    fi::train_ensemble(world(), options, fi::dataset_of(data, 4), [](fi::trainer&) {}, [](const fi::evaluation&) {});
  });
  const auto m = std::to_string(n + 1);
  BOOST_TEST(all_ranks(contains(message, "interop::train_ensemble: layout 'members=" + m + "' with preset "
                                         "single_broadcast (which adds producers=1 and aggregator=1, making "
                                         "'producers=1 members=" + m + " aggregator=1') needs " +
                                         std::to_string(n + 2) + " ranks, world has " + std::to_string(n))));
}

// "members=auto:2" sized from the members' costs: under single_broadcast, its producer in front
// where the world has room, the dearer member gets the spare ranks; without costs, refused
// saying what to give.
BOOST_AUTO_TEST_CASE(an_auto_layout_is_sized_from_the_member_costs) {
  const int n = world().size();
  if (n < 2) return;  // two members need two ranks
  fi::ensemble_options options{"single_broadcast", 0};
  options.layout = "members=auto:2";
  options.member_costs = {1.0, 8.0};
  options.end_job_on_error = false;
  counting data;
  std::vector<int> sizes(2, 0);
  bool trained = false;
  fi::train_ensemble(
      world(), options, fi::dataset_of(data, 4), [&](fi::trainer& ctx) {
        torch::nn::Linear model(6, 1);
        ctx.average_gradients(*model);
        auto loader = ctx.loader();
        for (auto& batch : *loader) {
          model->zero_grad();
          model->forward(batch.data.view({-1, 6})).sum().backward();
        }
        sizes[static_cast<std::size_t>(ctx.member())] = ctx.member_size();
        trained = true;
      },
      [](const fi::evaluation&) {});
  fc::mpi::iallreduce(world(), fc::span<int>(sizes.data(), 2), fc::op::max).wait();
  // Two ranks: no room for the producer, the baseline runs; more: one producer, the rest split.
  const int budget = n == 2 ? 2 : n - 1;
  BOOST_TEST(all_ranks(sizes[0] == 1 && sizes[1] == budget - 1));
  BOOST_TEST(all_ranks(trained || (n > 2 && world().rank() == 0)));
  options.member_costs.clear();
  const auto message = error_of([&] {
    fi::train_ensemble(world(), options, fi::dataset_of(data, 4), [](fi::trainer&) {}, [](const fi::evaluation&) {});
  });
  BOOST_TEST(all_ranks(contains(message, "asks flexcomm to size its members: give ensemble_options::member_costs")));
}
