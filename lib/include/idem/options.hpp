// idem — how a Coordinator behaves. Every option states its default.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "idem/clock.hpp"
#include "idem/key.hpp"

namespace idem {

// What a duplicate gets while the first request with its key is still running.
enum class InFlight {
  // No reservation: replay a stored result if there is one, else run the action, then try
  // to store the result and, losing that race, return the winner's. This is the broken
  // "result cache", kept to teach: two concurrent duplicates both run the action.
  run,
  // Wait for the first's outcome and replay it; if the first released the key (it
  // failed), reserve and run; if its lease expires, take over; after Options::max_wait,
  // InProgressError. For internal callers.
  wait,
  // InProgressError at once (HTTP 409 with Retry-After). For public APIs.
  raise,
};

// What happens when the store cannot be used before the action runs.
enum class FailureMode {
  fail_open,    // run the action unprotected; the store error is logged and counted
  fail_closed,  // do not run the action; StoreError (errc::store_unavailable)
};

// What happens to a call without an idempotency key.
enum class MissingKey {
  reject,           // InvalidKeyError ("is missing"); nothing runs
  run_unprotected,  // run the action without the store; counted as ran_unprotected
};

std::string_view to_string(InFlight policy) noexcept;

// Where bodies larger than Options::inline_body_limit live. The application
// implements it over its own blob storage. Must be thread-safe.
class PayloadStore {
 public:
  virtual ~PayloadStore() = default;
  // Stores `body` and returns a reference (at most 1024 bytes) that get() resolves.
  // Throws on failure; the coordinator then treats completion as failed (logged, counted).
  virtual std::string put(const KeyId& id, const std::string& body) = 0;
  // The body stored under `ref`. Throws on failure; the replay then fails with it.
  virtual std::string get(const std::string& ref) = 0;
};

enum class LogLevel { debug, info, warning, error };

// One event from the coordinator. key_hash is short_hash() of the key: a log line never
// carries the client's key. `event` is a stable name ("reserved", "lease_lost", ...).
struct LogEvent {
  TimePoint at;
  LogLevel level = LogLevel::info;
  std::string_view event;
  std::string_view key_hash;
  std::string_view operation;
  std::int64_t token = 0;
  std::string_view message;
};

// Receives log events, from any thread calling the coordinator (and from the clock's
// thread for heartbeats). Must be thread-safe and must not call back into the coordinator.
using LogSink = std::function<void(const LogEvent&)>;

struct Options {
  // Default: InFlight::wait.
  InFlight in_flight = InFlight::wait;

  // How long a reservation holds the key before another request may take it over. Must be
  // positive and shorter than every TTL. Longer than the slowest honest attempt, or use
  // heartbeat. Default: 30 s.
  std::chrono::milliseconds lease{std::chrono::seconds(30)};

  // While the action runs, renew the lease this often (0: never). Must be shorter than
  // the lease. Default: 10 s.
  std::chrono::milliseconds heartbeat{std::chrono::seconds(10)};

  // The least lease an owner must have left to start an external call: a single-step call's
  // action, or an external step (Attempt::external). Set it to the time the call needs to reach
  // the downstream system and take effect there. The store confirms it, on its own clock, in
  // the write that marks an external step pending (which also renews the lease); and the owner
  // checks it against the time it sent that write (or the reservation, for a single-step call),
  // so a reply that comes late, or an owner that was paused, never calls out on a lease that
  // ended meanwhile: it gets LeaseLostError and nothing is called. Must be shorter than the
  // lease. nullopt: 1 s, or a quarter of the lease if that is shorter.
  std::optional<std::chrono::milliseconds> call_margin{};

  // Per-operation call_margin overrides, same rules. Default: none.
  std::map<std::string, std::chrono::milliseconds, std::less<>> call_margin_by_operation{};

  // How long a completed record is replayed. At least one minute. Default: 24 h.
  std::chrono::milliseconds ttl{std::chrono::hours(24)};

  // Per-operation TTL overrides, same rules as ttl. Default: none.
  std::map<std::string, std::chrono::milliseconds, std::less<>> ttl_by_operation{};

  // InFlight::wait: the longest a duplicate waits before InProgressError. Default: 10 s.
  std::chrono::milliseconds max_wait{std::chrono::seconds(10)};

  // InFlight::wait with the holder in another process: the first and the largest interval
  // between polls of the store (it doubles in between). Same-process waiters are woken by
  // the completion itself and do not poll. Defaults: 1 ms and 8 ms.
  std::chrono::milliseconds poll_initial{1};
  std::chrono::milliseconds poll_max{8};

  // Default: FailureMode::fail_open.
  FailureMode on_store_failure = FailureMode::fail_open;

  // Default: MissingKey::reject.
  MissingKey missing_key = MissingKey::reject;

  // Bodies longer than this many bytes go to payload_store and the record keeps the
  // reference. 0 keeps every body inline. When non-zero, payload_store is required.
  // Default: 0.
  std::size_t inline_body_limit = 0;
  std::shared_ptr<PayloadStore> payload_store{};

  // reap() clears in_progress records whose lease ended more than this long ago.
  // Default: 5 min.
  std::chrono::milliseconds reap_after{std::chrono::minutes(5)};

  // Default: a SystemClock owned by the coordinator.
  std::shared_ptr<Clock> clock{};

  // Default: no logging.
  LogSink log{};
};

}  // namespace idem
