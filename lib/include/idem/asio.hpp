// idem — the Asio front end: the same coordinator for coroutines on an io_context.
//
// This header pulls in Boost.Asio; include it only where coroutines call idem.
#pragma once

#include <utility>  // Boost 1.74's awaitable.hpp needs std::exchange declared first

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/awaitable.hpp>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "idem/coordinator.hpp"
#include "idem/maintenance.hpp"
#include "idem/steps.hpp"

namespace idem {

using AsyncAction = std::function<boost::asio::awaitable<Response>()>;

// Coordinator::call for coroutines: same decisions, same errors, same counters. A
// duplicate under InFlight::wait suspends (it does not block the thread) until the
// holder in this process completes or releases the key, its lease ends, or max_wait
// passes; a holder in another process is polled with growing backoff.
// Reads (a replay or a conflict while duplicates are common, a waiter's look) of all the
// coroutines that become ready in one turn of the io_context go to the store together
// (Store::load_many: on SqliteStore one read transaction), in a handler posted to the first
// reader's executor; each coroutine gets its own record or its own error. Writes (reservations,
// completions) of all the coroutines that become ready in one turn of the io_context are committed
// together in one transaction (group commit) by a handler posted to the first writer's executor;
// each coroutine resumes after its write is committed (on SqliteStore in that handler itself, in
// turn, as the readers of a read batch resume in theirs). Each io_context posts its own handler:
// a write never waits for one posted to another io_context (busy, or stopped for good).
// On a store that may wait on a network
// (Store::remote(): PgStore) the io_context's thread never waits on the store: reads, a round's
// start (a connect, a batch on a busy store's main connection) and steps run on the
// coordinator's store threads, and a batch's results are waited for by the io_context's
// reactor on the store's socket (Store::start_apply), until its deadline. On SqliteStore the
// calls are made on the calling thread (they wait only for the disk and other processes'
// locks). The Coordinator (and its store) must outlive the io_context's pending work: destroy
// the io_context, or let run() return, first.
// With g++ 12 (Debian 12's compiler), name the action before the co_await when it is a lambda
// that captures anything with a destructor (a std::string, a shared_ptr):
//   idem::AsyncAction charge = [body]() -> boost::asio::awaitable<Response> { ... };
//   co_await idem::async_call(coordinator, request, std::move(charge));
// g++ 12.2 destroys such a temporary made inside a co_await expression twice (a double free,
// seen under ASan); clang 14 does not. tests/asio_test.cpp's race test names its action so.
boost::asio::awaitable<Outcome> async_call(Coordinator& coordinator, Request request,
                                           AsyncAction action);

// Coordinator::call_steps for coroutines (idem/steps.hpp). Use async_external and async_local
// for the Attempt's steps: on a store that may wait on a network they write from the
// coordinator's store threads (so do the reads, the reservation and the completion).
using AsyncStepsAction = std::function<boost::asio::awaitable<Response>(Attempt&)>;
boost::asio::awaitable<Outcome> async_call_steps(Coordinator& coordinator, Request request,
                                                 AsyncStepsAction action);

// Attempt::external for coroutine calls: the same plan (done, look up first after an unknown
// outcome, or call with the derived key), the same checks and errors. On a store that may wait
// on a network (Store::remote(): PgStore) the step's writes are made on the coordinator's store
// threads, never on the io_context's thread.
using AsyncExternalCall =
    std::function<boost::asio::awaitable<std::string>(const std::string& derived_key)>;
using AsyncLookup = std::function<boost::asio::awaitable<std::optional<std::string>>(
    const std::string& derived_key)>;
boost::asio::awaitable<std::string> async_external(Attempt& attempt, std::string step,
                                                   AsyncExternalCall call, AsyncLookup lookup = {});

// Attempt::local for coroutines: the same step, the same errors. On a store that may wait on a
// network (PgStore) the step's transaction, `work` included, runs on the coordinator's store
// threads, never on the io_context's thread (so `work` must not touch what only that thread
// may). A coroutine that calls Attempt::local itself blocks its thread for the step's round trips.
boost::asio::awaitable<std::string> async_local(Attempt& attempt, std::string step,
                                                Attempt::LocalWork work);

// --- Maintenance on a schedule ----------------------------------------------------------

// One background task for a long-running coroutine embedding (idem-demo serve uses it): the
// schedule of idem/maintenance.hpp (purge, reap, the completer and the outbox dispatcher, each
// at its interval; MaintenanceThread runs the same for a blocking one) on an executor the
// application gives it (its own thread, so the store work and the completer's steps never
// run on a request's thread). Jobs are counted in Coordinator::metrics() and logged; a job
// that fails is logged and tried again at its next turn. On a store that may wait on a network
// (PgStore) the releases of lost reservations, which wait for the group commit, are made on
// the coordinator's store threads, never on the executor's thread, where a batch's answer may
// be waited for.
// Thread-safety: configure (resume(), deliver()) before start(); stop() from any thread.
class Maintenance {
 public:
  // Throws idem::error(errc::invalid_argument) for a non-positive interval or a batch of 0.
  explicit Maintenance(Coordinator& coordinator, MaintenanceOptions options = {});
  ~Maintenance();
  Maintenance(const Maintenance&) = delete;
  Maintenance& operator=(const Maintenance&) = delete;

  // The completer's handler for `operation` (usually the action the requests run).
  void resume(std::string operation, AsyncStepsAction action);
  // Where outbox messages go. Without one, the outbox is not dispatched.
  void deliver(Delivery delivery);

  // Every job once, now.
  boost::asio::awaitable<MaintenanceReport> run_once();
  // Runs the jobs at their intervals on `executor` (on the coordinator's clock), each first
  // one interval after the start, until stop(). The object must outlive the loop: stop(), then let
  // the executor finish (join its thread) before destroying it.
  void start(const boost::asio::any_io_executor& executor);
  // Wakes the loop and ends it: at once when it sleeps; otherwise once the job it is running
  // ends (the completer stops between operations, finishing the one it has begun).
  void stop() noexcept;
  // Totals since construction.
  MaintenanceReport totals() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// Suspends the calling coroutine until `clock` reaches `at` (real or simulated time).
boost::asio::awaitable<void> async_sleep_until(Clock& clock, TimePoint at);

}  // namespace idem
