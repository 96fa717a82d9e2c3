// idem::sim — the simulated payment provider.
//
// charge() takes `latency` on the injected clock and returns charge ids ch_1, ch_2, ... in
// the order charges are made. Its ledger counts every charge made: that count is the bank
// statement, the ground truth of every table and test. The ledger is an SQLite database:
// private in memory by default, or a file shared by several processes, which then count
// their charges together (ids are assigned atomically across processes). Coroutines charge
// through idem/sim/async_provider.hpp.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "idem/clock.hpp"

namespace idem::sim {

struct ProviderOptions {
  // How long a charge takes. Default: 300 ms.
  std::chrono::milliseconds latency{300};
  // Deduplicate on the idempotency key passed to charge(): a second charge with a key
  // already charged returns the first charge and makes none. Default: on.
  bool dedup = true;
  // Ledger database file shared by processes; empty: private, in memory. Default: empty.
  std::string ledger_path{};
  // What a Fault::crash does after the charge is recorded. Default: std::_Exit(70), as a
  // killed process would (no destructors, no cleanup, the key left reserved).
  std::function<void()> crash{};
};

// A fault to inject into upcoming charges, in order (inject()).
enum class Fault {
  timeout,  // after the latency, throws ProviderTimeout; no charge is made
  decline,  // after the latency, returns a decline (insufficient funds); no charge is made
  crash,    // the charge is made and recorded, then ProviderOptions::crash runs
  // The unknown outcome: the charge is made and recorded as a normal one (same ids, same
  // dedup), then the answer is lost and ProviderTimeout is thrown.
  charged_then_timeout,
};

// An infrastructure failure: the provider did not answer in time. Not an outcome.
class ProviderTimeout : public std::runtime_error {
 public:
  ProviderTimeout() : std::runtime_error("payment provider timed out") {}
};

struct ChargeResult {
  bool declined = false;
  std::string charge_id;      // "ch_<n>" when charged (or deduplicated)
  std::string reason;         // "insufficient_funds" when declined
  bool deduplicated = false;  // true: an earlier charge with the same key was returned
};

// A charge on its way (Provider::start): what it will do was decided when it arrived; it
// settles (Provider::finish) once the clock reaches `due`.
struct PendingCharge {
  std::optional<Fault> fault;
  std::string order_id;
  std::int64_t amount = 0;
  std::string idempotency_key;
  TimePoint due;
};

struct Charge {
  std::string id;
  std::string order_id;
  std::int64_t amount = 0;
  std::string idempotency_key;
  TimePoint at;
};

// Thread-safety: safe for concurrent use.
class Provider {
 public:
  // Throws std::runtime_error if the ledger cannot be opened.
  Provider(std::shared_ptr<Clock> clock, ProviderOptions options = {});
  ~Provider();
  Provider(const Provider&) = delete;
  Provider& operator=(const Provider&) = delete;

  // Blocks the calling thread for the latency (on the clock), then charges: start(), a
  // sleep until its due time, finish(). Throws ProviderTimeout for an injected timeout
  // (nothing charged) or charged_then_timeout (charged); runs ProviderOptions::crash after
  // recording the charge for an injected crash; throws StoreError if the ledger cannot be
  // written.
  ChargeResult charge(const std::string& order_id, std::int64_t amount,
                      const std::string& idempotency_key);

  // The two halves of charge(), for drivers that wait their own way (a coroutine, a
  // simulator): start() takes the next injected fault and says when the charge is due;
  // finish() settles it, as charge() does after its sleep.
  PendingCharge start(std::string order_id, std::int64_t amount, std::string idempotency_key);
  ChargeResult finish(const PendingCharge& charge);

  // Forgets every charge, pending fault and event sink, as a new provider would: the next
  // charge is ch_1 again. For a simulator that reuses one provider across scenarios. Throws
  // StoreError if the ledger cannot be written.
  void clear();

  // Queues `times` copies of `fault` for the next charges (first in, first out).
  void inject(Fault fault, std::size_t times = 1);

  // The bank statement.
  std::size_t charge_count() const;
  std::vector<Charge> charges() const;
  // At most `limit` charges made after charge "ch_<after>" (0: from the first), in order.
  std::vector<Charge> charges_after(std::int64_t after, std::size_t limit) const;
  std::vector<std::string> charge_ids() const;
  // The charge made with `idempotency_key` (the first, if dedup is off and several were),
  // or nullopt if none was ('' never matches). Reads the ledger, so sees the charges of
  // every process sharing it; takes no latency and consumes no injected fault. Throws
  // StoreError if the ledger cannot be read.
  std::optional<Charge> find(const std::string& idempotency_key) const;

  // Called with a line for each charge made or refused (for timelines).
  void on_event(std::function<void(TimePoint, const std::string&)> sink);

  Clock& clock() const noexcept { return *clock_; }

 private:
  struct Ledger;

  std::shared_ptr<Clock> clock_;
  ProviderOptions options_;
  std::unique_ptr<Ledger> ledger_;
  mutable std::mutex mutex_;  // guards faults_, sink_ and every use of ledger_
  std::deque<Fault> faults_;
  std::function<void(TimePoint, const std::string&)> sink_;
};

}  // namespace idem::sim
