// A mutex that serves waiters in arrival order.
#pragma once

#include <condition_variable>
#include <mutex>

namespace idem::detail {

// SqliteStore's connection lock is one: a thread that loops (purge batches, a busy group
// commit) cannot starve the others, because releasing and re-locking puts it behind
// everyone already waiting. unlock() hands the lock to the first waiter and wakes that one
// thread only (waking every waiter to let one through costs each of them a context switch,
// which at eight threads was a third of the CPU). try_lock() takes it only when it is free
// (then nobody waits). Any thread may unlock it, not only the one that locked it (PgStore
// holds a batch connection's across an event loop's wait). Thread-safety: that is its
// purpose.
class FairMutex {
 public:
  void lock() {
    std::unique_lock guard(mutex_);
    if (!held_) {
      held_ = true;
      return;
    }
    // The waiter lives on this stack; it is signalled under mutex_, which this thread holds
    // again before it can return, so no signal reaches a dead waiter.
    Waiter self;
    if (tail_ != nullptr) {
      tail_->next = &self;
    } else {
      head_ = &self;
    }
    tail_ = &self;
    self.cv.wait(guard, [&] { return self.granted; });  // held_ stays true: handed to us
  }

  bool try_lock() {
    std::lock_guard guard(mutex_);
    if (held_) return false;
    held_ = true;
    return true;
  }

  void unlock() {
    std::lock_guard guard(mutex_);
    Waiter* next = head_;
    if (next == nullptr) {
      held_ = false;
      return;
    }
    head_ = next->next;
    if (head_ == nullptr) tail_ = nullptr;
    next->granted = true;
    next->cv.notify_one();
  }

 private:
  struct Waiter {
    std::condition_variable cv;
    bool granted = false;    // guarded by mutex_
    Waiter* next = nullptr;  // guarded by mutex_
  };

  std::mutex mutex_;
  bool held_ = false;       // guarded by mutex_
  Waiter* head_ = nullptr;  // guarded by mutex_: the first in line
  Waiter* tail_ = nullptr;  // guarded by mutex_
};

}  // namespace idem::detail
