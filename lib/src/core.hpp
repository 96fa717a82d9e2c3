// What every call of one Coordinator shares: the store, the options, the clock, the
// counters and latency histograms, the in-process registry of held keys, the group commit and
// whether calls read before they reserve. The flow (flow.hpp) of each call works on it; the effect
// loop (drive.hpp) only hands it effects.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string_view>
#include <utility>
#include <vector>

#include "decide.hpp"
#include "group_commit.hpp"
#include "idem/coordinator.hpp"
#include "inflight.hpp"
#include "latency.hpp"
#include "read_first.hpp"
#include "workers.hpp"

namespace idem::detail {

struct Counters {
  std::atomic<std::uint64_t> reserved{0}, taken_over{0}, executed{0}, completed{0}, replayed{0},
      waited{0}, in_progress_conflicts{0}, key_reuse{0}, released{0}, lease_lost{0},
      store_errors{0}, ran_unprotected{0}, purged{0}, reaped{0}, corrupt_records{0},
      steps_recorded{0}, resumed{0}, reconciled{0}, interrupted{0}, completer_finished{0},
      completer_failed{0}, outbox_delivered{0}, outbox_retried{0}, outbox_parked{0},
      outbox_given_back{0};
};

// Throws idem::error(errc::invalid_argument, "idem: <what>") unless `ok`.
void check(bool ok, std::string_view what);

inline void bump(std::atomic<std::uint64_t>& c, std::uint64_t n = 1) {
  c.fetch_add(n, std::memory_order_relaxed);
}

// Reservations this coordinator wrote whose outcome it never learned (the write failed, and it
// may have committed all the same: a reply lost on its way back), by the claim they carried.
// Such a reservation holds its key for a whole lease with nobody running it; whoever of this
// coordinator next finds a record with one of these claims knows its holder is gone, and
// releases it. Bounded: past kMax the oldest are forgotten (their leases end by themselves).
// Thread-safety: safe for concurrent use.
class LostReservations {
 public:
  static constexpr std::size_t kMax = 4096;
  void add(std::int64_t claim, const KeyId& id);
  // Forgets `claim`; true if it was there.
  bool take(std::int64_t claim);
  std::vector<std::pair<std::int64_t, KeyId>> all() const;
  bool empty() const;

 private:
  mutable std::mutex mutex_;
  std::deque<std::pair<std::int64_t, KeyId>> lost_;  // guarded by mutex_, oldest first
};

// Thread-safety: safe for concurrent use (the members are thread-safe or never change).
class CoordinatorCore {
 public:
  // Throws idem::error(errc::invalid_argument) naming the option that breaks a rule.
  CoordinatorCore(std::shared_ptr<Store> store, Options options);

  // Validates the request into a Call (throws InvalidKeyError). `steps`: for call_steps.
  Call prepare(const Request& request, bool steps = false) const;

  std::chrono::milliseconds ttl_for(std::string_view operation) const;
  // Options::call_margin for `operation` (call_margin_by_operation, else call_margin, else its
  // default).
  std::chrono::milliseconds call_margin_for(std::string_view operation) const;
  // A reservation's claim (StoreOp::claim): never 0, never the same twice in this coordinator,
  // and unlike any other coordinator's but by a 2^-64 chance.
  std::int64_t new_claim();
  // One purge transaction: deletes at most `batch` expired records, counted and timed; returns
  // how many (fewer than `batch`: none expired is left).
  std::size_t purge_batch(std::size_t batch);

  // One log event; the key appears only as its short hash.
  void log(LogLevel level, std::string_view event, const Call& call, std::int64_t token,
           std::string_view message) const;
  void log(LogLevel level, std::string_view event, std::string_view key_hash,
           std::string_view operation, std::int64_t token, std::string_view message) const;

  TimePoint now() const { return clock->now(); }

  const std::shared_ptr<Store> store;
  const Options options;
  const std::shared_ptr<Clock> clock;
  mutable Counters counters;
  mutable Latency latency;
  InflightRegistry inflight;
  // The store's wake-ups from other processes go to `inflight` (declared after it, so it
  // stops first).
  class ChangeSubscription {
   public:
    ChangeSubscription(Store& store, InflightRegistry& inflight);
    ~ChangeSubscription();
    ChangeSubscription(const ChangeSubscription&) = delete;
    ChangeSubscription& operator=(const ChangeSubscription&) = delete;

   private:
    Store& store_;
    std::uint64_t id_;
  } changes;
  GroupCommit commits;
  ReadFirst read_first;  // whether calls read their key's record before reserving it
  LostReservations lost;
  // Where the coroutine front end makes its calls into a store that may wait on a network
  // (Store::remote()). Declared last, so its threads are joined first.
  Workers store_threads{kStoreThreads};

  static constexpr std::size_t kStoreThreads = 4;

 private:
  std::atomic<std::uint64_t> claims_;  // the next claim's number (a random start)
};

// How the coroutine front end (asio.cpp) reaches a Coordinator's core.
struct CoordinatorAccess {
  static CoordinatorCore& core(Coordinator& c) noexcept { return *c.core_; }
};

}  // namespace idem::detail
