#include "idem/sim/simulated_clock.hpp"

namespace idem::sim {

TimePoint SimulatedClock::now() const {
  std::lock_guard lock(mutex_);
  return now_;
}

Clock::TimerId SimulatedClock::call_at(TimePoint at, std::function<void()> fn) {
  std::lock_guard lock(mutex_);
  return pending_.add(at, std::move(fn));
}

void SimulatedClock::cancel(TimerId id) {
  std::lock_guard lock(mutex_);
  pending_.cancel(id);
}

bool SimulatedClock::run_next() {
  std::function<void()> fn;
  {
    std::lock_guard lock(mutex_);
    if (pending_.empty()) return false;
    if (pending_.earliest() > now_) now_ = pending_.earliest();
    fn = pending_.pop();
  }
  fn();
  return true;
}

bool SimulatedClock::run_instant() {
  TimePoint instant;
  {
    std::lock_guard lock(mutex_);
    if (pending_.empty()) return false;
    instant = std::max(now_, pending_.earliest());
  }
  advance_to(instant);
  return true;
}

void SimulatedClock::advance_to(TimePoint t) {
  for (;;) {
    {
      std::lock_guard lock(mutex_);
      if (pending_.empty() || pending_.earliest() > t) {
        if (t > now_) now_ = t;
        return;
      }
    }
    run_next();
  }
}

bool SimulatedClock::idle() const {
  std::lock_guard lock(mutex_);
  return pending_.empty();
}

}  // namespace idem::sim
