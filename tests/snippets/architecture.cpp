// docs/architecture.md's blocks, compiled as they are printed (tests/snippets/check.py): each
// block is the body of a function template here, instantiated for every adapter it stands for.
#include <flexcomm/flexcomm.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace flexcomm::snippets {

inline std::size_t decode(std::int64_t step, int shard, span<std::byte> out) {
  for (auto& b : out) b = static_cast<std::byte>(step + shard);
  return out.size();
}

template <class Feed>
void feed_block(const mpi::communicator& world, const ensemble_layout& layout, const feed_options& options) {
  auto train = [](std::int64_t, span<const std::byte>) {};
  // bytes written into `out` (at most out.size()); called once per (step, shard)
  loader load = [](std::int64_t step, int shard, span<std::byte> out) { return decode(step, shard, out); };
  Feed feed(world, layout, load, options);   // collective over world
  if (layout.role_of(world.rank()).kind == role::producer) {
    feed.produce();                          // runs until the last step is shipped
  } else {
    while (auto batch = feed.next()) {       // on trainer ranks
      train(batch->step(), batch->bytes());  // span<const std::byte>, valid until the next next()
    }
  }
}
template void feed_block<local_feed>(const mpi::communicator&, const ensemble_layout&, const feed_options&);
template void feed_block<one_to_many<mpi>>(const mpi::communicator&, const ensemble_layout&, const feed_options&);
template void feed_block<all_shared<mpi>>(const mpi::communicator&, const ensemble_layout&, const feed_options&);

template <class Sync>
void sync_block(const mpi::communicator& member_comm, const sync_options& options, int index, span<float> grad) {
  Sync sync(member_comm, options);   // collective over the member
  sync.ready(index, grad);           // span<T>, as backprop produces gradient `index`
  sync.finish();                     // before the optimizer step; averages are in place
}
template void sync_block<subgroup_allreduce<mpi>>(const mpi::communicator&, const sync_options&, int, span<float>);
template void sync_block<overlapped_ring<mpi>>(const mpi::communicator&, const sync_options&, int, span<float>);

void collect_block(const mpi::communicator& world, const ensemble_layout& layout, const std::vector<float>& predictions) {
  using B = mpi;
  auto score = [](const gathered<float>&) {};
  many_to_one<B> collect(world, layout);             // collective over world
  if (layout.role_of(world.rank()).kind == role::trainer)
    collect.submit(predictions);                     // span<const T> or vector; once per round; may be empty
  collect.flush();                                   // waits until this rank's submissions have arrived
  if (collect.is_aggregator()) {                     // on layout.aggregator()
    gathered<float> each = collect.gather<float>();  // data, rank_counts, member_counts; member(m), trainer(m, r)
    score(each);                                     // (or collect.reduce<float>(op::avg): element-wise over members)
  }
}

void pipeline_block(const mpi::communicator& world, const ensemble_layout& layout,
                    presets::single_broadcast<overlapped_ring>::options options) {
  using P = presets::single_broadcast<overlapped_ring>;
  loader load = decode;
  auto train = [](auto&) {};
  auto aggregate = [](auto&) {};
  P::pipeline pipe(world, layout, P::configure(options));  // collective; options.feed, options.sync
  pipe.run(load, train, aggregate);  // train(ctx) on trainers, then aggregate(ctx) on the aggregator
}

}  // namespace flexcomm::snippets

int main() { return 0; }
