// A benchmark's command line, parsed the same way in every benchmark: a bad flag prints
// Boost.Program_options' message and the help on stderr and ends the run with status 2 (the bad
// counts test, tests/cli/bad_counts.sh, relies on both); --help prints the help on stdout and ends
// it with 0. Only the rank given as 0 prints, so a job of many ranks says it once.
//
//   if (const auto status = benchmark_flags::parse(argc, argv, opts, world.rank())) return *status;
#pragma once

#include <boost/program_options.hpp>

#include <iostream>
#include <optional>

namespace benchmark_flags {

// Parses argv into the options' targets; the exit status when the program must stop here, nullopt
// when it runs.
inline std::optional<int> parse(int argc, char** argv, const boost::program_options::options_description& opts,
                                 int rank) {
  namespace po = boost::program_options;
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, opts), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    if (rank == 0) std::cerr << e.what() << "\n" << opts;
    return 2;
  }
  if (vm.count("help")) {
    if (rank == 0) std::cout << opts;
    return 0;
  }
  return std::nullopt;
}

}  // namespace benchmark_flags
