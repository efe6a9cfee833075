// A trainer captures a whole step into a CUDA graph and replays it: forward, backward with
// subgroup_allreduce<nccl>'s ready()/finish() on the trainer's stream, and the optimizer step.
// Replays leave the parameters bit for bit where the same steps uncaptured leave them; a step a
// graph could not replay (staged, the first step, a Sync given no stream) is refused by name. On
// the stand-in the capture rules are CUDA's (tests/unit/standin.cpp).
#define BOOST_TEST_MODULE gpu_capture
#include "gpu_fixture.hpp"

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace fc = flexcomm;
namespace dv = flexcomm::device;
using fc::testing::world;

namespace {
// The model's parameter tensors, in forward order: small ones fuse into shared buckets.
const std::size_t sizes[] = {10, 1280, 128, 3};
constexpr int layers = 4;

float input(int rank, int step, int layer, std::size_t i) {
  return static_cast<float>(static_cast<int>((static_cast<std::size_t>(rank) * 7 + i * 3 + step * 5 + layer) % 9) - 4);
}

float* device_floats(std::size_t n) {
  void* p = nullptr;
  fc::check_cuda(dv::malloc_device(&p, n * sizeof(float)), "test: cudaMalloc");
  return static_cast<float*>(p);
}

// A tiny model on the device layer's kernels, everything on one stream: per layer, activation
// h = w * x, gradient g = h + x (handed over last layer first, as backward makes them), and
// SGD w += -1/8 * g on the averaged gradient.
struct model {
  dv::stream_t stream = nullptr;
  std::vector<float*> w, x, h, g, step_scale;
  explicit model(dv::stream_t s) : stream(s) {
    for (std::size_t n : sizes) {
      for (auto* v : {&w, &x, &h, &g, &step_scale}) v->push_back(device_floats(n));
      upload(w.back(), std::vector<float>(n, 0.5f));
      upload(step_scale.back(), std::vector<float>(n, -0.125f));
    }
  }
  ~model() {
    for (auto* v : {&w, &x, &h, &g, &step_scale})
      for (float* p : *v) dv::free_device(p);
  }
  void upload(float* to, const std::vector<float>& from) {
    fc::check_cuda(dv::copy_async(to, from.data(), from.size() * sizeof(float), stream), "test: upload");
  }
  // This step's batch, queued on the stream before the step (outside any graph, as a trainer's
  // loader fills its static input buffers between replays).
  void load(int rank, int step) {
    for (int l = 0; l < layers; ++l) {
      std::vector<float> host(sizes[l]);
      for (std::size_t i = 0; i < sizes[l]; ++i) host[i] = input(rank, step, l, i);
      upload(x[static_cast<std::size_t>(l)], host);
    }
  }
  // `wait_before_ready`: for a Sync given no stream, which does not order itself after this one.
  template <class Sync>
  void step(Sync& sync, bool wait_before_ready = false) {
    for (std::size_t l = 0; l < layers; ++l) {
      fc::check_cuda(dv::copy_async(h[l], w[l], sizes[l] * sizeof(float), stream), "test: forward");
      fc::cuda::combine(fc::op::prod, h[l], x[l], sizes[l], stream);
    }
    for (int l = layers - 1; l >= 0; --l) {
      const auto k = static_cast<std::size_t>(l);
      fc::check_cuda(dv::copy_async(g[k], h[k], sizes[k] * sizeof(float), stream), "test: backward");
      fc::cuda::combine(fc::op::sum, g[k], x[k], sizes[k], stream);
      if (wait_before_ready) fc::check_cuda(dv::stream_synchronize(stream), "test: sync");
      sync.ready(l, fc::span<float>(g[k], sizes[k]));
    }
    sync.finish();
    for (std::size_t l = 0; l < layers; ++l) {  // h is free again: it holds the update
      fc::check_cuda(dv::copy_async(h[l], g[l], sizes[l] * sizeof(float), stream), "test: optimizer");
      fc::cuda::combine(fc::op::prod, h[l], step_scale[l], sizes[l], stream);
      fc::cuda::combine(fc::op::sum, w[l], h[l], sizes[l], stream);
    }
  }
  std::vector<float> parameters() {
    fc::check_cuda(dv::stream_synchronize(stream), "test: sync");
    std::vector<float> all;
    for (std::size_t l = 0; l < layers; ++l) {
      std::vector<float> host(sizes[l]);
      fc::check_cuda(dv::copy_sync(host.data(), w[l], sizes[l] * sizeof(float)), "test: download");
      all.insert(all.end(), host.begin(), host.end());
    }
    return all;
  }
};

fc::sync_options fused(bool when_full) {
  fc::sync_options o;
  o.bucket_bytes = 8192;  // the small gradients share buckets; the 1280 travels alone
  o.launch_when_full = when_full;
  return o;
}

constexpr int steps = 6;

// `steps` steps of subgroup_allreduce<nccl> on `member`; from step `captured_from` on, the step is
// captured once, in `mode`, and the graph launched for it and every later step. The parameters.
std::vector<float> train(const fc::nccl::communicator& member, fc::sync_options options, int captured_from,
                         dv::capture_mode_t mode = dv::capture_global) {
  dv::stream_t s = nullptr;
  fc::check_cuda(dv::stream_create(&s, true), "test: stream");
  std::vector<float> out;
  {
    model m(s);
    fc::subgroup_allreduce<fc::nccl> sync(member, options);
    sync.on_stream(s);
    dv::graph_exec_t replay = nullptr;
    for (int step = 0; step < steps; ++step) {
      m.load(member.rank(), step);
      if (step < captured_from) {
        m.step(sync);
        continue;
      }
      if (!replay) {
        fc::check_cuda(dv::stream_begin_capture(s, mode), "test: cudaStreamBeginCapture");
        m.step(sync);
        dv::graph_t graph = nullptr;
        fc::check_cuda(dv::stream_end_capture(s, &graph), "test: cudaStreamEndCapture");
        fc::check_cuda(dv::graph_instantiate(&replay, graph), "test: cudaGraphInstantiate");
        dv::graph_destroy(graph);
      }
      fc::check_cuda(dv::graph_launch(replay, s), "test: cudaGraphLaunch");
    }
    out = m.parameters();
    if (replay) dv::graph_exec_destroy(replay);
  }
  dv::stream_destroy(s);
  return out;
}

// Every rank of `member` holds the same parameters (the averaged gradients reached them all).
bool same_on_every_rank(const std::vector<float>& p) {
  std::vector<float> lowest = p, highest = p;
  fc::mpi::iallreduce(world(), fc::span<float>(lowest.data(), lowest.size()), fc::op::min).wait();
  fc::mpi::iallreduce(world(), fc::span<float>(highest.data(), highest.size()), fc::op::max).wait();
  return std::memcmp(lowest.data(), highest.data(), p.size() * sizeof(float)) == 0 &&
         std::memcmp(p.data(), lowest.data(), p.size() * sizeof(float)) == 0;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Runs `call` inside a capture of `s` and ends it: the error it threw ("" if none).
template <class Call>
std::string refused_in_capture(dv::stream_t s, Call&& call) {
  fc::check_cuda(dv::stream_begin_capture(s, dv::capture_global), "test: cudaStreamBeginCapture");
  std::string message;
  try {
    call();
  } catch (const fc::error& e) {
    message = e.what();
  }
  dv::graph_t graph = nullptr;
  fc::check_cuda(dv::stream_end_capture(s, &graph), "test: cudaStreamEndCapture");
  if (graph) dv::graph_destroy(graph);
  return message;
}

bool names(const std::string& message, const std::string& what, const std::string& cause) {
  const bool ok = message.find(fc::cat("rank ", world().rank(), ": ")) != std::string::npos &&
                  message.find(what) != std::string::npos &&
                  message.find("captured into a CUDA graph") != std::string::npos &&
                  message.find(cause) != std::string::npos;
  if (!ok) BOOST_TEST_MESSAGE("refusal: '" << message << "'");
  return ok;
}
}  // namespace

BOOST_AUTO_TEST_CASE(ranks_sharing_a_gpu_have_distinct_nccl_host_ids) {
  const auto problem = fc::testing::nccl_gpu_sharing_problem();
  BOOST_TEST_REQUIRE(fc::testing::all_ranks(problem.empty()), problem);
}

// The step captured once after a first step uncaptured, then replayed for every later step.
BOOST_AUTO_TEST_CASE(replayed_steps_equal_uncaptured_steps_bit_for_bit) {
  fc::nccl::communicator member(world(), "member");
  const auto uncaptured = train(member, fused(false), steps);
  BOOST_TEST(fc::testing::all_ranks(same_on_every_rank(uncaptured)));
  BOOST_TEST(fc::testing::all_ranks(!bitwise_equal(uncaptured, std::vector<float>(uncaptured.size(), 0.5f))));
  BOOST_TEST(fc::testing::all_ranks(bitwise_equal(train(member, fused(false), 1), uncaptured)));
  BOOST_TEST(fc::testing::all_ranks(bitwise_equal(train(member, fused(true), steps), uncaptured)));
  BOOST_TEST(fc::testing::all_ranks(bitwise_equal(train(member, fused(true), 1), uncaptured)));
  BOOST_TEST(fc::testing::all_ranks(bitwise_equal(train(member, fused(true), 2, dv::capture_thread_local), uncaptured)));
  BOOST_TEST(fc::testing::all_ranks(bitwise_equal(train(member, fused(false), 3, dv::capture_relaxed), uncaptured)));
}

// The first step forms the bucket plan; a Sync given no stream would work outside the graph.
BOOST_AUTO_TEST_CASE(a_first_step_and_a_sync_without_the_stream_are_refused_when_captured) {
  fc::nccl::communicator member(world(), "member");
  dv::stream_t s = nullptr, blocking = nullptr;
  fc::check_cuda(dv::stream_create(&s, true), "test: stream");
  fc::check_cuda(dv::stream_create(&blocking, false), "test: stream");
  {
    model m(s);
    fc::subgroup_allreduce<fc::nccl> sync(member, fused(false));
    sync.on_stream(s);
    m.load(member.rank(), 0);
    BOOST_TEST(fc::testing::all_ranks(
        names(refused_in_capture(s, [&] { m.step(sync); }), "subgroup_allreduce: ready", "the first step")));
    m.step(sync);  // uncaptured, the same step goes through
    fc::subgroup_allreduce<fc::nccl> unnamed(member, fused(false));
    fc::check_cuda(dv::stream_synchronize(s), "test: sync");
    m.stream = blocking;
    m.step(unnamed, true);
    BOOST_TEST(fc::testing::all_ranks(
        names(refused_in_capture(blocking, [&] { m.step(unnamed); }), "subgroup_allreduce: ready", "on_stream()")));
    m.parameters();
  }
  dv::stream_destroy(s);
  dv::stream_destroy(blocking);
}

// staged moves bytes with MPI from the host: refused in a Sync and as an operation.
BOOST_AUTO_TEST_CASE(staged_is_refused_by_name_when_captured) {
  fc::staged::communicator member(world(), "member");
  dv::stream_t s = nullptr;
  fc::check_cuda(dv::stream_create(&s, true), "test: stream");
  {
    model m(s);
    fc::subgroup_allreduce<fc::staged> sync(member, fused(false));
    sync.on_stream(s);
    m.load(member.rank(), 0);
    m.step(sync);
    BOOST_TEST(fc::testing::all_ranks(
        names(refused_in_capture(s, [&] { m.step(sync); }), "subgroup_allreduce: ready", "MPI")));
    m.step(sync);  // and uncaptured it goes on
    BOOST_TEST(fc::testing::all_ranks(same_on_every_rank(m.parameters())));
    const auto message = refused_in_capture(
        s, [&] { fc::staged::iallreduce(member, fc::span<float>(m.g[0], sizes[0]), fc::op::sum, s).wait(); });
    BOOST_TEST(fc::testing::all_ranks(names(message, "staged iallreduce", "MPI")));
  }
  dv::stream_destroy(s);
}

// Averaging in tiers across hosts runs on the host and is the host backends' alone: on nccl a
// member across (pretend) hosts stays flat, NCCL crossing the hosts itself, and its steps capture.
BOOST_AUTO_TEST_CASE(a_member_across_hosts_on_nccl_stays_flat_and_captures) {
  const int n = world().size();
  setenv("FLEXCOMM_HOSTS", n == 1 ? "1" : n == 2 ? "1+1" : n == 3 ? "2+1" : "2+2", 1);
  auto across = fused(true);
  across.hierarchical = fc::hierarchy::on;
  fc::nccl::communicator member(world(), "member");
  bool flat = false;
  {
    fc::subgroup_allreduce<fc::nccl> probe(member, across);
    flat = !probe.hierarchical();
  }
  const auto captured = train(member, across, 1);
  unsetenv("FLEXCOMM_HOSTS");
  BOOST_TEST(fc::testing::all_ranks(flat));
  BOOST_TEST(fc::testing::all_ranks(bitwise_equal(captured, train(member, fused(true), steps))));
}
