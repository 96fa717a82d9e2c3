// The life of one call, as a state machine that performs no I/O of its own.
//
// A driver asks the flow for the next effect, performs it, reports back, and asks again.
// The one driver is drive() (drive.hpp), written once for the blocking Coordinator::call and
// the coroutine async_call:
//
//   Flow flow(core, request, make_waiter);
//   for (;;) switch (Effect e = flow.next(); e.kind) {
//     case read:    flow.loaded(read_record(store, flow.id()));          // the key's record
//     case payload: flow.transferred(transfer(payloads, flow.payload())); // a large body
//     case write:   group-commit flow.op();                              // results land in the op
//     case run:     flow.ran(action()) or flow.failed(exception);        // the application's
//                   action, with the lease renewed meanwhile when e.renew (heartbeat.hpp)
//     case sleep:   wait on the waiter until e.until (or a wake)
//     case answer:  return flow.outcome();
//   }
//
// next() decides with decide(), keeps the counters, the latency histograms (the call's
// duration, labelled by how it ended, is observed when the flow is destroyed) and the log,
// holds the key's
// in-process bookkeeping (who holds it, who waits on it), and throws the errors a call ends
// with (KeyReuseError, InProgressError, LeaseLostError, StoreError, or the action's own
// exception).
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>

#include "decide.hpp"
#include "idem/coordinator.hpp"
#include "inflight.hpp"
#include "latency.hpp"

namespace idem::detail {

class CoordinatorCore;

struct Effect {
  enum class Kind { read, payload, write, run, sleep, answer };
  Kind kind;
  TimePoint until{};   // sleep: wake by then at the latest
  bool renew = false;  // run: renew the lease while the action runs (Options::heartbeat)
};

// What a read of the key's record gave: the record (or none), or the store's error.
struct Loaded {
  std::optional<Record> record;
  std::exception_ptr error;  // a StoreError
};

// Reads `id`'s record; never throws (a StoreError goes to Loaded::error).
Loaded read_record(Store& store, const KeyId& id) noexcept;

// A body kept in Options::payload_store instead of the record (over inline_body_limit).
struct PayloadOp {
  bool put = false;           // put: keep *data (a body); get: fetch *data (a reference)
  const KeyId* id = nullptr;  // put: the key the body is kept for
  const std::string* data = nullptr;
};
// What a PayloadOp gave: put: the reference; get: the body. Or what the payload store threw.
struct Transferred {
  std::string data;
  std::exception_ptr error;
};
// Performs `op` on `store`; never throws (what the store throws goes to Transferred::error).
Transferred transfer(PayloadStore& store, const PayloadOp& op) noexcept;

// Not thread-safe: one flow belongs to one call, driven by one thread or coroutine at a time.
class Flow {
 public:
  using WaiterFactory = std::function<std::shared_ptr<Waiter>()>;

  // Validates the request (throws InvalidKeyError). `make_waiter` is called at most once,
  // when the call first has to wait for another request.
  // `steps`: a multi-step operation (call_steps), which never runs unprotected.
  Flow(CoordinatorCore& core, const Request& request, WaiterFactory make_waiter,
       bool steps = false);
  ~Flow();
  Flow(const Flow&) = delete;
  Flow& operator=(const Flow&) = delete;

  Effect next();

  const KeyId& id() const noexcept { return call_.id; }
  // The fencing token this call holds while its action runs (Effect::Kind::run).
  std::int64_t token() const noexcept { return token_; }
  void loaded(Loaded result) { loaded_ = std::move(result); }
  const PayloadOp& payload() const noexcept { return payload_; }
  void transferred(Transferred result) { transferred_ = std::move(result); }
  StoreOp& op() noexcept { return op_; }
  void ran(Response response);
  void failed(std::exception_ptr error);
  // The action's store calls failed (its steps' writes), whatever it answered or threw.
  void store_failed() noexcept { store_failed_ = true; }
  Outcome outcome() { return std::move(outcome_); }

 private:
  enum class Phase {
    start,
    read,
    reserve,
    run,
    ran,
    failed,
    complete,
    store,
    release,
    sleep,
    free,   // releasing a reservation of this coordinator whose reply was lost
    late,   // releasing a reservation whose reply came back too late to call out
    put,    // keeping the response's body in the payload store
    fetch,  // fetching a stored response's body from the payload store
  };
  enum class Mode { reserved, unreserved, unprotected };  // how the action runs

  // Performs decision `d`; `record` is the live record it was made on (nullptr if none),
  // which a replay moves from.
  Effect act(Decision d, Record* record, TimePoint now);
  // decide() on what was found, then act() on the decision.
  Effect on(const Found& found, Record* record, TimePoint now);
  Effect run(Mode mode);
  Effect read();
  Effect write(Phase phase);
  Effect answer(Response response, Outcome::Source source, TimePoint expires_at);
  Effect wait_for(const Record& holder, TimePoint now);
  Effect sleep(TimePoint now, bool after_failed_look = false);
  Effect after_read();
  Effect after_reserve();
  Effect after_ran();
  Effect after_complete();
  Effect after_store();
  Effect after_release();
  Effect after_free();
  Effect after_late();
  Effect after_put();
  Effect after_fetch();
  // The response the record holds, as `source`: its body fetched first when it is kept in the
  // payload store.
  Effect replay(Record&& record, Outcome::Source source);
  // The complete (reserved) or store_if_absent (unreserved) write of stored_.
  Effect store_response();
  // The key's record does not decode: counted, logged, and the call ends with `error` (a
  // CorruptRecordError), whatever the failure mode: it neither runs nor replays.
  [[noreturn]] void refuse_corrupt(const std::exception_ptr& error);
  // The reservation came back too late for the action to run (reserved_until_): releases it
  // and ends the call with LeaseLostError.
  Effect refuse_late(TimePoint now);
  // Whether `r` is a reservation of this coordinator whose reply was lost (LostReservations);
  // it is forgotten there, for this call is about to release it.
  bool lost_here(const Record& r);
  // Whether `error` is the store's failure (StoreError, or OutcomeUnknownError after a step).
  static bool store_failure(const std::exception_ptr& error);
  // Ends a reserved call whose action failed because the store did, without another write:
  // the key goes to core_.lost for release_lost_reservations.
  [[noreturn]] void defer_release();
  // Releases `r` (lost_here), then reserves again.
  Effect free_lost(const Record& r, TimePoint now);
  // The action ran but its response was not stored (logged "complete_failed", counted).
  Effect unstored(std::string_view why);
  void unsubscribe();
  void done_holding();
  void log(LogLevel level, std::string_view event, std::string_view message) const;
  void log(LogLevel level, std::string_view event, std::string_view message,
           std::int64_t token) const;

  CoordinatorCore& core_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  CallEnd ended_ = CallEnd::error;  // how the call ended, for its duration's label
  std::chrono::steady_clock::time_point wait_started_{};  // when it first waited
  Call call_;
  WaiterFactory make_waiter_;
  TimePoint give_up_;
  Phase phase_ = Phase::start;
  Mode mode_ = Mode::reserved;

  std::int64_t token_ = 0;     // Mode::reserved: this call's fencing token
  std::int64_t claim_ = 0;     // Mode::reserved: the claim of the reservation that gave token_
  bool store_failed_ = false;  // store_failed(): the action met a failing store
  // When the last reservation this call sent ends at the latest, on the call's clock: its
  // lease, counted from when the write went to the store (the store started it then or later,
  // or not at all). A single-step call runs its action only with Call::margin of it left.
  TimePoint reserved_until_{};
  // A reservation whose write failed, by its claim, while a read tells whether it committed
  // all the same; 0 otherwise. Only a call's first failed reservation is looked up, so a store
  // that reads but cannot write fails the call instead of looping.
  std::int64_t confirming_ = 0;
  bool confirmed_once_ = false;
  bool holding_ = false;  // the in-flight registry records this call as the key's holder

  // Waiting for another request (InFlight::wait).
  std::shared_ptr<Waiter> waiter_;
  std::int64_t holder_ = 0;  // the token waited on; 0: not waiting
  TimePoint holder_lease_{};
  bool subscribed_ = false;    // waiter_ is in the registry for holder_
  bool holder_local_ = false;  // the holder is in this process: its end wakes us
  std::chrono::milliseconds poll_;
  bool waited_ = false;  // counted once per call
  bool looked_ = false;  // told core_.read_first what the key held (once per call)

  Loaded loaded_;
  PayloadOp payload_;
  Transferred transferred_;
  std::string body_ref_;            // Phase::fetch: the body's reference
  Outcome::Source fetched_for_{};   // Phase::fetch: the answer's source
  TimePoint fetched_expires_{};     // Phase::fetch: the answer's expiry
  std::exception_ptr store_error_;  // the StoreError a store_failed decision was made on
  StoreOp op_;
  StoredResponse stored_;
  Response response_;
  std::exception_ptr failure_;
  Outcome outcome_;
};

}  // namespace idem::detail
