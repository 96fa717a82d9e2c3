// The scenarios behind `idem-demo table`: the comparison of seeds/001 run on idem's real
// coordinator and SQLite store against the simulated provider, on simulated time by default
// (identical on every run, under any load) or on real timers.
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "idem/options.hpp"
#include "idem/sim/timeline.hpp"

namespace idem::demo {

// Events of one scenario on its clock, for `table --timeline` and `table --svg`.
// Thread-safety: none; one scenario records into it from its own thread.
class Timeline {
 public:
  // `what` is the text line's description; `mark` and `label` (default: `what`) are how the
  // SVG draws the event.
  void add(long long at_ms, std::string who, std::string what, sim::Mark mark = sim::Mark::note,
           std::string label = {});
  // Lines "    t=  50 ms  req2   sends the request", in time order (stable for ties).
  std::vector<std::string> lines() const;
  bool empty() const { return events_.empty(); }
  // The events as one panel of a figure: lanes are the clients in order of first
  // appearance, then idem, bank and mail.
  sim::TimelinePanel panel(std::string title, std::string caption = {}) const;

 private:
  struct Event {
    long long at_ms;
    std::string who;
    std::string what;
    sim::Mark mark;
    std::string label;
  };
  std::vector<Event> events_;
};

struct RunOptions {
  bool real_time = false;        // real 300 ms timers instead of the simulated clock
  Timeline* timeline = nullptr;  // where to record events, if anywhere
};

// Request 1 at t=0, an identical duplicate at t=50 ms, provider latency 300 ms.
struct InFlightRow {
  std::vector<std::string> responses;  // per request: charge id or the error's name
  std::vector<std::string> charges;    // the provider's statement
};
InFlightRow in_flight_row(InFlight policy, const RunOptions& run = {});

// The same key sent again with the same amount, then with amount 5.
struct KeyReuse {
  std::string same_amount;  // "replayed ch_1"
  std::size_t charges_after_same = 0;
  std::string other_amount;  // "IdempotencyKeyReuseError"
  std::size_t charges_after_other = 0;
};
KeyReuse key_reuse(const RunOptions& run = {});

// The provider times out on the first call; the client retries.
struct FailureNotCached {
  std::string first;   // "provider timed out"
  std::string second;  // "ch_1"
  std::size_t charges = 0;
};
FailureNotCached failure_not_cached(const RunOptions& run = {});

// The idempotency store is unreachable when a charge arrives.
struct StoreUnreachable {
  std::string outcome;  // the charge id, or "StoreUnavailable"
  std::size_t charges = 0;
};
StoreUnreachable store_unreachable(FailureMode mode, const RunOptions& run = {});

// Twenty identical requests with one key at once, answered as HTTP.
struct HttpView {
  std::vector<int> statuses;            // sorted
  std::vector<std::string> charge_ids;  // distinct charge ids among the 200s
  std::size_t charges = 0;
};
HttpView http_view(InFlight policy, const RunOptions& run = {});

// The owner freezes (a stop-the-world pause: no heartbeat runs) for 3 s, past its 2 s lease,
// just before it calls the provider; the client's retry comes at t=3100 ms, as the owner
// wakes. With `lease_checked`, the owner's pending mark is refused (its lease ended on the
// store's clock): nothing is called, and the retry takes over and charges once. Without it
// (the demonstration's store marks the step checking only the token, as a store that trusts
// the caller's lease would), the owner calls out after its lease, the retry takes over during
// that call, finds no charge by the step's derived key yet, and charges a second time.
// Always on the simulated clock (`run.real_time` is ignored: the pause lasts seconds).
struct PausedOwner {
  std::vector<std::string> responses;  // req1, req2: charge id or what the error says
  std::vector<std::string> charges;    // the provider's statement
};
PausedOwner paused_owner(bool lease_checked, const RunOptions& run = {});

// The whole table as `idem-demo table` prints it.
std::string render_table(bool real_time, bool with_timeline);

// The table's scenarios as pictures (simulated time): one SVG sequence diagram per scenario,
// named for it ("in-flight.svg" holds the run, wait and raise rows side by side).
struct Figure {
  std::string file;  // "in-flight.svg", "key-reuse.svg", ...
  std::string svg;
};
std::vector<Figure> table_figures();
// Writes table_figures() into `dir` (created if missing) and returns the paths written.
// Throws std::runtime_error naming a file it cannot write (and std::filesystem_error when
// `dir` cannot be created).
std::vector<std::filesystem::path> write_table_figures(const std::filesystem::path& dir);

// Seed 000's checkout (debit -> order -> mail, demo/checkout.hpp) dies at one point; then a
// retry comes (or, for the last row, none comes and the completer finishes it). Counts of the
// effects after the death and at the end. Always on the simulated clock.
struct CheckoutCrash {
  std::string point;                                          // where the first attempt died
  bool retried = true;                                        // false: the completer finished it
  std::size_t debits = 0, orders = 0, mails = 0;              // after the death
  std::size_t end_debits = 0, end_orders = 0, end_mails = 0;  // after the retry or completer
  std::string resumed_from;  // the recovery point the second attempt resumed after
};
CheckoutCrash checkout_crash(const std::string& point, bool retried, const RunOptions& run = {});
// The table's four rows: death after each step with a retry, and after the debit without one.
std::vector<CheckoutCrash> checkout_crashes();

}  // namespace idem::demo
