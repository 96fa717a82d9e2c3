// idem (internal) — the pending calls of a Clock: SystemClock and the simulator's
// SimulatedClock keep theirs in one. Not installed; not part of the API.
#pragma once

#include <functional>
#include <map>
#include <utility>

#include "idem/clock.hpp"

namespace idem {

// Pending calls in (deadline, scheduling order) order: ties keep the order they were added
// in. Not thread-safe: its owner's lock guards it.
class TimerQueue {
 public:
  using TimerId = Clock::TimerId;

  TimerId add(TimePoint at, std::function<void()> fn);  // ids start at 1 and never repeat
  void cancel(TimerId id);                              // no effect if it is not pending
  bool empty() const noexcept { return pending_.empty(); }
  TimePoint earliest() const;  // requires !empty()
  // Removes and returns the earliest call (requires !empty()).
  std::function<void()> pop();

 private:
  std::map<std::pair<TimePoint, TimerId>, std::function<void()>> pending_;
  std::map<TimerId, TimePoint> deadline_of_;
  TimerId next_id_ = 1;
};

}  // namespace idem
