// Group commit: the writes of several calls that are ready together go to the store in one
// Store::apply (one transaction on SqliteStore), each keeping its own outcome. The blocking
// and the coroutine front end both write through here, so a thread-per-request server and a
// coroutine server batch alike.
//
// A round takes everything queued, applies it, tells each writer of the batch, and hands the
// next round to a writer that queued meanwhile (LevelDB's writer queue: whoever is at the
// head writes for all). A leader commits one batch and no more, so no caller carries others'
// writes for long. Up to Store::concurrent_applies() rounds run at once (one for SqliteStore;
// one per batch connection for PgStore): while one batch is in the database, the next one
// gathers and goes out on another connection. What that buys (scripts/bench --quick --only pg,
// "64 in flight on one io_context", 2026-12-02, a test PostgreSQL on the same 2 cores, three
// runs each, alternated): 15,500, 16,700 and 12,500 calls/s, against 9,000, 10,100 and 9,500
// with one round at a time.
//
// A blocking writer never depends on an event loop: if no round is running it leads at once
// (even when a coroutine's round is posted but has not started), and a hand-off goes to a
// queued blocking writer first. This is a rule, not a heuristic: a thread that waited for a
// round only a coroutine could start would wait for an event loop that may be blocked on it. A
// blocking leader whose last round carried other writers' ops first yields its CPU a few times,
// until the queue is as long as that round was (the threads it woke are on their way back with
// their next writes): threads then batch as coroutines do, and a lone caller never waits. Where a
// yield hands the CPU to a thread busy with other work (a slow yield), gathering backs off.
//
// A coroutine writer posts its round to its executor, so every coroutine that becomes ready
// in the same turn joins the batch; its ops may also be committed by any other leader. Rounds
// are posted per event loop: a coroutine never waits for a round posted to another loop, whose
// thread may be busy with other work, or stopped for good. Its
// round starts the batch with Store::start_apply() where the store can, and the event loop
// waits for the store's socket (lead()'s Drive), so its thread runs other coroutines
// meanwhile; otherwise the round runs Store::apply() on that thread. A round that may wait on
// its event loop for a network store (Store::remote()) takes only that loop's writes: a write
// of another loop or of a thread never waits for a loop that is busy or stopped, whose
// answer it could otherwise hear only when that loop runs again. (A round of a store that
// waits for nothing but its disk is done before its leader returns, and takes any writes.)
// The io_context of a coroutine that is waiting here must outlive the wait (as for any Asio
// operation in progress).
//
// Writers are told after the queue's lock is released, so a woken thread does not go
// straight back to sleep on that lock.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "idem/store.hpp"
#include "latency.hpp"

namespace idem::detail {

// Thread-safety: safe for concurrent use.
class GroupCommit {
 public:
  // With `clock`, a round's ops count their times from when the round goes to the store
  // (StoreOp::now and the times made from it move forward by what the op waited in the queue),
  // so a write that waited behind a stalled round starts its lease when it is applied.
  // With `latency`, each round's batch size and its time in the store (StoreCall::apply) are
  // observed there.
  explicit GroupCommit(Store& store, const Clock* clock = nullptr, Latency* latency = nullptr)
      : store_(store),
        clock_(clock),
        latency_(latency),
        max_rounds_(std::max<std::size_t>(1, store.concurrent_applies())) {}
  GroupCommit(const GroupCommit&) = delete;
  GroupCommit& operator=(const GroupCommit&) = delete;

  // What a queued writer is told: its op is committed (its results are in the op), or it is
  // to run the next round (blocking: run it now; coroutine: post lead()).
  enum class Signal { committed, lead };
  // Called without the queue's lock: may post work; must not call back into this
  // GroupCommit before returning.
  using Notify = std::function<void(Signal)>;

  // For a blocking caller: queues `op`, leads a round or waits for one, and returns once
  // `op` is committed.
  void commit(StoreOp& op);

  // For a coroutine of the event loop `context` (its execution context's address): queues
  // `op`; `notify` hears `committed` once it is, or `lead` (post lead() to `context`).
  // Returns true when the caller must post lead(…, context) itself: no round is free to hand
  // on to it, or none is posted to its own event loop. Rounds are posted per event loop, as
  // reads are batched per event loop: a coroutine's write never waits for a round posted to
  // another loop, whose thread may be busy, or stopped and never run it.
  bool enqueue(StoreOp& op, Notify notify, const void* context = nullptr);

  // How a coroutine's round waits for a batch the store started (Store::start_apply): waits
  // for the descriptor, calls advance() until done() and then `finished`, once, on any
  // thread. Throws (before waiting) if it cannot wait: then the round finishes it by blocking.
  using Drive = std::function<void(PendingApply& pending, std::function<void()> finished)>;

  // For tests: rounds running (or handed to a thread) and writes queued, now.
  std::size_t rounds_running();
  std::size_t queued();

  // A round posted to `context`: commits what is queued unless as many rounds as the store
  // allows are running (one of them hands on to the queue when it ends) or nothing is queued.
  // Without `drive` (or when it throws), a batch the store started is waited for here,
  // blocking, until it is done or its deadline (PendingApply::deadline) fails it.
  void lead(const Drive& drive = {}, const void* context = nullptr) noexcept;
  // A round posted to `context` was destroyed without running (its event loop was destroyed
  // after it stopped): `context` has no round posted any more.
  void dropped(const void* context) noexcept;

 private:
  // A blocking thread's doorbell, one per thread, shared with the round that rings it so a
  // ring that comes late never touches a dead object.
  struct Bell {
    std::atomic<int> rung{0};  // 0, or 1 + Signal
    void ring(Signal s);
    Signal wait();  // until rung; resets it
  };

  struct Pending {
    StoreOp* op;
    Notify notify;                  // a coroutine writer
    std::shared_ptr<Bell> bell;     // a blocking writer, which can run a round at once
    const void* context = nullptr;  // a coroutine writer's event loop
    // A blocking writer that leads a round (on its own, or handed one): no other round takes
    // its op and it is never handed another, so each round counted is run once.
    bool leading = false;
    void tell(Signal s) const;
  };

  // Runs the round of a blocking leader whose own op is queued.
  void lead_blocking(std::unique_lock<std::mutex>& lock, const Bell* own);
  // Yields the CPU until the last round's writers are back; backs off when a yield is slow.
  void gather(std::unique_lock<std::mutex>& lock);
  // Waits on `pending`'s descriptor, advancing it, until it is done or its deadline passes
  // (then it is failed, as an event loop's wait fails it).
  static void wait_blocking(PendingApply& pending) noexcept;
  // One round's batch, kept until its writers are told.
  struct Round {
    std::vector<Pending> batch;
    std::vector<StoreOp*> ops;
    std::unique_ptr<PendingApply> pending;
    std::chrono::steady_clock::time_point started{};  // when its batch went to the store
  };

  // Whether a round may take `p`: not another leading thread's write (own: the leading
  // thread's bell, if a thread leads), and, with `only`, nothing but the coroutine writes of
  // that event loop.
  static bool takes(const Pending& p, const Bell* own, std::optional<const void*> only);
  // Takes the first `most` queued writes that takes() allows as a round (a round counted in
  // rounds_ by the caller), and hands what is left on (hand_on()). Returns with the lock
  // released.
  std::shared_ptr<Round> take(std::unique_lock<std::mutex>& lock, std::size_t most, const Bell* own,
                              std::optional<const void*> only = std::nullopt);
  // Who leads the next round, if the queue holds writes and a round is free: counted in
  // rounds_ for a thread, in posted_ for a coroutine. Requires the lock; the caller tells it
  // after releasing the lock.
  std::optional<Pending> hand_on();
  // Runs one round with Store::apply() for the leading thread `own`; returns with the lock
  // released.
  void round(std::unique_lock<std::mutex>& lock, const Bell* own) noexcept;
  // A round's batch is decided: uncounts the round, hands on and tells its writers.
  void finish(Round& r) noexcept;
  // A round whose wait was destroyed unfinished (its io_context went away): its blocking
  // writers fail with StoreError, its coroutines (destroyed with that io_context) are not
  // told, and the round is uncounted and handed on.
  void abandon(Round& r) noexcept;
  // Applies a round's ops with Store::apply().
  void apply(Round& r) noexcept;

  Store& store_;
  const Clock* clock_;            // null: ops keep their times
  Latency* const latency_;        // null: rounds are not observed
  const std::size_t max_rounds_;  // Store::concurrent_applies(), at least 1
  std::mutex mutex_;
  std::vector<Pending> queue_;  // guarded by mutex_
  std::size_t rounds_ = 0;      // guarded by mutex_: rounds running (or handed to a thread)
  // Guarded by mutex_: the event loops that have a coroutine's round posted, not started.
  std::vector<const void*> posted_;
  std::size_t last_batch_ = 0;  // guarded by mutex_: ops in the last round
  int gather_skips_ = 0;        // guarded by mutex_: rounds left that do not gather
  int gather_backoff_ = 1;      // guarded by mutex_: how many to skip after a slow gather
};

}  // namespace idem::detail
