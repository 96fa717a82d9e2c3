#include "inflight.hpp"

#include <algorithm>

namespace idem::detail {

void InflightRegistry::hold(const KeyId& id, std::int64_t token) {
  std::lock_guard lock(mutex_);
  entries_[id].token = token;
}

void InflightRegistry::finished(const KeyId& id, std::int64_t token) {
  std::vector<std::shared_ptr<Waiter>> to_wake;
  {
    std::lock_guard lock(mutex_);
    auto it = entries_.find(id);
    if (it == entries_.end()) return;
    if (it->second.token == token) it->second.token = 0;
    to_wake.swap(it->second.waiters);
    if (it->second.token == 0) entries_.erase(it);
  }
  for (auto& w : to_wake) w->wake();
}

bool InflightRegistry::subscribe(const KeyId& id, std::int64_t token,
                                 const std::shared_ptr<Waiter>& waiter) {
  std::lock_guard lock(mutex_);
  Entry& e = entries_[id];
  e.waiters.push_back(waiter);
  return e.token == token;
}

void InflightRegistry::changed_elsewhere(const KeyId& id) {
  std::vector<std::shared_ptr<Waiter>> to_wake;
  {
    std::lock_guard lock(mutex_);
    const auto it = entries_.find(id);
    if (it == entries_.end()) return;
    to_wake = it->second.waiters;  // they stay subscribed: a wake-up may come early
  }
  for (auto& w : to_wake) w->wake();
}

void InflightRegistry::unsubscribe(const KeyId& id, const std::shared_ptr<Waiter>& waiter) {
  std::lock_guard lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  auto& ws = it->second.waiters;
  ws.erase(std::remove(ws.begin(), ws.end(), waiter), ws.end());
  if (ws.empty() && it->second.token == 0) entries_.erase(it);
}

}  // namespace idem::detail
