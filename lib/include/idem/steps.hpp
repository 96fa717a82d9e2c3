// idem — operations that span several systems: named steps with recovery points,
// local steps in the key's own transaction, derived keys, the outbox and the completer.
//
//   Outcome out = idem.call_steps(request, [&](Attempt& a) {
//     const std::string charge = a.external("debited",
//         [&](const std::string& key) { return provider.charge(amount, key).id; },   // runs once
//         [&](const std::string& key) { return provider.find(key); });   // after an unknown
//         outcome
//     a.local("order_created", [&](LocalTransaction& tx) {     // commits with its recovery point
//       tx.execute(kInsertOrderIgnoringConflict, {tenant, order_id, charge});
//       return order_id;
//     });
//     a.local("notified", [&](LocalTransaction& tx) {
//       tx.enqueue("mail", receipt);                             // delivered by a Dispatcher
//       return std::string("queued");
//     });
//     return Response{200, {}, receipt};
//   });
//
// A retry of the same request (same key, same fingerprint) resumes after the last recorded
// step: a step that is done returns its stored result and does not run again. A step that
// throws releases the key but keeps the progress (until the TTL from the operation's start),
// so the retry resumes rather than restarts; a process that dies leaves the key reserved, and
// the next owner takes over with the progress. Operations nobody retries are finished by a
// Completer (or idem/asio.hpp's Maintenance) from the request stored on the record.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/coordinator.hpp"

namespace idem {

namespace detail {
class CoordinatorCore;
}

// One attempt at a multi-step operation: the caller holds the key with token() and runs the
// steps in order. Not thread-safe: it belongs to the action it was given to.
//
// Every step method throws:
//   LeaseLostError - this attempt's lease was taken over: a zombie's step neither runs its
//                    local work to commit nor advances the recovery point. Or, before an
//                    external call, the lease had ended or had less than the call margin left
//                    (Options::call_margin): the call is not made. Do not retry the step.
//   OutcomeUnknownError - the store failed after an effect may have happened: an external
//                    call returned and its result could not be recorded (result() holds it),
//                    or a step had been recorded or begun already (may_have_effects()). Nothing
//                    of this step was recorded (a local step's work rolled back). Answer "retry
//                    with the same key, never a new one": the key is released with its
//                    progress and a retry resumes, looking an unrecorded call up first.
//   StoreError     - the store failed before anything of the operation took effect; nothing
//                    was recorded. A retry with the same key (or a new one) is safe.
//   idem::error(errc::invalid_argument) - an empty step name, or a result that is not
//                    UTF-8 text.
// and whatever the application's own function threw (the step is not recorded).
class Attempt {
 public:
  Attempt(const Attempt&) = delete;
  Attempt& operator=(const Attempt&) = delete;

  const KeyId& id() const noexcept { return id_; }
  std::int64_t token() const noexcept { return token_; }
  // The operation's origin (Progress::origin): the same on every attempt of this operation.
  std::int64_t origin() const noexcept { return progress_.origin; }
  // The request as call_steps stored it (Request::payload of the first attempt).
  const std::string& request() const noexcept { return progress_.request; }
  // True when an earlier attempt of this operation recorded progress (a resume).
  bool resumed() const noexcept { return resumed_; }
  // The last recorded step, or nullopt before the first.
  std::optional<std::string> recovery_point() const;
  const std::vector<StepResult>& steps() const noexcept { return progress_.steps; }
  // The stored result of `step`, or nullptr if it has not been recorded.
  const std::string* result(std::string_view step) const noexcept;
  // result(), or else what `step`'s external call returned in this attempt when recording it
  // failed (the effect happened; the store does not know yet): what an answer after a failure
  // can tell the client (a charge id). nullptr when neither is known.
  const std::string* known_result(std::string_view step) const noexcept;
  // Whether an effect of this operation may have happened: a step was recorded, or an external
  // step was begun (marked pending), by this attempt or an earlier one. A failure from then on
  // must never be answered as "nothing happened": the client retries with the same key.
  bool may_have_effects() const noexcept;
  // The key for a downstream call of `step` (idem::derived_key with the origin): the same on
  // every attempt and in every process, different per step, never the client's key.
  std::string derived_key(std::string_view step) const;

  // A local step: runs `work` inside the store's transaction that records `step` as the
  // recovery point (with work's result), so the application's rows, the messages it queues
  // (LocalTransaction::enqueue) and the progress commit or roll back together. Returns the
  // result; a step already recorded returns its stored result without running.
  using LocalWork = std::function<std::string(LocalTransaction&)>;
  std::string local(std::string_view step, const LocalWork& work);

  // An external step: `call` runs with derived_key(step) and its result is recorded. Right
  // before `call` runs, the step is marked pending in the store, in a write that also confirms,
  // on the store's clock, that this attempt's token is current and its lease still has the call
  // margin left (and renews the lease); and the attempt checks that margin again against the
  // time it sent that write. So an owner that was paused, or whose write came back late, never
  // calls out on a lease that may have passed to another owner: LeaseLostError, nothing called.
  // (A pause during the call itself, after the check, is not seen: only a downstream system
  // that deduplicates on the derived key closes that window.) If an attempt ends while the step
  // is pending (a timeout, a crash), the outcome is unknown, and the next attempt first asks
  // `lookup` with the same key: a result found there is recorded (reconciled, counted as
  // MetricsSnapshot::reconciled) and `call` does not run again; nullopt means the downstream
  // system never saw it, and `call` runs (after the same mark and check). Without a lookup the
  // call runs again with the same derived key, for a downstream system that deduplicates on it.
  using ExternalCall = std::function<std::string(const std::string& derived_key)>;
  using Lookup = std::function<std::optional<std::string>(const std::string& derived_key)>;
  std::string external(std::string_view step, const ExternalCall& call, const Lookup& lookup = {});

  // external() in parts, for drivers that wait their own way (idem/asio.hpp's
  // async_external). begin_external says what to do: return `result` (done), look up `key`
  // first (look_up: then finish_external with reconciled = true, or, if nothing was found,
  // begin_call and call with `key`), or call with `key` (call: the step is now marked pending
  // and the lease confirmed).
  struct Plan {
    enum class Kind { done, look_up, call };
    Kind kind = Kind::call;
    std::string result;  // done
    std::string key;     // look_up, call
  };
  Plan begin_external(std::string_view step);
  // Marks `step` pending and confirms the lease, as begin_external does before Plan::call:
  // call it right before the external call when a look-up found nothing. Throws what every step
  // method throws; after LeaseLostError, do not call.
  void begin_call(std::string_view step);
  // Checks again, on the thread about to make the call, that the lease begin_call confirmed
  // still has the call margin left on the coordinator's clock: LeaseLostError if not (then do
  // not call). A driver that hops between threads after begin_call (or begin_external's
  // Plan::call) calls it right before the call.
  void check_call(std::string_view step) const;
  // Records the external step's result.
  std::string finish_external(std::string_view step, std::string result, bool reconciled);

 private:
  friend struct AttemptAccess;
  Attempt(detail::CoordinatorCore& core, KeyId id, std::int64_t token, Progress progress);
  // Commits the step (StepStore::commit_step) and keeps its result; LeaseLostError if refused.
  std::string record(StepCommit& commit);
  void check_step(std::string_view step) const;
  // Rethrows the StoreError being handled as OutcomeUnknownError (nesting it) once an effect
  // may have happened in step `step`; else as it is.
  [[noreturn]] void store_failed(std::string_view step) const;
  [[noreturn]] void lease_lost(std::string_view step, std::string_view why) const;

  detail::CoordinatorCore& core_;
  KeyId id_;
  std::int64_t token_;
  Progress progress_;
  bool resumed_;
  bool called_ = false;                // this attempt began an external step
  TimePoint mark_sent_{};              // begin_call: when its pending mark was sent
  TimePoint confirmed_until_{};        // begin_call: the lease its mark confirmed
  mutable bool store_failed_ = false;  // a write of this attempt's steps failed in the store
  // What external calls returned in this attempt whose recording failed, by step.
  std::map<std::string, std::string, std::less<>> unrecorded_;
};

// --- The completer ---------------------------------------------------------------------

struct CompleterOptions {
  // An operation is abandoned once its lease ended (or its last attempt failed) this long
  // ago and no retry came. Default: 30 s.
  std::chrono::milliseconds abandoned_after{std::chrono::seconds(30)};
  // At most this many operations per run. Default: 20.
  std::size_t batch = 20;
};

struct CompleterReport {
  std::size_t found = 0;     // abandoned operations seen
  std::size_t finished = 0;  // driven to the end (their response is stored and replayed)
  std::size_t failed = 0;    // a step failed again (released again; retried next run)
  std::size_t skipped = 0;   // no handler registered, or held by someone else meanwhile
};

// Finishes multi-step operations abandoned mid-way, from their recovery point, with the
// request stored on the record, under the same fencing rules as any owner (it reserves the
// key like a retry of the same request would). Counted (MetricsSnapshot::completer_*) and
// logged ("completed_abandoned", "complete_abandoned_failed").
// Thread-safety: run_once() from one thread at a time; on() before the first run.
class Completer {
 public:
  using Resume = std::function<Response(Attempt&)>;
  explicit Completer(Coordinator& coordinator, CompleterOptions options = {});
  // The handler that finishes operations of `operation` (usually the action call_steps ran).
  void on(std::string operation, Resume resume);
  // One pass: finds up to `batch` abandoned operations and finishes each. Throws StoreError
  // if the search fails; a failure of one operation is counted and the pass goes on.
  CompleterReport run_once();

 private:
  Coordinator& coordinator_;
  CompleterOptions options_;
  std::map<std::string, Resume, std::less<>> handlers_;
};

// --- The outbox ------------------------------------------------------------------------

struct OutboxOptions {
  // Deliveries tried before a message is parked (kept, counted, no longer tried; an
  // operator looks at it). Default: 8.
  int max_attempts = 8;
  // Backoff after a failed delivery: first_retry, doubling, at most max_retry.
  std::chrono::milliseconds first_retry{std::chrono::seconds(1)};
  std::chrono::milliseconds max_retry{std::chrono::minutes(5)};
  // A claimed message is not handed to another dispatcher for this long (a dispatcher that
  // dies mid-delivery gives its messages back after it). Default: 30 s.
  std::chrono::milliseconds claim_for{std::chrono::seconds(30)};
  // A claimed message is handed to the delivery only while its claim has at least this long
  // left. A dispatcher paused (or held up by slow deliveries) past that gives the rest of its
  // batch back, due again when the claim ends, rather than deliver what another dispatcher may
  // have claimed and be delivering by then. Not negative, shorter than claim_for. nullopt: 1 s,
  // or a quarter of claim_for if that is shorter.
  std::optional<std::chrono::milliseconds> deliver_margin{};
  // Messages claimed at once, and at most marked delivered at once (in one transaction: a
  // dispatcher that dies mid-batch delivers up to this many again). Default: 100.
  std::size_t batch = 100;
  // Delivered messages are purged this long after delivery, and never later than the
  // coordinator's TTL (Options::ttl), so the outbox stays bounded as the keys do. (A receiver
  // deduplicates on the message id; a delivered message is never sent again, so nothing needs
  // it kept longer.) nullopt: the TTL.
  std::optional<std::chrono::milliseconds> keep_delivered{};
};

struct DispatchReport {
  std::size_t delivered = 0;
  std::size_t retried = 0;  // failed, due again after the backoff
  std::size_t parked = 0;   // failed for the max_attempts-th time
  // Claimed and not handed to the delivery: the claim had less than deliver_margin left (a
  // pause, slow deliveries). Due again when the claim ends.
  std::size_t given_back = 0;
};

// Delivers one message; throws if it was not delivered. The receiver deduplicates on
// OutboxMessage::id: delivery is at least once (a dispatcher marks what it delivered of a batch
// in one transaction, when the batch ends, before it records a failure or before it gives the
// rest back; one that dies before that leaves those messages claimed, delivered again once the
// claim ends), the effect exactly once. Give each delivery a deadline of its own (the
// receiver's client timeout), well under deliver_margin: idem cannot end a call in progress, so
// a delivery that never returns holds its dispatcher's thread (and, under Maintenance, the
// schedule's other jobs on it) until it does, and one that outlasts its claim may be delivered
// again meanwhile by another dispatcher, with the messages its batch delivered before it and
// has not marked yet.
using Delivery = std::function<void(const OutboxMessage&)>;

// Delivers the outbox. Never called on a request's path: messages queued by local steps
// wait in the store until a dispatcher runs (Maintenance runs one on a schedule).
// Thread-safety: run_once() from one thread at a time; several dispatchers (in one process
// or several) may run at once, each claiming its own messages.
class Dispatcher {
 public:
  // Throws idem::error(errc::invalid_argument) for a null delivery, max_attempts < 1, a
  // non-positive first_retry, max_retry below first_retry, a non-positive claim_for, a
  // deliver_margin negative or not shorter than claim_for, or a batch of 0.
  Dispatcher(Coordinator& coordinator, Delivery delivery, OutboxOptions options = {});
  // Claims the messages due when it began and delivers them, batch after batch, until none
  // is left (messages enqueued meanwhile wait for the next run, so an inflow cannot keep it
  // running), or until a claim has less than deliver_margin left: then the rest of that batch
  // is given back (DispatchReport::given_back, logged as outbox_claim_lapsed) and the run
  // ends. Throws StoreError if the outbox cannot be read; a failed delivery is counted
  // and retried later.
  DispatchReport run_once();
  // Deletes messages delivered longer than keep_delivered (at most the TTL) ago. Returns how
  // many.
  std::size_t purge();

 private:
  Coordinator& coordinator_;
  Delivery delivery_;
  OutboxOptions options_;
};

}  // namespace idem
