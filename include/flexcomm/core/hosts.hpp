// host_map: which ranks of a communicator share a host. Learnt once, collectively, by the
// backend (backend/mpi/hosts.hpp); kept beside the layout so that layouts can place producers per
// host and Sync adapters can average hierarchically. Backend-neutral: plain numbers only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "error.hpp"
#include "settings.hpp"

namespace flexcomm {

class host_map {
 public:
  host_map() = default;

  // Every one of `ranks` ranks on one host: what a job on one machine sees.
  static host_map single(int ranks) { return host_map(std::vector<int>(static_cast<std::size_t>(ranks), 0)); }

  // Host blocks of consecutive ranks: "2+1+2" is ranks 0-1 on host 0, rank 2 on host 1, ranks
  // 3-4 on host 2 (what Hydra does with a hostfile of `host:n` lines). Also FLEXCOMM_HOSTS.
  static host_map parse(std::string_view text);

  // Host index of each rank from any per-rank key that is equal exactly for ranks sharing a host
  // (e.g. the world rank of the host's first rank). Hosts are numbered in order of their lowest rank.
  static host_map from_keys(const std::vector<std::int64_t>& keys) {
    std::vector<std::int64_t> seen;
    std::vector<int> host(keys.size());
    for (std::size_t r = 0; r < keys.size(); ++r) {
      const auto it = std::find(seen.begin(), seen.end(), keys[r]);
      host[r] = static_cast<int>(it - seen.begin());
      if (it == seen.end()) seen.push_back(keys[r]);
    }
    return host_map(std::move(host));
  }

  explicit host_map(std::vector<int> host_of) : host_of_(std::move(host_of)) {
    for (std::size_t r = 0; r < host_of_.size(); ++r) {
      const int h = host_of_[r];
      check(h >= 0 && h <= hosts(), "host map",
            cat("rank ", r, " is on host ", h, "; hosts must be numbered 0, 1, ... in order of their first rank"));
      if (h == hosts()) ranks_.emplace_back();
      ranks_[static_cast<std::size_t>(h)].push_back(static_cast<int>(r));
    }
  }

  int ranks() const noexcept { return static_cast<int>(host_of_.size()); }
  int hosts() const noexcept { return static_cast<int>(ranks_.size()); }
  int host_of(int rank) const {
    check(rank >= 0 && rank < ranks(), "host map", cat("rank ", rank, " is outside the map's ", ranks(), " ranks"));
    return host_of_[static_cast<std::size_t>(rank)];
  }
  // The ranks on `host`, ascending; the first is the host's leader.
  const std::vector<int>& ranks_on(int host) const {
    check(host >= 0 && host < hosts(), "host map", cat("host ", host, " is outside the map's ", hosts(), " hosts"));
    return ranks_[static_cast<std::size_t>(host)];
  }
  int ranks_per_host(int host) const { return static_cast<int>(ranks_on(host).size()); }
  int leader_of(int host) const { return ranks_on(host).front(); }
  int most_ranks_on_a_host() const noexcept {
    std::size_t most = 0;
    for (const auto& r : ranks_) most = std::max(most, r.size());
    return static_cast<int>(most);
  }

  // The map restricted to `ranks` (e.g. one member's world ranks, in member order), renumbered.
  host_map subset(const std::vector<int>& ranks) const {
    std::vector<std::int64_t> keys;
    keys.reserve(ranks.size());
    for (int r : ranks) keys.push_back(host_of(r));
    return from_keys(keys);
  }

  // "2+1+2" when hosts hold consecutive ranks, else the host of every rank ("0,1,0,1").
  std::string str() const {
    std::string s;
    bool blocks = true;
    for (std::size_t r = 1; r < host_of_.size(); ++r) blocks = blocks && host_of_[r] >= host_of_[r - 1];
    if (blocks) {
      for (int h = 0; h < hosts(); ++h) s += cat(h ? "+" : "", ranks_per_host(h));
    } else {
      for (std::size_t r = 0; r < host_of_.size(); ++r) s += cat(r ? "," : "", host_of_[r]);
    }
    return s;
  }

  bool operator==(const host_map& o) const { return host_of_ == o.host_of_; }
  bool operator!=(const host_map& o) const { return !(*this == o); }

 private:
  std::vector<int> host_of_;
  std::vector<std::vector<int>> ranks_;
};

inline host_map host_map::parse(std::string_view text) {
  std::vector<int> host;
  std::size_t pos = 0;
  for (int h = 0;; ++h) {
    const std::size_t plus = text.find('+', pos);
    const auto piece = text.substr(pos, plus == std::string_view::npos ? text.size() - pos : plus - pos);
    long long n = 0;
    check(!piece.empty(), "host map", cat("cannot parse '", text, "': host ", h, " has no rank count (e.g. 2+1+2)"));
    for (char c : piece) {
      check(c >= '0' && c <= '9', "host map", cat("cannot parse '", text, "': '", piece, "' is not a rank count"));
      n = n * 10 + (c - '0');
      check(n <= (1 << 20), "host map", cat("cannot parse '", text, "': ", piece, " ranks on one host is too many"));
    }
    check(n > 0, "host map", cat("cannot parse '", text, "': host ", h, " has no ranks"));
    host.insert(host.end(), static_cast<std::size_t>(n), h);
    check(host.size() <= (1u << 20), "host map", cat("cannot parse '", text, "': too many ranks"));
    if (plus == std::string_view::npos) break;
    pos = plus + 1;
  }
  return host_map(std::move(host));
}

// Settings that are automatic, on or off, and read as auto|on|off (also 1|0), auto when unset.
template <class E>
constexpr const char* auto_on_off_name(E e) {
  switch (e) {
    case E::automatic: return "auto";
    case E::on: return "on";
    case E::off: return "off";
  }
  return "?";
}

template <class E>
E auto_on_off_from_env(const char* name) {
  const char* text = setting(name);
  if (!text) return E::automatic;
  const std::string_view v(text);
  if (v == "auto") return E::automatic;
  if (v == "on" || v == "1") return E::on;
  if (v == "off" || v == "0") return E::off;
  fail(name, cat("cannot parse '", v, "': expected auto, on or off"));
}

// When a member spans hosts, its gradients may be averaged hierarchically: reduce within each
// host, allreduce across the host leaders, broadcast within each host.
enum class hierarchy { automatic, on, off };
constexpr const char* name_of(hierarchy h) { return auto_on_off_name(h); }
// FLEXCOMM_HIERARCHICAL.
inline hierarchy hierarchy_from_env() { return auto_on_off_from_env<hierarchy>("FLEXCOMM_HIERARCHICAL"); }

// Whether the Sync adapters reduce through shared memory a member whose ranks all share one host
// (backends with has_host_shared_memory): automatic (one host, 2+ ranks), on (the same, and a
// member that spans hosts is an error), or off.
enum class shared_memory_use { automatic, on, off };
constexpr const char* name_of(shared_memory_use s) { return auto_on_off_name(s); }
// FLEXCOMM_SHM.
inline shared_memory_use shared_memory_from_env() { return auto_on_off_from_env<shared_memory_use>("FLEXCOMM_SHM"); }

// How often a ring through the member's ranks in rank order steps from one host to another.
// Ranks placed in host blocks (what Hydra does with a hostfile) cross once per host.
inline int ring_crossings(const host_map& member) {
  int crossings = 0;
  for (int r = 0; r < member.ranks(); ++r)
    crossings += member.host_of(r) != member.host_of((r + 1) % member.ranks());
  return crossings;
}

// Which algorithm the automatic choice weighs the tiers against.
enum class flat_algorithm {
  backend_allreduce,  // the backend's own allreduce (subgroup_allreduce)
  ring,               // flexcomm's segmented ring in rank order (overlapped_ring)
};

// Automatic: hierarchical where it saves network traffic, i.e. the member spans hosts and some
// host holds more than one of its ranks (one rank per host is the flat algorithm already). Against
// the ring, only where the ring would cross hosts more than once per host: a ring over ranks in
// host blocks sends at most 2(n-1)/n of a bucket across each host's link, against the tiers'
// 2(H-1)/H, and across hosts the unpipelined tiers cost more than that saves; against MPICH's
// own allreduce they pay (docs/benchmarks.md).
inline bool use_hierarchy(hierarchy h, const host_map& member, flat_algorithm flat) {
  if (h == hierarchy::on) return true;
  if (h == hierarchy::off) return false;
  const bool saves = member.hosts() > 1 && member.most_ranks_on_a_host() > 1;
  if (flat == flat_algorithm::ring) return saves && ring_crossings(member) > member.hosts();
  return saves;
}

namespace detail {
// The host name of each world rank, learnt once by the environment at start; empty while the job
// runs on one host (or before the environment is up).
inline std::vector<std::string>& world_host_names() {
  static std::vector<std::string> names;
  return names;
}
}  // namespace detail

// ", host NAME" for a world rank when the job spans several hosts, else "": timeout and
// disagreement reports name the host only where there is more than one to tell apart.
inline std::string on_host(int world_rank) {
  const auto& names = detail::world_host_names();
  if (world_rank < 0 || static_cast<std::size_t>(world_rank) >= names.size()) return {};
  return cat(", host ", names[static_cast<std::size_t>(world_rank)]);
}

}  // namespace flexcomm
