#include "idem/asio.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <atomic>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/execution/outstanding_work.hpp>
#include <boost/asio/execution_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/prefer.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <cerrno>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include "attempt.hpp"
#include "awaiting.hpp"
#include "core.hpp"
#include "drive.hpp"
#include "idem/errors.hpp"
#include "maintenance_jobs.hpp"

namespace idem {
namespace {

namespace net = boost::asio;

// A suspended coroutine that a completion (any thread) or a clock deadline wakes.
//
// No I/O reactor takes part: the wait parks the coroutine's continuation in a small shared
// Handle, and a wake posts it to the coroutine's executor. A wake that comes before the wait
// is not lost (the next wait returns at once); each wait forgets wakes when it ends. A parked
// coroutine still counts as work of its io_context (co_spawn holds work for a coroutine's
// whole life), so run() does not return under a waiting call. Other threads reach the wait only
// through the Handle (the in-flight registry and the clock keep it), so a late wake finds nothing
// parked and touches nothing. If the io_context shuts down with continuations parked, its
// ParkedWaits service destroys them, as the context destroys its own pending operations.
class AsyncWaiter {
 public:
  explicit AsyncWaiter(const net::any_io_executor& ex) : handle_(std::make_shared<Handle>(ex)) {}
  AsyncWaiter(const AsyncWaiter&) = delete;
  AsyncWaiter& operator=(const AsyncWaiter&) = delete;

  // What the in-flight registry wakes.
  std::shared_ptr<detail::Waiter> handle() const { return handle_; }

  net::awaitable<void> wait_until(Clock& clock, TimePoint at) {
    const Clock::TimerId id = clock.call_at(at, [handle = handle_] { handle->wake(); });
    co_await net::async_initiate<decltype(net::use_awaitable), void()>(
        [this](auto handler) { handle_->park(std::move(handler)); }, net::use_awaitable);
    clock.cancel(id);
    handle_->forget_wakes();
  }

 private:
  class ParkedWaits;

  struct Handle final : detail::Waiter, std::enable_shared_from_this<Handle> {
    explicit Handle(const net::any_io_executor& ex);

    void wake() override {
      std::lock_guard lock(mutex);
      if (!parked) {
        woken = true;
        return;
      }
      // Posted under the mutex, and unregistered only once posted: the continuation may
      // finish its coroutine and let run() return before post() is done with the context,
      // and an io_context destroyed meanwhile waits in ParkedWaits::shutdown (abandon() takes
      // this mutex) until it is.
      std::exchange(parked, nullptr)();  // posts the continuation to its executor
      unregister();
    }

    template <typename Handler>
    void park(Handler handler) {
      auto h = std::make_shared<Handler>(std::move(handler));
      std::unique_lock lock(mutex);
      if (woken) {
        woken = false;
        lock.unlock();
        net::post(std::move(*h));
        return;
      }
      parked = [h] { net::post(std::move(*h)); };
      enlist();
    }

    void forget_wakes() {
      std::lock_guard lock(mutex);
      woken = false;
    }

    // For ParkedWaits::shutdown: takes the parked continuation out, to be destroyed unrun.
    std::function<void()> abandon() {
      std::lock_guard lock(mutex);
      return std::exchange(parked, nullptr);
    }

    void enlist();      // requires mutex held
    void unregister();  // requires mutex held

    ParkedWaits& waits;
    std::mutex mutex;
    bool woken = false;            // guarded by mutex
    std::function<void()> parked;  // guarded by mutex: posts the parked continuation
  };

  // One per io_context: the Handles with a continuation parked. Locked after a Handle's
  // mutex, never before.
  class ParkedWaits final : public net::execution_context::service {
   public:
    static inline net::execution_context::id id;
    explicit ParkedWaits(net::execution_context& context) : service(context) {}

    void add(std::shared_ptr<Handle> h) {
      std::lock_guard lock(mutex_);
      Handle* const at = h.get();
      parked_.emplace(at, std::move(h));
    }
    void remove(Handle* h) {
      std::lock_guard lock(mutex_);
      parked_.erase(h);
    }

   private:
    void shutdown() override {
      std::unordered_map<Handle*, std::shared_ptr<Handle>> parked;
      {
        std::lock_guard lock(mutex_);
        parked.swap(parked_);
      }
      // Destroying a continuation destroys its coroutine's frames (and their waiters); the
      // map keeps each Handle alive meanwhile.
      for (const auto& [at, h] : parked) {
        std::function<void()> unrun = h->abandon();
      }
    }

    std::mutex mutex_;
    std::unordered_map<Handle*, std::shared_ptr<Handle>> parked_;  // guarded by mutex_
  };

  std::shared_ptr<Handle> handle_;
};

AsyncWaiter::Handle::Handle(const net::any_io_executor& ex)
    : waits(net::use_service<ParkedWaits>(net::query(ex, net::execution::context))) {}

void AsyncWaiter::Handle::enlist() { waits.add(shared_from_this()); }
void AsyncWaiter::Handle::unregister() { waits.remove(this); }

// A round's batch in the store (Store::start_apply), waited for by the io_context's reactor
// on the store's socket, until the batch is done or its deadline (PendingApply::deadline)
// passes: then the batch is failed, and the store drops its stalled connection. It waits on a
// duplicate of the descriptor, so closing its own never closes the store's, and follows the
// store to a new one if the batch moved connection (told by the socket's identity, not its
// number: a reconnection gets the closed socket's number back).
class SocketWait : public std::enable_shared_from_this<SocketWait> {
 public:
  // Throws std::system_error if the descriptor cannot be duplicated or registered.
  static void start(const net::any_io_executor& ex, PendingApply& pending,
                    std::function<void()> finished) {
    auto w = std::make_shared<SocketWait>(ex, pending, std::move(finished));
    std::lock_guard lock(w->mutex_);
    w->watch();
    w->arm();
    w->arm_deadline();
  }

  SocketWait(const net::any_io_executor& ex, PendingApply& pending, std::function<void()> finished)
      : socket_(ex), timer_(ex), pending_(pending), finished_(std::move(finished)) {}

 private:
  // Requires mutex_. (Again when the batch's next pipeline moved its deadline.)
  void arm_deadline() {
    const auto at = pending_.deadline();
    if (at == armed_deadline_ || at == std::chrono::steady_clock::time_point::max()) return;
    armed_deadline_ = at;
    timer_.expires_at(at);
    timer_.async_wait(
        [self = shared_from_this()](const boost::system::error_code& ec) { self->expired(ec); });
  }

  void expired(const boost::system::error_code& ec) {
    if (ec) return;  // cancelled: done, or a later deadline armed
    std::unique_lock lock(mutex_);
    if (ended_ || pending_.done()) return;
    if (std::chrono::steady_clock::now() < pending_.deadline()) {
      arm_deadline();  // the deadline moved meanwhile
      return;
    }
    pending_.fail(std::make_exception_ptr(
        StoreError("idem: the store did not answer a batch by its deadline", 0)));
    end(lock);
  }

  // Requires mutex_ (released here): the wait is over.
  void end(std::unique_lock<std::mutex>& lock) {
    ended_ = true;
    boost::system::error_code ignored;
    timer_.cancel(ignored);
    socket_.close(ignored);
    lock.unlock();
    finished_();
  }

  void watch() {
    const int fd = ::dup(pending_.descriptor());
    if (fd < 0) throw std::system_error(errno, std::generic_category(), "dup");
    watched_ = identity(fd);
    boost::system::error_code ec;
    socket_.close(ec);
    socket_.assign(fd, ec);
    if (ec) {
      ::close(fd);
      throw std::system_error(ec.value(), std::generic_category(), "watching the store");
    }
  }

  // Requires mutex_. The reactor reports a descriptor when it becomes readable
  // (edge-triggered), and only to a wait already queued: a report that came first (taken by
  // another thread running the io_context) is lost. So once the wait is queued, a descriptor
  // that is readable already cancels it, and its handler looks at once.
  void arm() {
    socket_.async_wait(
        net::posix::stream_descriptor::wait_read,
        [self = shared_from_this()](const boost::system::error_code& ec) { self->ready(ec); });
    if (readable(socket_.native_handle())) {
      boost::system::error_code ignored;
      socket_.cancel(ignored);
    }
  }

  void ready(const boost::system::error_code& ec) {
    std::unique_lock lock(mutex_);
    if (ended_) return;  // the deadline ended it
    if (ec && ec != net::error::operation_aborted) {
      pending_.fail(std::make_exception_ptr(
          StoreError(fmt::format("idem: waiting for the store failed: {}", ec.message()), 0)));
    } else {
      // The store may not take all that waits in one advance(): take until nothing is left,
      // so the next report comes with new data.
      do {
        pending_.advance();
      } while (!pending_.done() && readable(pending_.descriptor()));
    }
    if (!pending_.done()) {
      try {
        if (identity(pending_.descriptor()) != watched_) watch();
        arm();
        arm_deadline();
        return;
      } catch (...) {
        pending_.fail(std::current_exception());
      }
    }
    end(lock);
  }

  // Which open socket `fd` is ({0, 0} if none).
  static std::pair<dev_t, ino_t> identity(int fd) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) return {0, 0};
    return {st.st_dev, st.st_ino};
  }

  static bool readable(int fd) {
    pollfd p{fd, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }

  // Serialises the socket's and the batch's use between the thread that arms a wait and
  // the one that runs its handler (an io_context may be run by several threads).
  std::mutex mutex_;
  net::posix::stream_descriptor socket_;
  net::steady_timer timer_;
  PendingApply& pending_;
  std::function<void()> finished_;
  std::pair<dev_t, ino_t> watched_{};  // identity() of the store's socket socket_ duplicates
  std::chrono::steady_clock::time_point armed_deadline_{};
  bool ended_ = false;  // guarded by mutex_: finished_ ran
};

// Runs `f`, a call into the coordinator's store, and returns what it returns (or rethrows
// what it throws): on the coordinator's store threads when the store may wait on a network
// (Store::remote()), the coroutine resuming on its own executor afterwards; right here
// otherwise (SqliteStore: a call waits only for the disk and for other processes' locks).
template <class T, class F>
net::awaitable<T> store_call(detail::CoordinatorCore& core, F f) {
  if (!core.store->remote()) co_return f();
  std::optional<T> result;
  std::exception_ptr failure;
  co_await net::async_initiate<decltype(net::use_awaitable), void()>(
      [&](auto handler) {
        auto resume = std::make_shared<decltype(handler)>(std::move(handler));
        // The io_context keeps work while the call runs elsewhere: its coroutine resumes on it.
        const auto work = net::prefer(net::get_associated_executor(*resume),
                                      net::execution::outstanding_work.tracked);
        core.store_threads.post([&, resume, work] {
          try {
            result.emplace(f());
          } catch (...) {
            failure = std::current_exception();
          }
          net::post(std::move(*resume));
        });
      },
      net::use_awaitable);
  if (failure) std::rethrow_exception(failure);
  co_return std::move(*result);
}

// A suspended coroutine's continuation (an async_initiate handler) as a call that resumes it
// at once, where it may run in place (true), or in a handler of its own (false).
template <class Handler>
std::function<void(bool)> resumer(std::shared_ptr<Handler> resume) {
  return [resume = std::move(resume)](bool now) {
    if (now) {
      net::dispatch(std::move(*resume));
    } else {
      net::post(std::move(*resume));
    }
  };
}

// Calls resume(i, true) for each i below n, in turn. If a continuation throws out of it (on a
// strand, a handler dispatched in place lets what its completion handler rethrew out; the
// io_context's own executor keeps it for run()), the ones after it resume in handlers of their
// own (resume(i, false)) and this rethrows, out of the handler that resumed them.
template <class Resume>
void resume_in_turn(std::size_t n, Resume resume) {
  std::size_t next = 0;
  try {
    while (next < n) resume(next++, true);
  } catch (...) {
    while (next < n) resume(next++, false);
    throw;
  }
}

// The reads of the calls on one io_context that become ready in the same turn, made together:
// the first reader posts a batch to its executor, and every read queued before the batch runs
// goes to its coordinator's store in one Store::load_many() (one read transaction on
// SqliteStore, where beginning and ending a transaction is most of what a lone read costs).
// Each reader then resumes with its own answer. A read waits for nothing but its turn: it is
// made after the reader asked, never from an older snapshot. One per io_context, so a
// context's reads never wait for another context's thread; reads of several coordinators on
// one context go to each store apart.
class ReadBatches final : public net::execution_context::service {
 public:
  static inline net::execution_context::id id;
  explicit ReadBatches(net::execution_context& context) : service(context) {}

  struct Queued {
    detail::CoordinatorCore* core;
    StoreRead* read;
    std::function<void(bool)> resume;  // resumes the reader: at once (true), or posted
  };

  // Queues a read; true when the caller must post run() (no batch is posted yet).
  bool enqueue(Queued q) {
    std::lock_guard lock(mutex_);
    queued_.push_back(std::move(q));
    return !std::exchange(posted_, true);
  }

  // The posted batch: reads everything queued, then resumes each reader in turn, at once (a
  // lone reader then costs one turn of the event loop more than a read made in place, not
  // two).
  void run() {
    std::vector<Queued> batch;
    {
      std::lock_guard lock(mutex_);
      batch.swap(queued_);
      posted_ = false;
    }
    std::vector<bool> read(batch.size(), false);
    std::vector<StoreRead*> reads;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      if (read[i]) continue;
      detail::CoordinatorCore& core = *batch[i].core;
      reads.clear();
      for (std::size_t j = i; j < batch.size(); ++j) {
        if (batch[j].core != &core) continue;
        reads.push_back(batch[j].read);
        read[j] = true;
      }
      try {
        core.latency.time(detail::StoreCall::load, [&] { core.store->load_many(reads); });
      } catch (...) {  // a store that broke load_many's contract: its readers get what it threw
        for (StoreRead* r : reads) {
          if (!r->record && !r->error) r->error = std::current_exception();
        }
      }
    }
    resume_in_turn(batch.size(), [&batch](std::size_t i, bool now) { batch[i].resume(now); });
  }

 private:
  void shutdown() override {
    std::vector<Queued> unread;
    {
      std::lock_guard lock(mutex_);
      unread.swap(queued_);
    }
    // Destroying a continuation destroys its coroutine's frames, as the context destroys its
    // own pending operations.
  }

  std::mutex mutex_;
  std::vector<Queued> queued_;  // guarded by mutex_
  bool posted_ = false;         // guarded by mutex_: run() is posted and has not taken them
};

// The record of `id`, read in its io_context's batch (ReadBatches).
net::awaitable<detail::Loaded> batched_read(detail::CoordinatorCore& core, const KeyId& id) {
  StoreRead read{&id};
  co_await net::async_initiate<decltype(net::use_awaitable), void()>(
      [&core, &read](auto handler) {
        const auto ex = net::get_associated_executor(handler);
        auto& batches = net::use_service<ReadBatches>(net::query(ex, net::execution::context));
        auto resumed = resumer(std::make_shared<decltype(handler)>(std::move(handler)));
        if (batches.enqueue({&core, &read, std::move(resumed)}))
          net::post(ex, [&batches] { batches.run(); });
      },
      net::use_awaitable);
  if (read.error) {
    // A StoreError is the flow's to judge (Loaded::error); anything else ends the call, as it
    // does when a lone load() throws it.
    try {
      std::rethrow_exception(read.error);
    } catch (const StoreError&) {
    }
  }
  co_return detail::Loaded{std::move(read.record), read.error};
}

// The event loop `ex` runs on, as the group commit knows it (GroupCommit::enqueue).
const void* context_of(const net::any_io_executor& ex) {
  return &net::query(ex, net::execution::context);
}

// The writers a round led on this thread (lead_round) committed for the io_context it runs
// on, to resume when the round is done; null outside such a round.
struct CommittedHere {
  const void* context;
  std::vector<std::function<void(bool)>> resumes;
};
thread_local CommittedHere* committed_here = nullptr;

// A posted round of the group commit: waits for the store's batch on `ex`. A store that may
// wait on a network starts the round (a connect, a batch on the main connection when every
// batch connection is busy) on the coordinator's store threads, so the io_context's thread
// never waits on it; the batch's results are waited for on `ex` all the same.
//
// A round made right here (a store that waits for nothing but its disk) resumes the writers it
// committed for this io_context once it is done, in place and in turn (as the read batch does),
// not in a handler each: that would cost every write one more turn of the event loop.
void lead_round(detail::CoordinatorCore& core, const net::any_io_executor& ex) {
  const auto lead = [&commits = core.commits, ex] {
    commits.lead(
        [&ex](PendingApply& pending, std::function<void()> finished) {
          SocketWait::start(ex, pending, std::move(finished));
        },
        context_of(ex));
  };
  if (!core.store->remote()) {
    CommittedHere here{context_of(ex), {}};
    CommittedHere* const outer = std::exchange(committed_here, &here);
    lead();  // noexcept
    committed_here = outer;
    resume_in_turn(here.resumes.size(), [&here](std::size_t i, bool now) { here.resumes[i](now); });
    return;
  }
  const auto work = net::prefer(ex, net::execution::outstanding_work.tracked);
  core.store_threads.post([lead, work] { lead(); });
}

// Posts a round to `ex`. If its io_context is destroyed with the round unrun (it was stopped),
// the group commit hears that the context has no round posted any more.
void post_round(detail::CoordinatorCore& core, const net::any_io_executor& ex) {
  struct Posted {
    detail::CoordinatorCore* core;
    net::any_io_executor ex;
    Posted(detail::CoordinatorCore& c, net::any_io_executor e) : core(&c), ex(std::move(e)) {}
    Posted(Posted&& o) noexcept : core(std::exchange(o.core, nullptr)), ex(o.ex) {}
    Posted& operator=(Posted&&) = delete;
    ~Posted() {
      if (core != nullptr) core->commits.dropped(context_of(ex));
    }
    void operator()() { lead_round(*std::exchange(core, nullptr), ex); }
  };
  net::post(ex, Posted(core, ex));
}

// Hands `op` to the coordinator's group commit and suspends until it is committed. The
// first writer to find no leader posts the lead to its executor, so every coroutine that
// becomes ready in the same turn of the io_context joins its batch.
net::awaitable<void> group_write(detail::CoordinatorCore& core, StoreOp& op) {
  using Signal = detail::GroupCommit::Signal;
  co_await net::async_initiate<decltype(net::use_awaitable), void()>(
      [&core, &op](auto handler) {
        auto ex = net::get_associated_executor(handler);
        auto resume = resumer(std::make_shared<decltype(handler)>(std::move(handler)));
        auto notify = [&core, ex, resume = std::move(resume)](Signal s) mutable {
          // Called from whichever thread ran the round: a round led right here on this
          // coroutine's io_context resumes it when done (lead_round). Otherwise work is held
          // across the post: what it posts may end the last coroutine and let run() return
          // (and the io_context be destroyed) before post() is done with the context.
          if (s == Signal::committed && committed_here != nullptr &&
              committed_here->context == context_of(ex)) {
            committed_here->resumes.push_back(std::move(resume));  // told once
            return;
          }
          const auto work = net::prefer(ex, net::execution::outstanding_work.tracked);
          if (s == Signal::committed) {
            resume(false);
          } else {
            post_round(core, ex);
          }
        };
        if (core.commits.enqueue(op, notify, context_of(ex))) post_round(core, ex);
      },
      net::use_awaitable);
}

}  // namespace

net::awaitable<void> async_sleep_until(Clock& clock, TimePoint at) {
  if (at <= clock.now()) co_return;
  AsyncWaiter waiter(co_await net::this_coro::executor);
  co_await waiter.wait_until(clock, at);
}

namespace {

// The coroutine way of performing a call's effects (drive.hpp): each suspends the call's
// coroutine until it is done.
struct AsyncEffects : detail::Awaiting {
  detail::CoordinatorCore& core;
  net::any_io_executor ex;
  std::shared_ptr<AsyncWaiter> waiting{};

  std::shared_ptr<detail::Waiter> waiter() {
    waiting = std::make_shared<AsyncWaiter>(ex);
    return waiting->handle();
  }
  // A store that may wait on a network reads on the coordinator's store threads, each read
  // apart; any other reads in its io_context's batch.
  net::awaitable<detail::Loaded> read(const KeyId& id) {
    if (!core.store->remote()) return batched_read(core, id);
    return store([&core = core, &id] { return detail::read_timed(core, id); });
  }
  template <class F>
  net::awaitable<std::invoke_result_t<F&>> store(F f) {
    return store_call<std::invoke_result_t<F&>>(core, std::move(f));
  }
  net::awaitable<void> write(StoreOp& op) { return group_write(core, op); }
  net::awaitable<void> sleep(TimePoint until) { return waiting->wait_until(*core.clock, until); }
};

template <class Action>
net::awaitable<Outcome> async_drive(Coordinator& coordinator, const Request& request,
                                    const Action& action) {
  detail::CoordinatorCore& core = detail::CoordinatorAccess::core(coordinator);
  const net::any_io_executor ex = co_await net::this_coro::executor;
  co_return co_await detail::drive(core, request, action, AsyncEffects{{}, core, ex});
}

}  // namespace

net::awaitable<Outcome> async_call(Coordinator& coordinator, Request request, AsyncAction action) {
  co_return co_await async_drive(coordinator, request, action);
}

net::awaitable<Outcome> async_call_steps(Coordinator& coordinator, Request request,
                                         AsyncStepsAction action) {
  co_return co_await async_drive(coordinator, request, action);
}

net::awaitable<std::string> async_external(Attempt& attempt, std::string step,
                                           AsyncExternalCall call, AsyncLookup lookup) {
  detail::CoordinatorCore& core = AttemptAccess::core(attempt);
  const net::any_io_executor ex = co_await net::this_coro::executor;
  co_return co_await detail::external_step(attempt, step, call, lookup, AsyncEffects{{}, core, ex});
}

net::awaitable<std::string> async_local(Attempt& attempt, std::string step,
                                        Attempt::LocalWork work) {
  co_return co_await store_call<std::string>(AttemptAccess::core(attempt),
                                             [&] { return attempt.local(step, work); });
}

// --- Maintenance -------------------------------------------------------------------------

struct Maintenance::Impl : detail::MaintenanceJobs<AsyncEffects, AsyncStepsAction> {
  using MaintenanceJobs::MaintenanceJobs;
};

Maintenance::Maintenance(Coordinator& coordinator, MaintenanceOptions options)
    : impl_(std::make_shared<Impl>(coordinator, std::move(options))) {}

Maintenance::~Maintenance() { stop(); }

void Maintenance::resume(std::string operation, AsyncStepsAction action) {
  impl_->resume(std::move(operation), std::move(action));
}

void Maintenance::deliver(Delivery delivery) { impl_->deliver(std::move(delivery)); }

net::awaitable<MaintenanceReport> Maintenance::run_once() {
  // (named first: g++ 12 destroys a temporary with a destructor inside co_await twice)
  AsyncEffects perform{{}, impl_->core(), co_await net::this_coro::executor};
  co_return co_await impl_->run_once(std::move(perform));
}

void Maintenance::start(const net::any_io_executor& executor) {
  net::co_spawn(executor, Impl::loop(impl_, AsyncEffects{{}, impl_->core(), executor}),
                net::detached);
}

void Maintenance::stop() noexcept { impl_->stop(); }

MaintenanceReport Maintenance::totals() const { return impl_->totals_now(); }

}  // namespace idem
