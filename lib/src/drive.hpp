// The life of a call, driven: the one effect loop of a Flow (flow.hpp), written once for the
// blocking Coordinator::call and the coroutine async_call.
//
// The loop is a coroutine template over a way of performing effects, `P`:
//   P::Task<T>             what the loop (and each effect) returns: Immediate<T> for the
//                          blocking driver, boost::asio::awaitable<T> for the coroutine one;
//   p.waiter()             the call's Waiter (made at most once, when it first waits);
//   p.read(id)             the key's record (Loaded), read and timed;
//   p.store(f)             a call into the store (or the payload store) that returns f();
//   p.write(op)            `op` committed with the group commit;
//   p.sleep(until)         a wait on the waiter until `until` or a wake;
//   P::run(f, args...)     the application's f(args...), which returns a value or a Task;
//   P::call(c, r, action)  Coordinator c's call of `action` (what the HTTP layer makes).
// Blocking (below) performs each effect at once and hands back Now<T>, so its loop runs to
// its end on the calling thread without ever suspending; the coroutine way (asio.cpp)
// suspends on each. What the loop does with what comes back (the flow's decisions, the
// heartbeat, a multi-step call's progress) is the same code for both.
#pragma once

#include <condition_variable>
#include <coroutine>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "attempt.hpp"
#include "core.hpp"
#include "flow.hpp"
#include "heartbeat.hpp"

namespace idem::detail {

// A value that is already there: co_await never suspends.
template <class T>
struct Now {
  T value;
  bool await_ready() const noexcept { return true; }
  void await_suspend(std::coroutine_handle<>) const noexcept {}
  T await_resume() { return std::move(value); }
};

template <>
struct Now<void> {
  bool await_ready() const noexcept { return true; }
  void await_suspend(std::coroutine_handle<>) const noexcept {}
  void await_resume() const noexcept {}
};

template <class T>
struct ImmediateResult {
  std::optional<T> value;
  void return_value(T v) { value.emplace(std::move(v)); }
  T take() { return std::move(*value); }
};
template <>
struct ImmediateResult<void> {
  void return_void() noexcept {}
  void take() noexcept {}
};

// A coroutine that runs to its end as it is called, on the calling thread (it co_awaits only
// what never suspends: Now<T>, another Immediate). get() gives what it returned, or rethrows
// what it threw.
template <class T>
class [[nodiscard]] Immediate {
 public:
  struct promise_type : ImmediateResult<T> {
    std::exception_ptr error;
    Immediate get_return_object() {
      return Immediate(std::coroutine_handle<promise_type>::from_promise(*this));
    }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_always final_suspend() noexcept { return {}; }
    void unhandled_exception() noexcept { error = std::current_exception(); }
  };

  Immediate(Immediate&& other) noexcept : handle_(std::exchange(other.handle_, {})) {}
  Immediate& operator=(Immediate&&) = delete;
  ~Immediate() {
    if (handle_) handle_.destroy();
  }

  T get() {
    if (!handle_.done()) throw std::logic_error("idem: an Immediate coroutine suspended");
    promise_type& p = handle_.promise();
    if (p.error) std::rethrow_exception(p.error);
    return p.take();
  }

  // So that one Immediate may co_await another.
  bool await_ready() const noexcept { return true; }
  void await_suspend(std::coroutine_handle<>) const noexcept {}
  T await_resume() { return get(); }

 private:
  explicit Immediate(std::coroutine_handle<promise_type> h) : handle_(h) {}
  std::coroutine_handle<promise_type> handle_;
};

template <class T>
inline constexpr bool is_immediate = false;
template <class T>
inline constexpr bool is_immediate<Immediate<T>> = true;

// Reads `id`'s record alone, timed as a store round trip.
inline Loaded read_timed(CoordinatorCore& core, const KeyId& id) {
  return core.latency.time(StoreCall::load, [&] { return read_record(*core.store, id); });
}

// The blocking way of awaiting: what the application gives is called at once.
struct Blocking {
  template <class T>
  using Task = Immediate<T>;

  template <class F, class... Args>
  static auto run(const F& f, Args&&... args) {
    using R = std::invoke_result_t<const F&, Args...>;
    if constexpr (is_immediate<R>) {
      return f(std::forward<Args>(args)...);
    } else {
      return Now<R>{f(std::forward<Args>(args)...)};
    }
  }

  // coordinator.call of `action`, or call_steps for an action that takes an Attempt&; the
  // action returns a Response or an Immediate<Response>.
  template <class F>
  static Now<Outcome> call(Coordinator& coordinator, Request&& request, const F& action) {
    if constexpr (std::is_invocable_v<const F&, Attempt&>) {
      return {coordinator.call_steps(
          request, [&action](Attempt& attempt) { return run(action, attempt).await_resume(); })};
    } else {
      return {coordinator.call(request, [&action] { return run(action).await_resume(); })};
    }
  }
};

// Waits on a condition variable for a completion in this process or a clock deadline.
class BlockingWaiter final : public Waiter, public std::enable_shared_from_this<BlockingWaiter> {
 public:
  void wake() override {
    std::lock_guard lock(mutex_);
    woken_ = true;
    cv_.notify_all();
  }

  void wait_until(Clock& clock, TimePoint at) {
    const Clock::TimerId timer = clock.call_at(at, [weak = weak_from_this()] {
      if (auto self = weak.lock()) self->wake();
    });
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [this] { return woken_; });
      woken_ = false;
    }
    clock.cancel(timer);
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool woken_ = false;  // guarded by mutex_
};

// The blocking way of performing a call's effects (drive() below; the coroutine way is
// asio.cpp's AsyncEffects): each at once, on the calling thread.
struct BlockingEffects : Blocking {
  CoordinatorCore& core;
  std::shared_ptr<BlockingWaiter> waiting{};

  std::shared_ptr<Waiter> waiter() { return waiting = std::make_shared<BlockingWaiter>(); }
  Now<Loaded> read(const KeyId& id) { return {read_timed(core, id)}; }
  template <class F>
  Now<std::invoke_result_t<F&>> store(F f) {
    return {f()};
  }
  Now<void> write(StoreOp& op) {
    core.commits.commit(op);
    return {};
  }
  Now<void> sleep(TimePoint until) {
    waiting->wait_until(*core.clock, until);
    return {};
  }
};

// One call of `core`, start to answer. `action` is the application's: callable with no
// argument for a single-step call, with an Attempt& for a multi-step one (call_steps), and
// returning a Response or a P::Task<Response>. `request` and `action` must outlive the loop.
template <class P, class Action>
typename P::template Task<Outcome> drive(CoordinatorCore& core, const Request& request,
                                         const Action& action, P perform) {
  using Kind = Effect::Kind;
  constexpr bool steps = std::is_invocable_v<const Action&, Attempt&>;
  Flow flow(
      core, request, [&perform] { return perform.waiter(); }, steps);
  for (;;) {
    const Effect e = flow.next();
    switch (e.kind) {
      case Kind::read: {
        Loaded loaded = co_await perform.read(flow.id());
        flow.loaded(std::move(loaded));
        break;
      }
      case Kind::payload: {
        Transferred t = co_await perform.store(
            [&core, &flow] { return transfer(*core.options.payload_store, flow.payload()); });
        flow.transferred(std::move(t));
        break;
      }
      case Kind::write:
        co_await perform.write(flow.op());
        break;
      case Kind::run: {
        // The lease is renewed while the action runs (Options::heartbeat), and no longer.
        std::optional<Heartbeat> heartbeat;
        if (e.renew) heartbeat.emplace(core, flow.id(), flow.token());
        std::exception_ptr failure;
        bool store_failed = false;
        try {
          if constexpr (steps) {
            std::optional<Progress> progress = co_await perform.store([&core, &flow, &request] {
              return steps_of(*core.store).begin_steps(flow.id(), flow.token(), request.payload);
            });
            Attempt attempt =
                AttemptAccess::started(core, flow.id(), flow.token(), std::move(progress));
            try {
              // (named first: g++ 12 destroys a co_await result passed on as an argument twice)
              Response response = co_await P::run(action, attempt);
              flow.ran(std::move(response));
            } catch (...) {
              failure = std::current_exception();
            }
            if (failure) {
              AttemptAccess::failed(core, attempt);
              store_failed = AttemptAccess::store_failed(attempt);
            }
          } else {
            Response response = co_await P::run(action);
            flow.ran(std::move(response));
          }
        } catch (...) {
          failure = std::current_exception();
        }
        heartbeat.reset();
        if (store_failed) flow.store_failed();
        if (failure) flow.failed(std::move(failure));
        break;
      }
      case Kind::sleep:
        co_await perform.sleep(e.until);
        break;
      case Kind::answer:
        co_return flow.outcome();
    }
  }
}

}  // namespace idem::detail
