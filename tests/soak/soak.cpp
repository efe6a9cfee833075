// Soak test (meson -Dsoak=true; suite 'soak'): 100,000 small operations through the backend
// (directly and through the progress engine) and then through the adapters on this branch (a
// shared feed, both gradient syncs), checking that neither the resident memory nor the number of
// outstanding requests grows. Prints the RSS and request counts it sampled.
//
//   mpiexec -n 4 soak [operations]
#include <flexcomm/flexcomm.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <unistd.h>
#include <vector>

namespace fc = flexcomm;
using fc::mpi;

namespace {

long rss_kib() {
  std::ifstream statm("/proc/self/statm");
  long size = 0, resident = 0;
  statm >> size >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

struct sample {
  long ops, rss, outstanding, in_flight;
};

// One "step": a gradient allreduce, a flag broadcast, a ring exchange, and one allreduce driven by
// the progress engine while this thread waits on the completion only. Six operations.
int step(const mpi::communicator& world, std::vector<float>& grad, std::vector<int>& ring_in,
         std::vector<int>& ring_out, long s) {
  const int rank = world.rank(), size = world.size();
  auto a = mpi::iallreduce(world, fc::span<float>(grad), fc::op::avg);
  int flag = static_cast<int>(s);
  auto b = mpi::ibcast(world, fc::span<int>(&flag, 1), static_cast<int>(s % size));
  auto r = mpi::irecv(world, fc::span<int>(ring_in), (rank + size - 1) % size, 5);
  auto w = mpi::isend(world, fc::span<const int>(ring_out), (rank + 1) % size, 5);
  a.wait();
  b.wait();
  r.wait();
  w.wait();
  auto bg = std::make_shared<mpi::request>(mpi::iallreduce(world, fc::span<float>(grad), fc::op::sum));
  fc::progress_engine::instance().submit([bg] { return bg->test(); }, "soak allreduce")->wait();
  std::vector<std::int64_t> all(static_cast<std::size_t>(size));
  std::int64_t mine = s;
  mpi::iallgather<std::int64_t>(world, fc::span<const std::int64_t>(&mine, 1), fc::span<std::int64_t>(all)).wait();
  return flag == static_cast<int>(s) && all.back() == s ? 0 : 1;
}

// Adapters: one shared-feed stream of `steps` steps over "producers=1 members=(n-1)x1" (the
// world's only layout with a producer at every size), then `steps` sync steps of each Sync on one
// member spanning the world. Returns the number of wrong results.
int adapters(const mpi::communicator& world, std::int64_t steps, std::vector<sample>& samples, long& ops) {
  int wrong = 0;
  const int n = world.size();
  auto record = [&](long done) {
    samples.push_back({done, rss_kib(), static_cast<long>(fc::progress_engine::instance().outstanding()),
                       static_cast<long>(fc::watchdog::instance().in_flight())});
  };
  if (n > 1) {
    const auto layout = fc::ensemble_layout::parse(fc::cat("producers=1 members=", n - 1, "x1"));
    fc::feed_options options;
    options.steps = steps;
    options.shard_capacity = 64;
    fc::loader load = [](std::int64_t step, int, fc::span<std::byte> out) {
      for (auto& b : out) b = std::byte{static_cast<unsigned char>(step)};
      return out.size();
    };
    fc::one_to_many<mpi> feed(world, layout, load, options);
    if (layout.role_of(world.rank()).kind == fc::role::producer) {
      feed.produce();
    } else {
      while (auto b = feed.next())
        for (auto byte : b->bytes()) wrong += byte != std::byte{static_cast<unsigned char>(b->step())};
    }
  }
  ops += steps;
  record(ops);
  auto member = world.split(0, world.rank(), "member 0");
  fc::sync_options options;
  options.bucket_bytes = 32 * sizeof(float);
  std::vector<std::vector<float>> grads(3, std::vector<float>(24));
  auto train = [&](auto& sync) {
    for (std::int64_t s = 0; s < steps; ++s) {
      for (auto& g : grads) std::fill(g.begin(), g.end(), 2.0f);
      for (int i = 2; i >= 0; --i) sync.ready(i, fc::span<float>(grads[static_cast<std::size_t>(i)]));
      sync.finish();
      for (auto& g : grads) wrong += g[0] != 2.0f;
      ops += 3;
      if (s % (steps / 4) == 0) record(ops);
    }
  };
  {
    fc::subgroup_allreduce<mpi> sync(member, options);
    train(sync);
  }
  {
    fc::overlapped_ring<mpi> sync(member, options);
    train(sync);
  }
  record(ops);
  return wrong;
}

}  // namespace

int main(int argc, char** argv) {
  fc::environment env(argc, argv);
  const auto& world = env.world();
  const long operations = argc > 1 ? std::stol(argv[1]) : 100000;
  const long per_step = 6, steps = (operations + per_step - 1) / per_step;
  std::vector<float> grad(16, 1.0f);
  std::vector<int> ring_in(8), ring_out(8, world.rank());
  std::vector<sample> samples;
  int wrong = 0;
  for (long s = 0; s < steps; ++s) {
    wrong += step(world, grad, ring_in, ring_out, s);
    if (s % (steps / 10) == 0 || s == steps - 1)
      samples.push_back({(s + 1) * per_step, rss_kib(), static_cast<long>(fc::progress_engine::instance().outstanding()),
                         static_cast<long>(fc::watchdog::instance().in_flight())});
  }
  // Warm-up ends after the first tenth: MPICH and the allocator size their pools by then.
  const long base = samples.at(1).rss, backend_end = samples.back().rss;
  // The adapters' part: their warm-up is their first quarter.
  long ops = steps * per_step;
  std::vector<sample> adapter_samples;
  const std::int64_t adapter_steps = std::max<std::int64_t>(8, operations / 10 / 3);
  wrong += adapters(world, adapter_steps, adapter_samples, ops);
  const long adapter_base = adapter_samples.at(std::min<std::size_t>(2, adapter_samples.size() - 1)).rss;
  samples.insert(samples.end(), adapter_samples.begin(), adapter_samples.end());
  const long last = samples.back().rss;
  long worst_outstanding = 0;
  for (const auto& p : samples) worst_outstanding = std::max(worst_outstanding, p.outstanding + p.in_flight);
  const bool ok = wrong == 0 && backend_end - base <= 1024 && last - adapter_base <= 1024 &&
                  samples.back().outstanding == 0 && samples.back().in_flight == 0;
  int all_ok = ok ? 1 : 0;
  mpi::iallreduce(world, fc::span<int>(&all_ok, 1), fc::op::min).wait();
  if (world.rank() == 0 || !ok) {
    std::printf("rank %d: %ld backend operations, then adapter steps (feed, subgroup_allreduce, overlapped_ring), "
                "%d wrong results\n  ops      rss KiB  engine outstanding  in flight\n",
                world.rank(), steps * per_step, wrong);
    for (const auto& p : samples)
      std::printf("  %7ld  %7ld  %18ld  %9ld\n", p.ops, p.rss, p.outstanding, p.in_flight);
    std::printf("rank %d: backend: RSS after warm-up %ld KiB, at its end %ld KiB (growth %ld KiB, limit 1024); "
                "adapters: %ld KiB after warm-up, %ld KiB at the end (growth %ld KiB, limit 1024); "
                "most outstanding at a sample %ld: %s\n",
                world.rank(), base, backend_end, backend_end - base, adapter_base, last, last - adapter_base,
                worst_outstanding, ok ? "OK" : "FAILED");
  }
  return all_ok ? 0 : 1;
}
