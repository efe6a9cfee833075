// What a fault driver says, each line prefixed with its rank, so that tests/fault/launch.py can
// tell the ranks' reports apart in mpiexec's merged output.
#pragma once

#include <cstdio>
#include <sstream>
#include <string>

inline void report(int rank, const std::string& text) {
  std::istringstream lines(text);
  std::string line, out;
  while (std::getline(lines, line)) out += "[rank " + std::to_string(rank) + "] " + line + "\n";
  std::fputs(out.c_str(), stderr);
  std::fflush(stderr);
}
