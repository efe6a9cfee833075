/* The plain-MPI copy of mpi_progress's first case (see docs/reliability.md, "The Open MPI 'hang'
 * was this machine's scheduler"): no flexcomm. A helper thread posts an MPI_Iallreduce and tests
 * it while the main thread computes; each rank says when it is done, or that it is not after
 * 20 s. Knobs, to tell the MPI library from the machine:
 *   PLAIN_MODE=thread (default) | blocking | wait | testloop   the last three stay on the main thread
 *   PLAIN_COUNT=N       floats in the allreduce (default 262144: 1 MiB, past the eager limit)
 *   PLAIN_POLL=sleep (default, 50 us between tests) | spin | yield
 *   PLAIN_COMPUTE=spin (default) | sleep   what the main thread does meanwhile (1 ms sleeps)
 *   tests/cluster/run.sh --mpi openmpi --repeat 150 --limit 8 --no-stacks -- build-openmpi/tests/plain_progress */
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {
std::string knob(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value ? value : fallback;
}
}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  const std::string mode = knob("PLAIN_MODE", "thread"), poll = knob("PLAIN_POLL", "sleep");
  const bool compute = knob("PLAIN_COMPUTE", "spin") == "spin";
  const int count = std::atoi(knob("PLAIN_COUNT", "262144").c_str());
  std::vector<float> values(static_cast<std::size_t>(count), 1.0f);
  const auto limit = std::chrono::seconds(20);
  const auto start = std::chrono::steady_clock::now();
  MPI_Request request = MPI_REQUEST_NULL;
  auto test_until_done = [&] {
    int done = 0;
    while (!done && std::chrono::steady_clock::now() - start < limit) {
      MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (done) break;
      if (poll == "yield") std::this_thread::yield();
      else if (poll == "sleep") std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return done != 0;
  };
  bool done = false;
  if (mode == "blocking") {
    MPI_Allreduce(MPI_IN_PLACE, values.data(), count, MPI_FLOAT, MPI_SUM, comm);
    done = true;
  } else if (mode == "wait" || mode == "testloop") {
    MPI_Iallreduce(MPI_IN_PLACE, values.data(), count, MPI_FLOAT, MPI_SUM, comm, &request);
    if (mode == "wait") done = MPI_Wait(&request, MPI_STATUS_IGNORE) == MPI_SUCCESS;
    else done = test_until_done();
  } else {
    std::atomic<bool> finished{false};
    std::thread helper([&] {
      MPI_Iallreduce(MPI_IN_PLACE, values.data(), count, MPI_FLOAT, MPI_SUM, comm, &request);
      finished = test_until_done();
    });
    volatile double x = 1.0;  // "compute": a dependent chain that never sleeps
    while (!finished && std::chrono::steady_clock::now() - start < limit) {
      if (!compute) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      else for (int i = 0; i < 10000; ++i) x = x * 1.0000001 + 1e-9;
    }
    helper.join();
    done = finished;
  }
  if (!done) {
    // The allreduce is still posted on its buffer: leave without finalizing, as a hung job would.
    std::fprintf(stderr, "rank %d: the allreduce (%s) is not done after 20 s\n", rank, mode.c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
  bool right = true;
  for (float v : values) right = right && v == static_cast<float>(size);
  if (!right) std::fprintf(stderr, "rank %d: wrong sum\n", rank);
  MPI_Comm_free(&comm);
  MPI_Finalize();
  return right ? 0 : 1;
}
