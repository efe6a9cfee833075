// The Sync adapters on device gradients: subgroup_allreduce and overlapped_ring over the nccl and
// staged backends leave each gradient's average over the member in place, step after step, with
// gradients fused into shared buckets (device staging) and buckets launched as they fill.
#define BOOST_TEST_MODULE gpu_sync_device
#include "gpu_fixture.hpp"

#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

namespace fc = flexcomm;
using fc::testing::world;

namespace {
// Gradient sizes in backprop order: small ones fuse into shared buckets, the large one travels
// alone and is cut into many ring segments.
const std::size_t sizes[] = {10, 1280, 128, 100352, 3};

float value(int rank, int step, int gradient, std::size_t i) {
  return static_cast<float>(static_cast<int>((static_cast<std::size_t>(rank) * 7 + i * 3 + step * 5 + gradient) % 9) - 4);
}

enum class placed { own_allocations, gradient_memory };

// Runs `steps` steps of `Sync` on `member`; true when every gradient holds the average. The
// gradients are the trainer's own device allocations, or lie in the adapter's gradient_memory()
// (device memory on a device backend), 256-byte aligned as a caching allocator places them.
template <class Sync, class Comm>
bool averages_in_place(const Comm& member, fc::sync_options options, int steps, placed where = placed::own_allocations) {
  const int rank = member.rank(), size = member.size();
  Sync sync(member, options);
  std::vector<float*> grads;
  if (where == placed::gradient_memory) {
    std::vector<std::size_t> at;
    std::size_t floats = 0;
    for (std::size_t n : sizes) {
      at.push_back(floats);
      floats += (n + 63) / 64 * 64;
    }
    const auto memory = sync.gradient_memory(floats * sizeof(float));
    BOOST_TEST_REQUIRE(memory.size() == floats * sizeof(float));
    for (std::size_t offset : at) grads.push_back(reinterpret_cast<float*>(memory.data()) + offset);
  } else {
    for (std::size_t n : sizes) {
      void* g = nullptr;
      fc::check_cuda(fc::device::malloc_device(&g, n * sizeof(float)), "test: cudaMalloc");
      grads.push_back(static_cast<float*>(g));
    }
  }
  bool ok = true;
  for (int step = 0; step < steps; ++step) {
    for (int i = 0; i < static_cast<int>(grads.size()); ++i) {
      const std::size_t n = sizes[i];
      std::vector<float> host(n);
      for (std::size_t k = 0; k < n; ++k) host[k] = value(rank, step, i, k);
      fc::check_cuda(fc::device::copy_sync(grads[static_cast<std::size_t>(i)], host.data(), n * sizeof(float)),
                     "test: upload");
      sync.ready(i, fc::span<float>(grads[static_cast<std::size_t>(i)], n));
    }
    sync.finish();
    fc::check_cuda(fc::device::device_synchronize(), "test: sync");
    for (int i = 0; i < static_cast<int>(grads.size()); ++i) {
      const std::size_t n = sizes[i];
      std::vector<float> got(n);
      fc::check_cuda(fc::device::copy_sync(got.data(), grads[static_cast<std::size_t>(i)], n * sizeof(float)),
                     "test: download");
      for (std::size_t k = 0; k < n && ok; ++k) {
        float sum = 0;
        for (int r = 0; r < size; ++r) sum += value(r, step, i, k);
        const float want = sum * (1.0f / static_cast<float>(size));
        ok = std::fabs(got[k] - want) <= 1e-6f * std::fmax(1.f, std::fabs(want));
        if (!ok) BOOST_TEST_MESSAGE("step " << step << " gradient " << i << " [" << k << "]: " << got[k] << ", want " << want);
      }
    }
  }
  if (where == placed::own_allocations)
    for (float* g : grads) fc::device::free_device(g);
  return ok;
}

// Hosts of two ranks each (the last of one, for an odd count): "2+2", "2+2+1", ...
std::string cat_blocks(int ranks) {
  std::string out;
  for (int left = ranks; left > 0; left -= 2) out += (out.empty() ? "" : "+") + std::to_string(left >= 2 ? 2 : 1);
  return out;
}

fc::sync_options fused(bool when_full) {
  fc::sync_options o;
  o.bucket_bytes = 8192;  // the three small gradients share buckets
  o.segment_bytes = 4096;
  o.segments_in_flight = 2;
  o.launch_when_full = when_full;
  return o;
}
}  // namespace

// Runs first: two ranks on one GPU need the test-only environment of tests/gpu/nccl_env.sh.
BOOST_AUTO_TEST_CASE(ranks_sharing_a_gpu_have_distinct_nccl_host_ids) {
  const auto problem = fc::testing::nccl_gpu_sharing_problem();
  BOOST_TEST_REQUIRE(fc::testing::all_ranks(problem.empty()), problem);
}

BOOST_AUTO_TEST_CASE(subgroup_allreduce_on_nccl) {
  fc::nccl::communicator member(world(), "member");
  BOOST_TEST(fc::testing::all_ranks(averages_in_place<fc::subgroup_allreduce<fc::nccl>>(member, fused(false), 3)));
  BOOST_TEST(fc::testing::all_ranks(averages_in_place<fc::subgroup_allreduce<fc::nccl>>(member, fused(true), 3)));
}

BOOST_AUTO_TEST_CASE(subgroup_allreduce_on_staged) {
  fc::staged::communicator member(world(), "member");
  BOOST_TEST(fc::testing::all_ranks(averages_in_place<fc::subgroup_allreduce<fc::staged>>(member, fused(true), 3)));
}

// MPI tags keep the ring's segments apart: several buckets and lanes in flight at once.
BOOST_AUTO_TEST_CASE(overlapped_ring_on_staged) {
  fc::staged::communicator member(world(), "member");
  BOOST_TEST(fc::testing::all_ranks(averages_in_place<fc::overlapped_ring<fc::staged>>(member, fused(true), 3)));
}

// A member across hosts averages in tiers (reduce within each host, allreduce across the host
// leaders, broadcast within each host) on device backends too, on the progress engine's thread;
// pretend hosts of one and two ranks. On the stand-in each rank has a device of its own.
BOOST_AUTO_TEST_CASE(the_hierarchical_route_on_device_backends) {
  const int n = world().size();
  const std::string hosts = n == 1 ? "1" : n == 2 ? "1+1" : n == 3 ? "2+1" : cat_blocks(n);
  setenv("FLEXCOMM_HOSTS", hosts.c_str(), 1);
  auto options = fused(true);
  options.hierarchical = fc::hierarchy::on;
  fc::staged::communicator staged_member(world(), "member");
  const bool ring = averages_in_place<fc::overlapped_ring<fc::staged>>(staged_member, options, 3);
  const bool staged = averages_in_place<fc::subgroup_allreduce<fc::staged>>(staged_member, options, 3);
  fc::nccl::communicator nccl_member(world(), "member");
  const bool nccl = averages_in_place<fc::subgroup_allreduce<fc::nccl>>(nccl_member, options, 3);
  unsetenv("FLEXCOMM_HOSTS");
  BOOST_TEST(fc::testing::all_ranks(ring));
  BOOST_TEST(fc::testing::all_ranks(staged));
  BOOST_TEST(fc::testing::all_ranks(nccl));
}

// Trainer code that keeps its gradients in gradient_memory() (on one host's shared memory, reduced
// where they lie) runs unchanged on a device backend: there the memory is device memory.
BOOST_AUTO_TEST_CASE(gradients_in_gradient_memory_average_on_device_backends) {
  fc::nccl::communicator nccl_member(world(), "member");
  BOOST_TEST(fc::testing::all_ranks(
      averages_in_place<fc::subgroup_allreduce<fc::nccl>>(nccl_member, fused(true), 3, placed::gradient_memory)));
  fc::staged::communicator staged_member(world(), "member");
  BOOST_TEST(fc::testing::all_ranks(
      averages_in_place<fc::overlapped_ring<fc::staged>>(staged_member, fused(true), 3, placed::gradient_memory)));
  BOOST_TEST(fc::testing::all_ranks(
      averages_in_place<fc::subgroup_allreduce<fc::staged>>(staged_member, fused(false), 3, placed::gradient_memory)));
}

// NCCL has no tags, so overlapped_ring<nccl> does not compile (tests/compile_fail); the README's
// NCCL line is a preset with the Sync on nccl and the feed and collect on its host backend, MPI:
// batches arrive in host memory, gradients are averaged in device memory, predictions gathered
// on the host.
template <class Preset>
bool preset_runs_on_host_feed_and_device_sync(const fc::ensemble_layout& layout) {
  static_assert(std::is_same_v<typename Preset::pipeline::sync_type, fc::subgroup_allreduce<fc::nccl>>);
  static_assert(std::is_same_v<typename Preset::pipeline::collect_type, fc::many_to_one<fc::mpi>>);
  constexpr int steps = 3;
  constexpr std::size_t n = 1000;
  typename Preset::options options;
  options.feed.steps = steps;
  options.feed.shard_capacity = 64;
  typename Preset::pipeline pipe(world(), layout, Preset::configure(options));
  bool ok = true;
  pipe.run(
      [](std::int64_t step, int shard, fc::span<std::byte> out) {
        for (auto& b : out) b = std::byte{static_cast<unsigned char>(step * 16 + shard)};
        return out.size();
      },
      [&](auto& ctx) {
        void* raw = nullptr;
        fc::check_cuda(fc::device::malloc_device(&raw, n * sizeof(float)), "test: cudaMalloc");
        auto* g = static_cast<float*>(raw);
        float last = 0;
        // Batches into device memory, as a GPU trainer takes them: this rank's shards of the
        // step, 64 bytes each, shard k's bytes all step * 16 + k, in consecutive shards.
        fc::cuda::device_feed<std::remove_reference_t<decltype(ctx.feed())>> device_batches(ctx.feed(), 16 * 64);
        while (auto batch = device_batches.next()) {
          std::vector<unsigned char> bytes(batch->bytes().size());
          fc::check_cuda(fc::device::copy_sync(bytes.data(), batch->bytes().data(), bytes.size()), "test: download batch");
          ok = ok && !bytes.empty() && bytes.size() % 64 == 0 && bytes[0] >= batch->step() * 16 &&
               bytes[0] < batch->step() * 16 + 16;
          for (std::size_t j = 0; j < bytes.size() && ok; ++j)
            ok = bytes[j] == static_cast<unsigned char>(bytes[0] + j / 64);
          // The member's ranks hand over rank_in_member + step: the average is known.
          const std::vector<float> host(n, static_cast<float>(ctx.rank_in_member() + batch->step()));
          fc::check_cuda(fc::device::copy_sync(g, host.data(), n * sizeof(float)), "test: upload");
          ctx.sync().ready(0, fc::span<float>(g, n));
          ctx.sync().finish();
          std::vector<float> got(n);
          fc::check_cuda(fc::device::copy_sync(got.data(), g, n * sizeof(float)), "test: download");
          const float want = static_cast<float>(ctx.member_size() - 1) / 2.0f + static_cast<float>(batch->step());
          for (float x : got) ok = ok && std::fabs(x - want) <= 1e-6f;
          last = got[0];
        }
        fc::device::free_device(g);
        ctx.collect().submit(std::vector<float>{last});
      },
      [&](auto& ctx) {
        const auto all = ctx.collect().template gather<float>();
        for (int m = 0; m < ctx.members(); ++m)
          for (float x : all.member(m))
            ok = ok && std::fabs(x - (static_cast<float>(ctx.layout().member_size(m) - 1) / 2.0f + (steps - 1))) <= 1e-6f;
      });
  return ok;
}

BOOST_AUTO_TEST_CASE(a_preset_feeds_and_collects_on_the_host_and_averages_on_nccl) {
  const int n = world().size();
  bool ok;
  if (n == 1)  // no room for a producer: the members take turns preprocessing
    ok = preset_runs_on_host_feed_and_device_sync<fc::presets::all_shared<fc::subgroup_allreduce, fc::nccl>>(
        fc::ensemble_layout::parse("members=1"));
  else
    ok = preset_runs_on_host_feed_and_device_sync<fc::presets::single_broadcast<fc::subgroup_allreduce, fc::nccl>>(
        fc::ensemble_layout::parse(fc::cat("producers=1 members=", n - 1)));
  BOOST_TEST(fc::testing::all_ranks(ok));
}
