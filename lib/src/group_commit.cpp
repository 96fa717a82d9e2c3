#include "group_commit.hpp"

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>

namespace idem::detail {
namespace {

// How many times a blocking leader yields its CPU, at most, waiting for its batch to grow;
// a gather that takes longer than kGatherBudget backs off (up to kMaxGatherBackoff rounds).
constexpr int kGatherYields = 8;
constexpr std::chrono::microseconds kGatherBudget{200};
constexpr int kMaxGatherBackoff = 1024;

}  // namespace

void GroupCommit::Bell::ring(Signal s) {
  rung.store(1 + static_cast<int>(s), std::memory_order_release);
  rung.notify_one();
}

GroupCommit::Signal GroupCommit::Bell::wait() {
  int r = 0;
  while ((r = rung.load(std::memory_order_acquire)) == 0) rung.wait(0, std::memory_order_acquire);
  rung.store(0, std::memory_order_relaxed);  // rung once per queued op: nobody else writes now
  return static_cast<Signal>(r - 1);
}

void GroupCommit::Pending::tell(Signal s) const {
  if (bell) {
    bell->ring(s);
  } else {
    notify(s);
  }
}

bool GroupCommit::enqueue(StoreOp& op, Notify notify) {
  std::lock_guard lock(mutex_);
  queue_.push_back(Pending{&op, std::move(notify), nullptr});
  if (committing_ || lead_posted_) return false;
  lead_posted_ = true;
  return true;
}

void GroupCommit::lead() noexcept {
  std::unique_lock lock(mutex_);
  lead_posted_ = false;
  if (committing_ || queue_.empty()) return;  // a running round hands on to the queue
  committing_ = true;
  round(lock);
}

void GroupCommit::commit(StoreOp& op) {
  thread_local const std::shared_ptr<Bell> bell = std::make_shared<Bell>();
  std::unique_lock lock(mutex_);
  queue_.push_back(Pending{&op, nullptr, bell});
  if (committing_) {
    lock.unlock();
    if (bell->wait() == Signal::committed) return;
    lock.lock();  // the round was handed to us: committing_ is ours
  } else {
    committing_ = true;
  }
  lead_blocking(lock);
  bell->wait();  // the round rang our own bell too: returns at once and resets it
}

void GroupCommit::lead_blocking(std::unique_lock<std::mutex>& lock) {
  if (last_batch_ > 1) {  // others were writing a moment ago
    if (gather_skips_ > 0) {
      --gather_skips_;
    } else {
      gather(lock);
    }
  }
  round(lock);  // our op is queued: this round commits it
}

void GroupCommit::gather(std::unique_lock<std::mutex>& lock) {
  // Let the threads that are runnable reach the queue: the writers the last round woke are on
  // their way back with their next writes. A yield with nobody else to run returns at once.
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kGatherYields && queue_.size() < last_batch_; ++i) {
    lock.unlock();
    std::this_thread::yield();
    lock.lock();
  }
  // A yield that took long gave the CPU to a thread with work of its own, not to a writer:
  // here gathering costs more than it saves. Skip it for the next rounds, twice as many each
  // time it happens again.
  if (std::chrono::steady_clock::now() - start > kGatherBudget) {
    gather_backoff_ = std::min(gather_backoff_ * 2, kMaxGatherBackoff);
    gather_skips_ = gather_backoff_;
  } else {
    gather_backoff_ = std::max(gather_backoff_ / 2, 1);
  }
}

void GroupCommit::round(std::unique_lock<std::mutex>& lock) noexcept {
  std::vector<Pending> batch;
  batch.swap(queue_);
  last_batch_ = batch.size();
  lock.unlock();
  std::vector<StoreOp*> ops;
  try {
    ops.reserve(batch.size());
    for (const Pending& p : batch) ops.push_back(p.op);
    store_.apply(ops);  // never throws by contract; a broken engine must not wedge the queue
  } catch (...) {
    for (const Pending& p : batch) {
      if (!p.op->error) p.op->error = std::current_exception();
    }
  }
  lock.lock();
  committing_ = false;
  std::optional<Pending> next_leader;
  if (!queue_.empty()) {
    // Hand on: to a waiting thread if there is one (it needs no event loop), else to the
    // first coroutine, unless a round is already posted.
    const auto next = std::find_if(queue_.begin(), queue_.end(),
                                   [](const Pending& p) { return p.bell != nullptr; });
    if (next != queue_.end()) {
      committing_ = true;
      next_leader = *next;
    } else if (!lead_posted_) {
      lead_posted_ = true;
      next_leader = queue_.front();
    }
  }
  lock.unlock();
  // The next leader first: the round after this one waits for nobody else.
  if (next_leader) next_leader->tell(Signal::lead);
  for (const Pending& p : batch) p.tell(Signal::committed);
}

}  // namespace idem::detail
