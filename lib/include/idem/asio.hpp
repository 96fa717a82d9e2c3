// idem — the Asio front end: the same coordinator for coroutines on an io_context.
//
// This header pulls in Boost.Asio; include it only where coroutines call idem.
#pragma once

#include <utility>  // Boost 1.74's awaitable.hpp needs std::exchange declared first

#include <boost/asio/awaitable.hpp>
#include <functional>

#include "idem/coordinator.hpp"

namespace idem {

using AsyncAction = std::function<boost::asio::awaitable<Response>()>;

// Coordinator::call for coroutines: same decisions, same errors, same counters. A
// duplicate under InFlight::wait suspends (it does not block the thread) until the
// holder in this process completes or releases the key, its lease ends, or max_wait
// passes; a holder in another process is polled with growing backoff.
// Reads (a replay, a conflict) use the store directly from the calling coroutine. Writes
// (reservations, completions) of all the coroutines that become ready in one turn of the
// io_context are committed together in one transaction (group commit) by a handler posted
// to the first writer's executor; each coroutine resumes after its write is committed.
boost::asio::awaitable<Outcome> async_call(Coordinator& coordinator, Request request,
                                           AsyncAction action);

// Suspends the calling coroutine until `clock` reaches `at` (real or simulated time).
boost::asio::awaitable<void> async_sleep_until(Clock& clock, TimePoint at);

}  // namespace idem
