// flexcomm::error: every failure in flexcomm, naming the rank, the operation and the cause,
// so that a message from one rank of hundreds says where it came from and what went wrong.
#pragma once

#include <atomic>
#include <charconv>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace flexcomm {

class error : public std::runtime_error {
 public:
  error(int rank, std::string operation, std::string cause)
      : std::runtime_error(format(rank, operation, cause)),
        rank_(rank),
        operation_(std::move(operation)),
        cause_(std::move(cause)) {}

  // The world rank that raised it (-1 before MPI is up).
  int rank() const noexcept { return rank_; }
  const std::string& operation() const noexcept { return operation_; }
  const std::string& cause() const noexcept { return cause_; }

 private:
  static std::string format(int rank, const std::string& operation, const std::string& cause) {
    std::ostringstream out;
    out << "flexcomm: rank " << rank << ": " << operation << ": " << cause;
    return out.str();
  }

  int rank_;
  std::string operation_;
  std::string cause_;
};

namespace detail {
// The world rank of this process, set once by flexcomm::environment; core code has no MPI.
inline std::atomic<int>& process_rank_slot() {
  static std::atomic<int> rank{-1};
  return rank;
}
}  // namespace detail

inline int process_rank() noexcept { return detail::process_rank_slot().load(std::memory_order_relaxed); }

// Throws flexcomm::error for this process's rank.
[[noreturn]] inline void fail(std::string operation, std::string cause) {
  throw error(process_rank(), std::move(operation), std::move(cause));
}

// Builds a message from pieces: cat("step ", 17, " shard ", 1). Text and numbers are appended
// directly, as an ostream would print them (%g for floating point, characters as characters);
// anything else goes through an ostringstream. Every operation names itself with cat, so its
// cost is paid per operation: an ostringstream alone costs about a microsecond (its locale and
// facets), the appends a few allocations at most.
namespace detail {
template <class T>
void append_part(std::string& out, const T& part) {
  using U = std::decay_t<T>;
  if constexpr (std::is_array_v<T>) {
    out.append(part);  // a string literal
  } else if constexpr (std::is_same_v<U, std::string> || std::is_same_v<U, std::string_view>) {
    out.append(part.data(), part.size());
  } else if constexpr (std::is_same_v<U, const char*> || std::is_same_v<U, char*>) {
    if (part) out.append(part);  // a null char* prints nothing (the stream's badbit), never crashes
  } else if constexpr (std::is_same_v<U, bool>) {
    out.push_back(part ? '1' : '0');
  } else if constexpr (std::is_same_v<U, char> || std::is_same_v<U, signed char> || std::is_same_v<U, unsigned char>) {
    out.push_back(static_cast<char>(part));
  } else if constexpr (std::is_integral_v<U>) {
    char text[24];
    const auto end = std::to_chars(text, text + sizeof text, part).ptr;
    out.append(text, static_cast<std::size_t>(end - text));
  } else if constexpr (std::is_same_v<U, float> || std::is_same_v<U, double>) {
    char text[32];
    const int n = std::snprintf(text, sizeof text, "%.6g", static_cast<double>(part));
    out.append(text, static_cast<std::size_t>(n > 0 ? n : 0));
  } else {
    std::ostringstream stream;
    stream << part;
    out += stream.str();
  }
}
}  // namespace detail

template <class... Parts>
std::string cat(const Parts&... parts) {
  std::string out;
  (detail::append_part(out, parts), ...);
  return out;
}

// "world rank 3" or "world ranks 1, 2": the ranks a message blames, in the words a wait's report
// reads back (core/wait.hpp's ranks_named_in); each followed by after(rank) (a host, say).
template <class After>
std::string world_ranks_named(const std::vector<int>& ranks, After&& after) {
  std::string out = ranks.size() == 1 ? "world rank " : "world ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) out += cat(i ? ", " : "", ranks[i], after(ranks[i]));
  return out;
}
inline std::string world_ranks_named(const std::vector<int>& ranks) {
  return world_ranks_named(ranks, [](int) { return ""; });
}

// Precondition check that reports instead of crashing: check(n <= cap, "feed", "...", n). The
// cause is one piece or several, joined by cat() only when the check fails: a check that holds,
// as every check of every operation does, formats nothing.
template <class Operation, class... Cause>
void check(bool condition, const Operation& operation, const Cause&... cause) {
  if (!condition) fail(cat(operation), cat(cause...));
}

}  // namespace flexcomm
