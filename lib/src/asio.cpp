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
// The timer never expires on its own; wake() moves its expiry to the past, which both
// completes a pending wait and makes a later wait complete at once. Every use of the
// timer is under mutex_, so wake() from another thread cannot race the coroutine.
class AsyncWaiter final : public detail::Waiter, public std::enable_shared_from_this<AsyncWaiter> {
 public:
  explicit AsyncWaiter(const net::any_io_executor& ex)
      : timer_(ex, net::steady_timer::time_point::max()) {}

  void wake() override {
    std::lock_guard lock(mutex_);
    timer_.expires_at(net::steady_timer::time_point::min());
  }

  net::awaitable<void> wait_until(Clock& clock, TimePoint at) {
    const Clock::TimerId id = clock.call_at(at, [weak = weak_from_this()] {
      if (auto self = weak.lock()) self->wake();
    });
    // A wake cancels the wait (operation_aborted): that is the signal, not an error.
    boost::system::error_code ec;
    auto token = net::redirect_error(net::use_awaitable, ec);
    co_await net::async_initiate<decltype(token), void(boost::system::error_code)>(
        [this](auto handler) {
          std::lock_guard lock(mutex_);
          timer_.async_wait(std::move(handler));
        },
        token);
    clock.cancel(id);
  }

 private:
  std::mutex mutex_;
  net::steady_timer timer_;  // guarded by mutex_
};

}  // namespace

net::awaitable<void> async_sleep_until(Clock& clock, TimePoint at) {
  auto waiter = std::make_shared<AsyncWaiter>(co_await net::this_coro::executor);
  co_await waiter->wait_until(clock, at);
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
    auto waiter = std::make_shared<AsyncWaiter>(co_await net::this_coro::executor);
    const std::optional<TimePoint> wake = d.plan_wait(c, s, give_up, poll, waiter);
    if (!wake) continue;
    if (*wake > d.now()) co_await waiter->wait_until(*d.clock, *wake);
    d.inflight.unsubscribe(c.id, waiter);
  }
}

}  // namespace idem
