#include "idem/asio.hpp"

#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <mutex>
#include <optional>

#include "core.hpp"
#include "flow.hpp"

namespace idem {
namespace {

namespace net = boost::asio;

// A suspended coroutine that a completion (any thread) or a clock deadline wakes.
//
// The timer never expires on its own; a wake moves its expiry to the past, which both
// completes a pending wait and makes the next wait complete at once (a wake that came
// before the wait is not lost); each wait puts the expiry back when it ends. The waiter
// lives in the coroutine's frame and so does the timer: only the coroutine's own thread
// ever destroys it, while its io_context is alive. Other threads reach it through a small
// shared Handle that the waiter disconnects when it goes, so a late wake from the clock's
// thread or from a finishing request in another thread finds nothing to touch. Every use
// of the timer is under the handle's mutex.
class AsyncWaiter {
 public:
  explicit AsyncWaiter(const net::any_io_executor& ex)
      : timer_(ex, net::steady_timer::time_point::max()),
        handle_(std::make_shared<Handle>(&timer_)) {}
  ~AsyncWaiter() {
    std::lock_guard lock(handle_->mutex);
    handle_->timer = nullptr;
  }
  AsyncWaiter(const AsyncWaiter&) = delete;
  AsyncWaiter& operator=(const AsyncWaiter&) = delete;

  // What the in-flight registry wakes.
  std::shared_ptr<detail::Waiter> handle() const { return handle_; }

  net::awaitable<void> wait_until(Clock& clock, TimePoint at) {
    const Clock::TimerId id = clock.call_at(at, [handle = handle_] { handle->wake(); });
    // A wake cancels the wait (operation_aborted): that is the signal, not an error.
    boost::system::error_code ec;
    auto token = net::redirect_error(net::use_awaitable, ec);
    co_await net::async_initiate<decltype(token), void(boost::system::error_code)>(
        [this](auto handler) {
          std::lock_guard lock(handle_->mutex);
          timer_.async_wait(std::move(handler));
        },
        token);
    clock.cancel(id);
    std::lock_guard lock(handle_->mutex);
    timer_.expires_at(net::steady_timer::time_point::max());
  }

 private:
  struct Handle final : detail::Waiter {
    explicit Handle(net::steady_timer* t) : timer(t) {}
    void wake() override {
      std::lock_guard lock(mutex);
      if (timer != nullptr) timer->expires_at(net::steady_timer::time_point::min());
    }
    std::mutex mutex;
    net::steady_timer* timer;  // guarded by mutex; null once the waiter is gone
  };

  net::steady_timer timer_;
  std::shared_ptr<Handle> handle_;
};

// Hands `op` to the coordinator's group commit and suspends until it is committed. The
// first writer to find no leader posts the lead to its executor, so every coroutine that
// becomes ready in the same turn of the io_context joins its batch.
net::awaitable<void> group_write(detail::GroupCommit& commits, StoreOp& op) {
  using Signal = detail::GroupCommit::Signal;
  co_await net::async_initiate<decltype(net::use_awaitable), void()>(
      [&commits, &op](auto handler) {
        auto ex = net::get_associated_executor(handler);
        auto resume = std::make_shared<decltype(handler)>(std::move(handler));
        auto notify = [&commits, ex, resume](Signal s) {
          if (s == Signal::committed) {
            net::post(std::move(*resume));
          } else {
            net::post(ex, [&commits] { commits.lead(); });
          }
        };
        if (commits.enqueue(op, notify)) net::post(ex, [&commits] { commits.lead(); });
      },
      net::use_awaitable);
}

}  // namespace

net::awaitable<void> async_sleep_until(Clock& clock, TimePoint at) {
  if (at <= clock.now()) co_return;
  AsyncWaiter waiter(co_await net::this_coro::executor);
  co_await waiter.wait_until(clock, at);
}

// The coroutine driver of detail::Flow: the same effects as Coordinator::call, performed
// with co_await.
net::awaitable<Outcome> async_call(Coordinator& coordinator, Request request, AsyncAction action) {
  using Kind = detail::Effect::Kind;
  detail::CoordinatorCore& core = detail::CoordinatorAccess::core(coordinator);
  const net::any_io_executor ex = co_await net::this_coro::executor;
  std::optional<AsyncWaiter> waiter;
  detail::Flow flow(core, request, [&] { return waiter.emplace(ex).handle(); });
  for (;;) {
    const detail::Effect e = flow.next();
    switch (e.kind) {
      case Kind::read:
        flow.loaded(detail::read_record(*core.store, flow.id()));
        break;
      case Kind::write:
        co_await group_write(core.commits, flow.op());
        break;
      case Kind::run: {
        std::exception_ptr failure;
        try {
          // Not `flow.ran(co_await action())`: g++ 12 mishandles a co_await result passed
          // straight on as an argument (it destroys it twice).
          Response response = co_await action();
          flow.ran(std::move(response));
        } catch (...) {
          failure = std::current_exception();
        }
        if (failure) flow.failed(std::move(failure));
        break;
      }
      case Kind::sleep:
        co_await waiter->wait_until(*core.clock, e.until);
        break;
      case Kind::answer:
        co_return flow.outcome();
    }
  }
}

}  // namespace idem
