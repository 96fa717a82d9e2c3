// In-process bookkeeping of keys held by this process, and of the duplicates waiting on
// them, so a completion wakes its waiters directly instead of being polled for.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "idem/key.hpp"

namespace idem::detail {

// One waiting duplicate. wake() may be called from any thread, more than once.
class Waiter {
 public:
  virtual ~Waiter() = default;
  virtual void wake() = 0;
};

// Thread-safety: safe for concurrent use.
class InflightRegistry {
 public:
  // This process now holds `id` with `token`.
  void hold(const KeyId& id, std::int64_t token);

  // The holder with `token` is done (completed, released or failed to store): forget the
  // hold if it is still that token's, and wake every waiter of `id`.
  void finished(const KeyId& id, std::int64_t token);

  // Adds `waiter` to `id`'s waiters. Returns whether this process holds `id` with `token`
  // (then finished() will wake the waiter; otherwise the holder is elsewhere: poll).
  bool subscribe(const KeyId& id, std::int64_t token, const std::shared_ptr<Waiter>& waiter);

  void unsubscribe(const KeyId& id, const std::shared_ptr<Waiter>& waiter);

  // Another process completed or released `id` (Store::add_change_listener): wakes its
  // waiters, which read the store and subscribe again if it is still held.
  void changed_elsewhere(const KeyId& id);

 private:
  struct Entry {
    std::int64_t token = 0;  // 0: not held by this process
    std::vector<std::shared_ptr<Waiter>> waiters;
  };
  std::mutex mutex_;
  std::unordered_map<KeyId, Entry, KeyIdHash> entries_;  // guarded by mutex_
};

}  // namespace idem::detail
