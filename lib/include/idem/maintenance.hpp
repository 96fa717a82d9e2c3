// idem — maintenance on a schedule: purge, reap, the completer and the outbox dispatcher,
// each at its interval.
//
// One schedule serves both embeddings: MaintenanceThread (here) runs it on a thread of its
// own for a blocking service; Maintenance (idem/asio.hpp) runs it on an executor for a
// coroutine one. The jobs, their order, their intervals and their reports are the same.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "idem/coordinator.hpp"
#include "idem/steps.hpp"

namespace idem {

struct MaintenanceOptions {
  // How often each job runs. Defaults: purge, reap and the completer every 10 s, the outbox
  // (and the release of reservations whose reply was lost) every second.
  std::chrono::milliseconds purge_every{std::chrono::seconds(10)};
  std::chrono::milliseconds reap_every{std::chrono::seconds(10)};
  std::chrono::milliseconds complete_every{std::chrono::seconds(10)};
  std::chrono::milliseconds dispatch_every{std::chrono::seconds(1)};
  // Records per purge or reap transaction (short, so a request waits for the write lock at
  // most one batch). Default: 100. On the schedule, a purge backlog goes one batch per turn,
  // each followed by a pause three times as long as the batch took (run_once() and
  // Coordinator::purge_expired() purge flat out).
  std::size_t batch = 100;
  CompleterOptions completer{};
  OutboxOptions outbox{};
};

struct MaintenanceReport {
  std::size_t purged = 0;         // expired records deleted
  std::size_t reaped = 0;         // abandoned reservations without progress cleared
  std::size_t outbox_purged = 0;  // delivered messages deleted
  std::size_t lost_released = 0;  // reservations whose reply was lost, released
                                  // (Coordinator::release_lost_reservations)
  CompleterReport completer{};
  DispatchReport outbox{};
  std::size_t failures = 0;  // jobs that failed this round (logged "maintenance_failed")
  std::size_t rounds = 0;    // rounds run (totals(): one per wake of the schedule, and run_once)
};

// Maintenance on a schedule for a blocking embedding: every job at its interval (on the
// coordinator's clock), each first one interval after start(), on a thread of its own (so the
// store work and the completer's steps never run on a request's thread). Jobs are counted in
// Coordinator::metrics() and logged; a job that fails is logged and tried again at its next
// turn.
// Thread-safety: configure (resume(), deliver()) before start(); stop() and totals() from any
// thread.
class MaintenanceThread {
 public:
  // Throws idem::error(errc::invalid_argument) for a non-positive interval or a batch of 0.
  explicit MaintenanceThread(Coordinator& coordinator, MaintenanceOptions options = {});
  // stop().
  ~MaintenanceThread();
  MaintenanceThread(const MaintenanceThread&) = delete;
  MaintenanceThread& operator=(const MaintenanceThread&) = delete;

  // The completer's handler for `operation` (usually the action call_steps ran).
  void resume(std::string operation, Completer::Resume resume);
  // Where outbox messages go. Without one, the outbox is not dispatched.
  void deliver(Delivery delivery);

  // Every job once, now, on the calling thread (not while the thread runs).
  MaintenanceReport run_once();
  // Starts the thread. Throws std::logic_error if it was started already.
  void start();
  // Wakes the thread and joins it: at once when it sleeps; otherwise once the job it is running
  // ends (the completer stops between operations, finishing the one it has begun).
  void stop() noexcept;
  // Totals since construction.
  MaintenanceReport totals() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace idem
