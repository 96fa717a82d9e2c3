// The coordinator's decisions, shared by the blocking front end (coordinator.cpp) and the
// Asio one (asio.cpp). Each front end is one loop that reads like SPEC §4's table:
//
//   for (;;) {
//     Step s = begin(call);                       // reserve, or see who holds the key
//     execute     -> run the action, then finish() (store) or abandon() (release)
//     replay      -> return the stored response
//     unprotected -> run the action without the store (fail_open, no key)
//     wait        -> plan_wait(), sleep until woken / lease end / poll, then go round
//   }
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "idem/coordinator.hpp"
#include "inflight.hpp"

namespace idem {

struct Coordinator::Impl {
  struct Counters {
    std::atomic<std::uint64_t> reserved{0}, taken_over{0}, executed{0}, completed{0}, replayed{0},
        waited{0}, in_progress_conflicts{0}, key_reuse{0}, released{0}, lease_lost{0},
        store_errors{0}, ran_unprotected{0}, purged{0}, reaped{0};
  };

  // One call, validated.
  struct Call {
    KeyId id;
    Fingerprint fingerprint;
    InFlight policy = InFlight::wait;
    std::chrono::milliseconds ttl{0};
    bool has_key = true;  // false: MissingKey::run_unprotected
  };

  struct Step {
    enum class Kind { execute, replay, wait, unprotected };
    explicit Step(Kind k) : kind(k) {}
    Kind kind;
    std::int64_t token = 0;  // execute: 0 under InFlight::run (no reservation)
    Outcome replay;          // replay
    TimePoint lease_until;   // wait: the holder's lease end
    std::int64_t holder = 0; // wait: the holder's token
  };

  Impl(std::shared_ptr<Store> store, Options options);

  Call prepare(const Request& request) const;

  // The decision for one round. Throws KeyReuseError, InProgressError (raise, or wait once
  // `give_up` has passed) and, under fail_closed, StoreError.
  Step begin(const Call& call, TimePoint give_up);

  // After the action returned `response`. Throws LeaseLostError.
  Outcome finish(const Call& call, std::int64_t token, Response response);
  // After the action threw: release the key (store failures are logged, not thrown).
  void abandon(const Call& call, std::int64_t token) noexcept;

  // Subscribes `waiter` and re-reads the record. Returns the time to wake up by, or
  // nullopt when the holder is already gone (go round at once; nothing to unsubscribe).
  // `poll` is the current cross-process poll interval; it doubles up to poll_max.
  std::optional<TimePoint> plan_wait(const Call& call, const Step& step, TimePoint give_up,
                                     std::chrono::milliseconds& poll,
                                     const std::shared_ptr<detail::Waiter>& waiter);

  void log(LogLevel level, std::string_view event, const Call& call, std::int64_t token,
           std::string_view message) const;
  void log_event(LogLevel level, std::string_view event, std::string_view key_hash,
                 std::string_view operation, std::int64_t token, std::string_view message) const;

  // A store failure before the action: fail_open -> Step::unprotected, fail_closed -> throw.
  Step on_store_failure(const Call& call, const StoreError& e);

  TimePoint now() const { return clock->now(); }

  std::shared_ptr<Store> store;
  Options options;
  std::shared_ptr<Clock> clock;
  mutable Counters counters;
  detail::InflightRegistry inflight;
};

// Renews a lease every Options::heartbeat while an action runs (on the clock's thread).
// Stops when destroyed, or when a renewal finds the lease lost (logged and counted).
class Heartbeat {
 public:
  Heartbeat(Coordinator::Impl& impl, const Coordinator::Impl::Call& call, std::int64_t token);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

inline void bump(std::atomic<std::uint64_t>& c) { c.fetch_add(1, std::memory_order_relaxed); }

}  // namespace idem
