// idem — the storage interface: atomic operations on one record per key.
//
// A Store does no policy: it reserves, completes, releases and loads records atomically,
// and the Coordinator decides what those outcomes mean. SqliteStore (one machine) and
// PgStore (several nodes) are the engines that ship; another engine implements this interface.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "idem/clock.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/response.hpp"

namespace idem {

enum class State : int {
  in_progress = 1,  // reserved; the owner holds a lease and a fencing token
  completed = 2,    // the response is stored and replayed until expires_at
  released = 3,     // the owner failed and let go: counts as absent
};

struct Record {
  Fingerprint fingerprint;
  State state = State::in_progress;
  std::int64_t token = 0;  // fencing token; grows with every reservation or takeover
  TimePoint lease_until;   // in_progress: the lease's end
  TimePoint created_at;    // when this reservation was made
  TimePoint expires_at;    // when the record stops counting: the lease's end while in
                           // progress, the TTL's end once completed, the release time
  Response response;       // completed only
  std::string body_ref;    // completed only: non-empty when the body is stored elsewhere
  std::optional<std::string> recovery_point;  // last finished step of a multi-step operation
  // in_progress: the number the reservation's writer chose (StoreOp::claim), so a writer whose
  // reply was lost can tell its own reservation from another's; 0 when none was given.
  std::int64_t claim = 0;

  // Whether the record still counts at `now`: an in_progress record within its lease, a
  // completed record within its TTL. A record that does not count is as good as absent.
  bool live_at(TimePoint now) const noexcept {
    switch (state) {
      case State::in_progress:
        return now < lease_until;
      case State::completed:
        return now < expires_at;
      case State::released:
        return false;
    }
    return false;
  }
};

// The body of a completed record as the store keeps it: inline, or by reference.
struct StoredResponse {
  Response response;     // body empty when body_ref is set
  std::string body_ref;  // reference from PayloadStore::put, or empty
};

struct Reservation {
  enum class Kind {
    reserved,    // the key was absent (or its record no longer counted): caller owns it
    taken_over,  // an in_progress record whose lease had expired: caller owns it now
    existing,    // a live record holds the key: see `existing`
  };
  Kind kind = Kind::reserved;
  std::int64_t token = 0;          // the caller's token when it owns the key
  std::optional<Record> existing;  // Kind::existing only
};

// A reservation the reaper cleared.
struct ReapedRecord {
  std::string key_hash;  // short_hash of the key, never the key
  std::string operation;
  std::int64_t token = 0;
  TimePoint lease_until;
};

// --- Multi-step operations --------------------------------------------------------------

// One finished step of a multi-step operation and its small result (a charge id).
struct StepResult {
  std::string step;
  std::string result;
  bool reconciled = false;  // recorded from a lookup after an unknown outcome, not a call
};

// A multi-step operation's progress, kept on its record across failed attempts, takeovers
// and restarts until the operation completes and its TTL ends.
struct Progress {
  // The token of the reservation that began the operation. Derived keys and outbox message
  // ids come from it, so they hold across retries, takeovers and processes, and a request
  // made with the same key after the TTL gets new ones.
  std::int64_t origin = 0;
  std::vector<StepResult> steps;       // finished steps in order; the last is the recovery point
  std::optional<std::string> pending;  // an external step begun and not recorded: its outcome
                                       // is unknown until it is looked up
  std::string request;                 // the request as the operation stored it (the completer's)
};

// The open transaction of a local step (Attempt::local): the application's statements run in
// it, with the step's recovery point, and commit or roll back together.
class LocalTransaction {
 public:
  using Value = std::variant<std::nullptr_t, std::int64_t, double, std::string>;
  using Row = std::vector<Value>;
  // Which SQL execute() speaks, for steps written for both engines.
  enum class Dialect { sqlite, postgresql };
  virtual ~LocalTransaction() = default;
  virtual Dialect dialect() const noexcept = 0;
  // Runs one statement in the store's SQL dialect (SqliteStore: SQLite, parameters ?1..?N;
  // PgStore: PostgreSQL, $1..$N, unqualified names resolved in the store's schema, then
  // public) and returns its rows. Throws StoreError (the whole step rolls back).
  virtual std::vector<Row> execute(std::string_view sql,
                                   std::initializer_list<Value> params = {}) = 0;
  // Rows changed by the last INSERT, UPDATE or DELETE that execute() ran.
  virtual std::int64_t changes() const = 0;
  // Queues a message in the outbox, committed with this step and delivered at least once
  // afterwards. Returns its id (outbox_message_id()): the same for this operation, step and
  // n-th message of the step on every attempt, so the receiver can deduplicate on it.
  virtual std::string enqueue(std::string_view topic, std::string_view payload) = 0;
};

// What a write that starts an external call (StepStore::mark_pending) confirms about the caller's
// lease, on the caller's clock: the caller read `now` just before sending it; the lease must
// still run at `needed` (now plus the time the call needs), and it is extended to `renew_to`
// (now plus a whole lease) if it ends sooner. A store that keeps its own clock (PgStore under
// PgClock::database) puts `now` at its clock's reading when the write commits and keeps the
// distances, so a write that arrives late is judged by when it arrived.
struct LeaseCheck {
  TimePoint now{};
  TimePoint needed{};
  TimePoint renew_to{};
};

// One step to record (StepStore::commit_step).
struct StepCommit {
  StepResult result;
  TimePoint now{};  // when messages are queued (due at once)
  // Runs inside the transaction before the recovery point is written; may be empty. What it
  // throws rolls the step back and propagates.
  std::function<void(LocalTransaction&)> local{};
};

// A message of the outbox as the dispatcher gets it.
struct OutboxMessage {
  std::string id;  // stable: deduplicate on it
  std::string topic;
  std::string payload;
  int attempts = 0;  // deliveries tried before this one
  TimePoint created_at;
};

struct OutboxCounts {
  std::size_t pending = 0;    // not delivered yet (including those waiting for a retry)
  std::size_t delivered = 0;  // delivered and not yet purged
  std::size_t parked = 0;     // gave up after OutboxOptions::max_attempts; need an operator
};

// An operation left mid-way (StepStore::abandoned): what the completer needs to resume it.
struct AbandonedOperation {
  KeyId id;
  Fingerprint fingerprint;
  State state = State::in_progress;  // in_progress (its owner vanished) or released (it failed)
  std::string request;
};

// One read for Store::load_many: the key, and room for its answer.
struct StoreRead {
  const KeyId* id = nullptr;  // the caller's; valid until load_many() has returned
  std::optional<Record> record{};
  std::exception_ptr error{};  // what this read failed with, a StoreError (record then empty)
};

// One write for Store::apply: the inputs of reserve(), complete(), release() or
// store_if_absent(), and room for the result. The pointers belong to the caller and must
// stay valid until apply() has returned.
//
// Times are on the caller's clock, read when the caller made the op. A store that keeps its own
// clock (PgStore under PgClock::database) judges a reservation at its clock's reading when the
// write commits: the record's lease runs for `lease_until - now` from then, and its liveness is
// judged then, so a write that arrives late never makes a lease that has already ended.
struct StoreOp {
  enum class Kind { reserve, complete, release, store_if_absent };
  Kind kind = Kind::reserve;
  const KeyId* id = nullptr;
  const Fingerprint* fingerprint = nullptr;  // reserve, store_if_absent
  TimePoint now{};                           // reserve, release, store_if_absent
  TimePoint lease_until{};                   // reserve
  TimePoint expires_at{};                    // complete, store_if_absent; release: now + the
                                             // TTL, for a record with progress (kept for its
                                             // retry until the TTL from its origin)
  std::int64_t token = 0;                    // complete, release
  const StoredResponse* response = nullptr;  // complete, store_if_absent
  std::int64_t claim = 0;  // reserve: kept on the record (Record::claim); any number, 0 for none

  // Results. reserve: `reservation`. complete and release: `applied` (false: the token was
  // not current). store_if_absent: `reservation`, Kind::existing with the live record that
  // won, or Kind::reserved when this op stored its response. `error` holds the StoreError
  // if this op failed; then the other results mean nothing and nothing of this op was
  // written. `contended`: the write had to wait for a lock another writer held (another
  // process on the same file); a store that cannot tell leaves it false. The coordinator then
  // reads before reserving for a while, which leaves the lock free between its writes.
  Reservation reservation{};
  bool applied = false;
  std::exception_ptr error{};
  bool contended = false;
};

// An apply() that waits for its storage without blocking the caller's thread
// (Store::start_apply): the engine has sent the batch; the caller's event loop waits until
// descriptor() is ready to read, calls advance(), and goes on until done(). The ops are
// decided, each as apply() would, once done() is true; their pointers (and the span given
// to start_apply) must stay valid until then. Destroying it before done() abandons the
// batch: the engine's connection is dropped, and whether its transaction committed is
// unknown (as for a connection that broke).
// Thread-safety: one caller at a time (any thread; the caller orders its calls).
class PendingApply {
 public:
  virtual ~PendingApply() = default;
  // The descriptor to wait on (a socket the engine owns: never close it); -1 once done().
  virtual int descriptor() const noexcept = 0;
  // When the caller stops waiting: at this time, a batch not done yet is failed with
  // fail() (its connection stalled: the engine drops it, and whether it committed is unknown).
  virtual std::chrono::steady_clock::time_point deadline() const noexcept = 0;
  virtual bool done() const noexcept = 0;
  // The descriptor is readable: takes what arrived, without blocking for more. Never throws:
  // failures go to the ops.
  virtual void advance() noexcept = 0;
  // The wait itself failed (the event loop's error): every op not yet decided fails with
  // `why` and done() becomes true.
  virtual void fail(std::exception_ptr why) noexcept = 0;
};

class StepStore;

// Thread-safety: implementations must be safe for concurrent use from many threads, and
// atomic against other processes sharing the same storage.
// Errors: every operation throws StoreError when the storage cannot be used; an
// operation that throws changed nothing.
//
// An engine implements the virtual functions; reserve(), complete(), release() and
// store_if_absent() are apply() of one op, so every write of a record passes through apply()
// (a decorator that overrides it sees them all) and through renew().
class Store {
 public:
  virtual ~Store() = default;

  // ---- Writes

  // Applies several writes, each with its own outcome, as if one after another in `ops`
  // order: a conflict or a stale token in one op never fails its neighbours. An engine may
  // commit them in one transaction (SqliteStore and PgStore do; the coordinator's group commit
  // hands it the writes of every call that is ready at once); no result may be acted on before
  // its write is durable as configured. Never throws: failures go to StoreOp::error. What
  // each kind of op does is said at reserve(), complete(), release() and store_if_absent().
  virtual void apply(std::span<StoreOp* const> ops) = 0;

  // Extends the lease of an in_progress record to `lease_until`, only if `token` is current.
  // Returns false, changing nothing, if it is not (the lease was taken over, or the record
  // was completed, released, reaped or purged): the caller no longer holds the key.
  virtual bool renew(const KeyId& id, std::int64_t token, TimePoint lease_until) = 0;

  // The record as stored (live or not), or nullopt.
  virtual std::optional<Record> load(const KeyId& id) = 0;

  // Several load()s, each with its own answer: a corrupt record fails its own read only.
  // An engine may make them one read (SqliteStore: one read transaction for all, where most
  // of a lone read's time is beginning and ending its own); the coroutine front end hands it
  // the reads of every call that is ready in the same turn of an io_context. Never throws:
  // failures go to StoreRead::error. The default calls load() for each, so a decorator that
  // overrides load() sees every read unless it overrides this too.
  virtual void load_many(std::span<StoreRead* const> reads);

  // ---- Maintenance

  // Deletes up to `limit` records that no longer count (completed past expires_at, or
  // released) in one short transaction. Returns how many it deleted.
  virtual std::size_t purge_expired(TimePoint now, std::size_t limit) = 0;

  // Deletes up to `limit` in_progress records whose lease ended before `lease_ended_before`
  // and returns them. Records with Progress are left to the completer: money may have moved.
  virtual std::vector<ReapedRecord> reap(TimePoint lease_ended_before, std::size_t limit) = 0;

  // ---- Optional capabilities (each has a default)

  // apply() for an event loop: sends `ops` and returns what the loop then waits on (see
  // PendingApply), or null when it cannot do so now; the caller then runs apply(). The
  // default returns null. PgStore waits on its connection's socket, so a coroutine front end
  // keeps several batches in flight on one thread. Never throws: failures go to the ops.
  virtual std::unique_ptr<PendingApply> start_apply(std::span<StoreOp* const> ops);
  // How many apply() or start_apply() calls the store runs at once (it has that many
  // connections); the group commit keeps up to this many batches in flight. Default 1.
  virtual std::size_t concurrent_applies() const noexcept;
  // Whether a call may wait on a network peer (a database server), not only on this machine's
  // disk and locks. The coroutine front end (idem/asio.hpp) then makes its reads, writes and
  // steps on the coordinator's own threads, never on an io_context's thread. Default: false
  // (SqliteStore); PgStore: true.
  virtual bool remote() const noexcept;
  // The progress, steps and outbox of multi-step operations (StepStore), or null when the
  // engine keeps none (the default): then multi-step operations and the outbox fail with
  // idem::error(errc::invalid_argument) before they do anything. SqliteStore and PgStore
  // return themselves.
  virtual StepStore* steps() noexcept;

  // Wake-ups across processes. A store that learns when a key was completed or released
  // (PgStore: LISTEN/NOTIFY) calls every listener with the key's id, on a thread of its own;
  // the Coordinator adds one and wakes its duplicates waiting on that key, which then read
  // the store. They poll all the same (Options::poll_max): a lost wake-up costs latency,
  // never correctness. add_change_listener returns an id for remove_change_listener, or 0
  // when the store has no wake-ups (the default; SQLite's waiters in other processes poll).
  // After remove_change_listener returns, its listener is not running and is never called
  // again. A listener must not call back into the store.
  using ChangeListener = std::function<void(const KeyId&)>;
  virtual std::uint64_t add_change_listener(ChangeListener listener);
  virtual void remove_change_listener(std::uint64_t id);

  // ---- One write at a time: apply() of one op; the op's error is rethrown.

  // One atomic step: if no record for `id` counts at `now` (absent, expired, released,
  // or in_progress with an expired lease), makes an in_progress record with `fingerprint`
  // and a new token larger than any earlier token of this key, leased until
  // `lease_until`; otherwise returns the live record untouched.
  Reservation reserve(const KeyId& id, const Fingerprint& fingerprint, TimePoint now,
                      TimePoint lease_until);

  // in_progress -> completed with `response`, only if `token` is still current (and the
  // record still in_progress). Returns false, changing nothing, if it is not (lease lost).
  bool complete(const KeyId& id, std::int64_t token, const StoredResponse& response,
                TimePoint expires_at);

  // in_progress -> released, only if `token` is current. Returns false if it is not. (The
  // StoreOp form keeps a record with Progress for its retry, until the TTL, the difference of
  // StoreOp::expires_at and now, counted from the operation's origin; this form keeps it
  // until `now`.)
  bool release(const KeyId& id, std::int64_t token, TimePoint now);

  // For InFlight::run, which does not reserve: stores a completed record if none counts
  // at `now` and returns nullopt; otherwise returns the live record that won.
  std::optional<Record> store_if_absent(const KeyId& id, const Fingerprint& fingerprint,
                                        const StoredResponse& response, TimePoint now,
                                        TimePoint expires_at);
};

// The writes and reads of multi-step operations (idem/steps.hpp) and their outbox: an
// optional capability of a Store (Store::steps()). Thread-safety and errors as Store's.
class StepStore {
 public:
  virtual ~StepStore() = default;

  // Starts or resumes the operation on the record `token` holds: stores `request` the first
  // time (a resume keeps the stored one) and returns the recorded progress, or, when nothing
  // was recorded yet, a fresh one with origin = `token` (stored with the first step: a record
  // without progress is one where nothing happened). Returns nullopt, changing nothing, if
  // `token` is not current.
  virtual std::optional<Progress> begin_steps(const KeyId& id, std::int64_t token,
                                              const std::string& request) = 0;
  // Notes that the external step `step` is about to be called (Progress::pending; the
  // progress starts with `origin` if there was none), only if `token` is current and the
  // record's lease, on the store's clock, still runs at `lease.needed`; extends the lease to
  // `lease.renew_to` if it ends sooner. Returns false, changing nothing, otherwise: the caller
  // must not call out (its lease ended, or is about to, or was taken over).
  virtual bool mark_pending(const KeyId& id, std::int64_t token, std::int64_t origin,
                            const std::string& step, const LeaseCheck& lease) = 0;
  // In one transaction: checks `token` is current, runs step.local, appends step.result to
  // the progress (started with `origin` if there was none), makes it the recovery point
  // (Record::recovery_point) and clears `pending` if it named this step. Returns false,
  // changing nothing and running nothing, if `token` is not current (a zombie). Messages
  // step.local enqueued get ids from (id, origin, step, n).
  virtual bool commit_step(const KeyId& id, std::int64_t token, std::int64_t origin,
                           const StepCommit& step) = 0;
  // Up to `limit` operations of `operations` with a stored request and progress, left
  // mid-way: in_progress with a lease that ended before `idle_before`, or released before
  // `idle_before` and still kept at `now`. Oldest first.
  virtual std::vector<AbandonedOperation> abandoned(TimePoint idle_before, TimePoint now,
                                                    std::size_t limit,
                                                    std::span<const std::string> operations) = 0;
  // Claims up to `limit` messages due at `now` for delivery: they are not due again before
  // `claim_until` (another dispatcher skips them meanwhile). Oldest first.
  virtual std::vector<OutboxMessage> claim_outbox(TimePoint now, TimePoint claim_until,
                                                  std::size_t limit) = 0;
  // Marks messages delivered at `now`, all in one transaction (a dispatcher marks what it
  // delivered of a batch at once). A message no longer pending (delivered, parked, or purged)
  // is left as it is. Returns how many were pending.
  virtual std::size_t outbox_delivered(std::span<const std::string> ids, TimePoint now) = 0;
  // Counts a failed delivery: due again at `retry_at`, or parked for good if `park`.
  virtual void outbox_failed(const std::string& id, TimePoint retry_at, bool park,
                             const std::string& why) = 0;
  virtual OutboxCounts outbox_counts() = 0;
  // Deletes up to `limit` messages delivered before `delivered_before`. Returns how many.
  virtual std::size_t purge_outbox(TimePoint delivered_before, std::size_t limit) = 0;
};

// `store`'s StepStore. Throws idem::error(errc::invalid_argument) (a programming error: do
// not retry) when the store keeps no progress.
StepStore& steps_of(Store& store);

}  // namespace idem
