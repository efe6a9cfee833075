// Counts on the command line of the examples and benchmarks: `--batch -5` must be refused by
// name, not read as 18446744073709551611 (Boost.Program_options' lexical_cast wraps negative
// text into an unsigned type) and refused later, far from the flag, or not at all.
//
//   ("batch", counts::at_least<1>(&s.batch), "images per step")
//
// The flag keeps the target's current value as its default; a value below the bound, or not a
// whole number, ends the parse with Boost.Program_options' own message naming the flag:
// "the argument ('-5') for option '--batch' is invalid".
#pragma once

#include <boost/any.hpp>
#include <boost/program_options.hpp>

#include <cerrno>
#include <cstdlib>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

namespace counts {

// A whole number of at least Min, as Program_options stores it before it reaches its target.
template <class T, long long Min>
struct count {
  T value{};
};

template <class T, long long Min>
std::ostream& operator<<(std::ostream& out, const count<T, Min>& c) {
  return out << c.value;
}

// Found by argument-dependent lookup: Program_options' hook for parsing a value of a user type.
template <class T, long long Min>
void validate(boost::any& v, const std::vector<std::string>& values, count<T, Min>*, int) {
  namespace po = boost::program_options;
  po::validators::check_first_occurrence(v);
  const std::string& text = po::validators::get_single_string(values);
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(text.c_str(), &end, 10);
  const bool whole = !text.empty() && end && *end == '\0' && errno == 0;
  if (!whole || n < Min || static_cast<unsigned long long>(n) > static_cast<unsigned long long>(std::numeric_limits<T>::max()))
    throw po::invalid_option_value(text);
  v = count<T, Min>{static_cast<T>(n)};
}

// The option's value semantic: parsed as a count of at least Min, stored into *target.
template <long long Min, class T>
boost::program_options::typed_value<count<T, Min>>* at_least(T* target) {
  static_assert(Min >= 0, "counts are never negative");
  return boost::program_options::value<count<T, Min>>()
      ->default_value(count<T, Min>{*target})
      ->notifier([target](const count<T, Min>& c) { *target = c.value; });
}

}  // namespace counts
