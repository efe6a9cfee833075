// flexcomm::error: every failure in flexcomm, naming the rank, the operation and the cause,
// so that a message from one rank of hundreds says where it came from and what went wrong.
#pragma once

#include <atomic>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

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

// Precondition check that reports instead of crashing: check(n <= cap, "feed", "...").
inline void check(bool condition, const std::string& operation, const std::string& cause) {
  if (!condition) fail(operation, cause);
}

// Builds a message from pieces: cat("step ", 17, " shard ", 1).
template <class... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

}  // namespace flexcomm
