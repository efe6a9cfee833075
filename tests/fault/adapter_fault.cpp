// Fault-injection driver for the adapters: a shared feed (one_to_many) whose loader fails on one
// step, and a member's gradient sync (subgroup_allreduce) where one rank hands gradients over in
// another order. Prints like tests/fault/fault.cpp ("[rank R] ..." lines, time to error, guard
// words) for tests/fault/launch.py.
//
//   mpiexec -n N adapter_fault <fault>
//   faults: feed-none loader-throws loader-overfills loader-overwrites layout-feed trainer-stall sync-none
//           gradient-order sync-stall sync-stall-messages sync-stall-unwind claim-stall claim-dies claim-stall-messages
//           claim-dies-messages claim-stall-hosts claim-dies-hosts handover-stall handover-dies
//           handover-stall-shared handover-dies-shared handover-stall-adaptive handover-dies-adaptive
//           handover-stall-broadcast handover-dies-broadcast handover-stall-per-host
//           handover-dies-per-host bye-dies
#include <flexcomm/flexcomm.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "report.hpp"

namespace fc = flexcomm;
using fc::mpi;

namespace {

constexpr std::int64_t fault_step = 3;
constexpr std::int64_t steps = 6;
constexpr std::size_t capacity = 256;

// The adaptive feed over "members=nx1", where every trainer makes steps: the last rank's loader,
// from fault_step on, stalls (claim-stall) or ends the process (claim-dies) in the first piece it
// claimed. The others' loaders are slow, so that the last rank, always idle, surely claims one.
// The -messages faults: "producers=1 members=(n-1)x1" with shared memory off, where the trainers
// claim pieces from the producer by message and the producer waits for the faulty one's piece.
// The -hosts faults: "members=nx1" on pretend hosts "(n-1)+1", the faulty rank alone on host 1,
// which makes that host's steps; the others wait for them from across hosts.
bool run_adaptive(const mpi::communicator& world, const std::string& fault,
                  std::chrono::steady_clock::time_point& start) {
  const int n = world.size();
  const bool faulty = world.rank() == n - 1;
  const bool dies = fault.rfind("claim-dies", 0) == 0;
  const bool by_message = fault.find("-messages") != std::string::npos;
  if (fault.find("-hosts") != std::string::npos)
    setenv("FLEXCOMM_HOSTS", (n == 2 ? std::string("1+1") : fc::cat(n - 1, "+1")).c_str(), 1);
  fc::loader load = [&](std::int64_t step, int, fc::span<std::byte> out) -> std::size_t {
    if (faulty && step >= fault_step) {
      report(world.rank(), fc::cat("injected: ", dies ? "dies" : "stalls", " in the loader of step ",
                                   step, ", holding its claim"));
      if (dies) std::_Exit(9);
      std::this_thread::sleep_for(fc::default_timeout() * 4 + std::chrono::seconds(2));
    }
    if (!faulty) std::this_thread::sleep_for(std::chrono::milliseconds(30));
    for (auto& b : out) b = std::byte{static_cast<unsigned char>(step)};
    return out.size();
  };
  fc::feed_options options;
  options.steps = 40;
  options.shard_capacity = capacity;
  if (by_message) options.shared_memory = fc::shared_memory_use::off;
  const auto layout = fc::ensemble_layout::parse(by_message ? fc::cat("producers=1 members=", n - 1, "x1")
                                                            : fc::cat("members=", n, "x1"));
  fc::adaptive<mpi> feed(world, layout, load, options);
  bool ok = true;
  if (!feed.is_trainer()) {
    start = std::chrono::steady_clock::now();  // the producer's steps before the fault take 0.1 s
    feed.produce();
    return ok;
  }
  while (auto b = feed.next()) {
    if (b->step() == fault_step - 1) start = std::chrono::steady_clock::now();
    for (auto byte : b->bytes()) ok = ok && byte == std::byte{static_cast<unsigned char>(b->step())};
  }
  return ok;
}

// Each shard of step s: bytes s.
std::size_t step_bytes(std::int64_t step, int, fc::span<std::byte> out) {
  for (auto& b : out) b = std::byte{static_cast<unsigned char>(step)};
  return out.size();
}

// The end of a run with hand-overs over "members=1,1,..." (a step has one shard: no member has
// room): member 0 ends at step 1 with nowhere to go and waits at the end for the other roots'
// byes, as each of them does once it has trained its 12 steps; the last rank dies at step 3.
// A wait longer than the timeout goes on while the roots waited on answer; its silence ends it,
// and every other rank names it.
bool run_bye(const mpi::communicator& world, std::chrono::steady_clock::time_point& start) {
  const int n = world.size();
  using pipeline = fc::ensemble_pipeline<fc::local_feed, fc::subgroup_allreduce<mpi>, fc::many_to_one<mpi>>;
  pipeline::options options;
  options.feed.steps = 12;
  options.feed.shard_capacity = capacity;
  pipeline pipe(world, fc::ensemble_layout(0, std::vector<int>(static_cast<std::size_t>(n), 1), 0), options);
  pipe.on_handover({});
  const bool faulty = world.rank() == n - 1;
  pipe.run(step_bytes, [&](auto& ctx) {
    while (auto b = ctx.feed().next()) {
      if (b->step() == 1) start = std::chrono::steady_clock::now();
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      if (ctx.member() == 0 && b->step() == 1) return ctx.finish_member();
      if (faulty && b->step() == 3) {
        report(world.rank(), "injected: dies while it trains, after member 0 ended");
        std::_Exit(9);
      }
    }
  });
  return true;
}

// A hand-over (pipeline/handover.hpp) over "members=1,2,1..." (n >= 4): the last rank's member
// ends after step fault_step - 1 and joins member 0 (one rank, the longest expected step), then
// stalls in its state callback for 4x the timeout (as under SIGSTOP; handover-dies: ends its
// process there) once their communicator is made: member 0's rank, sending it the state, names
// it. Member 0 takes 30 ms a step, so that it still runs when the request comes.
// Feed: local_feed, or all_shared (handover-*-shared: the other members need the joining rank's
// turn in every round, so they wait on it too, and each names it or its wait within the timeout),
// or adaptive (handover-*-adaptive: on its board, where the joining rank holds the joining step),
// or one_to_many (handover-*-broadcast, n >= 5: `producers` 1, world rank 0, whose trainers read
// in place; member 0's rank is world rank 1), or one_to_many with a producer per host
// (handover-*-per-host, n = 6: `producers` -1 on pretend hosts 2+4, producers 0 and 2; member 0
// is world rank 1 on the first host, the joining rank 5 on the second: the joiner's steps would
// cross hosts from rank 0's producer).
template <class Feed>
bool run_handover(const mpi::communicator& world, bool dies, std::chrono::steady_clock::time_point& start,
                  int producers = 0) {
  const int n = world.size();
  if (producers < 0) setenv("FLEXCOMM_HOSTS", fc::cat("2+", n - 2).c_str(), 1);
  std::vector<int> sizes{1, 2};
  for (int left = n - (producers < 0 ? 2 : producers) - 3; left > 0; --left) sizes.push_back(1);
  using pipeline = fc::ensemble_pipeline<Feed, fc::subgroup_allreduce<mpi>, fc::many_to_one<mpi>>;
  typename pipeline::options options;
  options.feed.steps = 40;
  options.feed.shard_capacity = capacity;
  pipeline pipe(world,
                producers < 0 ? fc::ensemble_layout(fc::producers_per_host, sizes, 0) : fc::ensemble_layout(producers, sizes, 0),
                options);
  const bool faulty = world.rank() == n - 1;
  std::vector<float> weights(16, 1.0f);
  pipe.on_handover({[&](int) {
                      if (faulty) {
                        report(world.rank(), fc::cat("injected: ", dies ? "dies" : "stalls",
                                                     " in its state callback while joining member 0"));
                        if (dies) std::_Exit(9);
                        std::this_thread::sleep_for(fc::default_timeout() * 4 + std::chrono::seconds(2));
                      } else {
                        start = std::chrono::steady_clock::now();
                      }
                      return std::vector<fc::span<std::byte>>{fc::as_writable_bytes(fc::span<float>(weights))};
                    },
                    {}});
  const int last = static_cast<int>(sizes.size()) - 1;
  pipe.run(
      step_bytes,
      [&](auto& ctx) {
        while (auto b = ctx.feed().next()) {
          if (ctx.member() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(30));
          if (ctx.member() == last && b->step() == fault_step - 1) return ctx.finish_member();
        }
      });
  return true;
}

// handover-stall, handover-dies, and the same under all_shared (-shared), adaptive (-adaptive) and
// one_to_many (-broadcast; -per-host).
bool run_handover(const mpi::communicator& world, const std::string& fault, std::chrono::steady_clock::time_point& start) {
  const bool dies = fault.find("-dies") != std::string::npos;
  if (fault.find("-shared") != std::string::npos) return run_handover<fc::all_shared<mpi>>(world, dies, start);
  if (fault.find("-adaptive") != std::string::npos) return run_handover<fc::adaptive<mpi>>(world, dies, start);
  if (fault.find("-broadcast") != std::string::npos) return run_handover<fc::one_to_many<mpi>>(world, dies, start, 1);
  if (fault.find("-per-host") != std::string::npos) return run_handover<fc::one_to_many<mpi>>(world, dies, start, -1);
  return run_handover<fc::local_feed>(world, dies, start);
}

// Runs a shared feed over "producers=1 members=(n-1)x1"; the loader misbehaves on fault_step.
bool run_feed(const mpi::communicator& world, const std::string& fault, std::chrono::steady_clock::time_point& start) {
  const int n = world.size();
  const auto layout = fc::ensemble_layout::parse(
      fault == "layout-feed" ? fc::cat("producers=1 members=", n, "x1") : fc::cat("producers=1 members=", n - 1, "x1"));
  fc::loader load = [&](std::int64_t step, int, fc::span<std::byte> out) -> std::size_t {
    if (step == fault_step) {
      if (fault == "loader-throws") throw std::runtime_error("decode failed: corrupt JPEG in shard file 17");
      if (fault == "loader-overfills") return out.size() + 100;
      if (fault == "loader-overwrites") {
        for (std::size_t i = 0; i < out.size() + 8; ++i) out.data()[i] = std::byte{1};  // 8 bytes too many
        return out.size();
      }
    }
    for (auto& b : out) b = std::byte{static_cast<unsigned char>(step)};
    return out.size();
  };
  fc::feed_options options;
  options.steps = steps;
  options.shard_capacity = capacity;
  fc::one_to_many<mpi> feed(world, layout, load, options);
  const auto role = layout.role_of(world.rank());
  if (role.kind == fc::role::producer) {
    start = std::chrono::steady_clock::now();
    feed.produce();
    return true;
  }
  bool ok = true;
  while (auto b = feed.next()) {
    if (b->step() == fault_step - 1) start = std::chrono::steady_clock::now();
    // A trainer stopped (as by SIGSTOP) while holding a batch: it takes no further steps.
    if (fault == "trainer-stall" && world.rank() == n - 1 && b->step() == fault_step) {
      report(world.rank(), "injected: stalling outside flexcomm");
      std::this_thread::sleep_for(fc::default_timeout() * 4 + std::chrono::seconds(2));
    }
    for (auto byte : b->bytes()) ok = ok && byte == std::byte{static_cast<unsigned char>(b->step())};
  }
  return ok;
}

// sync-stall-unwind's side collective: 48 elements and 16 guard words, kept past the driver's end
// (the collective may still be in flight when the job ends).
std::vector<float>& side_data() {
  static auto* data = new std::vector<float>(48 + 16, -7.0f);
  return *data;
}

std::shared_ptr<fc::completion>& side_done() {
  static std::shared_ptr<fc::completion> done;
  return done;
}

std::vector<std::vector<float>>& gradients() {
  static std::vector<std::vector<float>> grads(4, std::vector<float>(48 + 16, -7.0f));
  return grads;
}

// One member over the whole world (sync-stall*: over the last two ranks, the others idle); four
// gradients per step, handed over in backprop order.
bool run_sync(const mpi::communicator& world, const std::string& fault, std::chrono::steady_clock::time_point& start) {
  const bool pair = fault.rfind("sync-stall", 0) == 0;
  const int n = world.size();
  const bool in_member = !pair || world.rank() >= n - 2;
  auto member = world.split(in_member ? 0 : mpi::communicator::undefined, world.rank(), "member 0");
  if (!in_member) return true;
  // sync-stall-unwind: a second communicator of the member, whose collective the progress engine
  // drives when the partner times out in shared memory, destroyed as that error unwinds (as a
  // pipeline's collect is). It must not wait out a second timeout for the collective, which has
  // not reached MPI (Open MPI holds it for its check), nor ever post it on the freed communicator.
  const bool unwind = fault == "sync-stall-unwind";
  std::optional<mpi::communicator> side;
  if (unwind) side.emplace(member.dup("side"));
  fc::sync_options options;
  options.bucket_bytes = 64 * sizeof(float);  // several buckets
  fc::subgroup_allreduce<mpi> sync(member, options);
  // 48 gradient elements, then 16 guard words no reduction may touch.
  auto& grads = gradients();
  bool ok = true;
  for (std::int64_t step = 0; step < steps; ++step) {
    if (step == fault_step) start = std::chrono::steady_clock::now();
    std::vector<int> order = {3, 2, 1, 0};
    if (fault == "gradient-order" && step == fault_step && world.rank() == world.size() - 1 && world.size() > 1)
      order = {0, 1, 2, 3};
    // A trainer of the two-rank member stopped (as by SIGSTOP) before its gradients of the step.
    if (pair && step == fault_step && world.rank() == n - 1 && n > 1) {
      report(world.rank(), "injected: stalling outside flexcomm");
      std::this_thread::sleep_for(fc::default_timeout() * 4 + std::chrono::seconds(2));
    }
    if (unwind && step == fault_step) {
      auto& data = side_data();
      auto pending = std::make_shared<mpi::request>(mpi::iallreduce(*side, fc::span<float>(data.data(), 48), fc::op::sum));
      side_done() = fc::progress_engine::instance().submit([pending] { return pending->test(); }, "side collective");
    }
    for (auto& g : grads) std::fill(g.begin(), g.begin() + 48, 1.0f);
    for (int i : order) sync.ready(i, fc::span<float>(grads[static_cast<std::size_t>(i)].data(), 48));
    sync.finish();
    for (auto& g : grads) ok = ok && g[0] == 1.0f;
  }
  return ok;
}

bool guards_intact() {
  const auto intact = [](const std::vector<float>& g) {
    return std::all_of(g.begin() + 48, g.end(), [](float x) { return x == -7.0f; });
  };
  return std::all_of(gradients().begin(), gradients().end(), intact) && intact(side_data());
}

}  // namespace

int main(int argc, char** argv) {
  const std::string fault = argc > 1 ? argv[1] : "feed-none";
  // The member's averaging over MPI messages instead of its host's shared memory.
  if (fault == "sync-stall-messages") setenv("FLEXCOMM_SHM", "off", 1);
  fc::environment env(argc, argv);
  const auto& world = env.world();
  const int rank = world.rank();
  auto start = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  int status = 0;
  try {
    const bool ok = fault.rfind("sync", 0) == 0 || fault == "gradient-order" ? run_sync(world, fault, start)
                    : fault.rfind("claim", 0) == 0                           ? run_adaptive(world, fault, start)
                    : fault.rfind("handover", 0) == 0 ? run_handover(world, fault, start)
                    : fault == "bye-dies"                ? run_bye(world, start)
                                                                             : run_feed(world, fault, start);
    report(rank, ok ? "finished every step" : "WRONG DATA");
    status = ok ? 0 : 1;
  } catch (const fc::error& e) {
    report(rank, fc::cat("caught after ", seconds(), " s: ", e.what()));
    status = 1;
  }
  if (side_done()) {
    // What became of sync-stall-unwind's side collective (Open MPI: refused once its communicator
    // was freed, never posted there; elsewhere it went to MPI at once and waits on the stalled rank).
    std::string what = "still pending";
    if (fc::default_wait().until([] { return side_done()->done(); }, std::chrono::seconds(1))) {
      try {
        side_done()->wait();
        what = "completed";
      } catch (const fc::error& e) {
        what = e.what();
      }
    }
    report(rank, fc::cat("side collective: ", what));
  }
  // The sync reduces in place in the trainer's gradients: their guard words must survive. (The
  // feed's slots carry guard words of their own, which one_to_many checks.)
  if (!(fault.rfind("feed", 0) == 0 || fault.rfind("loader", 0) == 0 || fault == "layout-feed" ||
        fault == "trainer-stall" || fault.rfind("claim", 0) == 0 || fault.rfind("handover", 0) == 0 ||
        fault == "bye-dies"))
    report(rank, guards_intact() ? "guards intact" : "GUARD BROKEN: an operation wrote past its buffer");
  return status;
}
