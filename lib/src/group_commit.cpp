#include "group_commit.hpp"

#include <algorithm>

namespace idem::detail {

bool GroupCommit::enqueue(StoreOp& op, Notify notify) {
  std::lock_guard lock(mutex_);
  queue_.push_back(Pending{&op, std::move(notify), false});
  if (committing_ || lead_posted_) return false;
  lead_posted_ = true;
  return true;
}

void GroupCommit::lead() noexcept {
  std::unique_lock lock(mutex_);
  lead_posted_ = false;
  if (committing_ || queue_.empty()) return;  // a running round hands on to the queue
  committing_ = true;
  round(lock);
}

void GroupCommit::commit(StoreOp& op) {
  struct Slot {
    std::condition_variable cv;
    bool committed = false;  // guarded by mutex_
    bool lead = false;       // guarded by mutex_
  } slot;
  // The slot lives on this stack; it is signalled under mutex_, which this thread holds
  // again before it can return, so no signal reaches a dead slot.
  std::unique_lock lock(mutex_);
  queue_.push_back(Pending{&op,
                           [&slot](Signal s) {
                             (s == Signal::committed ? slot.committed : slot.lead) = true;
                             slot.cv.notify_one();
                           },
                           true});
  if (committing_) {
    slot.cv.wait(lock, [&] { return slot.committed || slot.lead; });
    if (slot.committed) return;  // else the round was handed to us: committing_ is ours
  } else {
    committing_ = true;
  }
  round(lock);  // our op is queued: this round commits it
}

void GroupCommit::round(std::unique_lock<std::mutex>& lock) noexcept {
  std::vector<Pending> batch;
  batch.swap(queue_);
  lock.unlock();
  std::vector<StoreOp*> ops;
  try {
    ops.reserve(batch.size());
    for (const Pending& p : batch) ops.push_back(p.op);
    store_.apply(ops);  // never throws by contract; a broken engine must not wedge the queue
  } catch (...) {
    for (const Pending& p : batch) {
      if (!p.op->error) p.op->error = std::current_exception();
    }
  }
  lock.lock();
  for (const Pending& p : batch) p.notify(Signal::committed);
  committing_ = false;
  if (!queue_.empty()) {
    // Hand on: to a waiting thread if there is one (it needs no event loop), else to the
    // first coroutine, unless a round is already posted.
    const auto next =
        std::find_if(queue_.begin(), queue_.end(), [](const Pending& p) { return p.blocking; });
    if (next != queue_.end()) {
      committing_ = true;
      next->notify(Signal::lead);
    } else if (!lead_posted_) {
      lead_posted_ = true;
      queue_.front().notify(Signal::lead);
    }
  }
  lock.unlock();
}

}  // namespace idem::detail
