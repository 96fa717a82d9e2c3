// idem::sim — simulated time.
#pragma once

#include <chrono>
#include <functional>
#include <mutex>

#include "idem/clock.hpp"
#include "idem/internal/timer_queue.hpp"

namespace idem::sim {

// 2026-01-01T00:00:00Z: where simulated time starts unless told otherwise.
inline constexpr TimePoint kSimulationStart{std::chrono::milliseconds(1767225600000)};

// A Clock whose time moves only when told to. Scheduled calls run on the thread that moves
// time, in (deadline, scheduling order) order, each seeing now() equal to its deadline, so a
// scenario replays identically on every run and under any load.
//
// Thread-safety: safe for concurrent use; calls run without the internal lock held.
class SimulatedClock final : public Clock {
 public:
  explicit SimulatedClock(TimePoint start = kSimulationStart) : now_(start) {}
  SimulatedClock(const SimulatedClock&) = delete;
  SimulatedClock& operator=(const SimulatedClock&) = delete;

  TimePoint now() const override;
  TimerId call_at(TimePoint at, std::function<void()> fn) override;
  void cancel(TimerId id) override;

  // Runs the earliest pending call, first moving now() to its deadline (never backwards).
  // Returns false, changing nothing, if no call is pending.
  bool run_next();

  // Moves now() to the earliest deadline and runs every call due by then, so events at
  // the same instant happen together. Returns false if no call is pending.
  bool run_instant();

  // Moves time to `t` (no-op if t is not later), running every call due by then.
  void advance_to(TimePoint t);
  void advance(std::chrono::milliseconds d) { advance_to(now() + d); }

  bool idle() const;  // no call pending

 private:
  mutable std::mutex mutex_;
  TimePoint now_;       // guarded by mutex_
  TimerQueue pending_;  // guarded by mutex_; ties keep their scheduling order
};

}  // namespace idem::sim
