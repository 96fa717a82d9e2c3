#include "group_commit.hpp"

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <optional>
#include <thread>

#include "idem/errors.hpp"

namespace idem::detail {
namespace {

// How many times a blocking leader yields its CPU, at most, waiting for its batch to grow;
// a gather that takes longer than kGatherBudget backs off (up to kMaxGatherBackoff rounds).
// What gathering buys (scripts/bench --only calls, 2026-12-02, two runs with it and two with
// lead_blocking() never gathering, 2 cores, 8 blocking threads, synchronous=normal): with it
// 35,700 and 34,600 calls/s, p99 615 and 980 us; without it 25,100 and 31,900 calls/s, p99
// 3,840 and 3,940 us. Under synchronous=full the runs overlap (14,200 to 16,200 calls/s with
// it, 12,600 to 15,700 without): the fsync, not the batch, bounds them there. The back-off
// after a slow yield is for a leader sharing its CPU with other work (scripts/bench's "8
// threads, both CPUs busy with other work", threads_busy_fresh_calls_per_s; --quick --only
// calls, 2026-12-02, three runs each, alternated): with it 8,300, 7,400 and 7,900 calls/s,
// without it 900, 850 and 970: each gather then waits out the busy threads' time slices.
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

bool GroupCommit::enqueue(StoreOp& op, Notify notify, const void* context) {
  std::lock_guard lock(mutex_);
  queue_.push_back(Pending{&op, std::move(notify), nullptr, context});
  if (rounds_ >= max_rounds_ || std::ranges::find(posted_, context) != posted_.end()) return false;
  posted_.push_back(context);
  return true;
}

void GroupCommit::dropped(const void* context) noexcept {
  std::lock_guard lock(mutex_);
  std::erase(posted_, context);
}

std::size_t GroupCommit::rounds_running() {
  std::lock_guard lock(mutex_);
  return rounds_;
}

std::size_t GroupCommit::queued() {
  std::lock_guard lock(mutex_);
  return queue_.size();
}

void GroupCommit::lead(const Drive& drive, const void* context) noexcept {
  std::unique_lock lock(mutex_);
  std::erase(posted_, context);
  if (rounds_ >= max_rounds_) return;  // a running round hands on
  // Waiting on this event loop for a network store, the round takes this loop's writes only
  // (the rule is in group_commit.hpp).
  const std::optional<const void*> only =
      store_.remote() ? std::optional<const void*>(context) : std::nullopt;
  const auto mine = static_cast<std::size_t>(
      std::ranges::count_if(queue_, [only](const Pending& p) { return takes(p, nullptr, only); }));
  if (mine == 0) {  // nothing of this loop's is queued now: hand on whatever is left
    const std::optional<Pending> next_leader = hand_on();
    lock.unlock();
    if (next_leader) next_leader->tell(Signal::lead);
    return;
  }
  ++rounds_;
  // With connections to spare, a round takes its share of the queue and the rest goes out
  // at once on another: while the database works on one batch, the event loop runs the
  // calls the other one answered, which queue the next (double buffering).
  const std::size_t free = max_rounds_ - rounds_ + 1;  // this round's included
  const std::shared_ptr<Round> r = take(lock, (mine + free - 1) / free, nullptr, only);
  try {
    r->pending = store_.start_apply(r->ops);
  } catch (...) {  // start_apply never throws by contract; a broken engine must not wedge us
    for (StoreOp* op : r->ops) op->error = std::current_exception();
    finish(*r);
    return;
  }
  if (!r->pending) {
    apply(*r);
  } else if (!r->pending->done()) {
    // The round is told once; a wait destroyed before it finishes gives back its count.
    struct Once {
      Once(GroupCommit* s, std::shared_ptr<Round> r) : self(s), round(std::move(r)) {}
      Once(const Once&) = delete;
      Once& operator=(const Once&) = delete;
      ~Once() {
        if (!told) self->abandon(*round);
      }
      GroupCommit* self;
      std::shared_ptr<Round> round;
      bool told = false;
    };
    if (drive) {
      auto once = std::make_shared<Once>(this, r);
      try {
        drive(*r->pending, [once] {
          once->told = true;
          once->self->finish(*once->round);
        });
        return;
      } catch (...) {  // cannot wait on it there: finish the batch here
        once->told = true;
      }
    }
    wait_blocking(*r->pending);
  }
  finish(*r);
}

void GroupCommit::wait_blocking(PendingApply& pending) noexcept {
  using std::chrono::steady_clock;
  while (!pending.done()) {
    // Until the batch's deadline, as SocketWait waits: a connection that stays open and says
    // nothing must not hold this thread (and the round's writers) for ever.
    const steady_clock::time_point deadline = pending.deadline();
    int timeout_ms = -1;
    if (deadline != steady_clock::time_point::max()) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(deadline - steady_clock::now());
      if (left.count() <= 0) {
        pending.fail(std::make_exception_ptr(
            StoreError("idem: the store did not answer a batch by its deadline", 0)));
        return;
      }
      timeout_ms = static_cast<int>(std::min<std::int64_t>(left.count(), 60'000));  // fits an int
    }
    pollfd p{pending.descriptor(), POLLIN, 0};
    const int ready = ::poll(&p, 1, timeout_ms);
    if (ready < 0 && errno != EINTR) {
      pending.fail(
          std::make_exception_ptr(StoreError("idem: cannot wait for the store's connection", 0)));
    } else if (ready > 0) {
      pending.advance();
    }
  }
}

void GroupCommit::commit(StoreOp& op) {
  thread_local const std::shared_ptr<Bell> bell = std::make_shared<Bell>();
  std::unique_lock lock(mutex_);
  queue_.push_back(Pending{&op, nullptr, bell});
  if (rounds_ >= max_rounds_) {
    lock.unlock();
    if (bell->wait() == Signal::committed) return;
    lock.lock();  // the round was handed to us: it is counted for us, our entry marked
  } else {
    ++rounds_;
    queue_.back().leading = true;
  }
  lead_blocking(lock, bell.get());
  bell->wait();  // the round rang our own bell too: returns at once and resets it
}

void GroupCommit::lead_blocking(std::unique_lock<std::mutex>& lock, const Bell* own) {
  if (last_batch_ > 1) {  // others were writing a moment ago
    if (gather_skips_ > 0) {
      --gather_skips_;
    } else {
      gather(lock);
    }
  }
  round(lock, own);  // our op is queued: this round commits it
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

bool GroupCommit::takes(const Pending& p, const Bell* own, std::optional<const void*> only) {
  if (p.leading && p.bell.get() != own) return false;  // another thread's round takes it
  return !only || (p.bell == nullptr && p.context == *only);
}

std::shared_ptr<GroupCommit::Round> GroupCommit::take(std::unique_lock<std::mutex>& lock,
                                                      std::size_t most, const Bell* own,
                                                      std::optional<const void*> only) {
  auto r = std::make_shared<Round>();
  std::vector<Pending> rest;
  for (Pending& p : queue_) {
    if (takes(p, own, only) && r->batch.size() < most) {
      r->batch.push_back(std::move(p));
    } else {
      rest.push_back(std::move(p));
    }
  }
  queue_.swap(rest);
  last_batch_ = r->batch.size();
  const std::optional<Pending> next_leader = hand_on();
  lock.unlock();
  if (next_leader) next_leader->tell(Signal::lead);
  r->ops.reserve(r->batch.size());
  for (const Pending& p : r->batch) r->ops.push_back(p.op);
  if (latency_ != nullptr) {
    latency_->batch.observe(r->batch.size());
    r->started = std::chrono::steady_clock::now();
  }
  if (clock_ != nullptr) {
    const TimePoint now = clock_->now();
    for (StoreOp* op : r->ops) {
      const auto waited = now - op->now;
      if (waited.count() <= 0) continue;
      op->now += waited;
      if (op->lease_until != TimePoint{}) op->lease_until += waited;
      if (op->expires_at != TimePoint{}) op->expires_at += waited;
    }
  }
  return r;
}

std::optional<GroupCommit::Pending> GroupCommit::hand_on() {
  if (queue_.empty() || rounds_ >= max_rounds_) return std::nullopt;
  // To a waiting thread if there is one (it needs no event loop), else to the first
  // coroutine whose event loop has no round posted yet (one that has will run it).
  const auto next = std::find_if(queue_.begin(), queue_.end(),
                                 [](const Pending& p) { return p.bell != nullptr && !p.leading; });
  if (next != queue_.end()) {
    ++rounds_;
    next->leading = true;
    return *next;
  }
  const auto coroutine = std::find_if(queue_.begin(), queue_.end(), [this](const Pending& p) {
    return p.bell == nullptr && std::ranges::find(posted_, p.context) == posted_.end();
  });
  if (coroutine == queue_.end()) return std::nullopt;  // threads that lead, or posted rounds
  posted_.push_back(coroutine->context);
  return *coroutine;
}

void GroupCommit::apply(Round& r) noexcept {
  try {
    store_.apply(r.ops);  // never throws by contract; a broken engine must not wedge the queue
  } catch (...) {
    for (StoreOp* op : r.ops) {
      if (!op->error) op->error = std::current_exception();
    }
  }
}

void GroupCommit::round(std::unique_lock<std::mutex>& lock, const Bell* own) noexcept {
  const std::shared_ptr<Round> r = take(lock, queue_.size(), own);
  apply(*r);
  finish(*r);
}

void GroupCommit::finish(Round& r) noexcept {
  if (latency_ != nullptr) latency_->of(StoreCall::apply).observe_since(r.started);
  std::unique_lock lock(mutex_);
  --rounds_;
  const std::optional<Pending> next_leader = hand_on();
  lock.unlock();
  // The next leader first: the round after this one waits for nobody else.
  if (next_leader) next_leader->tell(Signal::lead);
  for (const Pending& p : r.batch) p.tell(Signal::committed);
}

void GroupCommit::abandon(Round& r) noexcept {
  const std::exception_ptr gone = std::make_exception_ptr(
      StoreError("idem: the event loop that waited for this write's batch went away; whether "
                 "it committed is unknown",
                 0));
  for (const Pending& p : r.batch) {
    if (p.bell) p.op->error = gone;  // a coroutine's op went with its io_context
  }
  std::unique_lock lock(mutex_);
  --rounds_;
  const std::optional<Pending> next_leader = hand_on();
  lock.unlock();
  if (next_leader) next_leader->tell(Signal::lead);
  for (const Pending& p : r.batch) {
    if (p.bell) p.bell->ring(Signal::committed);
  }
}

}  // namespace idem::detail
