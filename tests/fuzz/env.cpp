// libFuzzer target: the parsers of flexcomm's environment variables, FLEXCOMM_WAIT
// (wait_policy::parse), FLEXCOMM_TIMEOUT (parse_timeout), FLEXCOMM_CHECK (parse_check) and
// FLEXCOMM_BUCKET_BYTES / FLEXCOMM_SEGMENT_BYTES (parse_bytes). The
// first byte picks the parser; the rest is the variable's text. Each accepts or throws
// flexcomm::error, and what it accepts is in range.
#include <flexcomm/core/wait.hpp>
#include <flexcomm/core/watchdog.hpp>
#include <flexcomm/patterns/sync/options.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);  // getenv gives C strings
  try {
    switch (data[0] % 4) {
      case 0: {
        const auto p = flexcomm::wait_policy::parse(text);
        if (p.kind == flexcomm::wait_kind::backoff && (p.max_sleep.count() <= 0 || p.max_sleep.count() > 1000000))
          std::abort();
        break;
      }
      case 1: {
        const auto t = flexcomm::parse_timeout(text.c_str());
        if (t.count() < 0) std::abort();
        break;
      }
      case 2: static_cast<void>(flexcomm::parse_check(text.c_str())); break;
      case 3: {
        const std::size_t bytes = flexcomm::parse_bytes(text, "FLEXCOMM_BUCKET_BYTES");
        if (bytes == 0 || bytes > (std::size_t{1} << 40)) std::abort();  // positive, at most 1 TiB
        break;
      }
    }
  } catch (const flexcomm::error&) {
  }
  return 0;
}
