// libFuzzer target: ensemble_layout::parse (FLEXCOMM_LAYOUT and job scripts are outside input).
// Any text either parses into a layout that validates against its own world size and prints
// back to text that parses to the same layout, or throws flexcomm::error; nothing else. A
// per-host layout is placed on one host first.
#include <flexcomm/core/layout.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const auto parsed = flexcomm::ensemble_layout::parse(text);
    const auto layout =
        parsed.is_placed() ? parsed : parsed.placed_on(flexcomm::host_map::single(parsed.trainers() + 1));
    layout.validate(layout.world_size());
    const auto again = flexcomm::ensemble_layout::parse(layout.str());
    if (again.member_sizes() != layout.member_sizes() || again.per_host() != layout.per_host() ||
        (!layout.per_host() && again.producers() != layout.producers()) || again.aggregator() != layout.aggregator())
      std::abort();  // str() and parse() disagree
    for (int r = 0; r < layout.world_size() && r < 64; ++r) static_cast<void>(layout.role_of(r));
  } catch (const flexcomm::error&) {
  }
  return 0;
}
