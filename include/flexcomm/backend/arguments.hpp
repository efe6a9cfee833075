// The checks every backend runs on a call's arguments before its library sees them, and the
// words an operation is named by, written once: mpi, nccl and staged refuse the same bad call
// (a root outside the communicator, counts that do not add up, a receive too small) with the
// same error, on the rank that made it, before anything is posted that a peer could wait for.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../core/datatype.hpp"
#include "../core/error.hpp"
#include "../core/span.hpp"

namespace flexcomm::detail {

// What an operation's name says after its count and type (", sum, root 0", ", to 1, tag 3"), kept as
// numbers and words until the name is written: a string made at every call would cost more than
// most of the call.
struct call_detail {
  const char* redop = nullptr;  // the reduction's name, where there is one
  bool rooted = false;          // ", root R"
  int root = -1;
  const char* toward = nullptr;  // "to" or "from": ", to P, tag T"
  int peer = -1, tag = -1;

  static call_detail reduction(const char* redop) { return {redop}; }
  static call_detail rooted_at(int root, const char* redop = nullptr) { return {redop, true, root}; }
  static call_detail point_to_point(const char* toward, int peer, int tag) {
    return {nullptr, false, -1, toward, peer, tag};
  }
};

// "mpi iallreduce on member 0 #12 (1024 x f32, sum)": how errors, timeouts and the flight
// recorder's readers name one operation. Written into `out`, whose capacity a backend may reuse.
inline void describe_operation_into(std::string& out, const char* backend, const char* name, const std::string& comm,
                                    std::uint64_t sequence, std::size_t count, dtype type, const call_detail& d) {
  out.clear();
  auto put = [&out](const auto&... parts) { (flexcomm::detail::append_part(out, parts), ...); };
  put(backend, " ", name, " on ", comm, " #", sequence, " (", count, " x ", name_of(type));
  if (d.redop) put(", ", d.redop);
  if (d.rooted) put(", root ", d.root);
  if (d.toward) put(", ", d.toward, " ", d.peer, ", tag ", d.tag);
  out.push_back(')');
}

inline std::string describe_operation(const char* backend, const char* name, const std::string& comm,
                                      std::uint64_t sequence, std::size_t count, dtype type, const call_detail& d) {
  std::string out;
  describe_operation_into(out, backend, name, comm, sequence, count, type, d);
  return out;
}

// `role` is "root" or "peer".
inline void check_rank_of(int r, int comm_size, const char* role, const std::string& what) {
  check(r >= 0 && r < comm_size, what, role, " ", r, " is not a rank of ", comm_size);
}

inline void check_same_size(std::size_t send, std::size_t recv, const std::string& what) {
  check(send == recv, what, "send holds ", send, " elements, receive holds ", recv);
}

// A reduce's receive is significant at the root only.
inline void check_root_receive(bool at_root, std::size_t send, std::size_t recv, const std::string& what) {
  check(!at_root || recv == send, what, "send holds ", send, " elements, the root's receive holds ", recv);
}

// Where each rank's block starts when counts[r] elements of rank r lie one after the other.
struct blocks {
  std::vector<int> offsets;
  std::size_t total = 0;
};

// Counts must be one per rank, none negative, adding up to no more than `capacity` elements
// and to no more than one int-counted call carries (MPI's and NCCL's counts are ints).
// `offsets` false: the offsets are left out (reduce_scatter, and the v-collectives of a backend that
// walks the counts itself: contract.hpp, reads_block_offsets), so that none are made per call.
inline blocks block_layout(span<const int> counts, int comm_size, std::size_t capacity, const std::string& what,
                           bool offsets = true) {
  check(counts.size() == static_cast<std::size_t>(comm_size), what,
        "needs one count per rank (", comm_size, "), got ", counts.size());
  blocks out;
  if (offsets) out.offsets.resize(counts.size());
  long long total = 0;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    check(counts[r] >= 0, what, "count for rank ", r, " is negative (", counts[r], ")");
    if (offsets) out.offsets[r] = static_cast<int>(total);
    total += counts[r];
    check(total <= INT_MAX, what, "counts add up past what one call carries (INT_MAX elements)");
  }
  check(static_cast<std::size_t>(total) <= capacity, what,
        "counts add up to ", total, " elements but the receive buffer holds ", capacity);
  out.total = static_cast<std::size_t>(total);
  return out;
}

// This rank's entry in `counts` must be what it sends.
inline void check_own_count(span<const int> counts, int rank, std::size_t send, const char* who,
                            const std::string& what) {
  const int mine = counts[static_cast<std::size_t>(rank)];
  check(static_cast<std::size_t>(mine) == send, what, who, " sends ", send, " elements but counts say ", mine);
}

// gatherv at the root: one count per rank, the root's own matching its send, room for all.
// `offsets` as block_layout's, here and in allgatherv_layout.
inline blocks gather_layout(span<const int> counts, int comm_size, int root, std::size_t send, std::size_t capacity,
                            const std::string& what, bool offsets = true) {
  check(counts.size() == static_cast<std::size_t>(comm_size), what,
        "root needs one count per rank (", comm_size, "), got ", counts.size());
  check_own_count(counts, root, send, "root", what);
  return block_layout(counts, comm_size, capacity, what, offsets);
}

inline blocks allgatherv_layout(span<const int> counts, int comm_size, int rank, std::size_t send,
                                std::size_t capacity, const std::string& what, bool offsets = true) {
  check(counts.size() == static_cast<std::size_t>(comm_size), what,
        "needs one count per rank (", comm_size, "), got ", counts.size());
  check_own_count(counts, rank, send, "this rank", what);
  return block_layout(counts, comm_size, capacity, what, offsets);
}

inline void check_allgather_sizes(std::size_t send, std::size_t recv, int comm_size, const std::string& what) {
  check(recv == send * static_cast<std::size_t>(comm_size), what,
        "receive holds ", recv, " elements, needs ", send, " x ", comm_size, " ranks");
}

// reduce_scatter: the counts split the send buffer, and this rank's receive holds its block. The
// layout has its total only.
inline blocks reduce_scatter_layout(span<const int> counts, int comm_size, int rank, std::size_t send,
                                    std::size_t recv, const std::string& what) {
  auto layout = block_layout(counts, comm_size, send, what, false);
  const auto mine = static_cast<std::size_t>(counts[static_cast<std::size_t>(rank)]);
  check(recv >= mine, what, "receive holds ", recv, " elements, this rank gets ", mine);
  return layout;
}

}  // namespace flexcomm::detail
