// ensemble_layout: which world rank does what. Producers come first, then each member's
// trainer ranks in member order; one rank (world rank 0 unless told) aggregates results.
#pragma once

#include <cstdlib>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include "error.hpp"

namespace flexcomm {

enum class role { producer, trainer };

// The shards of one step that a trainer receives: [first, first + count).
struct shard_range {
  int first = 0;
  int count = 0;
};

struct rank_role {
  role kind = role::trainer;
  int producer = -1;        // index among producers, for a producer
  int member = -1;          // which member, for a trainer
  int rank_in_member = -1;  // rank inside that member, for a trainer
};

class ensemble_layout {
 public:
  // Text: "producers=1 members=4x2", "members=2,2,4 aggregator=3"; keys in any order,
  // producers and aggregator optional (0).
  static ensemble_layout parse(std::string_view text);

  // FLEXCOMM_LAYOUT when set, otherwise `fallback`; lets a job script change the layout.
  static ensemble_layout from_env(std::string_view fallback);

  ensemble_layout(int producers, std::vector<int> member_sizes, int aggregator = 0)
      : producers_(producers), member_sizes_(std::move(member_sizes)), aggregator_(aggregator) {
    check(producers_ >= 0, "layout", cat("producers must be >= 0, got ", producers_));
    check(!member_sizes_.empty(), "layout", "an ensemble needs at least one member, layout has zero");
    for (std::size_t m = 0; m < member_sizes_.size(); ++m)
      check(member_sizes_[m] > 0, "layout",
            cat("member ", m, " has ", member_sizes_[m], " ranks; every member needs at least one"));
    check(aggregator_ >= 0 && aggregator_ < world_size(), "layout",
          cat("aggregator is world rank ", aggregator_, " but the layout has ranks 0..", world_size() - 1));
  }

  int producers() const noexcept { return producers_; }
  int members() const noexcept { return static_cast<int>(member_sizes_.size()); }
  int member_size(int member) const { return member_sizes_.at(static_cast<std::size_t>(member)); }
  const std::vector<int>& member_sizes() const noexcept { return member_sizes_; }
  int trainers() const noexcept { return std::accumulate(member_sizes_.begin(), member_sizes_.end(), 0); }
  int world_size() const noexcept { return producers_ + trainers(); }
  int aggregator() const noexcept { return aggregator_; }
  bool homogeneous() const noexcept {
    for (int s : member_sizes_) if (s != member_sizes_.front()) return false;
    return true;
  }

  // Throws with what is wrong ("layout needs 9 ranks, world has 8").
  void validate(int world) const {
    check(world == world_size(), "layout",
          cat("layout '", str(), "' needs ", world_size(), " ranks, world has ", world));
  }

  // A feed that ships from producers cannot run on a layout without them.
  void require_producers(const char* feed) const {
    check(producers_ > 0, feed, cat("this feed needs producer ranks but layout '", str(), "' has none"));
  }

  rank_role role_of(int world_rank) const {
    check(world_rank >= 0 && world_rank < world_size(), "layout",
          cat("world rank ", world_rank, " is outside layout '", str(), "' (", world_size(), " ranks)"));
    if (world_rank < producers_) return {role::producer, world_rank, -1, -1};
    int first = producers_;
    for (int m = 0; m < members(); ++m) {
      if (world_rank < first + member_sizes_[m]) return {role::trainer, -1, m, world_rank - first};
      first += member_sizes_[m];
    }
    return {};  // unreachable: the range check above covers every rank
  }

  int producer_rank(int producer) const { return producer; }

  // A step is cut into lcm(member sizes) shards, so that every member divides it evenly.
  int shards_per_step() const {
    long long l = 1;
    for (int s : member_sizes_) {
      l = l / std::gcd(l, static_cast<long long>(s)) * s;
      check(l <= (1 << 20), "layout", cat("layout '", str(), "' needs more than ", 1 << 20,
                                          " shards per step (the lcm of its member sizes)"));
    }
    return static_cast<int>(l);
  }

  // Trainer `rank_in_member` of `member` (n ranks) receives shards [r*L/n, (r+1)*L/n).
  shard_range shards_of(int member, int rank_in_member) const {
    const int n = member_size(member), l = shards_per_step();
    check(rank_in_member >= 0 && rank_in_member < n, "layout",
          cat("member ", member, " has ranks 0..", n - 1, ", not ", rank_in_member));
    return {rank_in_member * (l / n), l / n};
  }

  // Which rank of `member` receives shard `shard`.
  int owner_of(int member, int shard) const { return shard / (shards_per_step() / member_size(member)); }

  int trainer_rank(int member, int rank_in_member) const {
    int first = producers_;
    for (int m = 0; m < member; ++m) first += member_sizes_.at(static_cast<std::size_t>(m));
    return first + rank_in_member;
  }

  std::string str() const {
    std::string s;
    if (producers_ > 0) s += cat("producers=", producers_, " ");
    s += "members=";
    if (homogeneous() && members() > 1) {
      s += cat(members(), "x", member_sizes_.front());
    } else {
      for (std::size_t m = 0; m < member_sizes_.size(); ++m) s += cat(m ? "," : "", member_sizes_[m]);
    }
    if (aggregator_ != 0) s += cat(" aggregator=", aggregator_);
    return s;
  }

 private:
  int producers_;
  std::vector<int> member_sizes_;
  int aggregator_;
};

namespace detail {
// A count in a layout: digits only, small enough that sums cannot overflow.
inline int parse_layout_count(std::string_view digits, std::string_view text, const char* what) {
  constexpr int limit = 1 << 20;
  check(!digits.empty(), "layout", cat("cannot parse '", text, "': ", what, " is empty"));
  long long v = 0;
  for (char c : digits) {
    check(c >= '0' && c <= '9', "layout",
          cat("cannot parse '", text, "': ", what, " '", digits, "' is not a number"));
    v = v * 10 + (c - '0');
    check(v <= limit, "layout", cat("cannot parse '", text, "': ", what, " exceeds ", limit));
  }
  return static_cast<int>(v);
}
}  // namespace detail

inline ensemble_layout ensemble_layout::parse(std::string_view text) {
  int producers = 0, aggregator = 0;
  std::vector<int> sizes;
  bool seen_producers = false, seen_members = false, seen_aggregator = false;
  std::size_t pos = 0;
  while (pos < text.size()) {
    if (text[pos] == ' ' || text[pos] == '\t') { ++pos; continue; }
    std::size_t end = text.find_first_of(" \t", pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view item = text.substr(pos, end - pos);
    pos = end;
    const std::size_t eq = item.find('=');
    check(eq != std::string_view::npos, "layout",
          cat("cannot parse '", text, "': expected key=value, got '", item, "'"));
    const std::string_view key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "producers") {
      check(!seen_producers, "layout", cat("cannot parse '", text, "': producers given twice"));
      seen_producers = true;
      producers = detail::parse_layout_count(value, text, "producers");
    } else if (key == "aggregator") {
      check(!seen_aggregator, "layout", cat("cannot parse '", text, "': aggregator given twice"));
      seen_aggregator = true;
      aggregator = detail::parse_layout_count(value, text, "aggregator");
    } else if (key == "members") {
      check(!seen_members, "layout", cat("cannot parse '", text, "': members given twice"));
      seen_members = true;
      if (const std::size_t x = value.find('x'); x != std::string_view::npos) {
        const int count = detail::parse_layout_count(value.substr(0, x), text, "member count");
        const int size = detail::parse_layout_count(value.substr(x + 1), text, "member size");
        check(static_cast<long long>(count) * size <= (1 << 20), "layout",
              cat("cannot parse '", text, "': ", count, "x", size, " ranks is too many"));
        sizes.assign(static_cast<std::size_t>(count), size);
      } else {
        std::size_t p = 0;
        for (;;) {
          const std::size_t comma = value.find(',', p);
          const auto piece = value.substr(p, comma == std::string_view::npos ? value.size() - p : comma - p);
          sizes.push_back(detail::parse_layout_count(piece, text, "member size"));
          check(sizes.size() <= (1u << 20), "layout", cat("cannot parse '", text, "': too many members"));
          if (comma == std::string_view::npos) break;
          p = comma + 1;
        }
      }
    } else {
      fail("layout", cat("cannot parse '", text, "': unknown key '", key,
                         "' (known: producers, members, aggregator)"));
    }
  }
  check(seen_members, "layout", cat("cannot parse '", text, "': members=... is missing"));
  check(static_cast<long long>(producers) +
                std::accumulate(sizes.begin(), sizes.end(), 0LL) <= (1 << 20),
        "layout", cat("cannot parse '", text, "': too many ranks"));
  return ensemble_layout(producers, std::move(sizes), aggregator);
}

inline ensemble_layout ensemble_layout::from_env(std::string_view fallback) {
  if (const char* text = std::getenv("FLEXCOMM_LAYOUT"); text && *text) return parse(text);
  return parse(fallback);
}

}  // namespace flexcomm
