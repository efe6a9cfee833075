// flexcomm-trace-merge: one Chrome trace (Perfetto, chrome://tracing) from the ranks' files,
// one track per rank on rank 0's clock; optionally the lanes as a table for gnuplot.
//   flexcomm-trace-merge [-o merged.json] [--lanes lanes.dat] <trace dir | rank files...>
#include <boost/program_options.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "analysis.hpp"

namespace po = boost::program_options;
using flexcomm::trace_tools::json;

// One line per span, for gnuplot (docs/trace-lanes.gp): rank, lane, the lane's centre and
// half height on the y axis, begin and end in ms, a colour index per name, the name. Each
// thread of a rank is a lane; collectives (arrival to completion) get a lane of their own.
static void write_lanes(const json& events, const std::string& path) {
  struct box {
    int rank, lane;
    double begin, end;
    std::string name;
  };
  std::vector<box> boxes;
  std::map<int, std::map<int, int>> lanes;  // rank -> tid -> lane (collectives: tid -1, last)
  std::map<std::string, const json*> open;  // async id -> its begin
  for (const auto& e : events) {
    const std::string ph = e.value("ph", "");
    const int pid = e.value("pid", 0);
    if (ph == "X") {
      const double ts = e.value("ts", 0.0) / 1000.0;
      boxes.push_back({pid, e.value("tid", 0), ts, ts + e.value("dur", 0.0) / 1000.0, e.value("name", "")});
      lanes[pid].emplace(e.value("tid", 0), 0);
    } else if (ph == "b") {
      open[e.value("id", "")] = &e;
    } else if (ph == "e") {
      auto it = open.find(e.value("id", ""));
      if (it == open.end()) continue;
      const json& b = *it->second;
      boxes.push_back({pid, -1, b.value("ts", 0.0) / 1000.0, e.value("ts", 0.0) / 1000.0, b.value("name", "")});
      lanes[pid].emplace(-1, 0);
      open.erase(it);
    }
  }
  for (auto& [rank, tids] : lanes) {
    int i = 0;
    for (auto& [tid, lane] : tids) lane = tid < 0 ? -1 : i++;
    for (auto& [tid, lane] : tids)
      if (lane < 0) lane = i;  // the collectives lane comes last
  }
  std::map<std::string, int> colour;
  for (const auto& b : boxes) colour.emplace(b.name, 0);
  std::string names;
  {
    int c = 0;
    for (auto& [name, index] : colour) {
      index = c++;
      std::string word = name;
      for (auto& ch : word)
        if (ch == ' ') ch = '_';
      names += (names.empty() ? "" : " ") + word;
    }
  }
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write '" + path + "'");
  out << "# names: " << names << "\n# ranks: " << lanes.size() << "\n";
  out << "# rank lane y half_height begin_ms end_ms colour name\n";
  for (const auto& b : boxes) {
    const int lane = lanes[b.rank][b.lane];
    const double count = static_cast<double>(lanes[b.rank].size());
    // rank r occupies [r - 0.45, r + 0.45]; its lanes split that band from the top down
    const double y = b.rank - 0.45 + 0.9 * (lane + 0.5) / count;  // the plot puts rank 0 on top
    out << b.rank << ' ' << lane << ' ' << y << ' ' << 0.4 / count << ' ' << b.begin << ' ' << b.end << ' '
        << colour[b.name] << " \"" << b.name << "\"\n";
  }
}

int main(int argc, char** argv) {
  std::string output, lanes;
  std::vector<std::string> inputs;
  po::options_description visible("flexcomm-trace-merge [options] <trace dir | rank files...>");
  visible.add_options()("help,h", "this help")(
      "output,o", po::value(&output)->default_value("flexcomm-trace.json"), "merged trace to write")(
      "lanes", po::value(&lanes), "also write every span as a line for gnuplot (docs/trace-lanes.gp)");
  po::options_description all;
  all.add(visible).add_options()("input", po::value(&inputs)->multitoken());
  po::positional_options_description positional;
  positional.add("input", -1);
  try {
    po::variables_map vm;
    po::store(po::command_line_parser(argc, argv).options(all).positional(positional).run(), vm);
    po::notify(vm);
    if (vm.count("help") || inputs.empty()) {
      std::cout << visible << "\n";
      return inputs.empty() && !vm.count("help") ? 2 : 0;
    }
    const json merged = flexcomm::trace_tools::merge(flexcomm::trace_tools::trace_files(inputs));
    std::ofstream out(output);
    if (!out) throw std::runtime_error("cannot write '" + output + "'");
    out << merged.dump() << "\n";
    if (!lanes.empty()) write_lanes(merged["traceEvents"], lanes);
    std::printf("merged %zu ranks, %zu events into %s\n", merged["otherData"]["ranks"].get<std::size_t>(),
                merged["traceEvents"].size(), output.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flexcomm-trace-merge: %s\n", e.what());
    return 1;
  }
  return 0;
}
