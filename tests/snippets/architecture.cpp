// docs/architecture.md's blocks, compiled as they are printed (tests/snippets/check.py): each
// block is the body of a function template here, instantiated for every adapter it stands for.
#include <flexcomm/flexcomm.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
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

inline void decode_image(std::int64_t index, span<float> pixels, span<std::int32_t> label) {
  for (auto& p : pixels) p = static_cast<float>(index);
  label[0] = static_cast<std::int32_t>(index % 10);
}

template <class Feed>
void typed_feed_block(const mpi::communicator& world, const ensemble_layout& layout, const feed_options& options) {
  auto evaluate = [](std::int64_t) {};
  auto train = [](const tensor_view<float>&, const tensor_view<std::int32_t>&, std::int64_t, bool) {};
  dataset data;                                          // the same description on every rank
  data.size = 60000;                                     // samples per epoch
  data.batch = 64;                                       // any size, for any layout
  data.epochs = 3;
  data.sample = field::of<float>({28, 28});
  data.label = field::of<std::int32_t>();
  data.load_sample = [&](std::int64_t index, const sample_slot& out) {  // needed only where this rank loads
    decode_image(index, out.sample<float>(), out.label<std::int32_t>());
  };
  typed_feed<Feed> feed(world, layout, data, options);   // collective; options: depth, flow
  if (!feed.is_trainer()) feed.produce();
  feed.on_epoch_end([&](std::int64_t epoch) { evaluate(epoch); });
  for (const typed_batch& batch : feed) {                // on trainer ranks
    tensor_view<float> x = batch.as<float>();            // {samples, 28, 28}, 64-byte aligned
    tensor_view<std::int32_t> y = batch.labels<std::int32_t>();
    train(x, y, batch.epoch(), batch.last_in_epoch());
  }
}
template void typed_feed_block<local_feed>(const mpi::communicator&, const ensemble_layout&, const feed_options&);
template void typed_feed_block<one_to_many<mpi>>(const mpi::communicator&, const ensemble_layout&, const feed_options&);
template void typed_feed_block<all_shared<mpi>>(const mpi::communicator&, const ensemble_layout&, const feed_options&);

template <class Sync>
void sync_block(const mpi::communicator& member_comm, const sync_options& options, int index, span<float> grad,
                std::size_t bytes) {
  Sync sync(member_comm, options);   // collective over the member
  sync.ready(index, grad);           // span<T>, as backprop produces gradient `index`
  sync.finish();                     // before the optimizer step; averages are in place
  auto memory = sync.gradient_memory(bytes);  // collective: where to keep gradients (optional)
  (void)memory;
}
template void sync_block<subgroup_allreduce<mpi>>(const mpi::communicator&, const sync_options&, int, span<float>,
                                                  std::size_t);
template void sync_block<overlapped_ring<mpi>>(const mpi::communicator&, const sync_options&, int, span<float>,
                                               std::size_t);

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

void typed_pipeline_block(const mpi::communicator& world, const ensemble_layout& layout, const dataset& data,
                          presets::all_shared<>::options options) {
  presets::all_shared<>::pipeline pipe(world, layout, presets::all_shared<>::configure(options));
  auto score = [](std::int64_t, span<float>) {};
  auto predict = [] { return std::vector<float>(10, 0.1f); };
  auto step = [](const typed_batch&) {};
  pipe.on_round([&](std::int64_t round, gathered<float>& each) { score(round, each.member(0)); });
  pipe.run(data, [&](auto& ctx) {                      // a dataset instead of a loader: ctx.batches()
    ctx.batches().on_epoch_end([&](std::int64_t) { ctx.collect().submit(predict()); });
    while (auto batch = ctx.batches().next()) step(*batch);
  });
}

// docs/heterogeneous.md's block: a member that converges hands its ranks on.
struct handover_model {
  std::vector<float> weights = std::vector<float>(4, 0.0f);
  std::vector<span<std::byte>> state_spans() { return {as_writable_bytes(span<float>(weights))}; }
};

void handover_block(ensemble_pipeline<local_feed, subgroup_allreduce<mpi>, many_to_one<mpi>>& pipe, loader load,
                    std::vector<double> costs) {
  using Model = handover_model;
  auto train_step = [](Model& model, const batch&, auto& sync) {
    sync.ready(0, span<float>(model.weights));
    sync.finish();
  };
  auto converged = [](const Model& model) { return model.weights[0] > 1.0f; };
  std::map<int, Model> models;                        // this rank's model of each member it trains
  pipe.on_handover({[&](int m) { return models[m].state_spans(); },  // parameters + optimizer state
                    costs});                          // optional: plan costs, for the default target
  pipe.run(load, [&](auto& ctx) {
    auto& model = models[ctx.member()];               // called again after a hand-over: new member
    while (auto batch = ctx.feed().next()) {
      train_step(model, *batch, ctx.sync());
      if (converged(model)) return ctx.finish_member();  // collective over the member, this step
    }
  });
}

}  // namespace flexcomm::snippets

int main() { return 0; }
