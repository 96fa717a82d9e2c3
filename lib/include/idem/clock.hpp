// idem — the injectable clock.
//
// Every source of time in idem (leases, TTLs, waits, polling backoff, heartbeats) goes
// through one Clock, so tests and the demo can run on simulated time
// (idem::sim::SimulatedClock) and production on SystemClock.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

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

// Blocks the calling thread until `clock` reaches `at` (through call_at, so it works on a
// simulated clock as long as another thread advances it).
void sleep_until(Clock& clock, TimePoint at);

// Wall-clock time (std::chrono::system_clock) with one timer thread, started on the first
// call_at and joined by the destructor (calls still pending then never run).
// Thread-safety: safe for concurrent use.
class SystemClock final : public Clock {
 public:
  SystemClock();
  ~SystemClock() override;
  SystemClock(const SystemClock&) = delete;
  SystemClock& operator=(const SystemClock&) = delete;

  TimePoint now() const override;
  TimerId call_at(TimePoint at, std::function<void()> fn) override;
  void cancel(TimerId id) override;

 private:
  struct Timers;
  std::unique_ptr<Timers> timers_;  // the pending calls and their thread
};

}  // namespace idem
