// Group commit: the writes of several calls that are ready together go to the store in one
// Store::apply (one transaction on SqliteStore), each keeping its own outcome. The blocking
// and the coroutine front end both write through here, so a thread-per-request server and a
// coroutine server batch alike.
//
// One writer at a time leads: it takes everything queued, applies it, tells each writer of
// the batch, and hands the lead to the first writer that queued meanwhile. A leader commits
// one batch and no more, so no caller carries others' writes for long.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <vector>

#include "idem/store.hpp"

namespace idem::detail {

// Thread-safety: safe for concurrent use.
class GroupCommit {
 public:
  explicit GroupCommit(Store& store) : store_(store) {}
  GroupCommit(const GroupCommit&) = delete;
  GroupCommit& operator=(const GroupCommit&) = delete;

  // What a queued writer is told: its op is committed (its results are in the op), or it
  // must lead (call lead(), which commits its op with the rest of the queue).
  enum class Signal { committed, lead };
  // Called with the queue's lock held: must only record the signal or post work, never call
  // back into this GroupCommit.
  using Notify = std::function<void(Signal)>;

  // Queues `op`. Returns true when no one leads: the caller leads and must call lead() (at
  // once, or after gathering more writes); `notify` then only ever hears `committed`.
  bool enqueue(StoreOp& op, Notify notify);

  // Commits the queue's writes in one Store::apply, tells each writer, and hands the lead on.
  void lead() noexcept;

  // For a blocking caller: enqueue, lead or wait, return once `op` is committed.
  void commit(StoreOp& op);

 private:
  struct Pending {
    StoreOp* op;
    Notify notify;
  };

  Store& store_;
  std::mutex mutex_;
  std::vector<Pending> queue_;  // guarded by mutex_
  bool leading_ = false;        // guarded by mutex_: someone leads (or has been told to)
};

}  // namespace idem::detail
