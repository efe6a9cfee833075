// Reading flexcomm traces back: merging the ranks' files into one timeline, and the report
// Li et al. (MLHPC19) ask for: arrival skew per collective, stragglers, gaps between updates.
// Shared by flexcomm-trace-merge, flexcomm-trace-report and the tests.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace flexcomm::trace_tools {

using json = nlohmann::json;

// The rank files in `dir` (flexcomm-trace-<rank>.json), or `paths` themselves when they are files.
inline std::vector<std::string> trace_files(const std::vector<std::string>& paths) {
  std::vector<std::string> files;
  for (const auto& p : paths) {
    if (std::filesystem::is_directory(p)) {
      for (const auto& entry : std::filesystem::directory_iterator(p)) {
        const std::string name = entry.path().filename().string();
        if (name.rfind("flexcomm-trace-", 0) == 0 && entry.path().extension() == ".json")
          files.push_back(entry.path().string());
      }
    } else {
      files.push_back(p);
    }
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) throw std::runtime_error("no trace files found");
  return files;
}

inline json load(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open '" + path + "'");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw std::runtime_error("'" + path + "' is not valid JSON: " + e.what());
  }
}

// One Chrome trace with every rank's events, one process (track) per rank. Rank files are
// already on rank 0's clock when their otherData says "aligned"; others are shifted by the
// offset they recorded.
inline json merge(const std::vector<std::string>& files) {
  json events = json::array();
  json offsets = json::object();
  std::uint64_t dropped = 0;
  std::set<int> ranks;
  for (const auto& path : files) {
    json trace = load(path);
    if (!trace.contains("traceEvents") || !trace["traceEvents"].is_array())
      throw std::runtime_error("'" + path + "' has no traceEvents array");
    const json other = trace.value("otherData", json::object());
    const int rank = other.value("rank", -1);
    if (rank >= 0 && !ranks.insert(rank).second)
      throw std::runtime_error("'" + path + "': rank " + std::to_string(rank) + " appears twice");
    const double shift = other.value("aligned", true) ? 0.0 : other.value("clock_offset_us", 0.0);
    offsets[std::to_string(rank)] = other.value("clock_offset_us", 0.0);
    dropped += other.value("dropped", std::uint64_t{0});
    for (auto& e : trace["traceEvents"]) {
      if (shift != 0.0 && e.contains("ts")) e["ts"] = e["ts"].get<double>() - shift;
      events.push_back(std::move(e));
    }
  }
  // Metadata first, then time order: viewers accept any order, people reading the file do not.
  std::stable_sort(events.begin(), events.end(), [](const json& a, const json& b) {
    const bool ma = a.value("ph", "") == "M", mb = b.value("ph", "") == "M";
    if (ma != mb) return ma;
    return a.value("ts", 0.0) < b.value("ts", 0.0);
  });
  return json{{"displayTimeUnit", "ms"},
              {"traceEvents", std::move(events)},
              {"otherData",
               {{"producer", "flexcomm-trace-merge"},
                {"ranks", ranks.size()},
                {"clock_offset_us", offsets},
                {"dropped", dropped}}}};
}

// Every rank's events: a merged file, or rank files merged on the fly.
inline json events_of(const std::vector<std::string>& paths) {
  const auto files = trace_files(paths);
  if (files.size() == 1) {
    json trace = load(files[0]);
    if (!trace.contains("traceEvents")) throw std::runtime_error("'" + files[0] + "' has no traceEvents");
    return trace["traceEvents"];
  }
  return merge(files)["traceEvents"];
}

struct report_options {
  double min_skew_us = 100;       // collectives arriving closer together name no one last
  // Last in this share of its skewed collectives beyond what chance gives (1/ranks each): 0 is
  // chance, 1 always last. Plain shares would name one rank of every two-rank group.
  double straggler_share = 0.5;
  std::string update = "update";  // the weight-update span
  std::string backward = "backward";
  std::set<std::string> waits = {"feed wait", "finish", "collect"};  // idle, though inside a span
};

struct collective_arrival {
  std::string comm, kind;
  std::int64_t sequence = 0;
  std::map<int, double> arrival_us;  // rank -> when it posted the collective
  double skew_us = 0;
  int first = -1, last = -1;
  bool kinds_differ = false;  // ranks posted different operations under one sequence number
};

struct rank_summary {
  int rank = 0;
  std::size_t collectives = 0, skewed = 0, last = 0;
  double expected_last = 0;     // how often chance alone would make it last (sum of 1/ranks)
  double mean_lateness_us = 0;  // arrival after the first rank, averaged over its collectives
  bool straggler = false;
  // Between the end of one weight update and the start of the next backward:
  std::size_t steps = 0;
  double step_us = 0;   // mean update-to-update time
  double gap_us = 0;    // mean update end -> next backward start
  double idle_us = 0;   // mean part of the gap in no span, or in a waiting span
  double gap_work_us = 0;  // mean part of the gap spent on run_in_gaps work
  double idle_share = 0;   // idle / step
};

struct report {
  std::vector<collective_arrival> collectives;
  std::vector<rank_summary> ranks;
  std::vector<int> stragglers;
};

namespace detail {
struct interval {
  double begin, end;
  std::string name, category;
};

// Length of the part of [from, to] covered by `spans` (sorted by begin).
inline double covered(const std::vector<interval>& spans, double from, double to) {
  double total = 0, reach = from;
  for (const auto& s : spans) {
    if (s.end <= reach || s.begin >= to) continue;
    const double b = std::max(s.begin, reach), e = std::min(s.end, to);
    if (e > b) total += e - b;
    reach = std::max(reach, e);
  }
  return total;
}
}  // namespace detail

inline report analyze(const json& events, const report_options& opt = {}) {
  report out;
  std::map<std::pair<std::string, std::int64_t>, collective_arrival> matched;
  // rank -> tid -> complete spans
  std::map<int, std::map<int, std::vector<detail::interval>>> spans;
  for (const auto& e : events) {
    const std::string ph = e.value("ph", "");
    const int pid = e.value("pid", -1);
    if (ph == "b" && e.value("cat", "") == "collective" && e.contains("args")) {
      const auto& args = e["args"];
      const std::string comm = args.value("comm", "");
      const std::int64_t seq = args.value("seq", std::int64_t{-1});
      auto& c = matched[{comm, seq}];
      const std::string kind = e.value("name", "");
      if (c.arrival_us.empty()) {
        c.comm = comm;
        c.sequence = seq;
        c.kind = kind;
      } else if (c.kind != kind) {
        c.kinds_differ = true;
      }
      c.arrival_us[pid] = e.value("ts", 0.0);
    } else if (ph == "X") {
      const double ts = e.value("ts", 0.0);
      spans[pid][e.value("tid", 0)].push_back({ts, ts + e.value("dur", 0.0), e.value("name", ""), e.value("cat", "")});
    }
  }

  std::map<int, rank_summary> per_rank;
  auto summary_of = [&](int rank) -> rank_summary& {
    auto& r = per_rank[rank];
    r.rank = rank;
    return r;
  };
  std::map<int, double> lateness_sum;
  for (auto& [key, c] : matched) {
    if (c.arrival_us.size() < 2) continue;  // a one-rank communicator has no skew
    double first = 0, last = 0;
    for (const auto& [rank, t] : c.arrival_us) {
      if (c.first < 0 || t < first) first = t, c.first = rank;
      if (c.last < 0 || t > last) last = t, c.last = rank;
    }
    c.skew_us = last - first;
    const bool skewed = c.skew_us >= opt.min_skew_us;
    for (const auto& [rank, t] : c.arrival_us) {
      auto& r = summary_of(rank);
      ++r.collectives;
      lateness_sum[rank] += t - first;
      if (skewed) {
        ++r.skewed;
        r.expected_last += 1.0 / static_cast<double>(c.arrival_us.size());
      }
    }
    if (skewed) ++summary_of(c.last).last;
    out.collectives.push_back(c);
  }
  std::sort(out.collectives.begin(), out.collectives.end(), [](const auto& a, const auto& b) {
    return a.comm != b.comm ? a.comm < b.comm : a.sequence < b.sequence;
  });

  for (auto& [rank, lanes] : spans) {
    auto& r = summary_of(rank);
    double step_total = 0, gap_total = 0, idle_total = 0, work_total = 0;
    std::size_t steps = 0;
    for (auto& [tid, list] : lanes) {
      std::sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
      std::vector<detail::interval> busy, work;
      std::vector<const detail::interval*> updates, backwards;
      for (const auto& s : list) {
        if (s.name == opt.update) updates.push_back(&s);
        if (s.name == opt.backward) backwards.push_back(&s);
        if (s.category == "gaps") work.push_back(s);
        else if (!opt.waits.count(s.name)) busy.push_back(s);
      }
      for (std::size_t k = 0; k + 1 < updates.size(); ++k) {
        const double from = updates[k]->end;
        auto next = std::find_if(backwards.begin(), backwards.end(), [&](auto* b) { return b->begin >= from; });
        if (next == backwards.end() || (*next)->begin > updates[k + 1]->begin) continue;
        const double to = (*next)->begin;
        const double gap = to - from;
        gap_total += gap;
        work_total += detail::covered(work, from, to);
        idle_total += gap - detail::covered(busy, from, to);
        step_total += updates[k + 1]->end - updates[k]->end;
        ++steps;
      }
    }
    if (steps) {
      r.steps = steps;
      r.step_us = step_total / steps;
      r.gap_us = gap_total / steps;
      r.idle_us = idle_total / steps;
      r.gap_work_us = work_total / steps;
      r.idle_share = step_total > 0 ? idle_total / step_total : 0;
    }
  }

  for (auto& [rank, r] : per_rank) {
    if (r.collectives) r.mean_lateness_us = lateness_sum[rank] / static_cast<double>(r.collectives);
    const double beyond = static_cast<double>(r.last) - r.expected_last;
    const double room = static_cast<double>(r.skewed) - r.expected_last;
    r.straggler = r.last > 0 && room > 0 && beyond >= opt.straggler_share * room;
    if (r.straggler) out.stragglers.push_back(rank);
    out.ranks.push_back(r);
  }
  return out;
}

inline json to_json(const report& rep, const report_options& opt) {
  json collectives = json::array();
  for (const auto& c : rep.collectives) {
    json arrivals = json::object();
    for (const auto& [rank, t] : c.arrival_us) arrivals[std::to_string(rank)] = t;
    collectives.push_back({{"comm", c.comm}, {"kind", c.kind}, {"seq", c.sequence}, {"skew_us", c.skew_us},
                           {"first_rank", c.first}, {"last_rank", c.last}, {"kinds_differ", c.kinds_differ},
                           {"arrival_us", arrivals}});
  }
  json ranks = json::array();
  for (const auto& r : rep.ranks)
    ranks.push_back({{"rank", r.rank}, {"collectives", r.collectives}, {"skewed", r.skewed}, {"last", r.last},
                     {"expected_last", r.expected_last}, {"mean_lateness_us", r.mean_lateness_us}, {"straggler", r.straggler}, {"steps", r.steps},
                     {"step_us", r.step_us}, {"gap_us", r.gap_us}, {"idle_us", r.idle_us},
                     {"gap_work_us", r.gap_work_us}, {"idle_share", r.idle_share}});
  return {{"options",
           {{"min_skew_us", opt.min_skew_us}, {"straggler_share", opt.straggler_share}, {"update", opt.update},
            {"backward", opt.backward}}},
          {"stragglers", rep.stragglers},
          {"ranks", ranks},
          {"collectives", collectives}};
}

}  // namespace flexcomm::trace_tools
