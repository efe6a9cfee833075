// Starting a trace on every rank of a world: each rank measures its clock's offset to rank 0
// (ping-pongs, the one with the smallest round trip wins), so that merged timelines line up.
// The MPI-aware half of trace.hpp; flexcomm::environment calls it when FLEXCOMM_TRACE is set.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

#include "../../core/settings.hpp"
#include "../../core/trace.hpp"
#include "../mpi.hpp"

namespace flexcomm::trace {

struct clock_estimate {
  std::int64_t offset_ns = 0;  // this rank's clock minus rank 0's
  std::int64_t rtt_ns = 0;     // round trip of the ping-pong the offset comes from
  std::int64_t origin_ns = 0;  // rank 0's clock when it finished measuring: time zero of the traces
};

// Collective over `world`: this rank's clock offset to rank 0, from `rounds` ping-pongs.
// Its traffic stays out of the trace and out of the world's sequence numbers.
inline clock_estimate measure_clock_offset(const mpi::communicator& world, int rounds = 8);

// Collective over `world`: starts tracing into `dir` on every rank with clocks aligned to rank 0.
inline void start(const mpi::communicator& world, const std::string& dir, options opts = {}) {
  const clock_estimate clock = measure_clock_offset(world);
  start(dir, world.rank(), opts);
  set_clock(clock.offset_ns, clock.rtt_ns, clock.origin_ns, world.size());
}

// FLEXCOMM_TRACE=<dir>: starts tracing over `world` (collective); does nothing when unset.
inline bool start_from_environment(const mpi::communicator& world) {
  const char* dir = setting("FLEXCOMM_TRACE");
  if (!dir) return false;
  start(world, dir);
  return true;
}

inline clock_estimate measure_clock_offset(const mpi::communicator& world, int rounds) {
  check(rounds > 0, "trace: clock offset", "needs at least one round");
  // A private communicator: the ping-pongs count in no sequence of the world's operations.
  const mpi::communicator clock = world.dup("trace clock");
  // Yielding, not sleeping: a backoff sleep would land inside the round trip being measured.
  const wait_policy policy = wait_policy::yield();
  clock_estimate best{0, -1, 0};
  // Rank 0's clock at the end becomes time zero of every rank's file.
  auto share_origin = [&] {
    best.origin_ns = now();
    mpi::ibcast(clock, flexcomm::span<std::int64_t>(&best.origin_ns, 1), 0).wait(policy);
  };
  if (clock.rank() == 0) {
    for (int peer = 1; peer < clock.size(); ++peer)
      for (int k = 0; k < rounds; ++k) {
        std::int64_t ping = 0;
        mpi::irecv(clock, flexcomm::span<std::int64_t>(&ping, 1), peer, k).wait(policy);
        std::int64_t stamp = now();
        mpi::isend(clock, flexcomm::span<const std::int64_t>(&stamp, 1), peer, k).wait(policy);
      }
    best.rtt_ns = 0;
    share_origin();
    return best;
  }
  for (int k = 0; k < rounds; ++k) {
    std::int64_t stamp = 0;
    auto reply = mpi::irecv(clock, flexcomm::span<std::int64_t>(&stamp, 1), 0, k);
    const std::int64_t sent = now();
    mpi::isend(clock, flexcomm::span<const std::int64_t>(&sent, 1), 0, k).wait(policy);
    reply.wait(policy);
    const std::int64_t received = now();
    const std::int64_t rtt = received - sent;
    if (best.rtt_ns < 0 || rtt < best.rtt_ns) {
      best.rtt_ns = rtt;
      best.offset_ns = sent + rtt / 2 - stamp;
    }
  }
  share_origin();
  return best;
}

}  // namespace flexcomm::trace
