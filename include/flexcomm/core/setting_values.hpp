// The values FLEXCOMM_ settings take, parsed, and the one check of every setting at start, so
// that a bad value ends the job at once with the setting's name, on every rank alike, instead of
// an uncaught exception wherever the value is first read, or a value that silently does nothing.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "error.hpp"
#include "hosts.hpp"
#include "layout.hpp"
#include "settings.hpp"
#include "wait.hpp"
#include "watchdog.hpp"

namespace flexcomm {

// "26214400", "64K", "25M", "1G" (or KiB, MiB, GiB) as bytes; anything else is an error of `what`.
inline std::size_t parse_bytes(const std::string& text, const char* what) {
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
  std::size_t scale = 1;
  const std::string suffix = end ? std::string(end) : std::string();
  if (suffix == "K" || suffix == "KiB") scale = std::size_t{1} << 10;
  else if (suffix == "M" || suffix == "MiB") scale = std::size_t{1} << 20;
  else if (suffix == "G" || suffix == "GiB") scale = std::size_t{1} << 30;
  else if (!suffix.empty()) scale = 0;
  // The limit applies after scaling: "9000000000GiB" must not pass, "1099511627776G" must not wrap to 0.
  if (text.empty() || end == text.c_str() || scale == 0 || value == 0 || text[0] == '-' ||
      value > (1ull << 40) / scale)
    fail(what, cat("cannot parse '", text, "': expected a positive byte count, e.g. 26214400, 64K, 25M, 1G"));
  return static_cast<std::size_t>(value) * scale;
}

// The smallest bucket or segment a job script may ask for: below a page, the count of messages
// grows by orders of magnitude for nothing. Code that sets sync_options itself may go lower (the
// tests do).
inline constexpr std::size_t smallest_setting_bytes = 4096;

inline std::size_t parse_setting_bytes(const std::string& text, const char* what) {
  const std::size_t bytes = parse_bytes(text, what);
  check(bytes >= smallest_setting_bytes, what,
        cat("'", text, "' is below the smallest ", smallest_setting_bytes, " bytes (4K) a setting may ask for"));
  return bytes;
}

// FLEXCOMM_STAGE_CHUNK: the staged backend's chunk, in bytes.
inline std::size_t parse_stage_chunk(const char* text) {
  char* end = nullptr;
  const long long bytes = std::strtoll(text, &end, 10);
  check(end && *end == '\0' && bytes >= 16 && bytes <= (1LL << 34), "FLEXCOMM_STAGE_CHUNK",
        cat("cannot parse '", text, "': expected a chunk size in bytes, 16 .. 2^34"));
  return static_cast<std::size_t>(bytes);
}
inline constexpr std::size_t default_stage_chunk = std::size_t{1} << 20;  // unset: 1 MiB

// FLEXCOMM_PINNED_BYTES: the staged backend's pinned blocks, in bytes (as parse_bytes reads them),
// at least one chunk of `chunk_bytes`; unset, default_pinned_chunks chunks (64 MiB at 1 MiB).
inline constexpr std::size_t default_pinned_chunks = 64;
inline std::size_t parse_pinned_bytes(const char* text, std::size_t chunk_bytes) {
  const std::size_t bytes = parse_bytes(text, "FLEXCOMM_PINNED_BYTES");
  check(bytes >= chunk_bytes, "FLEXCOMM_PINNED_BYTES",
        cat("'", text, "' holds less than one chunk (FLEXCOMM_STAGE_CHUNK: ", chunk_bytes, " bytes)"));
  return bytes;
}

// FLEXCOMM_STANDIN_LATENCY: microseconds, 0 .. 1000000.
inline long parse_standin_latency(const char* text) {
  char* end = nullptr;
  const long us = std::strtol(text, &end, 10);
  check(end && end != text && *end == '\0' && us >= 0 && us <= 1000000, "FLEXCOMM_STANDIN_LATENCY",
        cat("cannot parse '", text, "': expected microseconds, 0 .. 1000000"));
  return us;
}

// FLEXCOMM_DEVICE: `local` (device_by_local_rank) or a device index, 0 .. 1023.
inline constexpr int device_by_local_rank = -1;
inline int parse_device(const char* text) {
  if (std::string_view(text) == "local") return device_by_local_rank;
  char* end = nullptr;
  const long device = std::strtol(text, &end, 10);
  check(end && end != text && *end == '\0' && device >= 0 && device <= 1023, "FLEXCOMM_DEVICE",
        cat("cannot parse '", text, "': expected local or a device index, 0 .. 1023"));
  return static_cast<int>(device);
}

// FLEXCOMM_STANDIN_DEVICES: 1 .. 16.
inline int parse_standin_devices(const char* text) {
  char* end = nullptr;
  const long devices = std::strtol(text, &end, 10);
  check(end && end != text && *end == '\0' && devices >= 1 && devices <= 16, "FLEXCOMM_STANDIN_DEVICES",
        cat("cannot parse '", text, "': expected a device count, 1 .. 16"));
  return static_cast<int>(devices);
}

// The presets' names (pipeline/presets.hpp: presets::names), kept here so that FLEXCOMM_PRESET
// is checked at start with the others, below the pipeline layer.
inline constexpr const char* preset_names[] = {"baseline", "single_broadcast", "multi_broadcast", "all_shared",
                                               "adaptive"};
// FLEXCOMM_PRESET (and any preset name): one of preset_names; otherwise an error listing them.
inline void check_preset_name(std::string_view name) {
  std::string known;
  for (const char* n : preset_names) {
    if (name == n) return;
    known += cat(known.empty() ? "" : ", ", n);
  }
  fail("presets", cat("unknown preset '", name, "' (known: ", known, ")"));
}

namespace detail {
// Whether this program carries the device backends (a CUDA build's translation units, or the
// device stand-in's): the settings that only they read apply.
#if defined(FLEXCOMM_HAVE_CUDA) || defined(FLEXCOMM_DEVICE_STANDIN)
inline constexpr bool device_backends_built = true;
#else
inline constexpr bool device_backends_built = false;
#endif
#if defined(FLEXCOMM_DEVICE_STANDIN)
inline constexpr bool device_standin_built = true;
#else
inline constexpr bool device_standin_built = false;
#endif

// Runs `parse` on the setting's value, when set; its error names the setting.
template <class Parse>
void check_setting(const char* name, Parse&& parse) {
  const char* text = setting(name);
  if (!text) return;
  try {
    parse(text);
  } catch (const error& e) {
    fail(name, e.cause());
  }
}
}  // namespace detail

// Parses every FLEXCOMM_ setting that is set: the first bad value is a flexcomm::error naming its
// setting. Returns the settings that are set but cannot apply to this program, with why.
inline std::vector<std::string> check_settings() {
  using detail::check_setting;
  check_setting("FLEXCOMM_WAIT", [](const char* t) { wait_policy::parse(t); });
  check_setting("FLEXCOMM_TIMEOUT", [](const char* t) { parse_timeout(t); });
  check_setting("FLEXCOMM_CHECK", [](const char* t) { parse_check(t); });
  check_setting("FLEXCOMM_FINALIZE_TIMEOUT", [](const char* t) { parse_seconds("FLEXCOMM_FINALIZE_TIMEOUT", t); });
  check_setting("FLEXCOMM_BUCKET_BYTES", [](const char* t) { parse_setting_bytes(t, "FLEXCOMM_BUCKET_BYTES"); });
  check_setting("FLEXCOMM_SEGMENT_BYTES", [](const char* t) { parse_setting_bytes(t, "FLEXCOMM_SEGMENT_BYTES"); });
  check_setting("FLEXCOMM_HIERARCHICAL", [](const char*) { hierarchy_from_env(); });
  check_setting("FLEXCOMM_SHM", [](const char*) { shared_memory_from_env(); });
  check_setting("FLEXCOMM_HOSTS", [](const char* t) { host_map::parse(t); });
  check_setting("FLEXCOMM_LAYOUT", [](const char* t) { ensemble_layout::parse(t); });
  check_setting("FLEXCOMM_PRESET", [](const char* t) { check_preset_name(t); });
  check_setting("FLEXCOMM_STAGE_CHUNK", [](const char* t) { parse_stage_chunk(t); });
  check_setting("FLEXCOMM_PINNED_BYTES", [](const char* t) {
    const char* chunk = setting("FLEXCOMM_STAGE_CHUNK");
    parse_pinned_bytes(t, chunk ? parse_stage_chunk(chunk) : default_stage_chunk);
  });
  check_setting("FLEXCOMM_STANDIN_LATENCY", [](const char* t) { parse_standin_latency(t); });
  check_setting("FLEXCOMM_STANDIN_DEVICES", [](const char* t) { parse_standin_devices(t); });
  check_setting("FLEXCOMM_DEVICE", [](const char* t) { parse_device(t); });
  std::vector<std::string> idle;
  if (!detail::device_backends_built && setting("FLEXCOMM_STAGE_CHUNK"))
    idle.emplace_back("FLEXCOMM_STAGE_CHUNK does not apply: this program has no device backend (staged)");
  if (!detail::device_backends_built && setting("FLEXCOMM_PINNED_BYTES"))
    idle.emplace_back("FLEXCOMM_PINNED_BYTES does not apply: this program has no device backend (staged)");
  if (!detail::device_standin_built && setting("FLEXCOMM_STANDIN_LATENCY"))
    idle.emplace_back("FLEXCOMM_STANDIN_LATENCY does not apply: this program does not run on the device stand-in");
  if (!detail::device_standin_built && setting("FLEXCOMM_STANDIN_DEVICES"))
    idle.emplace_back("FLEXCOMM_STANDIN_DEVICES does not apply: this program does not run on the device stand-in");
  if (!detail::device_backends_built && setting("FLEXCOMM_DEVICE"))
    idle.emplace_back("FLEXCOMM_DEVICE does not apply: this program has no device backend");
  return idle;
}

}  // namespace flexcomm
