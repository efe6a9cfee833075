// Brings MPI and a CUDA device up once per GPU test program. Without a GPU the program exits 77
// (Meson's "skipped") before MPI starts; with one, each rank takes a device of its node. Built
// with FLEXCOMM_DEVICE_STANDIN, the same program runs on the device layer's host stand-in.
#pragma once

#define BOOST_TEST_NO_MAIN
#include <boost/test/results_collector.hpp>
#include <boost/test/results_reporter.hpp>
#include <boost/test/unit_test.hpp>

#include <flexcomm/backend/cuda/runtime.hpp>
#include <flexcomm/flexcomm.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace flexcomm::testing {

struct gpu_fixture {
  gpu_fixture() {
    env = new flexcomm::environment(boost::unit_test::framework::master_test_suite().argc,
                                    boost::unit_test::framework::master_test_suite().argv);
    cuda::use_local_device(env->world());
  }
  ~gpu_fixture() {
    backend_world.reset();  // device communicators end before MPI does
    const std::string affinity = device_affinity_problem();
    if (!affinity.empty()) std::fprintf(stderr, "gpu test: world rank %d: %s\n", env->world().rank(), affinity.c_str());
    const auto& results = boost::unit_test::results_collector.results(
        boost::unit_test::framework::master_test_suite().p_id);
    // A case that left MPI operations that cannot finish ends the job at shutdown (MPI_Abort),
    // before Boost.Test would print its summary: print it now, so one failing case never hides
    // what the others did; should shutdown end the process, it leaves with Boost.Test's status.
    if (watchdog::instance().job_must_end()) boost::unit_test::results_reporter::make_report();
    env->set_exit_status(results.passed() && affinity.empty() ? 0 : 201);
    delete env;
  }
  // A rank works on its own device only, from every thread: no context on another device, and
  // no kernel that reached another device's memory (a sticky error). "" when so.
  static std::string device_affinity_problem() {
    int mine = 0, devices = 0;
    device::get_device(&mine);
    device::device_count(&devices);
    std::string problem;
    if (const auto sticky = device::last_error(); sticky != device::success)
      problem = cat("a device call failed: ", device::error_name(sticky), " (", device::error_string(sticky), "); ");
    for (int d = 0; d < devices; ++d) {
      bool open = false;
      device::has_context(d, &open);
      if (open && d != mine) problem += cat("opened a context on device ", d, " besides its own device ", mine, "; ");
    }
    return problem;
  }
  static inline flexcomm::environment* env = nullptr;
  static inline std::shared_ptr<void> backend_world;
};

inline const mpi::communicator& world() { return gpu_fixture::env->world(); }

inline bool all_ranks(bool ok) {
  int all = ok ? 1 : 0;
  mpi::iallreduce(world(), span<int>(&all, 1), op::min).wait();
  return all == 1;
}

// The world communicator of backend B, made once, collectively, on first use.
template <class B>
const typename B::communicator& backend_world() {
  if (!gpu_fixture::backend_world)
    gpu_fixture::backend_world = std::make_shared<typename B::communicator>(world(), "world");
  return *std::static_pointer_cast<typename B::communicator>(gpu_fixture::backend_world);
}

// NCCL refuses two ranks on one GPU ("duplicate GPU") unless each believes it is on its own
// host: tests that share a GPU run through tests/gpu/nccl_env.sh, which gives every rank its
// own NCCL_HOSTID (and NCCL_NET=Socket). Returns what is wrong, or "" when NCCL can start.
inline std::string nccl_gpu_sharing_problem() {
#if defined(FLEXCOMM_DEVICE_STANDIN)
  return {};  // the stand-in's NCCL is MPI: ranks share its device freely
#endif
  constexpr int width = 128;
  char mine[2 * width] = {};
  int device = 0;
  check_cuda(device::get_device(&device), "gpu test: cudaGetDevice");
  char bus[64] = {};
  check_cuda(device::pci_bus_id(bus, sizeof bus, device), "gpu test: cudaDeviceGetPCIBusId");
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  MPI_Get_processor_name(host, &length);
  const auto put = [&](char* at, const std::string& text) {
    std::memcpy(at, text.data(), std::min<std::size_t>(text.size(), width - 1));
  };
  put(mine, cat(host, "/", bus));
  const char* id = std::getenv("NCCL_HOSTID");
  put(mine + width, id ? id : "");
  std::vector<char> all(static_cast<std::size_t>(world().size()) * 2 * width);
  MPI_Allgather(mine, 2 * width, MPI_CHAR, all.data(), 2 * width, MPI_CHAR, MPI_COMM_WORLD);
  for (int a = 0; a < world().size(); ++a)
    for (int b = a + 1; b < world().size(); ++b) {
      const char* ga = &all[static_cast<std::size_t>(a) * 2 * width];
      const char* gb = &all[static_cast<std::size_t>(b) * 2 * width];
      if (std::strcmp(ga, gb) != 0) continue;
      if (*(ga + width) == '\0' || std::strcmp(ga + width, gb + width) == 0)
        return cat("ranks ", a, " and ", b, " share GPU ", ga,
                   " but not distinct NCCL_HOSTID values; run the test through tests/gpu/nccl_env.sh");
    }
  return {};
}

}  // namespace flexcomm::testing

using flexcomm_gpu_fixture = flexcomm::testing::gpu_fixture;
BOOST_TEST_GLOBAL_FIXTURE(flexcomm_gpu_fixture);

int main(int argc, char** argv) {
  if (!flexcomm::cuda_device_present()) {
    std::puts("no CUDA device: skipped");
    return 77;
  }
  return boost::unit_test::unit_test_main(&init_unit_test, argc, argv);
}
