#include "idem/clock.hpp"

#include <condition_variable>
#include <mutex>
#include <thread>

#include "idem/internal/timer_queue.hpp"

namespace idem {

struct SystemClock::Timers {
  std::mutex mutex;
  std::condition_variable cv;
  TimerQueue pending;     // guarded by mutex
  bool stopping = false;  // guarded by mutex
  // Guarded by mutex: when the timer thread will next wake on its own. call_at() only
  // signals it for an earlier deadline, so a steady stream of later ones (heartbeats) costs
  // no wake-up.
  TimePoint wakes_at = TimePoint::max();
  std::thread thread;  // started under mutex by the first call_at

  void run();
};

TimerQueue::TimerId TimerQueue::add(TimePoint at, std::function<void()> fn) {
  const TimerId id = next_id_++;
  pending_.emplace(std::make_pair(at, id), std::move(fn));
  deadline_of_.emplace(id, at);
  return id;
}

void TimerQueue::cancel(TimerId id) {
  auto it = deadline_of_.find(id);
  if (it == deadline_of_.end()) return;
  pending_.erase(std::make_pair(it->second, id));
  deadline_of_.erase(it);
}

TimePoint TimerQueue::earliest() const { return pending_.begin()->first.first; }

std::function<void()> TimerQueue::pop() {
  auto first = pending_.begin();
  std::function<void()> fn = std::move(first->second);
  deadline_of_.erase(first->first.second);
  pending_.erase(first);
  return fn;
}

void sleep_until(Clock& clock, TimePoint at) {
  if (at <= clock.now()) return;
  struct Gate {
    std::mutex mutex;
    std::condition_variable cv;
    bool open = false;  // guarded by mutex
  };
  auto gate = std::make_shared<Gate>();
  clock.call_at(at, [gate] {
    std::lock_guard lock(gate->mutex);
    gate->open = true;
    gate->cv.notify_all();
  });
  std::unique_lock lock(gate->mutex);
  gate->cv.wait(lock, [&] { return gate->open; });
}

SystemClock::SystemClock() : timers_(std::make_unique<Timers>()) {}

SystemClock::~SystemClock() {
  {
    std::lock_guard lock(timers_->mutex);
    timers_->stopping = true;
  }
  timers_->cv.notify_all();  // whatever it waits for
  if (timers_->thread.joinable()) timers_->thread.join();
}

TimePoint SystemClock::now() const {
  return std::chrono::time_point_cast<std::chrono::milliseconds>(std::chrono::system_clock::now());
}

Clock::TimerId SystemClock::call_at(TimePoint at, std::function<void()> fn) {
  Timers& t = *timers_;
  std::lock_guard lock(t.mutex);
  const TimerId id = t.pending.add(at, std::move(fn));
  if (!t.thread.joinable()) {
    t.thread = std::thread([&t] { t.run(); });
  } else if (at < t.wakes_at) {
    t.cv.notify_one();
  }
  return id;
}

void SystemClock::cancel(TimerId id) {
  std::lock_guard lock(timers_->mutex);
  timers_->pending.cancel(id);
}

void SystemClock::Timers::run() {
  std::unique_lock lock(mutex);
  while (!stopping) {
    if (pending.empty()) {
      wakes_at = TimePoint::max();
      cv.wait(lock);
      continue;
    }
    const TimePoint due = pending.earliest();
    if (std::chrono::system_clock::now() < due) {
      // Wait on the system clock itself, so a deadline is met in wall time.
      wakes_at = due;
      cv.wait_until(lock, std::chrono::system_clock::time_point(due));
      continue;
    }
    wakes_at = TimePoint::min();  // running calls: it will look at pending again anyway
    std::function<void()> fn = pending.pop();
    lock.unlock();
    fn();
    lock.lock();
  }
}

}  // namespace idem
