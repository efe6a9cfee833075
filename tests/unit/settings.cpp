#define BOOST_TEST_MODULE settings
#include <boost/test/unit_test.hpp>

#include <cstdlib>
#include <string>

#include <flexcomm/core/settings.hpp>
#include <flexcomm/core/wait.hpp>

#include "../errors.hpp"

namespace fc = flexcomm;

BOOST_AUTO_TEST_CASE(a_setting_reads_as_unset_when_empty) {
  ::setenv("FLEXCOMM_SEGMENT_BYTES", "", 1);
  BOOST_TEST(fc::setting("FLEXCOMM_SEGMENT_BYTES") == nullptr);
  ::setenv("FLEXCOMM_SEGMENT_BYTES", "64K", 1);
  BOOST_TEST(std::string(fc::setting("FLEXCOMM_SEGMENT_BYTES")) == "64K");
  ::unsetenv("FLEXCOMM_SEGMENT_BYTES");
  BOOST_TEST(fc::setting("FLEXCOMM_SEGMENT_BYTES") == nullptr);
}

// Reading a name outside the table is flexcomm's own mistake, caught by any test that reads it.
BOOST_AUTO_TEST_CASE(every_setting_read_is_in_the_table) {
  BOOST_TEST(fc::testing::contains(fc::testing::error_of([] { fc::setting("FLEXCOMM_TIMEOUTS"); }),
                                   "FLEXCOMM_TIMEOUTS is read but is not in flexcomm's table"));
  BOOST_CHECK_NO_THROW(fc::setting("FLEXCOMM_TIMEOUT"));
}

BOOST_AUTO_TEST_CASE(a_misspelled_setting_is_found_and_a_test_harness_variable_is_not) {
  ::setenv("FLEXCOMM_TIMOUT", "5000", 1);
  ::setenv("FLEXCOMM_TEST_HOSTS", "2+2", 1);
  ::setenv("FLEXCOMM_WAIT", "yield", 1);
  const auto unknown = fc::unknown_settings();
  BOOST_TEST(unknown.size() == 1u);
  BOOST_TEST((unknown.size() == 1u && unknown[0] == "FLEXCOMM_TIMOUT"));
  ::unsetenv("FLEXCOMM_TIMOUT");
  ::unsetenv("FLEXCOMM_TEST_HOSTS");
  ::unsetenv("FLEXCOMM_WAIT");
  BOOST_TEST(fc::unknown_settings().empty());
}
