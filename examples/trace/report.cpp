// flexcomm-trace-report: which ranks arrive last at collectives (stragglers), by how much, and
// how long each rank idles between one weight update and the next backward.
//   flexcomm-trace-report [--json report.json] [--min-skew-us 100] <merged trace | dir | files...>
#include <boost/program_options.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>

#include "analysis.hpp"

namespace po = boost::program_options;
namespace tt = flexcomm::trace_tools;

static void print(const tt::report& rep, const tt::report_options& opt, std::size_t top) {
  std::printf("# per rank (collectives matched by communicator and sequence number; 'last' counts those\n"
              "# with arrival skew >= %.0f us; gaps: update end -> next backward start, per step)\n",
              opt.min_skew_us);
  std::printf("%5s %11s %7s %6s %12s %9s %6s %10s %10s %10s %10s %6s\n", "rank", "collectives", "skewed", "last",
              "lateness_us", "straggler", "steps", "step_us", "gap_us", "idle_us", "gapwork_us", "idle%");
  for (const auto& r : rep.ranks)
    std::printf("%5d %11zu %7zu %6zu %12.1f %9s %6zu %10.1f %10.1f %10.1f %10.1f %6.1f\n", r.rank, r.collectives,
                r.skewed, r.last, r.mean_lateness_us, r.straggler ? "YES" : "-", r.steps, r.step_us, r.gap_us,
                r.idle_us, r.gap_work_us, 100.0 * r.idle_share);
  std::vector<const tt::collective_arrival*> by_skew;
  for (const auto& c : rep.collectives) by_skew.push_back(&c);
  std::sort(by_skew.begin(), by_skew.end(), [](auto* a, auto* b) { return a->skew_us > b->skew_us; });
  if (by_skew.size() > top) by_skew.resize(top);
  std::printf("\n# the %zu most skewed of %zu matched collectives\n", by_skew.size(), rep.collectives.size());
  std::printf("%-20s %-16s %7s %5s %10s %10s\n", "comm", "kind", "seq", "ranks", "skew_us", "last_rank");
  for (auto* c : by_skew)
    std::printf("%-20s %-16s %7lld %5zu %10.1f %10d%s\n", c->comm.c_str(), c->kind.c_str(),
                static_cast<long long>(c->sequence), c->arrival_us.size(), c->skew_us, c->last,
                c->kinds_differ ? "  (ranks posted different operations!)" : "");
  std::printf("\nstragglers:");
  if (rep.stragglers.empty()) std::printf(" none");
  for (int r : rep.stragglers) std::printf(" rank %d", r);
  std::printf("\n");
}

int main(int argc, char** argv) {
  tt::report_options opt;
  std::string json_path;
  std::size_t top = 10;
  std::vector<std::string> inputs;
  po::options_description visible("flexcomm-trace-report [options] <merged trace | trace dir | rank files...>");
  visible.add_options()("help,h", "this help")("json", po::value(&json_path), "also write the report as JSON")(
      "min-skew-us", po::value(&opt.min_skew_us)->default_value(opt.min_skew_us),
      "arrival skew below which a collective names no rank last")(
      "straggler-share", po::value(&opt.straggler_share)->default_value(opt.straggler_share),
      "a rank last in this share of its skewed collectives beyond chance (0: as chance has it, 1: always) is a straggler")(
      "update", po::value(&opt.update)->default_value(opt.update), "name of the weight-update span")(
      "backward", po::value(&opt.backward)->default_value(opt.backward), "name of the backward span")(
      "top", po::value(&top)->default_value(top), "collectives listed, most skewed first");
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
    const auto rep = tt::analyze(tt::events_of(inputs), opt);
    print(rep, opt, top);
    if (!json_path.empty()) {
      std::ofstream out(json_path);
      if (!out) throw std::runtime_error("cannot write '" + json_path + "'");
      out << tt::to_json(rep, opt).dump(1) << "\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flexcomm-trace-report: %s\n", e.what());
    return 1;
  }
  return 0;
}
