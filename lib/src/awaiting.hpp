// The coroutine way of awaiting (drive.hpp's Blocking is the other): what the application
// gives returns an awaitable, and the coordinator is called with async_call.
#pragma once

#include <type_traits>
#include <utility>

#include "idem/asio.hpp"

namespace idem::detail {

struct Awaiting {
  template <class T>
  using Task = boost::asio::awaitable<T>;

  template <class F, class... Args>
  static auto run(const F& f, Args&&... args) {
    return f(std::forward<Args>(args)...);
  }

  // async_call of `action`, or async_call_steps for an action that takes an Attempt&; the
  // action returns an awaitable<Response>. It must outlive the call.
  template <class F>
  static Task<Outcome> call(Coordinator& coordinator, Request&& request, const F& action) {
    if constexpr (std::is_invocable_v<const F&, Attempt&>) {
      return async_call_steps(coordinator, std::move(request),
                              [&action](Attempt& attempt) { return action(attempt); });
    } else {
      return async_call(coordinator, std::move(request), [&action] { return action(); });
    }
  }
};

}  // namespace idem::detail
