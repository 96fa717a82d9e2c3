// idem — counters for every decision the coordinator makes.
#pragma once

#include <cstdint>
#include <string>

namespace idem {

// A consistent-enough copy of the counters (each read atomically, not all at one instant).
struct MetricsSnapshot {
  std::uint64_t reserved = 0;               // fresh reservations (the action will run)
  std::uint64_t taken_over = 0;             // reservations that took over an expired lease
  std::uint64_t executed = 0;               // actions run under a reservation (or InFlight::run)
  std::uint64_t completed = 0;              // results stored
  std::uint64_t replayed = 0;               // stored results returned without running
  std::uint64_t waited = 0;                 // calls that waited for another request
  std::uint64_t in_progress_conflicts = 0;  // InProgressError raised
  std::uint64_t key_reuse = 0;              // KeyReuseError raised
  std::uint64_t released = 0;               // reservations released after a failed action
  std::uint64_t lease_lost = 0;             // complete/release/renew with a stale token
  std::uint64_t store_errors = 0;           // StoreError seen, whatever came of it
  std::uint64_t ran_unprotected = 0;        // actions run without the store
  std::uint64_t purged = 0;                 // expired records deleted
  std::uint64_t reaped = 0;                 // abandoned reservations cleared
  std::uint64_t corrupt_records = 0;        // calls refused on a record that did not decode
  // Multi-step operations (idem/steps.hpp).
  std::uint64_t steps_recorded = 0;      // steps recorded with their recovery point
  std::uint64_t resumed = 0;             // attempts that resumed recorded progress
  std::uint64_t reconciled = 0;          // unknown outcomes settled by a lookup, not a call
  std::uint64_t interrupted = 0;         // attempts that failed after recording a step
  std::uint64_t completer_finished = 0;  // abandoned operations the completer finished
  std::uint64_t completer_failed = 0;    // completer attempts that failed again
  std::uint64_t outbox_delivered = 0;    // messages delivered
  std::uint64_t outbox_retried = 0;      // failed deliveries, to be retried
  std::uint64_t outbox_parked = 0;       // messages given up on after max_attempts

  // Prometheus text exposition, each counter as idem_<name>_total.
  std::string to_prometheus() const;
};

}  // namespace idem
