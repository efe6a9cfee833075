// Every FLEXCOMM_ environment variable flexcomm reads, in one table, and the one function that
// reads them. A FLEXCOMM_ variable outside the table is most likely a misspelling, and a
// setting that silently does nothing is the worst kind: the environment names it at start.
#pragma once

#include <unistd.h>  // environ

#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "error.hpp"

namespace flexcomm {

struct setting_doc {
  std::string_view name, meaning;
};

inline constexpr setting_doc known_settings[] = {
    {"FLEXCOMM_WAIT", "wait policy: spin, yield, backoff or backoff:<max us> (default: by ranks per node)"},
    {"FLEXCOMM_TIMEOUT", "seconds before a wait becomes an error naming who did not arrive (unset or 0: never)"},
    {"FLEXCOMM_CHECK", "0 turns off the cross-rank checks of counts, types and bucket order"},
    {"FLEXCOMM_FINALIZE_TIMEOUT", "seconds MPI_Finalize may take once every rank is done (default 0.5 on MPICH, 10 on Open MPI)"},
    {"FLEXCOMM_TRACE", "directory for a Chrome trace per rank"},
    {"FLEXCOMM_BUCKET_BYTES", "gradient bucket capacity of the Sync adapters (default 25 MiB)"},
    {"FLEXCOMM_SEGMENT_BYTES", "overlapped_ring's segment size (default 1 MiB)"},
    {"FLEXCOMM_HIERARCHICAL", "averaging across hosts in tiers: auto, on or off (default auto)"},
    {"FLEXCOMM_SHM", "shared memory within a host (Sync adapters, hierarchical stages, one_to_many, all_shared): auto, on or off (default auto)"},
    {"FLEXCOMM_HOSTS", "a host map to pretend, e.g. 2+1+2 (tests on one machine)"},
    {"FLEXCOMM_LAYOUT", "the ensemble layout of examples and benchmarks"},
    {"FLEXCOMM_PRESET", "the preset train_ensemble runs where its options name none (default single_broadcast)"},
    {"FLEXCOMM_STAGE_CHUNK", "the staged backend's chunk size in bytes"},
    {"FLEXCOMM_PINNED_BYTES", "the staged backend's pinned host memory for chunks, in bytes; at least one chunk (default 64 chunks: 64 MiB)"},
    {"FLEXCOMM_DEVICE", "the GPU of a rank, by cuda::use_local_device: local (node-local rank modulo the devices, the default) or a device index"},
    {"FLEXCOMM_STANDIN_LATENCY", "the device stand-in's (tests only) longest delay before a queued copy or kernel runs, in microseconds (default 200)"},
    {"FLEXCOMM_STANDIN_DEVICES", "how many devices the device stand-in (tests only) has, 1 .. 16 (default 1)"},
};

// The value of setting `name` (which must be in known_settings), or nullptr when it is unset or
// empty.
inline const char* setting(std::string_view name) {
  bool known = false;
  for (const auto& s : known_settings) known = known || s.name == name;
  check(known, "settings", cat(name, " is read but is not in flexcomm's table (core/settings.hpp)"));
  const char* value = std::getenv(std::string(name).c_str());
  return value && *value ? value : nullptr;
}

// FLEXCOMM_ variables in this process's environment that flexcomm does not read (FLEXCOMM_TEST_*,
// the test harness's own, aside).
inline std::vector<std::string> unknown_settings() {
  std::vector<std::string> out;
  for (char** e = environ; e && *e; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    if (name.rfind("FLEXCOMM_", 0) != 0 || name.rfind("FLEXCOMM_TEST_", 0) == 0) continue;
    bool known = false;
    for (const auto& s : known_settings) known = known || s.name == name;
    if (!known) out.emplace_back(name);
  }
  return out;
}

}  // namespace flexcomm
