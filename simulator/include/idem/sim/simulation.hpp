// idem::sim — the seeded whole-system simulator.
//
// One seed makes one scenario: a plan of clients, processes, crashes and faults drawn from the
// seed, run on the real Coordinator (its coroutine front end), real SqliteStore connections on
// one database file and the simulated provider, all on one SimulatedClock and one thread, so
// the same seed always runs the same way. After the run the scenario's invariants are checked
// against the provider's ledger and the store (see Invariant). A failing seed is shrunk: parts
// of its plan are dropped while it still fails, and what is left is the minimal trace.
//
//   idem::sim::ScenarioResult r = idem::sim::simulate(42);
//   if (!r.ok()) std::cout << idem::sim::describe(r);   // seed, plan, violations, trace
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "idem/sim/timeline.hpp"

namespace idem::sim {

// What a scenario checks. Each violation names one.
enum class Invariant {
  at_most_once,     // charges for a key <= 1 + the attempts that charged and did not end
                    // cleanly (crashed, lost their lease, or failed after the charge);
                    // multi-step operations: at most one charge and one order, always
  success_charged,  // every success for a key carries a charge of that key in the ledger
  same_answer,      // every success for a key carries the same status and body bytes
  right_payload,    // a success answers the request's own tenant, key and amount
  tokens_grow,      // each reservation of a key gets a token above every earlier one
  fencing,          // only the newest reservation of a key completes, releases, renews or
                    // records steps and recovery points for it, and nobody takes the key
                    // over before that reservation's lease (as granted or renewed) ended
  lease_bounded,    // no reservation outlives its lease plus the reaper's delay
  waiters_wake,     // under InFlight::wait without crashes, stalls or store faults, no
                    // duplicate gives up (InProgressError), and a freed key wakes its waiters:
                    // all of them once its answer is stored, at least one after a release
                    // (unless a later call took the key first)
  finished,         // every client got a final answer, or gave up after its retries
  called_in_lease,  // every action and every external step's call starts under the key's
                    // newest token, with its lease (as granted or renewed) still running: an
                    // owner that was paused, or whose reply came late, never calls out
};

inline constexpr std::size_t kInvariantCount = 10;

const char* to_string(Invariant i) noexcept;

struct Violation {
  Invariant invariant;
  std::string detail;
};

// One line of a scenario's trace, on its simulated clock.
struct TraceEvent {
  long long at_ms = 0;  // since the scenario's start
  std::string who;      // "c3" (client 3), "p1" (process 1), "idem@p1", "bank", "psp", "check"
  std::string what;
  Mark mark = Mark::note;  // how a timeline draws it
};

struct ScenarioOptions {
  // Requests per scenario (each retried by its client); 0: drawn from the seed (2 to 6).
  std::size_t requests = 0;
  // Record the trace (slower; simulate() records it anyway when it shrinks a failure).
  bool trace = false;
  // Shrink a failing scenario to a minimal plan before returning it, keeping the violation of
  // `shrink_for` if it has one (else its first violation).
  bool shrink = true;
  std::optional<Invariant> shrink_for{};
};

struct ScenarioResult {
  std::uint64_t seed = 0;
  std::string plan;  // the configuration and plan, one line per item
  std::vector<Violation> violations;
  std::vector<TraceEvent> trace;  // when recorded
  // Size, for reporting.
  std::size_t requests = 0, attempts = 0, processes = 0, crashes = 0, faults = 0, charges = 0;
  std::size_t pauses = 0;  // owners frozen, and replies held back or lost
  std::size_t events = 0;  // handlers and clock instants the scenario ran
  long long simulated_ms = 0;
  // How often each invariant had something to judge (indexed by Invariant): keys whose
  // charges were counted, successes traced to the ledger, stored answers compared with an
  // earlier one, answers whose payload was read, reservations granted, token-checked writes
  // and takeovers, reaper rounds that found a reservation, keys freed with calls waiting,
  // clients. A rule never judged proves nothing, so the suite checks none stays at zero.
  std::array<std::size_t, kInvariantCount> checked{};
  bool ok() const noexcept { return violations.empty(); }
};

// Runs the scenario of `seed`. Throws only if the simulator itself cannot run (a temporary
// database cannot be created); a broken contract is a violation in the result.
ScenarioResult simulate(std::uint64_t seed, const ScenarioOptions& options = {});

// The seed, plan, violations and trace, for a person reading a failure.
std::string describe(const ScenarioResult& result);

// The trace as a timeline panel (clients, idem in each process, the providers as lanes), for
// timeline_svg(). Empty when the trace was not recorded.
TimelinePanel timeline_of(const ScenarioResult& result);

}  // namespace idem::sim
