// A member whose split changed (a hand-over: pipeline/handover.hpp) gets its steps from the
// change on as one message per rank and step, its shards repacked from the pieces its producer
// made: the producer's side of it (one_to_many.hpp), with the notice that tells the producers,
// the credits that ask for those messages and the repacking. docs/heterogeneous.md says why.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../../backend/contract.hpp"
#include "../../core/error.hpp"
#include "../../core/layout.hpp"
#include "../../core/span.hpp"
#include "../../core/stall.hpp"
#include "../../core/wait.hpp"
#include "../../core/watchdog.hpp"
#include "steps_in_flight.hpp"
#include "wire.hpp"

namespace flexcomm::detail {

// Tags on the feed's duplicate of the world: each member's credits and steps apart, so that a
// rank that leaves one member and joins another never has the one's message taken for the other's.
constexpr int split_notice_tag = 1;
constexpr int split_members_max = 16000;  // two tags a member under MPI's least tag bound, 32767
inline int split_credit_tag(int member) { return 2 + 2 * member; }
inline int split_piece_tag(int member) { return 3 + 2 * member; }

// The notice a member's rank 0 sends each producer: member, first step, rank count, world ranks
// (a fixed size: the world's ranks at most).
inline std::vector<std::int64_t> split_notice(int member, std::int64_t from, const std::vector<int>& ranks, int world) {
  std::vector<std::int64_t> m(3 + static_cast<std::size_t>(world), -1);
  m[0] = member;
  m[1] = from;
  m[2] = static_cast<std::int64_t>(ranks.size());
  std::copy(ranks.begin(), ranks.end(), m.begin() + 3);
  return m;
}

// Waits for every request, naming the world ranks (peers[i] of rs[i]) that did not answer; once
// long, peers that follow a stall through this rank learn whom it waits on, and the timeout
// leads with where the stall is.
template <class Request>
void await_named(std::vector<Request>& rs, const std::vector<int>& peers, const std::string& what) {
  const auto limit = default_timeout();
  std::vector<char> done(rs.size(), 0);
  const auto silent = [&] {
    std::vector<int> out;
    for (std::size_t i = 0; i < rs.size(); ++i)
      if (!done[i]) out.push_back(peers[i]);
    return out;
  };
  waiting_note note;
  const bool all = wait_answering(
      default_wait(), limit,
      [&] {
        bool out = true;
        for (std::size_t i = 0; i < rs.size(); ++i) out = (done[i] = done[i] || rs[i].test()) && out;
        return out;
      },
      [&] {
        note.set(what, silent());
        watchdog::instance().answer_queries();
      });
  if (!all) timed_out_waiting(what, limit, world_ranks_named(silent()));
}

// Shards [first, first + count) of step `step` as one piece on the wire, out of the pieces that
// hold them (`piece(c)`: piece c's wire bytes). A failed piece travels as the step's failure.
template <class PieceBytes>
void repack(const std::vector<piece>& pieces, PieceBytes&& piece, std::int64_t step, int first, int count,
            std::size_t capacity, span<std::byte> out) {
  auto* header = reinterpret_cast<piece_header*>(out.data());
  auto* sizes = reinterpret_cast<std::uint64_t*>(out.data() + sizeof(piece_header));
  std::byte* payload = out.data() + sizeof(piece_header) + static_cast<std::size_t>(count) * sizeof(std::uint64_t);
  *header = {step, piece_ok, count, -1, process_rank(), 0};
  std::size_t offset = 0;
  for (std::size_t c = 0; c < pieces.size(); ++c) {
    const int lo = std::max(first, pieces[c].first_shard);
    const int hi = std::min(first + count, pieces[c].first_shard + pieces[c].shards);
    if (lo >= hi) continue;
    const span<const std::byte> in = piece(static_cast<int>(c));
    const auto& h = *reinterpret_cast<const piece_header*>(in.data());
    const std::byte* from = in.data() + sizeof(piece_header) + static_cast<std::size_t>(h.shards) * sizeof(std::uint64_t);
    if (h.status != piece_ok) {  // its text, where it has one, cut to what this piece holds
      *header = h;
      header->shards = count;
      if (h.status == piece_threw) {
        header->bad_size = std::min<std::uint64_t>(h.bad_size, static_cast<std::uint64_t>(count) * capacity);
        std::memcpy(payload, from, static_cast<std::size_t>(header->bad_size));
      }
      return;
    }
    const auto* in_sizes = reinterpret_cast<const std::uint64_t*>(in.data() + sizeof(piece_header));
    for (int x = pieces[c].first_shard; x < hi; ++x) {
      const std::uint64_t n = in_sizes[x - pieces[c].first_shard];
      if (x >= lo) {
        sizes[x - first] = n;
        std::memcpy(payload + offset, from, static_cast<std::size_t>(n));
        offset += static_cast<std::size_t>(n);
      }
      from += n;
    }
  }
}

// A producer's account of the members whose split changed: each split (from which step, which
// ranks), learnt from the members' notices when a credit says one is due, and the ranks that left.
template <class B>
class changed_splits {
 public:
  using communicator = typename B::communicator;
  using request = typename B::request;

  changed_splits(const communicator& joins, const ensemble_layout& layout)
      : joins_(&joins), layout_(&layout), splits_(static_cast<std::size_t>(layout.members())),
        gone_(static_cast<std::size_t>(layout.members())) {}

  // A credit said member m's split changed to one from `from` or later (0: any): waits for its
  // root's notice.
  void await_notice(int m, std::int64_t from);
  // Step s's credits from the ranks of every changed split that holds s (each rank sent them
  // ahead; one receive per rank and step, posted here), learning the newer splits they name.
  void take_credits(std::int64_t s);
  // Step s to every rank of each changed split that holds it, repacked from `piece(c)`; `out`
  // keeps the messages until `sends` are done.
  template <class PieceBytes>
  void ship(std::int64_t s, const std::vector<piece>& pieces, PieceBytes&& piece, std::size_t capacity,
            std::vector<std::vector<std::byte>>& out, in_flight<request>& sends);

 private:
  struct split {
    std::int64_t from;
    std::vector<int> ranks;
  };
  const split* at(int m, std::int64_t s) const {
    const split* found = nullptr;
    for (const auto& x : splits_[static_cast<std::size_t>(m)])
      if (x.from <= s) found = &x;
    return found;
  }
  bool gone(int m, int rank) const {
    const auto& g = gone_[static_cast<std::size_t>(m)];
    return std::find(g.begin(), g.end(), rank) != g.end();
  }
  std::int64_t credits_of(int m, std::int64_t s, const split& x, std::vector<int>& answered);

  const communicator* joins_;
  const ensemble_layout* layout_;
  std::vector<std::vector<split>> splits_;  // [member], in order of `from`
  std::vector<std::vector<int>> gone_;      // [member]: world ranks that said "none"
};

template <class B>
void changed_splits<B>::await_notice(int m, std::int64_t from) {
  const int root = layout_->trainer_rank(m, 0);
  auto& known = splits_[static_cast<std::size_t>(m)];
  while (known.empty() || known.back().from < from) {
    std::vector<std::int64_t> n(3 + static_cast<std::size_t>(joins_->size()), -1);
    std::vector<request> r;
    r.push_back(B::irecv(*joins_, span<std::int64_t>(n.data(), n.size()), root, split_notice_tag));
    await_named(r, {root}, cat("one_to_many: the new split of member ", m, " (from its rank 0)"));
    check(n[0] == m && n[2] > 0 && n[2] <= joins_->size(), "one_to_many: hand-over",
          cat("member ", m, "'s rank 0 (world rank ", root, ") sent a notice for member ", n[0], " with ", n[2], " rank(s)"));
    known.push_back({n[1], std::vector<int>(n.begin() + 3, n.begin() + 3 + n[2])});
  }
}

// One round of member m's credits for step s from the ranks of split x not yet `answered`;
// returns the newest split a credit names (x's own when none is newer).
template <class B>
std::int64_t changed_splits<B>::credits_of(int m, std::int64_t s, const split& x, std::vector<int>& answered) {
  std::vector<int> peers;
  for (int w : x.ranks)
    if (!gone(m, w) && std::find(answered.begin(), answered.end(), w) == answered.end()) peers.push_back(w);
  std::vector<int> value(peers.size(), 0);
  std::vector<request> rs;
  for (std::size_t i = 0; i < peers.size(); ++i)
    rs.push_back(B::irecv(*joins_, span<int>(&value[i], 1), peers[i], split_credit_tag(m)));
  await_named(rs, peers, cat("one_to_many: credits of member ", m, "'s step ", s));
  std::int64_t newest = x.from;
  for (std::size_t i = 0; i < peers.size(); ++i) {
    answered.push_back(peers[i]);
    if (value[i] <= 0) {  // "none": the rank left the member's stream; -(1 + from): it left the split from
      gone_[static_cast<std::size_t>(m)].push_back(peers[i]);  // `from` before it began (the member ended)
      newest = std::max<std::int64_t>(newest, -std::int64_t{value[i]} - 1);
      continue;
    }
    check(value[i] - 1 >= x.from, "one_to_many: hand-over",
          cat("world rank ", peers[i], " asked step ", s, " of member ", m, " on its split from step ", value[i] - 1,
              ", older than the one from step ", x.from));
    newest = std::max<std::int64_t>(newest, value[i] - 1);
  }
  return newest;
}

template <class B>
void changed_splits<B>::take_credits(std::int64_t s) {
  for (int m = 0; m < static_cast<int>(splits_.size()); ++m) {
    std::vector<int> answered;
    for (const split* x = at(m, s); x;) {
      const std::int64_t newest = credits_of(m, s, *x, answered);
      if (newest == x->from) break;
      await_notice(m, newest);  // the member grew again: its new ranks' credits too
      x = at(m, s);
    }
  }
}

template <class B>
template <class PieceBytes>
void changed_splits<B>::ship(std::int64_t s, const std::vector<piece>& pieces, PieceBytes&& piece, std::size_t capacity,
                             std::vector<std::vector<std::byte>>& out, in_flight<request>& sends) {
  const int shards = layout_->shards_per_step();
  std::size_t count = 0;
  for (int m = 0; m < static_cast<int>(splits_.size()); ++m)
    if (const split* x = at(m, s)) count += x->ranks.size();
  out.resize(count);  // before any send points into it
  std::size_t next = 0;
  for (int m = 0; m < static_cast<int>(splits_.size()); ++m) {
    const split* x = at(m, s);
    if (!x) continue;
    const int n = static_cast<int>(x->ranks.size());
    for (int r = 0; r < n; ++r) {
      const int w = x->ranks[static_cast<std::size_t>(r)];
      if (gone(m, w)) continue;
      const int first = r * shards / n, k = (r + 1) * shards / n - first;
      auto& message = out[next++];
      message.assign(piece_bytes(k, capacity), std::byte{0});
      repack(pieces, piece, s, first, k, capacity, span<std::byte>(message));
      sends.post(B::isend(*joins_, span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(message.data()),
                                                            message.size()),
                          w, split_piece_tag(m)),
                 w);
    }
  }
}

}  // namespace flexcomm::detail
