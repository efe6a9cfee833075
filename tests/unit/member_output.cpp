#define BOOST_TEST_MODULE member_output
// interop/member_output.hpp: what a rank prints while train_ensemble runs its part, read back
// from file descriptor 1 as the terminal (or mpiexec) would get it.
#include <boost/test/unit_test.hpp>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include <flexcomm/interop/member_output.hpp>

namespace fi = flexcomm::interop;

namespace {
// What `print` writes to fd 1, through a temporary file in its place.
template <class Print>
std::string stdout_of(Print print) {
  char path[] = "/tmp/flexcomm-member-output-XXXXXX";
  const int file = ::mkstemp(path);
  BOOST_REQUIRE(file >= 0);
  std::cout.flush();
  std::fflush(stdout);
  const int saved = ::dup(STDOUT_FILENO);
  ::dup2(file, STDOUT_FILENO);
  print();
  std::cout.flush();
  std::fflush(stdout);
  ::dup2(saved, STDOUT_FILENO);
  ::close(saved);
  ::close(file);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  ::unlink(path);
  return text.str();
}
}  // namespace

// A member's first rank among several: every line printf or std::cout starts, after \n or \r
// (a progress line rewriting itself), begins with the member, in the order printed.
BOOST_AUTO_TEST_CASE(each_line_of_a_member_starts_with_it) {
  const auto text = stdout_of([] {
    fi::member_output out(fi::output::prefixed, "member 1: ");
    std::printf("Training on CPU.\n\rTrain Epoch: 1 [ 64/60000]");
    std::printf("\rTrain Epoch: 1 [704/60000]");
    std::cout << "\nTest set: " << 0.5 << std::endl;
    std::printf("after ");
    std::cout << "cout\n";
  });
  BOOST_TEST(text ==
             "member 1: Training on CPU.\n\rmember 1: Train Epoch: 1 [ 64/60000]\rmember 1: Train Epoch: 1 "
             "[704/60000]\nmember 1: Test set: 0.5\nmember 1: after cout\n");
}

// A replica prints nothing; paused (the aggregator's report), a rank prints as the program does,
// then as before; gone, stdout and std::cout are the program's again.
BOOST_AUTO_TEST_CASE(replicas_are_quiet_and_a_report_is_printed_as_is) {
  const auto quiet = stdout_of([] {
    fi::member_output out(fi::output::quiet, "member 0: ");
    std::printf("replica\n");
    std::cout << "replica too" << std::endl;
  });
  BOOST_TEST(quiet.empty());
  const auto reported = stdout_of([] {
    fi::member_output out(fi::output::prefixed, "member 2: ");
    std::printf("mine\n");
    out.pause();
    std::printf("Epoch 1: members 0.5 0.6\n");
    out.resume();
    std::cout << "mine again\n";
  });
  BOOST_TEST(reported == "member 2: mine\nEpoch 1: members 0.5 0.6\nmember 2: mine again\n");
  const auto after = stdout_of([] {
    { fi::member_output out(fi::output::prefixed, "member 3: "); }
    std::printf("plain ");
    std::cout << "again\n";
  });
  BOOST_TEST(after == "plain again\n");
}
