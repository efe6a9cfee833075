// README.md's "Using it": a whole program, compiled and run (4 ranks, suite mpi) as it is printed
// there (tests/snippets/check.py).
#include <flexcomm/flexcomm.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace fc = flexcomm;

int main(int argc, char** argv) {
  fc::environment env{argc, argv};  // MPI up (MPI_THREAD_MULTIPLE); wait policy chosen for this host
  // producers=1: world rank 0 produces; members=2,1: member 0 trains on ranks 1-2, member 1 on rank 3;
  // aggregator=1: world rank 1 (a rank, not a count) gathers the results.
  auto layout = fc::ensemble_layout::from_env("producers=1 members=2,1 aggregator=1");
  layout.validate(env.world().size());  // "layout '...' needs 4 ranks, world has 3"

  using Preset = fc::presets::single_broadcast<fc::overlapped_ring>;
  Preset::options options;             // .feed (fc::feed_options) and .sync (fc::sync_options)
  options.feed.steps = 50;             // batches in the stream
  options.feed.shard_capacity = 1024;  // the most bytes the loader writes into one shard
  Preset::pipeline pipe{env.world(), layout, Preset::configure(options)};

  // Runs on the producer, once per step and shard: writes the shard's bytes, returns how many.
  auto loader = [](std::int64_t step, int shard, fc::span<std::byte> out) {
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::byte>((step + shard + i) % 256);
    return out.size();
  };
  bool members_agree = true;
  pipe.run(loader,
           [&](auto& ctx) {  // every trainer rank: a model of 64 weights
             std::vector<float> weights(64, 0.1f * static_cast<float>(ctx.member() + 1)), grad(64);
             while (auto batch = ctx.feed().next()) {  // this rank's shards of the step
               for (std::size_t i = 0; i < grad.size(); ++i)
                 grad[i] = weights[i] * static_cast<float>(batch->bytes()[i % batch->size()]) / 255.0f;
               ctx.sync().ready(0, fc::span<float>(grad));  // averaged over this member's ranks
               ctx.sync().finish();
               for (std::size_t i = 0; i < weights.size(); ++i) weights[i] -= 0.01f * grad[i];
             }
             ctx.collect().submit(weights);  // to the aggregator
           },
           [&](auto& ctx) {  // the aggregator only, after its own role's work
             auto each = ctx.collect().template gather<float>();
             for (int m = 0; m < ctx.members(); ++m)  // averaged gradients: a member's ranks agree
               for (int r = 1; r < ctx.layout().member_size(m); ++r)
                 members_agree = members_agree && std::equal(each.trainer(m, r).begin(), each.trainer(m, r).end(),
                                                             each.trainer(m, 0).begin());
             std::printf("aggregator (world rank %d, %s): %d members, weights %s within each member\n",
                         env.world().rank(), ctx.is_trainer() ? "also a trainer" : "a producer", ctx.members(),
                         members_agree ? "agree" : "DIFFER");
           });
  return members_agree ? 0 : 1;
}
