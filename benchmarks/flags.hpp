// A benchmark's command line, parsed the same way in every benchmark: a bad flag prints
// Boost.Program_options' message and the help on stderr and ends the run with status 2 (the bad
// counts test, tests/cli/bad_counts.sh, relies on both); --help prints the help on stdout and ends
// it with 0. Only the rank given as 0 prints, so a job of many ranks says it once. Byte sizes
// ("4K", "64M") and size multipliers (above 1) are refused at the parse the same way, naming the
// flag, as examples/common/counts.hpp refuses counts.
//
//   ("minbytes,b", benchmark_flags::bytes(&min_bytes, "4K"), "smallest size")
//   ("stepfactor,f", benchmark_flags::above_one(&factor), "size multiplier")
//   if (const auto status = benchmark_flags::parse(argc, argv, opts, world.rank())) return *status;
#pragma once

#include <boost/any.hpp>
#include <boost/program_options.hpp>

#include <flexcomm/core/setting_values.hpp>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace benchmark_flags {

// What Program_options stores before the value reaches its target (found by argument-dependent
// lookup through validate below).
struct byte_size {
  std::size_t value = 0;
};
struct multiplier {
  double value = 0;
};

inline void validate(boost::any& v, const std::vector<std::string>& values, byte_size*, int) {
  namespace po = boost::program_options;
  po::validators::check_first_occurrence(v);
  const std::string& text = po::validators::get_single_string(values);
  try {
    v = byte_size{flexcomm::parse_bytes(text, "")};
  } catch (const flexcomm::error&) {
    throw po::invalid_option_value(text);
  }
}

inline void validate(boost::any& v, const std::vector<std::string>& values, multiplier*, int) {
  namespace po = boost::program_options;
  po::validators::check_first_occurrence(v);
  const std::string& text = po::validators::get_single_string(values);
  char* end = nullptr;
  errno = 0;
  const double f = std::strtod(text.c_str(), &end);
  if (text.empty() || !end || *end != '\0' || errno != 0 || !std::isfinite(f) || !(f > 1))
    throw po::invalid_option_value(text);
  v = multiplier{f};
}

// A byte count with an optional K, M or G suffix, `default_text` when not given.
inline boost::program_options::typed_value<byte_size>* bytes(std::size_t* target, const char* default_text) {
  return boost::program_options::value<byte_size>()
      ->default_value(byte_size{flexcomm::parse_bytes(default_text, "a benchmark's default")}, default_text)
      ->notifier([target](const byte_size& b) { *target = b.value; });
}

// A number above 1 (a size multiplier), *target when not given.
inline boost::program_options::typed_value<multiplier>* above_one(double* target) {
  std::ostringstream text;
  text << *target;
  return boost::program_options::value<multiplier>()
      ->default_value(multiplier{*target}, text.str())
      ->notifier([target](const multiplier& m) { *target = m.value; });
}

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
