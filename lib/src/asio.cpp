#include "idem/asio.hpp"

#include <boost/asio/async_result.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <mutex>

#include "coordinator_impl.hpp"

namespace idem {
namespace {

namespace net = boost::asio;
using Kind = Coordinator::Impl::Step::Kind;

// A suspended coroutine that a completion (any thread) or a clock deadline wakes.
//
// The timer never expires on its own; a wake moves its expiry to the past, which both
// completes a pending wait and makes a later wait complete at once. The waiter lives in the
// coroutine's frame and so does the timer: only the coroutine's own thread ever destroys it,
// while its io_context is alive. Other threads reach it through a small shared Handle that
// the waiter disconnects when it goes, so a late wake from the clock's thread or from a
// finishing request in another thread finds nothing to touch. Every use of the timer is
// under the handle's mutex.
class AsyncWaiter {
 public:
  explicit AsyncWaiter(const net::any_io_executor& ex)
      : timer_(ex, net::steady_timer::time_point::max()), handle_(std::make_shared<Handle>(&timer_)) {}
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

}  // namespace

net::awaitable<void> async_sleep_until(Clock& clock, TimePoint at) {
  AsyncWaiter waiter(co_await net::this_coro::executor);
  co_await waiter.wait_until(clock, at);
}

net::awaitable<Outcome> async_call(Coordinator& coordinator, Request request, AsyncAction action) {
  Coordinator::Impl& d = coordinator.impl();
  const Coordinator::Impl::Call c = d.prepare(request);
  const TimePoint give_up = d.now() + d.options.max_wait;
  std::chrono::milliseconds poll = d.options.poll_initial;
  bool waited = false;
  for (;;) {
    Coordinator::Impl::Step s = d.begin(c, give_up);
    switch (s.kind) {
      case Kind::replay:
        co_return std::move(s.replay);
      case Kind::unprotected: {
        // Not `Outcome{co_await action(), ...}`: g++ 12 destroys a co_await result inside a
        // braced initializer twice.
        Response response = co_await action();
        co_return Outcome{std::move(response), Outcome::Source::unprotected};
      }
      case Kind::execute: {
        Response response;
        std::exception_ptr failure;
        {
          Heartbeat heartbeat(d, c, s.token);
          try {
            response = co_await action();
          } catch (...) {
            failure = std::current_exception();
          }
        }
        if (failure) {
          d.abandon(c, s.token);
          std::rethrow_exception(failure);
        }
        co_return d.finish(c, s.token, std::move(response));
      }
      case Kind::wait:
        break;
    }
    if (!std::exchange(waited, true)) {
      bump(d.counters.waited);
      d.log(LogLevel::debug, "waiting", c, s.holder, "another request holds the key; waiting for its outcome");
    }
    AsyncWaiter waiter(co_await net::this_coro::executor);
    const std::optional<TimePoint> wake = d.plan_wait(c, s, give_up, poll, waiter.handle());
    if (!wake) continue;
    if (*wake > d.now()) co_await waiter.wait_until(*d.clock, *wake);
    d.inflight.unsubscribe(c.id, waiter.handle());
  }
}

}  // namespace idem
