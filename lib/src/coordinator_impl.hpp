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
#include <functional>
#include <mutex>
#include <vector>
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

  // The decision for one round, in two phases so the Asio front end can batch the write:
  //   look()     reads the record; returns the step if the record decides it (replay,
  //              wait, unprotected, InFlight::run's execute), or nullopt: reserve;
  //   reserve_op() is the reservation write, which the caller applies to the store;
  //   reserved() says what the applied reservation means.
  // They throw KeyReuseError, InProgressError (raise, or wait once `give_up` has passed)
  // and, under fail_closed, StoreError. begin() is all three, applying the write itself.
  std::optional<Step> look(const Call& call, TimePoint t, TimePoint give_up);
  StoreOp reserve_op(const Call& call, TimePoint t) const;
  Step reserved(const Call& call, StoreOp& op, TimePoint t, TimePoint give_up);
  Step begin(const Call& call, TimePoint give_up);

  // After the action returned, likewise in phases: prepare_completion() builds the write
  // (false: it cannot be stored; answer with the response unstored), the caller applies
  // done.op, completed() reports (throws LeaseLostError). finish() is all of it, and
  // finish_unreserved() is InFlight::run's store-if-absent.
  struct Completion {
    TimePoint t;
    StoredResponse stored;
    StoreOp op;
  };
  bool prepare_completion(const Call& call, std::int64_t token, const Response& response, Completion& out);
  Outcome completed(const Call& call, std::int64_t token, Completion& done, Response response);
  Outcome finish(const Call& call, std::int64_t token, Response response);
  Outcome finish_unreserved(const Call& call, Response response);

  // A response as the store keeps it: bodies over inline_body_limit go to the payload
  // store (throws what PayloadStore::put throws). response_of() is the way back.
  StoredResponse stored_form(const Call& call, const Response& response) const;
  Response response_of(Record&& record) const;
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
  // What a live record found by look() or reserve means for this call.
  Step on_live(const Call& call, Record&& found, TimePoint t, TimePoint give_up);

  TimePoint now() const { return clock->now(); }

  // Writes queued by coroutines, applied together by flush_writes() (group commit for the
  // Asio front end: everything that became ready in one turn of the io_context shares one
  // transaction). queue_write() returns true when the caller must schedule a flush.
  struct PendingWrite {
    StoreOp* op;
    std::function<void()> done;  // resumes the writer, after the commit
  };
  bool queue_write(StoreOp& op, std::function<void()> done);
  void flush_writes();

  std::shared_ptr<Store> store;
  Options options;
  std::shared_ptr<Clock> clock;
  mutable Counters counters;
  detail::InflightRegistry inflight;
  std::mutex writes_mutex;
  std::vector<PendingWrite> writes;  // guarded by writes_mutex
  bool flush_scheduled = false;      // guarded by writes_mutex
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
