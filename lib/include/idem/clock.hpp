// idem — the injectable clock.
//
// Every source of time in idem (leases, TTLs, waits, polling backoff, heartbeats) goes
// through one Clock, so tests and the demo can run on simulated time
// (idem::sim::SimulatedClock) and production on SystemClock.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

namespace idem {

// Milliseconds since the Unix epoch: the unit of every time idem stores.
using TimePoint = std::chrono::sys_time<std::chrono::milliseconds>;

// Thread-safety: implementations must be safe to call from any thread.
class Clock {
 public:
  using TimerId = std::uint64_t;

  virtual ~Clock() = default;

  virtual TimePoint now() const = 0;

  // Calls `fn` once, when this clock has reached `at`, unless cancel(id) came first.
  // `fn` runs on the thread that drives the clock (SystemClock: its timer thread;
  // SimulatedClock: the thread that advances it), never inside call_at itself, and must
  // not block for long. Returns an id for cancel(); ids are never 0.
  virtual TimerId call_at(TimePoint at, std::function<void()> fn) = 0;

  // Forgets a pending call. No effect if it already ran or was cancelled. A call that is
  // running concurrently is not waited for.
  virtual void cancel(TimerId id) = 0;
};

// The pending calls of a clock, in (deadline, scheduling order) order. Not thread-safe:
// its owner's lock guards it. Shared by SystemClock and idem::sim::SimulatedClock.
class TimerQueue {
 public:
  using TimerId = Clock::TimerId;

  TimerId add(TimePoint at, std::function<void()> fn);
  void cancel(TimerId id);  // no effect if it is not pending
  bool empty() const noexcept { return pending_.empty(); }
  TimePoint earliest() const;  // requires !empty()
  // Removes and returns the earliest call (requires !empty()).
  std::function<void()> pop();

 private:
  std::map<std::pair<TimePoint, TimerId>, std::function<void()>> pending_;
  std::map<TimerId, TimePoint> deadline_of_;
  TimerId next_id_ = 1;
};

// Blocks the calling thread until `clock` reaches `at` (through call_at, so it works on a
// simulated clock as long as another thread advances it).
void sleep_until(Clock& clock, TimePoint at);

// Wall-clock time (std::chrono::system_clock) with one timer thread, started on the first
// call_at and joined by the destructor.
class SystemClock final : public Clock {
 public:
  SystemClock() = default;
  ~SystemClock() override;
  SystemClock(const SystemClock&) = delete;
  SystemClock& operator=(const SystemClock&) = delete;

  TimePoint now() const override;
  TimerId call_at(TimePoint at, std::function<void()> fn) override;
  void cancel(TimerId id) override;

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable cv_;
  TimerQueue pending_;    // guarded by mutex_
  bool stopping_ = false;  // guarded by mutex_
  // Guarded by mutex_: when the timer thread will next wake on its own. call_at() only
  // signals it for an earlier deadline, so a steady stream of later ones (heartbeats)
  // costs no wake-up.
  TimePoint wakes_at_ = TimePoint::max();
  std::thread thread_;                          // started under mutex_
};

}  // namespace idem
