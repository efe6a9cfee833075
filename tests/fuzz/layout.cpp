// libFuzzer target: ensemble_layout::parse (FLEXCOMM_LAYOUT and job scripts are outside input).
// Any text either parses into a layout that validates against its own world size and prints
// back to text that parses to the same layout, or throws flexcomm::error; nothing else. A
// per-host layout is placed on one host first; an unplanned one ("members=auto:N") prints back
// before planning, and is then planned one rank per member.
#include <flexcomm/core/layout.hpp>
#include <flexcomm/core/member_plan.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

namespace {
bool same(const flexcomm::ensemble_layout& a, const flexcomm::ensemble_layout& b) {
  return a.is_planned() == b.is_planned() && a.members() == b.members() && a.per_host() == b.per_host() &&
         (a.per_host() || a.producers() == b.producers()) && a.aggregator() == b.aggregator() &&
         (!a.is_planned() || a.member_sizes() == b.member_sizes());
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    auto parsed = flexcomm::ensemble_layout::parse(text);
    if (!same(flexcomm::ensemble_layout::parse(parsed.str()), parsed)) std::abort();  // str() and parse() disagree
    if (!parsed.is_planned()) {
      const std::vector<double> costs(static_cast<std::size_t>(parsed.members()), 1.0);
      parsed = flexcomm::plan_layout(parsed, parsed.members(), costs).layout;
    }
    const auto layout =
        parsed.is_placed() ? parsed : parsed.placed_on(flexcomm::host_map::single(parsed.trainers() + 1));
    layout.validate(layout.world_size());
    if (!same(flexcomm::ensemble_layout::parse(layout.str()), layout)) std::abort();
    for (int r = 0; r < layout.world_size() && r < 64; ++r) static_cast<void>(layout.role_of(r));
  } catch (const flexcomm::error&) {
  }
  return 0;
}
