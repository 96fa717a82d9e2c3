#include "idem/metrics.hpp"

#include <fmt/format.h>

namespace idem {

std::string MetricsSnapshot::to_prometheus() const {
  std::string out;
  auto put = [&out](std::string_view name, std::uint64_t value, std::string_view help) {
    fmt::format_to(std::back_inserter(out),
                   "# HELP idem_{0}_total {2}\n# TYPE idem_{0}_total counter\nidem_{0}_total {1}\n",
                   name, value, help);
  };
  put("reserved", reserved, "Fresh reservations.");
  put("taken_over", taken_over, "Reservations that took over an expired lease.");
  put("executed", executed, "Actions run under idem's protection.");
  put("completed", completed, "Results stored.");
  put("replayed", replayed, "Stored results returned without running the action.");
  put("waited", waited, "Calls that waited for another request with the same key.");
  put("in_progress_conflicts", in_progress_conflicts, "InProgress errors raised.");
  put("key_reuse", key_reuse, "KeyReuse errors raised.");
  put("released", released, "Reservations released after a failed action.");
  put("lease_lost", lease_lost, "Operations refused because the fencing token was stale.");
  put("store_errors", store_errors, "Store failures seen.");
  put("ran_unprotected", ran_unprotected, "Actions run without the store.");
  put("purged", purged, "Expired records deleted.");
  put("reaped", reaped, "Abandoned reservations cleared.");
  put("corrupt_records", corrupt_records, "Calls refused on a stored record that did not decode.");
  put("steps_recorded", steps_recorded, "Steps of multi-step operations recorded.");
  put("resumed", resumed, "Attempts that resumed recorded progress.");
  put("reconciled", reconciled, "Unknown outcomes settled by a lookup instead of a call.");
  put("interrupted", interrupted, "Attempts that failed after recording a step.");
  put("completer_finished", completer_finished, "Abandoned operations finished.");
  put("completer_failed", completer_failed, "Completer attempts that failed again.");
  put("outbox_delivered", outbox_delivered, "Outbox messages delivered.");
  put("outbox_retried", outbox_retried, "Failed outbox deliveries, retried later.");
  put("outbox_parked", outbox_parked, "Outbox messages parked after too many failures.");
  return out;
}

}  // namespace idem
