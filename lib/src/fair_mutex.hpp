// A mutex that serves waiters in arrival order.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

namespace idem::detail {

// SqliteStore's connection lock is one: a thread that loops (purge batches, a busy group
// commit) cannot starve the others, because releasing and re-locking puts it behind
// everyone already waiting. unlock() hands the lock to the first waiter and wakes that one
// thread only (waking every waiter to let one through costs each of them a context switch,
// which at eight threads was a third of the CPU). try_lock() takes it only when it is free
// (then nobody waits); try_lock_until() and try_lock_for() wait in line until a deadline. Any
// thread may unlock it, not only the one that locked it (PgStore holds a batch connection's across
// an event loop's wait). Thread-safety: that is its purpose.
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
    join(self);
    self.cv.wait(guard, [&] { return self.granted; });  // held_ stays true: handed to us
  }

  // lock(), giving up at `deadline`: false, and out of the line, when the lock was not handed
  // over by then.
  bool try_lock_until(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock guard(mutex_);
    if (!held_) {
      held_ = true;
      return true;
    }
    Waiter self;
    join(self);
    if (self.cv.wait_until(guard, deadline, [&] { return self.granted; })) return true;
    // Not granted, so still in the line (unlock() takes a waiter out as it grants it).
    Waiter* before = nullptr;
    for (Waiter* w = head_; w != &self; w = w->next) before = w;
    (before != nullptr ? before->next : head_) = self.next;
    if (tail_ == &self) tail_ = before;
    return false;
  }

  // lock(), giving up after `patience` in line (try_lock_until from now, the clock read only
  // when the lock is held).
  bool try_lock_for(std::chrono::steady_clock::duration patience) {
    return try_lock() || try_lock_until(std::chrono::steady_clock::now() + patience);
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

  void join(Waiter& self) {  // at the end of the line; requires mutex_
    if (tail_ != nullptr) {
      tail_->next = &self;
    } else {
      head_ = &self;
    }
    tail_ = &self;
  }

  std::mutex mutex_;
  bool held_ = false;       // guarded by mutex_
  Waiter* head_ = nullptr;  // guarded by mutex_: the first in line
  Waiter* tail_ = nullptr;  // guarded by mutex_
};

}  // namespace idem::detail
