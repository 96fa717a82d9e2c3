// idem — switches that break idem's contract on purpose, for idem's own simulator and tests.
//
// Each switch plants one known bug, so a test can show that the simulator's invariants catch
// it (a test that cannot fail proves nothing). SQLite's sqlite3_test_control() is the model.
// The switches exist only in a build with IDEM_TEST_CONTROL (CMake option of that name, on
// when the suite, the demo or the fuzz targets are built); everywhere else, the library as a
// service links it, each check is a constant false the compiler removes, and this header is
// not installed.
#pragma once

namespace idem::test_control {

enum class Mutation : unsigned {
  complete_without_token_check,  // SqliteStore completes whatever reservation holds the key
  wait_runs_unprotected,         // InFlight::wait behaves as InFlight::run
  release_without_wake,          // a release does not wake this process's waiters
  takeover_reuses_token,         // a takeover keeps the expired holder's token
  skip_lease_check,              // an owner calls out without confirming its lease (a single-step
                                 // call after a late reservation, an external step's mark)
};

#ifdef IDEM_TEST_CONTROL
// Turns `m` on or off for the whole process. Thread-safety: safe from any thread; calls
// already past the switch's point are not affected.
void set(Mutation m, bool on) noexcept;
bool enabled(Mutation m) noexcept;
#else
// consteval: never a function of its own in the library, at any optimisation level.
consteval bool enabled(Mutation) noexcept { return false; }
#endif

}  // namespace idem::test_control
