// ensemble_layout: which world rank does what. Producers come first, then each member's
// trainer ranks in member order; one rank (world rank 0 unless told) aggregates results.
// Or one producer per host ("producers=per-host"): placed on a host_map, each host's lowest rank
// produces for the trainers on that host, and each member sits on as few hosts as it can.
// Or members flexcomm sizes ("members=auto:N"): unplanned until planned() gives their ranks
// (core/member_plan.hpp chooses them from the members' step costs).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include "error.hpp"
#include "settings.hpp"
#include "hosts.hpp"

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

// Tag of a layout with one producer on each host: ensemble_layout(producers_per_host, {2, 1}).
namespace detail {
// Said wherever an aggregator is out of range: producers= counts ranks, aggregator= names one.
inline constexpr const char* aggregator_is_a_rank =
    " (aggregator= names the world rank that gathers results, unlike producers=, a count)";
}  // namespace detail

struct per_host_tag {
  explicit per_host_tag() = default;
};
inline constexpr per_host_tag producers_per_host{};

class ensemble_layout {
 public:
  // Text: key=value items separated by spaces, in any order ("producers=1 members=4x2",
  // "members=2,2,4 aggregator=3", "producers=per-host members=2,1"):
  //   producers=P     a count: world ranks 0..P-1 produce (default 0); or per-host
  //   members=a,b,..  each member's rank count, in member order (KxN: K members of N ranks);
  //                   member 0 takes the ranks after the producers, then member 1, ...
  //                   auto:N: N members that flexcomm sizes (unplanned until planned())
  //   aggregator=R    a world rank, not a count (default 0): the rank that gathers results.
  //                   With producers=1, aggregator=1 is member 0's first trainer.
  static ensemble_layout parse(std::string_view text);

  // FLEXCOMM_LAYOUT when set, otherwise `fallback`; lets a job script change the layout.
  static ensemble_layout from_env(std::string_view fallback);

  // `producers` ranks (a count), then the members' ranks; `aggregator` is a world rank.
  ensemble_layout(int producers, std::vector<int> member_sizes, int aggregator = 0)
      : producers_(producers), member_sizes_(std::move(member_sizes)), aggregator_(aggregator) {
    check(producers_ >= 0, "layout", cat("producers must be >= 0, got ", producers_));
    check_members();
    check(aggregator_ >= 0 && aggregator_ < world_size(), "layout",
          cat("aggregator is world rank ", aggregator_, " but the layout has ranks 0..", world_size() - 1,
              detail::aggregator_is_a_rank));
  }

  // One producer per host, not yet placed: placed_on(hosts) says which rank does what. The
  // aggregator is a world rank; whether it fits is known once the layout is placed.
  ensemble_layout(per_host_tag, std::vector<int> member_sizes, int aggregator = 0)
      : producers_(0), per_host_(true), member_sizes_(std::move(member_sizes)), aggregator_(aggregator) {
    check_members();
    check(aggregator_ >= 0, "layout", cat("aggregator must be a world rank >= 0, got ", aggregator_));
  }

  // The producer count; for a per-host layout, its hosts (known once placed).
  int producers() const {
    require_placed("its producer count");
    return producers_;
  }
  int members() const noexcept { return unplanned_ > 0 ? unplanned_ : static_cast<int>(member_sizes_.size()); }
  int member_size(int member) const {
    require_planned("a member's size");
    return member_sizes_.at(static_cast<std::size_t>(member));
  }
  const std::vector<int>& member_sizes() const {
    require_planned("its member sizes");
    return member_sizes_;
  }
  int trainers() const {
    require_planned("its trainer count");
    return std::accumulate(member_sizes_.begin(), member_sizes_.end(), 0);
  }
  int world_size() const {
    require_planned("its world size");
    require_placed("its world size");
    return producers_ + trainers();
  }
  int aggregator() const noexcept { return aggregator_; }
  bool homogeneous() const {
    require_planned("whether its members are alike");
    for (int s : member_sizes_) if (s != member_sizes_.front()) return false;
    return true;
  }

  // Whether its members have their sizes: always, except for "members=auto:N" before planned().
  bool is_planned() const noexcept { return unplanned_ == 0; }

  // The trainer ranks an unplanned layout's members share in a world of `world` ranks: all but
  // the producers (the aggregator is one of the producers or trainers, never a rank of its own).
  // A per-host layout asks the host map, whose hosts each keep a producer.
  int rank_budget(int world) const;
  int rank_budget(const host_map& hosts) const;

  // This unplanned layout with its members' sizes (member order); the rest stays as written.
  // Throws where the sizes do not fit (their count, a size below 1, the aggregator's rank).
  ensemble_layout planned(std::vector<int> member_sizes) const;

  // One producer per host ("producers=per-host"), placed or not.
  bool per_host() const noexcept { return per_host_; }
  // Whether the text parse() read wrote producers= (aggregator=): what the user chose, which a
  // preset keeps (presets::choose). False for a layout built in code.
  bool wrote_producers() const noexcept { return wrote_producers_; }
  bool wrote_aggregator() const noexcept { return wrote_aggregator_; }
  // Whether every rank's role is known: always, except for a per-host layout before placed_on().
  bool is_placed() const noexcept { return !per_host_ || placement_ != nullptr; }

  // This layout on these hosts (the host_map of the world it will run on). A per-host layout
  // gets one producer per host, the host's lowest rank, and its members' trainers on the other
  // ranks, each member on as few hosts as it can: members largest first (ties in member order)
  // take the host with the fewest free ranks that holds them all, or, when no host can, the
  // hosts with the most free ranks, the last part again into the tightest host that holds it.
  // Inside a host, its ranks go to members in member order; a member's ranks are in world-rank
  // order. The same on every rank for the same map; on one host it is "producers=1". Other
  // layouts are returned as they are.
  ensemble_layout placed_on(const host_map& hosts) const;

  // Throws with what is wrong ("layout needs 9 ranks, world has 8"). A per-host layout not
  // yet placed checks only what no host map can change: a producer beside the trainers.
  void validate(int world) const {
    require_planned("whether it fits the world");
    if (!is_placed()) {
      check(world > trainers(), "layout",
            cat("layout '", str(), "' needs ", trainers(), " trainer ranks and a producer on each host, world has ",
                world));
      return;
    }
    check(world == world_size(), "layout",
          cat("layout '", str(), "' needs ", world_size(), " ranks, world has ", world,
              per_host_ ? cat(" (a producer on each of ", producers_, " hosts and ", trainers(), " trainers)") : ""));
  }

  // A feed that ships from producers cannot run on a layout without them.
  void require_producers(const char* feed) const {
    check(per_host_ || producers_ > 0, feed, cat("this feed needs producer ranks but layout '", str(), "' has none"));
  }

  // A per-host layout must be placed before anyone asks which rank does what.
  void require_placed(const char* what) const {
    check(is_placed(), "layout",
          cat("layout '", str(), "' puts a producer on each host and is not placed yet: ", what,
              " depends on the hosts (place it with placed_on(hosts); the feeds, the collect and the pipeline "
              "place it on their world's hosts)"));
  }

  // "members=auto:N" must be planned before anyone asks how many ranks a member has.
  // (No check(): its message would be built, str() included, on every call of a hot accessor.)
  void require_planned(const char* what) const {
    if (is_planned()) return;
    fail("layout", cat("layout '", str(), "' asks flexcomm to size its ", unplanned_, " members and is not planned yet: ",
                       what, " depends on the plan (plan it with plan_layout(...) or measure_and_plan(...), ",
                       "docs/architecture.md)"));
  }

  rank_role role_of(int world_rank) const {
    require_planned("the role of a rank");
    require_placed("the role of a rank");
    check(world_rank >= 0 && world_rank < world_size(), "layout",
          cat("world rank ", world_rank, " is outside layout '", str(), "' (", world_size(), " ranks)"));
    if (placement_) return placement_->roles[static_cast<std::size_t>(world_rank)];
    if (world_rank < producers_) return {role::producer, world_rank, -1, -1};
    int first = producers_;
    for (int m = 0; m < members(); ++m) {
      if (world_rank < first + member_sizes_[m]) return {role::trainer, -1, m, world_rank - first};
      first += member_sizes_[m];
    }
    return {};  // unreachable: the range check above covers every rank
  }

  // The world rank of producer `producer`.
  int producer_rank(int producer) const {
    require_planned("the rank of a producer");
    require_placed("the rank of a producer");
    check(producer >= 0 && producer < producers_, "layout",
          cat("layout '", str(), "' has producers 0..", producers_ - 1, ", not ", producer));
    return placement_ ? placement_->producer_ranks[static_cast<std::size_t>(producer)] : producer;
  }

  // Whether producer `producer` ever ships to trainer `rank_in_member` of `member`: every
  // producer to every trainer when producers take turns; a per-host producer to its host's.
  bool feeds(int producer, int member, int rank_in_member) const {
    require_placed("which producer feeds a trainer");
    if (!per_host_) return true;
    return producer_of_host(member, rank_in_member) == producer;
  }

  // Whether producer `producer` ships step `step`: s mod P when producers take turns; every
  // step for a per-host producer (to its host's trainers only).
  bool produces(int producer, std::int64_t step) const {
    require_placed("which producer ships a step");
    return per_host_ || step % producers_ == producer;
  }

  // The producer that ships step `step` to trainer `rank_in_member` of `member`.
  int producer_for(int member, int rank_in_member, std::int64_t step) const {
    require_placed("which producer feeds a trainer");
    check(producers_ > 0, "layout", cat("layout '", str(), "' has no producers"));
    return per_host_ ? producer_of_host(member, rank_in_member) : static_cast<int>(step % producers_);
  }

  // A step is cut into lcm(member sizes) shards, so that every member divides it evenly.
  int shards_per_step() const {
    require_planned("a step's shards");
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
    require_planned("the rank of a trainer");
    require_placed("the rank of a trainer");
    if (placement_) {
      check(member >= 0 && member < members() && rank_in_member >= 0 && rank_in_member < member_size(member),
            "layout", cat("member ", member, " rank ", rank_in_member, " is not a trainer of layout '", str(), "'"));
      return placement_->member_ranks[static_cast<std::size_t>(member)][static_cast<std::size_t>(rank_in_member)];
    }
    int first = producers_;
    for (int m = 0; m < member; ++m) first += member_sizes_.at(static_cast<std::size_t>(m));
    return first + rank_in_member;
  }

  // A member's world ranks, in member order.
  std::vector<int> member_ranks(int member) const {
    std::vector<int> ranks;
    for (int r = 0; r < member_size(member); ++r) ranks.push_back(trainer_rank(member, r));
    return ranks;
  }

  // Parses back to the same layout; a placed per-host layout prints as before placement.
  std::string str() const {
    std::string s;
    if (per_host_) {
      s += "producers=per-host ";
    } else if (producers_ > 0) {
      s += cat("producers=", producers_, " ");
    }
    s += "members=";
    if (!is_planned()) {
      s += cat("auto:", unplanned_);
    } else if (homogeneous() && members() > 1) {
      s += cat(members(), "x", member_sizes_.front());
    } else {
      for (std::size_t m = 0; m < member_sizes_.size(); ++m) s += cat(m ? "," : "", member_sizes_[m]);
    }
    if (aggregator_ != 0) s += cat(" aggregator=", aggregator_);
    return s;
  }

 private:
  // Who does what in a placed per-host layout, rank by rank (shared: adapters copy layouts).
  struct placement {
    std::vector<rank_role> roles;               // by world rank
    std::vector<int> producer_ranks;            // by producer (= host)
    std::vector<std::vector<int>> member_ranks;  // by member, in member order
    std::vector<int> host_producer;             // by world rank: the producer of its host
  };

  // "members=auto:N" as parsed: N members, no sizes yet.
  struct unplanned_tag {};
  ensemble_layout(unplanned_tag, int producers, bool per_host, int members, int aggregator)
      : producers_(producers), per_host_(per_host), aggregator_(aggregator), unplanned_(members) {
    check(members > 0, "layout", "an ensemble needs at least one member, layout has zero");
    check(aggregator_ >= 0, "layout", cat("aggregator must be a world rank >= 0, got ", aggregator_));
  }

  void check_members() const {
    check(!member_sizes_.empty(), "layout", "an ensemble needs at least one member, layout has zero");
    for (std::size_t m = 0; m < member_sizes_.size(); ++m)
      check(member_sizes_[m] > 0, "layout",
            cat("member ", m, " has ", member_sizes_[m], " ranks; every member needs at least one"));
  }

  int producer_of_host(int member, int rank_in_member) const {
    return placement_->host_producer[static_cast<std::size_t>(trainer_rank(member, rank_in_member))];
  }

  // placed_on's share of each member's ranks on each host ([member][host]), given the free
  // ranks of each host: a member goes whole on the tightest host that holds it, else its rest
  // on the roomiest, largest member first.
  std::vector<std::vector<int>> shares_on(std::vector<int> free) const;

  int producers_;
  bool per_host_ = false;
  std::vector<int> member_sizes_;
  int aggregator_;
  int unplanned_ = 0;  // "members=auto:N": N until planned(), then 0
  bool wrote_producers_ = false, wrote_aggregator_ = false;  // parse()'s text did
  std::shared_ptr<const placement> placement_;  // per-host layouts, once placed
};

inline std::vector<std::vector<int>> ensemble_layout::shares_on(std::vector<int> free) const {
  const int h = static_cast<int>(free.size()), members_count = members();
  std::vector<int> order(static_cast<std::size_t>(members_count));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return member_size(a) > member_size(b); });
  std::vector<std::vector<int>> share(static_cast<std::size_t>(members_count),
                                      std::vector<int>(static_cast<std::size_t>(h), 0));
  for (int m : order) {
    for (int need = member_size(m); need > 0;) {
      int best = -1;  // the tightest host that holds what is left ...
      for (int host = 0; host < h; ++host) {
        const int f = free[static_cast<std::size_t>(host)];
        if (f >= need && (best < 0 || f < free[static_cast<std::size_t>(best)])) best = host;
      }
      if (best < 0)  // ... else the roomiest (there is room: free ranks = trainers)
        for (int host = 0; host < h; ++host) {
          const int f = free[static_cast<std::size_t>(host)];
          if (f > 0 && (best < 0 || f > free[static_cast<std::size_t>(best)])) best = host;
        }
      const int take = std::min(need, free[static_cast<std::size_t>(best)]);
      share[static_cast<std::size_t>(m)][static_cast<std::size_t>(best)] += take;
      free[static_cast<std::size_t>(best)] -= take;
      need -= take;
    }
  }
  return share;
}

inline ensemble_layout ensemble_layout::placed_on(const host_map& hosts) const {
  require_planned("where its members go on the hosts");
  if (!per_host_) return *this;
  const int h = hosts.hosts(), n = hosts.ranks(), members_count = members();
  check(n > 0, "layout", cat("layout '", str(), "' cannot be placed on an empty host map"));
  check(n == h + trainers(), "layout",
        cat("layout '", str(), "' needs ", h + trainers(), " ranks, world has ", n, " (a producer on each of ", h,
            " hosts ", hosts.str(), " and ", trainers(), " trainers)"));
  check(aggregator_ < n, "layout",
        cat("aggregator is world rank ", aggregator_, " but layout '", str(), "' has ranks 0..", n - 1,
            detail::aggregator_is_a_rank));
  auto p = std::make_shared<placement>();
  p->roles.resize(static_cast<std::size_t>(n));
  p->host_producer.resize(static_cast<std::size_t>(n));
  std::vector<int> free(static_cast<std::size_t>(h));
  for (int host = 0; host < h; ++host) {  // hosts are numbered by their lowest rank: producers ascend
    p->roles[static_cast<std::size_t>(hosts.leader_of(host))] = {role::producer, host, -1, -1};
    p->producer_ranks.push_back(hosts.leader_of(host));
    free[static_cast<std::size_t>(host)] = hosts.ranks_per_host(host) - 1;
  }
  for (int r = 0; r < n; ++r) p->host_producer[static_cast<std::size_t>(r)] = hosts.host_of(r);

  // How many ranks of each member go on each host.
  const std::vector<std::vector<int>> share = shares_on(std::move(free));

  // Which ranks: a host's free ranks to members in member order.
  p->member_ranks.resize(static_cast<std::size_t>(members_count));
  for (int host = 0; host < h; ++host) {
    const auto& on = hosts.ranks_on(host);
    std::size_t next = 1;  // on[0] produces
    for (int m = 0; m < members_count; ++m)
      for (int k = 0; k < share[static_cast<std::size_t>(m)][static_cast<std::size_t>(host)]; ++k)
        p->member_ranks[static_cast<std::size_t>(m)].push_back(on[next++]);
  }
  for (int m = 0; m < members_count; ++m) {
    auto& ranks = p->member_ranks[static_cast<std::size_t>(m)];
    std::sort(ranks.begin(), ranks.end());
    for (std::size_t r = 0; r < ranks.size(); ++r)
      p->roles[static_cast<std::size_t>(ranks[r])] = {role::trainer, -1, m, static_cast<int>(r)};
  }
  ensemble_layout out = *this;
  out.producers_ = h;
  out.placement_ = std::move(p);
  return out;
}

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

// members=...'s value: the sizes ("a,b,..", "KxN") into `sizes`; or, for "auto:N", returns N.
inline int parse_member_sizes(std::string_view value, std::string_view text, std::vector<int>& sizes) {
  if (value.substr(0, 5) == "auto:") {
    const int members = parse_layout_count(value.substr(5), text, "member count after auto:");
    check(members > 0, "layout", cat("cannot parse '", text, "': members=auto:N needs N >= 1 members"));
    return members;
  }
  if (const std::size_t x = value.find('x'); x != std::string_view::npos) {
    const int count = parse_layout_count(value.substr(0, x), text, "member count");
    const int size = parse_layout_count(value.substr(x + 1), text, "member size");
    check(static_cast<long long>(count) * size <= (1 << 20), "layout",
          cat("cannot parse '", text, "': ", count, "x", size, " ranks is too many"));
    sizes.assign(static_cast<std::size_t>(count), size);
    return 0;
  }
  for (std::size_t p = 0;;) {
    const std::size_t comma = value.find(',', p);
    const auto piece = value.substr(p, comma == std::string_view::npos ? value.size() - p : comma - p);
    sizes.push_back(parse_layout_count(piece, text, "member size"));
    check(sizes.size() <= (1u << 20), "layout", cat("cannot parse '", text, "': too many members"));
    if (comma == std::string_view::npos) return 0;
    p = comma + 1;
  }
}
}  // namespace detail

inline ensemble_layout ensemble_layout::parse(std::string_view text) {
  int producers = 0, aggregator = 0, unplanned = 0;
  std::vector<int> sizes;
  bool per_host = false;
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
      if (value == "per-host") {
        per_host = true;
      } else {
        producers = detail::parse_layout_count(value, text, "producers (a count or per-host)");
      }
    } else if (key == "aggregator") {
      check(!seen_aggregator, "layout", cat("cannot parse '", text, "': aggregator given twice"));
      seen_aggregator = true;
      aggregator = detail::parse_layout_count(value, text, "aggregator");
    } else if (key == "members") {
      check(!seen_members, "layout", cat("cannot parse '", text, "': members given twice"));
      seen_members = true;
      unplanned = detail::parse_member_sizes(value, text, sizes);
    } else {
      fail("layout", cat("cannot parse '", text, "': unknown key '", key,
                         "' (known: producers, members, aggregator)"));
    }
  }
  check(seen_members, "layout", cat("cannot parse '", text, "': members=... is missing"));
  check(static_cast<long long>(producers) +
                std::accumulate(sizes.begin(), sizes.end(), 0LL) <= (1 << 20),
        "layout", cat("cannot parse '", text, "': too many ranks"));
  auto layout = unplanned > 0 ? ensemble_layout(unplanned_tag{}, producers, per_host, unplanned, aggregator)
                : per_host    ? ensemble_layout(producers_per_host, std::move(sizes), aggregator)
                              : ensemble_layout(producers, std::move(sizes), aggregator);
  layout.wrote_producers_ = seen_producers;
  layout.wrote_aggregator_ = seen_aggregator;
  return layout;
}

inline int ensemble_layout::rank_budget(int world) const {
  check(!per_host_, "layout",
        cat("layout '", str(), "' puts a producer on each host: its rank budget depends on the hosts (rank_budget(hosts))"));
  check(world > producers_, "layout",
        cat("layout '", str(), "' has ", producers_, " producers, leaving no trainer rank in a world of ", world));
  return world - producers_;
}

inline int ensemble_layout::rank_budget(const host_map& hosts) const {
  if (!per_host_) return rank_budget(hosts.ranks());
  check(hosts.ranks() > hosts.hosts(), "layout",
        cat("layout '", str(), "' puts a producer on each of ", hosts.hosts(), " hosts ", hosts.str(),
            ", leaving no trainer rank"));
  return hosts.ranks() - hosts.hosts();
}

inline ensemble_layout ensemble_layout::planned(std::vector<int> member_sizes) const {
  check(!is_planned(), "layout", cat("layout '", str(), "' is planned already (its members' sizes are written)"));
  check(static_cast<int>(member_sizes.size()) == unplanned_, "layout",
        cat("layout '", str(), "' has ", unplanned_, " members, the plan gives sizes for ", member_sizes.size()));
  ensemble_layout out = per_host_ ? ensemble_layout(producers_per_host, std::move(member_sizes), aggregator_)
                                  : ensemble_layout(producers_, std::move(member_sizes), aggregator_);
  out.wrote_producers_ = wrote_producers_;
  out.wrote_aggregator_ = wrote_aggregator_;
  return out;
}

inline ensemble_layout ensemble_layout::from_env(std::string_view fallback) {
  if (const char* text = setting("FLEXCOMM_LAYOUT")) return parse(text);
  return parse(fallback);
}

}  // namespace flexcomm
