// What every call of one Coordinator shares: the store, the options, the clock, the
// counters, the in-process registry of held keys, the group commit and whether calls read
// before they reserve. The flow (flow.hpp) of each call works on it; the drivers
// (coordinator.cpp, asio.cpp) only hand it effects.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string_view>

#include "decide.hpp"
#include "group_commit.hpp"
#include "idem/coordinator.hpp"
#include "inflight.hpp"
#include "read_first.hpp"

namespace idem::detail {

struct Counters {
  std::atomic<std::uint64_t> reserved{0}, taken_over{0}, executed{0}, completed{0}, replayed{0},
      waited{0}, in_progress_conflicts{0}, key_reuse{0}, released{0}, lease_lost{0},
      store_errors{0}, ran_unprotected{0}, purged{0}, reaped{0}, steps_recorded{0}, resumed{0},
      reconciled{0}, interrupted{0}, completer_finished{0}, completer_failed{0},
      outbox_delivered{0}, outbox_retried{0}, outbox_parked{0};
};

// Throws idem::error(errc::invalid_argument, "idem: <what>") unless `ok`.
void check(bool ok, std::string_view what);

inline void bump(std::atomic<std::uint64_t>& c, std::uint64_t n = 1) {
  c.fetch_add(n, std::memory_order_relaxed);
}

// Thread-safety: safe for concurrent use (the members are thread-safe or never change).
class CoordinatorCore {
 public:
  // Throws idem::error(errc::invalid_argument) naming the option that breaks a rule.
  CoordinatorCore(std::shared_ptr<Store> store, Options options);

  // Validates the request into a Call (throws InvalidKeyError). `steps`: for call_steps.
  Call prepare(const Request& request, bool steps = false) const;

  std::chrono::milliseconds ttl_for(std::string_view operation) const;

  // A response as the store keeps it: bodies over inline_body_limit go to the payload
  // store (throws what PayloadStore::put throws). response_of() is the way back (throws
  // what PayloadStore::get throws).
  StoredResponse stored_form(const KeyId& id, const Response& response) const;
  Response response_of(Record&& record) const;

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
};

// How the coroutine front end (asio.cpp) reaches a Coordinator's core.
struct CoordinatorAccess {
  static CoordinatorCore& core(Coordinator& c) noexcept { return *c.core_; }
};

}  // namespace idem::detail
