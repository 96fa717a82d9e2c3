// idem — the coordinator: runs an action once per (tenant, operation, key).
//
//   idem::Coordinator idem(std::make_shared<idem::SqliteStore>("keys.db"), options);
//   idem::Request req{.tenant = "alpha", .operation = "payment.charge",
//                     .key = client_key, .fingerprint = idem::Fingerprint::of(body,
//                     {"amount", "currency", "order_id"})};
//   idem::Outcome out = idem.call(req, [&] { return charge(body); });
//
// The blocking call() is for threaded code; idem/asio.hpp has async_call() for
// coroutines on an io_context. Both run the same decisions and share in-process waiters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/metrics.hpp"
#include "idem/options.hpp"
#include "idem/response.hpp"
#include "idem/store.hpp"

namespace idem {

namespace detail {
class CoordinatorCore;
struct CoordinatorAccess;
}  // namespace detail

class Attempt;  // idem/steps.hpp

struct Request {
  std::string tenant;
  std::string operation;
  std::optional<std::string> key;       // nullopt: the client sent none (Options::missing_key)
  Fingerprint fingerprint;              // of the request's significant fields
  std::optional<InFlight> in_flight{};  // per-call override of Options::in_flight
  // call_steps only: the request as the action needs it to run without its client. Stored on
  // the record with the first attempt (Attempt::request()), so the completer can resume it.
  std::string payload{};
  // At most this long waiting for another request with the key (InFlight::wait), when it is
  // shorter than Options::max_wait: what is left of the client's deadline, say. Not negative.
  std::optional<std::chrono::milliseconds> max_wait{};
};

struct Outcome {
  enum class Source {
    executed,     // the action ran for this call and its response is stored
    replayed,     // a stored response; the action did not run for this call
    unprotected,  // the action ran without the store (fail_open, or no key)
  };
  Response response;
  Source source = Source::executed;
  // Until when the key is remembered (the stored record's TTL end); the epoch when nothing
  // was stored (unprotected, or the store failed after the action).
  TimePoint expires_at{};
  bool replayed() const noexcept { return source == Source::replayed; }
};

// Thread-safety: a Coordinator is safe for concurrent use from many threads and
// coroutines. Several coordinators (in one process or several) may share one database;
// only those in the same process wake each other without polling.
class Coordinator {
 public:
  // Throws idem::error(errc::invalid_argument) naming the option if `options` breaks a
  // rule (TTL under a minute, lease not shorter than a TTL, heartbeat not shorter than the
  // lease, non-positive waits, inline_body_limit without payload_store).
  Coordinator(std::shared_ptr<Store> store, Options options);
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // Runs `action` at most once per (tenant, operation, key) while a reservation holds,
  // and returns its response, or the stored response of the request that ran it.
  //
  // - Stored responses (any status the action returned, a 402 included) replay byte for
  //   byte with Outcome::Source::replayed.
  // - If `action` throws, the reservation is released and the exception propagates: the
  //   next call with this key really runs again. (If the release itself fails, it is
  //   logged as "release_failed" and counted; the exception still propagates and the key
  //   stays reserved until its lease ends.)
  // Throws:
  //   InvalidKeyError   - key, tenant or operation breaks the key rules (idem/key.hpp), or the key
  //   is missing
  //                       under MissingKey::reject. Nothing ran, nothing stored.
  //   KeyReuseError     - a live record of this key has another fingerprint.
  //   InProgressError   - another request holds the key (InFlight::raise), or it still
  //                       held it after max_wait (InFlight::wait). A look that fails while
  //                       waiting (logged "wait_poll_failed", counted) does not end the wait:
  //                       the holder was seen, so the call keeps polling and, past max_wait,
  //                       ends here under either FailureMode.
  //   LeaseLostError    - the action ran (and returned or threw), but this caller's lease was
  //                       taken over in the meantime; the new owner's record stands. If the
  //                       action threw, its exception is nested (std::rethrow_if_nested).
  //   StoreError        - the store failed under FailureMode::fail_closed (action not run).
  // A store failure after the action ran is logged and counted, not thrown: the response
  // is returned and the key stays reserved until its lease ends.
  Outcome call(const Request& request, const std::function<Response()>& action);

  // call() for an operation of several steps (idem/steps.hpp): `action` gets an Attempt that
  // runs named steps, records each with its result as the recovery point, and skips the
  // steps an earlier attempt recorded. Differences from call():
  //  - If `action` throws, the key is released but its progress is kept (until the TTL from
  //    the operation's start), so a retry of the same request resumes (counted as
  //    MetricsSnapshot::interrupted once a step was recorded or begun). A request with another
  //    fingerprint meanwhile, or after a crash left the key reserved with progress, is a
  //    KeyReuseError. An attempt that recorded nothing leaves the key free.
  //  - It never runs unprotected: its progress lives in the store, so a store failure is a
  //    StoreError under either FailureMode, and a missing key is an InvalidKeyError.
  //  - InFlight::run is refused (idem::error(errc::invalid_argument)).
  // Every other rule and error is call()'s. Needs a store with progress (SqliteStore,
  // PgStore).
  Outcome call_steps(const Request& request, const std::function<Response(Attempt&)>& action);

  // Multi-step operations of `operations` left mid-way after making progress
  // (StepStore::abandoned): in progress with a lease that ended, or released after a failed step,
  // longer than `idle_for` ago. At most `limit`, oldest first. The Completer resumes them.
  // Throws StoreError.
  std::vector<AbandonedOperation> abandoned(std::chrono::milliseconds idle_for, std::size_t limit,
                                            const std::vector<std::string>& operations);

  // Deletes completed records past their TTL and released records (those of a multi-step
  // operation with progress once their TTL from its origin is over), in batches of `batch`
  // records, each its own short transaction, until a batch comes back short. Reservations
  // whose lease ended are not purged: reap() reports and clears them. Returns how many were
  // deleted (also counted in metrics().purged). Throws StoreError; the batches deleted
  // before the failure stay deleted. Throws idem::error(errc::invalid_argument) if `batch`
  // is 0. Safe to run while calls are served.
  std::size_t purge_expired(std::size_t batch = 100);

  // Reports (log event "reaped", counter) and deletes in_progress records whose lease
  // ended more than Options::reap_after ago, in batches of `batch`; a multi-step operation
  // that made progress is left to the completer (money may have moved). Returns them. Throws
  // StoreError; the batches cleared before the failure stay cleared. Throws
  // idem::error(errc::invalid_argument) if `batch` is 0.
  std::vector<ReapedRecord> reap(std::size_t batch = 100);

  // Releases the reservations this coordinator wrote that nobody runs any more: one whose write
  // failed and may have committed all the same (its reply lost as a connection broke), with the
  // look that followed failing too; and, on a remote store (Store::remote()), one whose call
  // ended because the store failed, left unreleased so that the caller is answered at once
  // rather than after another deadline (a multi-step record keeps its progress). Each may hold
  // its key for a whole lease with nobody to run it; a call of this coordinator that meets one
  // releases it (and goes on), and this finds them without waiting for a call (Maintenance runs it
  // every dispatch_every). Returns how many it released (counted in metrics().released, logged
  // "released_lost"); one it cannot look at yet (the store still failing) is kept for the next run.
  // Throws nothing for the store's failures (logged, counted).
  std::size_t release_lost_reservations();

  // The TTL for `operation` (ttl_by_operation, else ttl).
  std::chrono::milliseconds ttl_for(std::string_view operation) const;

  // A snapshot of the decision counters since this coordinator was built (see
  // MetricsSnapshot). Cheap; safe from any thread at any time.
  MetricsSnapshot metrics() const;

  // The options as given to the constructor (Options::clock stays null when the
  // coordinator made its own SystemClock: use clock()).
  const Options& options() const noexcept;

  // The clock every time of this coordinator comes from: Options::clock, or the SystemClock
  // the coordinator owns. Valid as long as the coordinator.
  Clock& clock() const noexcept;

  // The store given to the constructor. Valid as long as the coordinator (which shares its
  // ownership). Writing to it directly bypasses the coordinator's bookkeeping: meant for
  // maintenance and tests.
  Store& store() const noexcept;

 private:
  friend struct detail::CoordinatorAccess;  // the coroutine front end (idem/asio.hpp), steps
  std::unique_ptr<detail::CoordinatorCore> core_;
};

}  // namespace idem
