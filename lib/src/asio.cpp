#include "idem/asio.hpp"

#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/post.hpp>
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

// Queues `op` with the coordinator's other pending writes and suspends until the batch it
// joined is committed. The first writer of a batch posts the flush, so every coroutine that
// becomes ready in the same turn of the io_context joins it.
net::awaitable<void> write(Coordinator::Impl& d, StoreOp& op) {
  co_await net::async_initiate<decltype(net::use_awaitable), void()>(
      [&d, &op](auto handler) {
        auto ex = net::get_associated_executor(handler);
        auto shared = std::make_shared<decltype(handler)>(std::move(handler));
        if (d.queue_write(op, [shared]() mutable { net::post(std::move(*shared)); })) {
          net::post(ex, [&d] { d.flush_writes(); });
        }
      },
      net::use_awaitable);
}

}  // namespace

net::awaitable<void> async_sleep_until(Clock& clock, TimePoint at) {
  if (at <= clock.now()) co_return;
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
    const TimePoint t = d.now();
    std::optional<Coordinator::Impl::Step> s = d.look(c, t, give_up);
    if (!s) {
      StoreOp op = d.reserve_op(c, t);
      co_await write(d, op);
      s.emplace(d.reserved(c, op, t, give_up));
    }
    switch (s->kind) {
      case Kind::replay:
        co_return std::move(s->replay);
      case Kind::unprotected: {
        // Not `Outcome{co_await action(), ...}`: g++ 12 destroys a co_await result inside a
        // braced initializer twice.
        Response response = co_await action();
        co_return Outcome{std::move(response), Outcome::Source::unprotected};
      }
      case Kind::execute: {
        const std::int64_t token = s->token;
        Response response;
        std::exception_ptr failure;
        {
          Heartbeat heartbeat(d, c, token);
          try {
            response = co_await action();
          } catch (...) {
            failure = std::current_exception();
          }
        }
        if (failure) {
          d.abandon(c, token);
          std::rethrow_exception(failure);
        }
        if (token == 0) co_return d.finish_unreserved(c, std::move(response));
        Coordinator::Impl::Completion done;
        if (!d.prepare_completion(c, token, response, done)) {
          co_return Outcome{std::move(response), Outcome::Source::executed};
        }
        co_await write(d, done.op);
        co_return d.completed(c, token, done, std::move(response));
      }
      case Kind::wait:
        break;
    }
    if (!std::exchange(waited, true)) {
      bump(d.counters.waited);
      d.log(LogLevel::debug, "waiting", c, s->holder, "another request holds the key; waiting for its outcome");
    }
    AsyncWaiter waiter(co_await net::this_coro::executor);
    const std::optional<TimePoint> wake = d.plan_wait(c, *s, give_up, poll, waiter.handle());
    if (!wake) continue;
    if (*wake > d.now()) co_await waiter.wait_until(*d.clock, *wake);
    d.inflight.unsubscribe(c.id, waiter.handle());
  }
}

}  // namespace idem
