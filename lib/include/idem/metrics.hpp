// idem — counters for every decision the coordinator makes, and histograms of how long calls,
// waits and store round trips take.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace idem {

// One histogram, as Prometheus counts it: how many observations fell at or below each bound.
struct HistogramSnapshot {
  std::vector<double> bounds;          // the buckets' upper bounds ("le"), ascending
  std::vector<std::uint64_t> buckets;  // observations per bucket, not cumulative; one more than
                                       // bounds: the last holds those above every bound (+Inf)
  double sum = 0;                      // of all observations (seconds, or ops)
  std::uint64_t count = 0;             // of all observations (the total of buckets)
};

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
  std::uint64_t outbox_given_back = 0;   // claimed messages handed back undelivered: the claim
                                         // had less than OutboxOptions::deliver_margin left

  // Latency, in seconds of real time (std::chrono::steady_clock, never Options::clock). Every
  // label is present from the start, with zero counts. Each observation costs two relaxed
  // atomic additions (no lock); see docs/reference.md, "Metrics".
  //
  // Call durations (Coordinator::call, call_steps, async_call and the layers over them), from
  // the call's start to its answer or error, by how it ended:
  //   executed     the action ran for this call
  //   replayed     a stored response was returned
  //   conflict     InProgressError (another request held the key)
  //   reuse        KeyReuseError
  //   released     the action failed; its reservation was released for a retry
  //   failed_open  the store failed and the action ran unprotected (FailureMode::fail_open)
  //   no_key       a request without a key, run unprotected
  //   error        any other error (the store's, a lost lease, a corrupt record, the action's
  //                when nothing was reserved)
  std::map<std::string, HistogramSnapshot> call_duration;
  // Calls that waited for another request with the same key: from the first wait to the end.
  HistogramSnapshot wait_duration;
  // Round trips to the store, by operation: load (one read: a key's record, or on the
  // coroutine front end the records of every call ready in the same turn, Store::load_many),
  // apply (one group-commit round: the reserve, complete and release writes of every call in
  // its batch, one transaction), renew (a heartbeat), purge and reap (one batch each).
  std::map<std::string, HistogramSnapshot> store_duration;
  // Writes per group-commit round.
  HistogramSnapshot commit_batch_size;

  // Prometheus text exposition (format 0.0.4): each counter as idem_<name>_total, then the
  // histograms idem_call_duration_seconds{outcome}, idem_wait_duration_seconds,
  // idem_store_duration_seconds{operation} and idem_commit_batch_size.
  std::string to_prometheus() const;
};

}  // namespace idem
