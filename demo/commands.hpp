// The one-shot commands of idem-demo: one real-time charge through the coordinator from this
// process, and the provider's statement.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace idem::demo {

struct ChargeArgs {
  std::string db;  // keys: a SQLite file or a postgresql:// URI (database.hpp)
  std::string ledger;
  std::string key;
  std::string tenant = "alpha";
  std::string operation = "payment.charge";
  long long amount = 4990;
  std::string currency = "RUB";
  std::string order_id = "A-10023";
  std::string policy = "wait";
  long long lease_ms = 30000;
  long long provider_latency_ms = 300;
  bool provider_dedup = true;
  bool fail_closed = false;
  bool crash_after_charge = false;
  // "reserved": the process stops itself (SIGSTOP) right after its reservation committed,
  // before it has the reply in hand, so a test can freeze it past its lease and send SIGCONT.
  // Empty: never.
  std::string stop_at;
};

// Prints one JSON line (outcome, charge_id, status, ...) and returns the exit code: 0 when a
// charge id came back, 1 otherwise.
int run_charge(const ChargeArgs& args);

struct CheckoutArgs {
  std::string db;      // keys, orders and the outbox (SQLite file or postgresql:// URI)
  std::string ledger;  // the provider's ledger and the mail journal (SQLite file)
  std::string key;
  std::string tenant = "alpha";
  std::string order_id = "A-10023";
  long long amount = 4990;
  std::string currency = "RUB";
  long long lease_ms = 30000;
  long long heartbeat_ms = -1;  // how often the lease is renewed (0: never; -1: a third of it)
  long long provider_latency_ms = 300;
  bool provider_dedup = true;
  // One of checkout.hpp's CrashHook points ("before debited", ...): the process stops itself
  // (SIGSTOP) there, for a test to freeze it past its lease and send SIGCONT. Empty: never.
  std::string stop_at;
};

// Seed 000's checkout (debit, order, mail) through Coordinator::call_steps, once, from this
// process; a duplicate waits out a dead holder's lease and resumes its progress. Prints one
// JSON line (status, body, debits, orders) and returns 0 on a 200, 1 otherwise.
int run_checkout(const CheckoutArgs& args);

// Delivers the outbox of `db` (SQLite file or postgresql:// URI) to the mail journal in `ledger`
// once (a one-shot Dispatcher), then prints {"delivered", "retried", "parked", "pending", "mails"}.
int run_dispatch(const std::string& db, const std::string& ledger);

struct SimulateArgs {
  std::uint64_t seed = 1;
  std::uint64_t scenarios = 1;
  std::size_t steps = 0;  // requests per scenario; 0: drawn from each seed
  double minutes = 0;     // > 0: run fresh seeds for this long instead of `scenarios`
  bool trace = false;     // print every scenario's trace, not only failures'
  std::string mutation;   // a test_control switch to turn on (breaks idem on purpose)
  std::string svg;        // write the (first failing, else first) scenario's timeline here
};

// Runs seeded whole-system scenarios (idem/sim/simulation.hpp) and prints each failure (seed,
// shrunk plan, violations, trace) and a summary: scenarios, failures, scenarios per CPU
// second, the average scenario's size. Returns 0 when every scenario held, 1 otherwise.
int run_simulate(const SimulateArgs& args);

// Prints the ledger as JSON: {"count": n, "charges": [...]}. Returns the exit code.
int run_ledger(const std::string& ledger);

}  // namespace idem::demo
