// How a step travels: cut into pieces (runs of shards with the same receivers), each a
// fixed-size message of a header, the shard sizes and the shards, with loader failures carried
// in the header so that every trainer learns of them at that step. A trainer reads its pieces
// back into a batch in step_source.hpp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/layout.hpp"
#include "../../core/span.hpp"
#include "../../core/trace.hpp"
#include "vocabulary.hpp"

namespace flexcomm {
namespace detail {

// A run of consecutive shards received by the same trainer of every member: the unit a feed
// moves in one message. Owners are monotone in the shard, so equal owner sets are contiguous.
struct piece {
  int first_shard = 0;
  int shards = 0;
  std::vector<int> owner;  // owner[m]: the rank of member m that receives this piece
};

inline std::vector<piece> pieces_of(const ensemble_layout& layout) {
  std::vector<piece> out;
  const int l = layout.shards_per_step();
  for (int k = 0; k < l; ++k) {
    std::vector<int> owner(static_cast<std::size_t>(layout.members()));
    for (int m = 0; m < layout.members(); ++m) owner[static_cast<std::size_t>(m)] = layout.owner_of(m, k);
    if (!out.empty() && out.back().owner == owner) {
      ++out.back().shards;
    } else {
      out.push_back({k, 1, std::move(owner)});
    }
  }
  return out;
}

// The pieces a trainer receives, in shard order.
inline std::vector<int> pieces_of_trainer(const std::vector<piece>& pieces, int member, int rank_in_member) {
  std::vector<int> mine;
  for (std::size_t c = 0; c < pieces.size(); ++c)
    if (pieces[c].owner[static_cast<std::size_t>(member)] == rank_in_member) mine.push_back(static_cast<int>(c));
  return mine;
}

// A piece on the wire: a header, the shard sizes, then the shards packed one after the other.
// Messages have a fixed size (header + shards * capacity) so receivers can post them early.
struct piece_header {
  std::int64_t step;
  std::int32_t status;     // piece_status
  std::int32_t shards;
  std::int32_t bad_shard;  // the shard the loader failed on
  std::int32_t origin;     // world rank that ran the loader
  std::uint64_t bad_size;  // what the loader returned, or the length of its error text
};
enum piece_status : std::int32_t { piece_ok = 0, piece_overfill = 1, piece_threw = 2, piece_guard = 3, piece_none = 4 };

// Rounded to 8 bytes, so that the headers of pieces laid side by side stay aligned.
inline std::size_t piece_bytes(int shards, std::size_t capacity) {
  const std::size_t n = sizeof(piece_header) + static_cast<std::size_t>(shards) * (sizeof(std::uint64_t) + capacity);
  return (n + 7) / 8 * 8;
}

// Bytes after a loader's slot that must survive it: a loader that writes past its span is caught.
constexpr std::size_t guard_bytes = 64;
constexpr std::byte guard_value{0xA5};

// Calls the loader for each shard of a piece and packs the result into `slot`
// (piece_bytes + guard_bytes long). Failures are recorded in the header, never thrown: the
// message must still travel, so that every trainer learns of the failure at that step.
inline void fill_piece(const loader& load, std::int64_t step, int first_shard, int shards, std::size_t capacity,
                       span<std::byte> slot) {
  auto* header = reinterpret_cast<piece_header*>(slot.data());
  auto* sizes = reinterpret_cast<std::uint64_t*>(slot.data() + sizeof(piece_header));
  std::byte* payload = slot.data() + sizeof(piece_header) + static_cast<std::size_t>(shards) * sizeof(std::uint64_t);
  const std::size_t end = piece_bytes(shards, capacity);
  *header = {step, piece_ok, shards, -1, process_rank(), 0};
  std::fill(slot.data() + end, slot.data() + end + guard_bytes, guard_value);
  std::size_t offset = 0;
  for (int i = 0; i < shards; ++i) {
    std::size_t written = 0;
    try {
      trace::span traced(trace::names::loader, step, "step", "feed");
      written = load(step, first_shard + i, span<std::byte>(payload + offset, capacity));
    } catch (const std::exception& e) {
      const std::string what = e.what();
      const std::size_t n = std::min(what.size(), static_cast<std::size_t>(shards) * capacity);
      std::memcpy(payload, what.data(), n);
      *header = {step, piece_threw, shards, first_shard + i, process_rank(), n};
      return;
    }
    const bool guard_intact = std::all_of(slot.data() + end, slot.data() + end + guard_bytes,
                                          [](std::byte b) { return b == guard_value; });
    if (written > capacity || !guard_intact) {
      *header = {step, written > capacity ? piece_overfill : piece_guard, shards, first_shard + i, process_rank(),
                 written};
      return;
    }
    sizes[i] = written;
    offset += written;
  }
}

// A piece that carries no step (past the end of the stream, or drained after a failure).
inline void empty_piece(std::int64_t step, int shards, span<std::byte> slot) {
  *reinterpret_cast<piece_header*>(slot.data()) = {step, piece_none, shards, -1, process_rank(), 0};
}

// The error a failed piece stands for.
[[noreturn]] inline void piece_failure(const char* feed, span<const std::byte> slot, std::size_t capacity) {
  const auto& h = *reinterpret_cast<const piece_header*>(slot.data());
  const std::string where = cat(feed, ": step ", h.step, " shard ", h.bad_shard);
  switch (h.status) {
    case piece_overfill:
      fail(where, cat("loader on rank ", h.origin, " wrote ", h.bad_size, " bytes, slot holds ", capacity));
    case piece_guard:
      fail(where, cat("loader on rank ", h.origin, " wrote past the end of its ", capacity, "-byte slot"));
    case piece_threw: {
      const std::byte* text = slot.data() + sizeof(piece_header) + static_cast<std::size_t>(h.shards) * sizeof(std::uint64_t);
      fail(where, cat("loader on rank ", h.origin, " failed: ",
                      std::string(reinterpret_cast<const char*>(text), static_cast<std::size_t>(h.bad_size))));
    }
    case piece_none:
      fail(cat(feed, ": step ", h.step), cat("rank ", h.origin, " left the stream before this step"));
    default: fail(where, cat("received a piece with unknown status ", h.status));
  }
}

}  // namespace detail
}  // namespace flexcomm
