// The suite's main. ctest runs one TEST_CASE per entry by name (doctest_discover_tests); a
// name that no longer matches (CMake cuts names at ';') would run nothing and "pass", so a
// run whose filters select no test case fails.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <iostream>

namespace {

unsigned selected = 0;  // test cases that passed the filters in this run

struct SelectedCounter : doctest::IReporter {
  explicit SelectedCounter(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& stats) override {
    selected = stats.numTestCasesPassingFilters;
  }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

REGISTER_LISTENER("selected_counter", 1, SelectedCounter);

}  // namespace

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int result = context.run();
  if (context.shouldExit()) return result;  // --list-test-cases, --help, ...
  if (selected == 0) {
    std::cerr << "no test case matched the filters: nothing ran\n";
    return 1;
  }
  return result;
}
