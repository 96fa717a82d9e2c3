#include "idem/metrics.hpp"

#include <fmt/format.h>

#include "latency.hpp"

namespace idem {
namespace {

// Upper bounds: durations in nanoseconds (50 µs to 30 s), batches in ops (1 to 512).
constexpr std::uint64_t kSecondsBounds[] = {
    50'000,      100'000,       250'000,       500'000,       1'000'000,      2'500'000,
    5'000'000,   10'000'000,    25'000'000,    50'000'000,    100'000'000,    250'000'000,
    500'000'000, 1'000'000'000, 2'500'000'000, 5'000'000'000, 10'000'000'000, 30'000'000'000};
constexpr std::uint64_t kOpsBounds[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
static_assert(std::size(kSecondsBounds) <= detail::Histogram::kMaxBounds);
static_assert(std::size(kOpsBounds) <= detail::Histogram::kMaxBounds);

constexpr const char* kCallEndNames[detail::kCallEnds] = {
    "executed", "replayed", "conflict", "reuse", "released", "failed_open", "no_key", "error"};
constexpr const char* kStoreCallNames[detail::kStoreCalls] = {"load", "apply", "renew", "purge",
                                                              "reap"};

void put_histogram(std::string& out, std::string_view name, std::string_view label,
                   const std::map<std::string, HistogramSnapshot>& by_label,
                   std::string_view help) {
  fmt::format_to(std::back_inserter(out), "# HELP {0} {1}\n# TYPE {0} histogram\n", name, help);
  for (const auto& [value, h] : by_label) {
    const std::string labels =
        label.empty() ? std::string() : fmt::format("{}=\"{}\",", label, value);
    std::uint64_t cumulative = 0;
    for (std::size_t i = 0; i < h.bounds.size(); ++i) {
      cumulative += h.buckets[i];
      fmt::format_to(std::back_inserter(out), "{}_bucket{{{}le=\"{}\"}} {}\n", name, labels,
                     h.bounds[i], cumulative);
    }
    fmt::format_to(std::back_inserter(out), "{}_bucket{{{}le=\"+Inf\"}} {}\n", name, labels,
                   h.count);
    const std::string braces =
        label.empty() ? std::string() : fmt::format("{{{}=\"{}\"}}", label, value);
    fmt::format_to(std::back_inserter(out), "{0}_sum{1} {2}\n{0}_count{1} {3}\n", name, braces,
                   h.sum, h.count);
  }
}

}  // namespace

namespace detail {

Histogram::Histogram(Unit unit) noexcept
    : bounds_(unit == Unit::seconds ? std::span<const std::uint64_t>(kSecondsBounds)
                                    : std::span<const std::uint64_t>(kOpsBounds)),
      divisor_(unit == Unit::seconds ? 1e9 : 1.0) {}

HistogramSnapshot Histogram::snapshot() const {
  HistogramSnapshot h;
  h.bounds.reserve(bounds_.size());
  for (const std::uint64_t b : bounds_) h.bounds.push_back(static_cast<double>(b) / divisor_);
  h.buckets.reserve(bounds_.size() + 1);
  for (std::size_t i = 0; i <= bounds_.size(); ++i) {
    h.buckets.push_back(counts_[i].load(std::memory_order_relaxed));
    h.count += h.buckets.back();
  }
  h.sum = static_cast<double>(sum_.load(std::memory_order_relaxed)) / divisor_;
  return h;
}

void Latency::snapshot(MetricsSnapshot& m) const {
  for (std::size_t i = 0; i < kCallEnds; ++i)
    m.call_duration[kCallEndNames[i]] = calls[i].snapshot();
  m.wait_duration = wait.snapshot();
  for (std::size_t i = 0; i < kStoreCalls; ++i)
    m.store_duration[kStoreCallNames[i]] = store[i].snapshot();
  m.commit_batch_size = batch.snapshot();
}

}  // namespace detail

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
  put("outbox_given_back", outbox_given_back,
      "Claimed outbox messages given back undelivered: the claim was about to end.");
  put_histogram(out, "idem_call_duration_seconds", "outcome", call_duration,
                "Calls from start to answer, by how they ended.");
  put_histogram(out, "idem_wait_duration_seconds", "", {{"", wait_duration}},
                "Calls that waited for another request with their key: first wait to end.");
  put_histogram(out, "idem_store_duration_seconds", "operation", store_duration,
                "Round trips to the store, by operation (apply: one group-commit round).");
  put_histogram(out, "idem_commit_batch_size", "", {{"", commit_batch_size}},
                "Writes per group-commit round.");
  return out;
}

}  // namespace idem
