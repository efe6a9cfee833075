// flexcomm-trace-merge: one Chrome trace (Perfetto, chrome://tracing) from the ranks' files,
// one track per rank on rank 0's clock; optionally the lanes as a table for gnuplot.
//   flexcomm-trace-merge [-o merged.json] [--lanes lanes.dat] <trace dir | rank files...>
#include <boost/program_options.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>

#include "analysis.hpp"

namespace po = boost::program_options;
using flexcomm::trace_tools::json;

// One line per complete span: rank, lane (0 = the rank's first thread), begin and end in ms,
// a colour index per span name, and the name. docs/trace-lanes.gp draws it.
static void write_lanes(const json& events, const std::string& path) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write '" + path + "'");
  std::map<std::string, int> colour;
  std::map<int, std::map<int, int>> lane;  // pid -> tid -> lane
  for (const auto& e : events)
    if (e.value("ph", "") == "X") lane[e.value("pid", 0)].emplace(e.value("tid", 0), 0);
  for (auto& [pid, tids] : lane) {
    int i = 0;
    for (auto& [tid, l] : tids) l = i++;
  }
  out << "# rank lane begin_ms end_ms colour name\n";
  for (const auto& e : events) {
    if (e.value("ph", "") != "X") continue;
    const std::string name = e.value("name", "");
    const int c = colour.emplace(name, static_cast<int>(colour.size())).first->second;
    const double ts = e.value("ts", 0.0) / 1000.0, dur = e.value("dur", 0.0) / 1000.0;
    const int pid = e.value("pid", 0);
    out << pid << ' ' << lane[pid][e.value("tid", 0)] << ' ' << ts << ' ' << ts + dur << ' ' << c << " \""
        << name << "\"\n";
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
