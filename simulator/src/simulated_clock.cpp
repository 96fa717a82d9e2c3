#include "idem/sim/simulated_clock.hpp"

namespace idem::sim {

TimePoint SimulatedClock::now() const {
  std::lock_guard lock(mutex_);
  return now_;
}

Clock::TimerId SimulatedClock::call_at(TimePoint at, std::function<void()> fn) {
  std::lock_guard lock(mutex_);
  const TimerId id = next_id_++;
  pending_.emplace(std::make_pair(at, id), std::move(fn));
  deadline_of_.emplace(id, at);
  return id;
}

void SimulatedClock::cancel(TimerId id) {
  std::lock_guard lock(mutex_);
  auto it = deadline_of_.find(id);
  if (it == deadline_of_.end()) return;
  pending_.erase(std::make_pair(it->second, id));
  deadline_of_.erase(it);
}

bool SimulatedClock::run_next() {
  std::function<void()> fn;
  {
    std::lock_guard lock(mutex_);
    if (pending_.empty()) return false;
    auto first = pending_.begin();
    if (first->first.first > now_) now_ = first->first.first;
    fn = std::move(first->second);
    deadline_of_.erase(first->first.second);
    pending_.erase(first);
  }
  fn();
  return true;
}

bool SimulatedClock::run_instant() {
  TimePoint instant;
  {
    std::lock_guard lock(mutex_);
    if (pending_.empty()) return false;
    instant = std::max(now_, pending_.begin()->first.first);
  }
  advance_to(instant);
  return true;
}

void SimulatedClock::advance_to(TimePoint t) {
  for (;;) {
    {
      std::lock_guard lock(mutex_);
      if (pending_.empty() || pending_.begin()->first.first > t) {
        if (t > now_) now_ = t;
        return;
      }
    }
    run_next();
  }
}

std::size_t SimulatedClock::pending() const {
  std::lock_guard lock(mutex_);
  return pending_.size();
}

}  // namespace idem::sim
