// What a test asks of a failure: the text of the flexcomm::error an action throws, and whether a
// message names what it should.
#pragma once

#include <flexcomm/core/error.hpp>

#include <string>

namespace flexcomm::testing {

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The message of the flexcomm::error that `f` throws, or "" when it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const error& e) {
    return e.what();
  }
  return "";
}

}  // namespace flexcomm::testing
