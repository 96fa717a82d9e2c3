#include "idem/clock.hpp"

namespace idem {

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

SystemClock::~SystemClock() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();  // whatever it waits for
  if (thread_.joinable()) thread_.join();
}

TimePoint SystemClock::now() const {
  return std::chrono::time_point_cast<std::chrono::milliseconds>(std::chrono::system_clock::now());
}

Clock::TimerId SystemClock::call_at(TimePoint at, std::function<void()> fn) {
  std::lock_guard lock(mutex_);
  const TimerId id = pending_.add(at, std::move(fn));
  if (!thread_.joinable()) {
    thread_ = std::thread([this] { run(); });
  } else if (at < wakes_at_) {
    cv_.notify_one();
  }
  return id;
}

void SystemClock::cancel(TimerId id) {
  std::lock_guard lock(mutex_);
  pending_.cancel(id);
}

void SystemClock::run() {
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    if (pending_.empty()) {
      wakes_at_ = TimePoint::max();
      cv_.wait(lock);
      continue;
    }
    const TimePoint due = pending_.earliest();
    if (now() < due) {
      // Wait on the system clock itself, so a deadline is met in wall time.
      wakes_at_ = due;
      cv_.wait_until(lock, std::chrono::system_clock::time_point(due));
      continue;
    }
    wakes_at_ = TimePoint::min();  // running calls: it will look at pending_ again anyway
    std::function<void()> fn = pending_.pop();
    lock.unlock();
    fn();
    lock.lock();
  }
}

}  // namespace idem
