#include "group_commit.hpp"

namespace idem::detail {

bool GroupCommit::enqueue(StoreOp& op, Notify notify) {
  std::lock_guard lock(mutex_);
  queue_.push_back(Pending{&op, std::move(notify)});
  if (leading_) return false;
  leading_ = true;
  return true;
}

void GroupCommit::lead() noexcept {
  std::vector<Pending> batch;
  {
    std::lock_guard lock(mutex_);
    batch.swap(queue_);
  }
  std::vector<StoreOp*> ops;
  try {
    ops.reserve(batch.size());
    for (const Pending& p : batch) ops.push_back(p.op);
    store_.apply(ops);  // never throws by contract; a broken engine must not wedge the queue
  } catch (...) {
    for (const Pending& p : batch) p.op->error = std::current_exception();
  }
  std::lock_guard lock(mutex_);
  for (const Pending& p : batch) p.notify(Signal::committed);
  if (queue_.empty()) {
    leading_ = false;
  } else {
    queue_.front().notify(Signal::lead);
  }
}

void GroupCommit::commit(StoreOp& op) {
  struct Slot {
    std::condition_variable cv;
    bool committed = false;  // guarded by mutex_
    bool lead = false;       // guarded by mutex_
  } slot;
  // The slot lives on this stack; it is signalled under mutex_, which this thread holds
  // again before it can return, so no signal reaches a dead slot.
  const bool leading = enqueue(op, [&slot](Signal s) {
    (s == Signal::committed ? slot.committed : slot.lead) = true;
    slot.cv.notify_one();
  });
  if (!leading) {
    std::unique_lock lock(mutex_);
    slot.cv.wait(lock, [&] { return slot.committed || slot.lead; });
    if (slot.committed) return;
  }
  lead();  // our op is at the head of the queue: this batch commits it
}

}  // namespace idem::detail
