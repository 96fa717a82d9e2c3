// A mutex that serves waiters in arrival order (a ticket lock).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace idem::detail {

// SqliteStore's connection lock is one: a thread that loops (purge batches, a busy group
// commit) cannot starve the others, because releasing and re-locking puts it behind
// everyone already waiting. Thread-safety: that is its purpose.
class FairMutex {
 public:
  void lock() {
    std::unique_lock guard(mutex_);
    const std::uint64_t ticket = next_++;
    cv_.wait(guard, [&] { return serving_ == ticket; });
  }
  void unlock() {
    {
      std::lock_guard guard(mutex_);
      ++serving_;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::uint64_t next_ = 0;     // guarded by mutex_
  std::uint64_t serving_ = 0;  // guarded by mutex_
};

}  // namespace idem::detail
