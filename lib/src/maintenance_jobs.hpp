// The maintenance jobs and their schedule, one body for the coroutine Maintenance (asio.cpp)
// and the blocking MaintenanceThread (maintenance.cpp), and the completer's resumes, one body
// for those and Completer::run_once (steps.cpp).
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "attempt.hpp"
#include "core.hpp"
#include "idem/maintenance.hpp"

namespace idem::detail {

// Resumes each of `found` with its operation's handler (Coordinator::call_steps, through
// P::call: P is drive.hpp's Blocking or awaiting.hpp's Awaiting), counting each in `report`;
// stops between operations once `stopping` is set.
template <class P, class Handlers>
typename P::template Task<void> resume_abandoned(Coordinator& coordinator,
                                                 const std::vector<AbandonedOperation>& found,
                                                 const Handlers& handlers,
                                                 const std::atomic<bool>& stopping,
                                                 CompleterReport& report) {
  CoordinatorCore& core = CoordinatorAccess::core(coordinator);
  for (const AbandonedOperation& op : found) {
    if (stopping.load()) break;
    ++report.found;
    const auto handler = handlers.find(op.id.operation);
    if (handler == handlers.end()) {
      ++report.skipped;
      continue;
    }
    std::exception_ptr failure;
    try {
      Request request = AttemptAccess::resume_request(op);
      const Outcome done = co_await P::call(coordinator, std::move(request), handler->second);
    } catch (...) {
      failure = std::current_exception();
    }
    AttemptAccess::resumed(core, report, op, failure);
  }
}

// E performs the schedule's waits (drive.hpp's BlockingEffects, asio.cpp's AsyncEffects) and
// is the way of awaiting; Handler resumes an abandoned operation (Completer::Resume,
// AsyncStepsAction).
template <class E, class Handler>
struct MaintenanceJobs {
  template <class T>
  using Task = typename E::template Task<T>;

  // Throws idem::error(errc::invalid_argument) for a non-positive interval or a batch of 0.
  MaintenanceJobs(Coordinator& c, MaintenanceOptions o) : coordinator(c), options(std::move(o)) {
    using Interval = std::pair<std::chrono::milliseconds, std::string_view>;
    for (const Interval& i :
         {Interval{options.purge_every, "purge_every"}, Interval{options.reap_every, "reap_every"},
          Interval{options.complete_every, "complete_every"},
          Interval{options.dispatch_every, "dispatch_every"}}) {
      check(i.first.count() > 0, fmt::format("maintenance: {} must be positive", i.second));
    }
    check(options.batch > 0, "maintenance: batch must be at least 1");
    check(options.completer.batch > 0, "maintenance: completer.batch must be at least 1");
  }

  Coordinator& coordinator;
  const MaintenanceOptions options;
  std::map<std::string, Handler, std::less<>> handlers;
  std::optional<Dispatcher> dispatcher;
  std::atomic<bool> stopping{false};
  mutable std::mutex mutex;      // guards wake and totals
  std::shared_ptr<Waiter> wake;  // the running loop's, while it runs
  MaintenanceReport totals;

  CoordinatorCore& core() { return CoordinatorAccess::core(coordinator); }

  void resume(std::string operation, Handler handler) {
    validate_key_part("operation", operation);
    check(static_cast<bool>(handler), "maintenance: a resume handler is required");
    handlers[std::move(operation)] = std::move(handler);
  }

  void deliver(Delivery delivery) {
    dispatcher.emplace(coordinator, std::move(delivery), options.outbox);
  }

  // Runs `job`; a failure is logged and counted in `report`, never thrown.
  template <class Job>
  void guarded(std::string_view name, MaintenanceReport& report, Job&& job) {
    try {
      job();
    } catch (const std::exception& e) {
      ++report.failures;
      core().log(LogLevel::error, "maintenance_failed", "-", name, 0, e.what());
    } catch (...) {
      ++report.failures;
      core().log(LogLevel::error, "maintenance_failed", "-", name, 0, "unknown error");
    }
  }

  Task<void> complete(MaintenanceReport& report) {
    std::vector<AbandonedOperation> found;
    guarded("completer", report, [&] {
      std::vector<std::string> operations;
      for (const auto& [operation, handler] : handlers) operations.push_back(operation);
      found = coordinator.abandoned(options.completer.abandoned_after, options.completer.batch,
                                    operations);
    });
    co_await resume_abandoned<E>(coordinator, found, handlers, stopping, report.completer);
  }

  void purge(MaintenanceReport& r) {
    guarded("purge", r, [&] { r.purged += coordinator.purge_expired(options.batch); });
    if (dispatcher) guarded("outbox_purge", r, [&] { r.outbox_purged += dispatcher->purge(); });
  }
  // One batch of the purge; true when it was full (more may be expired).
  bool purge_some(MaintenanceReport& r) {
    bool full = false;
    guarded("purge", r, [&] {
      const std::size_t n = core().purge_batch(options.batch);
      r.purged += n;
      full = n == options.batch;
    });
    if (!full && dispatcher) {
      guarded("outbox_purge", r, [&] { r.outbox_purged += dispatcher->purge(); });
    }
    return full;
  }
  void reap(MaintenanceReport& r) {
    guarded("reap", r, [&] { r.reaped += coordinator.reap(options.batch).size(); });
  }
  // Releases commit through the group commit and wait for their round, blocking: through
  // perform.store(), so a coroutine schedule makes them on the coordinator's store threads
  // when the store may wait on a network. On the executor's own thread, a round of PgStore's
  // waiting on that very executor for its batch's answer would never be told, and neither
  // would the release (nor the executor) ever go on.
  Task<void> release_lost(MaintenanceReport& r, E& perform) {
    co_await perform.store([&] {
      guarded("release_lost", r,
              [&] { r.lost_released += coordinator.release_lost_reservations(); });
      return true;
    });
  }
  void dispatch(MaintenanceReport& r) {
    if (!dispatcher) return;
    guarded("outbox", r, [&] {
      const DispatchReport d = dispatcher->run_once();
      r.outbox.delivered += d.delivered;
      r.outbox.retried += d.retried;
      r.outbox.parked += d.parked;
      r.outbox.given_back += d.given_back;
    });
  }

  void add_to_totals(MaintenanceReport& r) {
    r.rounds = 1;
    std::lock_guard lock(mutex);
    totals.purged += r.purged;
    totals.reaped += r.reaped;
    totals.outbox_purged += r.outbox_purged;
    totals.lost_released += r.lost_released;
    totals.completer.found += r.completer.found;
    totals.completer.finished += r.completer.finished;
    totals.completer.failed += r.completer.failed;
    totals.completer.skipped += r.completer.skipped;
    totals.outbox.delivered += r.outbox.delivered;
    totals.outbox.retried += r.outbox.retried;
    totals.outbox.parked += r.outbox.parked;
    totals.outbox.given_back += r.outbox.given_back;
    totals.failures += r.failures;
    totals.rounds += r.rounds;
  }

  MaintenanceReport totals_now() const {
    std::lock_guard lock(mutex);
    return totals;
  }

  // Every job once, now.
  Task<MaintenanceReport> run_once(E perform) {
    MaintenanceReport report;
    co_await release_lost(report, perform);
    dispatch(report);
    purge(report);
    reap(report);
    co_await complete(report);
    add_to_totals(report);
    co_return report;
  }

  // The jobs at their intervals, on the coordinator's clock, until stop(). Each job first runs
  // one interval after the start (a process that starts does not compete with its first
  // requests for the write lock).
  static Task<void> loop(std::shared_ptr<MaintenanceJobs> d, E perform) {
    {
      std::lock_guard lock(d->mutex);
      d->wake = perform.waiter();
    }
    Clock& clock = d->coordinator.clock();
    const MaintenanceOptions& o = d->options;
    const TimePoint start = clock.now();
    TimePoint next_purge = start + o.purge_every, next_reap = start + o.reap_every,
              next_complete = start + o.complete_every, next_dispatch = start + o.dispatch_every;
    while (!d->stopping.load()) {
      MaintenanceReport report;
      const TimePoint now = clock.now();
      if (now >= next_dispatch) {
        co_await d->release_lost(report, perform);
        d->dispatch(report);
        next_dispatch = clock.now() + o.dispatch_every;
      }
      if (now >= next_purge) {
        // A backlog goes one batch per turn, each followed by a pause three times as long as
        // the batch took: the purge uses the disk at most a quarter of the time, so requests'
        // commits and the checkpoints behind them are not queued behind a stream of deletes
        // (scripts/bench, maintenance: the longest call with / without maintenance went from
        // 5.05 flat out to 2.50 with a pause of one batch and 1.73 with three).
        const TimePoint began = clock.now();
        const bool more = d->purge_some(report);
        const TimePoint ended = clock.now();
        next_purge = more ? ended + 3 * (ended - began) : ended + o.purge_every;
      }
      if (now >= next_reap) {
        d->reap(report);
        next_reap = clock.now() + o.reap_every;
      }
      if (now >= next_complete) {
        co_await d->complete(report);
        next_complete = clock.now() + o.complete_every;
      }
      d->add_to_totals(report);
      if (d->stopping.load()) break;
      // (named first: g++ 12 cannot keep an initializer list across a co_await)
      const TimePoint wake_at =
          std::min(std::min(next_purge, next_reap), std::min(next_complete, next_dispatch));
      co_await perform.sleep(wake_at);
    }
    std::lock_guard lock(d->mutex);
    d->wake.reset();
  }

  // Ends the loop: wakes it when it sleeps.
  void stop() noexcept {
    stopping.store(true);
    std::lock_guard lock(mutex);
    if (wake) wake->wake();
  }
};

}  // namespace idem::detail
