// The seeded whole-system simulator (idem/sim/simulation.hpp): the suite's seeds hold every
// invariant, the same seed runs the same way, and each planted bug (idem/test_control.hpp) is
// caught by an invariant within the suite's seeds.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <array>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "idem/sim/simulation.hpp"
#include "idem/test_control.hpp"

namespace {

using idem::sim::Invariant;
using idem::test_control::Mutation;

// The suite's seeds: the first 10,000 (IDEM_SIM_SEEDS may say fewer: the sanitizer builds run
// 3,000, for CI's time). The planted bugs are looked for among the first 10,000 in every build.
constexpr std::uint64_t kSuiteSeeds = 10000;

std::uint64_t suite_seeds() {
  const char* env = std::getenv("IDEM_SIM_SEEDS");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : kSuiteSeeds;
}

// Turns a planted bug on for one test.
class Planted {
 public:
  explicit Planted(Mutation m) : m_(m) { idem::test_control::set(m_, true); }
  ~Planted() { idem::test_control::set(m_, false); }
  Planted(const Planted&) = delete;
  Planted& operator=(const Planted&) = delete;

 private:
  Mutation m_;
};

bool violates(const idem::sim::ScenarioResult& r, Invariant i) {
  for (const auto& v : r.violations)
    if (v.invariant == i) return true;
  return false;
}

// The first suite seed whose scenario breaks `expected`, shrunk; seed 0 if none does.
idem::sim::ScenarioResult first_caught(Invariant expected) {
  idem::sim::ScenarioOptions fast;
  fast.shrink = false;
  for (std::uint64_t seed = 1; seed <= kSuiteSeeds; ++seed) {
    if (violates(idem::sim::simulate(seed, fast), expected)) {
      idem::sim::ScenarioOptions shrunk;
      shrunk.shrink_for = expected;
      return idem::sim::simulate(seed, shrunk);
    }
  }
  return {};
}

void expect_caught(Mutation m, Invariant expected) {
  Planted bug(m);
  const idem::sim::ScenarioResult r = first_caught(expected);
  REQUIRE_MESSAGE(r.seed != 0, "no suite seed caught the planted bug");
  MESSAGE(fmt::format("caught by seed {} ({})", r.seed, idem::sim::to_string(expected)));
  CHECK(violates(r, expected));
  // The shrunk failure reads as a reproduction: its seed, its plan and its trace.
  const std::string text = idem::sim::describe(r);
  CHECK(text.find(fmt::format("seed {}: FAILED", r.seed)) != std::string::npos);
  CHECK(text.find(idem::sim::to_string(expected)) != std::string::npos);
  CHECK_FALSE(r.trace.empty());
}

}  // namespace

TEST_CASE("simulation: the suite's seeded scenarios (10,000) hold every invariant") {
  idem::sim::ScenarioOptions options;
  const std::uint64_t seeds = suite_seeds();
  REQUIRE(seeds > 0);
  std::uint64_t failed = 0;
  std::size_t requests = 0, attempts = 0, crashes = 0, faults = 0, charges = 0, events = 0;
  std::size_t pauses = 0;
  std::array<std::size_t, idem::sim::kInvariantCount> checked{};
  for (std::uint64_t seed = 1; seed <= seeds; ++seed) {
    const idem::sim::ScenarioResult r = idem::sim::simulate(seed, options);
    for (std::size_t i = 0; i < checked.size(); ++i) checked[i] += r.checked[i];
    requests += r.requests;
    attempts += r.attempts;
    crashes += r.crashes;
    faults += r.faults;
    pauses += r.pauses;
    charges += r.charges;
    events += r.events;
    if (!r.ok() && failed++ < 3) FAIL_CHECK(idem::sim::describe(r));
  }
  MESSAGE(
      fmt::format("{} scenarios: {} requests, {} attempts, {} events, {} charges, {} crashes, "
                  "{} store faults, {} pauses and held or lost replies",
                  seeds, requests, attempts, events, charges, crashes, faults, pauses));
  CHECK(failed == 0);
  // The seeds really exercise what the invariants are about.
  CHECK(crashes > seeds / 10);
  CHECK(faults > seeds / 10);
  CHECK(pauses > seeds / 10);
  CHECK(attempts > requests);
  CHECK(charges > seeds);
  // Every invariant had something to judge, many times over.
  for (std::size_t i = 0; i < checked.size(); ++i) {
    const auto invariant = static_cast<idem::sim::Invariant>(i);
    MESSAGE(fmt::format("{} judged {} times", idem::sim::to_string(invariant), checked[i]));
    CHECK_MESSAGE(checked[i] > seeds / 100, idem::sim::to_string(invariant));
  }
}

TEST_CASE("simulation: the same seed always runs the same way") {
  idem::sim::ScenarioOptions traced;
  traced.trace = true;
  for (std::uint64_t seed : {7ull, 42ull, 1234ull, 9999ull}) {
    const idem::sim::ScenarioResult a = idem::sim::simulate(seed, traced);
    const idem::sim::ScenarioResult b = idem::sim::simulate(seed, traced);
    REQUIRE(a.trace.size() == b.trace.size());
    CHECK(idem::sim::describe(a) == idem::sim::describe(b));
    CHECK(a.events == b.events);
  }
  CHECK(idem::sim::describe(idem::sim::simulate(7, traced)) !=
        idem::sim::describe(idem::sim::simulate(8, traced)));
  // Tracing and what ran before on this thread change nothing: the counts match an untraced
  // run after other seeds, for seeds with crashes.
  idem::sim::ScenarioOptions plain;
  for (std::uint64_t seed = 1; seed <= 200; ++seed) {
    const idem::sim::ScenarioResult a = idem::sim::simulate(seed, traced);
    if (a.crashes == 0) continue;
    (void)idem::sim::simulate(seed + 1000, plain);
    const idem::sim::ScenarioResult b = idem::sim::simulate(seed, plain);
    CHECK(a.events == b.events);
    CHECK(a.attempts == b.attempts);
    CHECK(a.charges == b.charges);
    CHECK(a.simulated_ms == b.simulated_ms);
  }
}

TEST_CASE("simulation catches a completion without its token check") {
  expect_caught(Mutation::complete_without_token_check, Invariant::fencing);
}

TEST_CASE("simulation catches InFlight::run where wait is configured") {
  expect_caught(Mutation::wait_runs_unprotected, Invariant::at_most_once);
}

TEST_CASE("simulation catches a release that forgets to wake its waiters") {
  expect_caught(Mutation::release_without_wake, Invariant::waiters_wake);
}

TEST_CASE("simulation catches a takeover that reuses the old token") {
  expect_caught(Mutation::takeover_reuses_token, Invariant::tokens_grow);
}

TEST_CASE("simulation catches an owner that calls out without confirming its lease") {
  expect_caught(Mutation::skip_lease_check, Invariant::called_in_lease);
}
