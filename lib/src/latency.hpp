// What an operator reads of a call's time: lock-free histograms of call durations by outcome,
// of waits, of store round trips by operation and of group-commit batch sizes, copied into
// MetricsSnapshot (idem/metrics.hpp) by Coordinator::metrics().
//
// One observation is one relaxed atomic add to its bucket and one to the sum (no lock, no
// allocation), plus a search of at most 20 bounds; a duration also costs its two reads of
// std::chrono::steady_clock. Durations are real time, never the injectable Clock's: a test
// on simulated time still counts its calls, only their durations are the machine's.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>

#include "idem/metrics.hpp"

namespace idem::detail {

// Thread-safety: safe for concurrent use.
class Histogram {
 public:
  enum class Unit {
    seconds,
    ops
  };  // observations in nanoseconds (exported as seconds), or a count

  Histogram() noexcept : Histogram(Unit::seconds) {}
  explicit Histogram(Unit unit) noexcept;
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  void observe(std::uint64_t value) noexcept {
    std::size_t i = 0;  // the first bucket whose upper bound is at least `value` (Prometheus "le")
    while (i < bounds_.size() && value > bounds_[i]) ++i;
    counts_[i].fetch_add(1, std::memory_order_relaxed);
    sum_.fetch_add(value, std::memory_order_relaxed);
  }
  void observe_since(std::chrono::steady_clock::time_point start) noexcept {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - start)
                        .count();
    observe(ns > 0 ? static_cast<std::uint64_t>(ns) : 0);
  }

  // Each bucket read atomically; the count is their total, so it always matches "+Inf".
  HistogramSnapshot snapshot() const;

  static constexpr std::size_t kMaxBounds = 20;

 private:
  std::span<const std::uint64_t> bounds_;
  double divisor_;  // an observation in the exported unit is value / divisor_
  std::array<std::atomic<std::uint64_t>, kMaxBounds + 1> counts_{};
  std::atomic<std::uint64_t> sum_{0};
};

// How a call ended, as its duration is labelled (idem_call_duration_seconds{outcome=...}).
enum class CallEnd {
  executed,     // the action ran for this call (its response stored, or storing it failed)
  replayed,     // a stored response
  conflict,     // InProgressError: another request held the key (raise, or a wait gave up)
  reuse,        // KeyReuseError
  released,     // the action failed and its reservation was released for a retry
  failed_open,  // the store failed and Options::on_store_failure ran the action unprotected
  no_key,       // a request without a key, run unprotected
  error,        // any other error: the store's, a lost lease, a corrupt record, the action's
};
inline constexpr std::size_t kCallEnds = 8;

// The store's operations, as their round trips are labelled (idem_store_duration_seconds).
enum class StoreCall {
  load,   // Store::load or load_many: a key's record, or a turn's reads together
  apply,  // Store::apply: one group-commit round (reserve, complete, release... of its batch)
  renew,  // Store::renew: a heartbeat
  purge,  // Store::purge_expired: one batch
  reap,   // Store::reap: one batch
};
inline constexpr std::size_t kStoreCalls = 5;

// Thread-safety: safe for concurrent use.
struct Latency {
  std::array<Histogram, kCallEnds> calls;
  Histogram wait;  // a call that waited for another request: from its first wait to its end
  std::array<Histogram, kStoreCalls> store;
  Histogram batch{Histogram::Unit::ops};  // ops per group-commit round

  Histogram& call(CallEnd e) noexcept { return calls[static_cast<std::size_t>(e)]; }
  Histogram& of(StoreCall c) noexcept { return store[static_cast<std::size_t>(c)]; }

  // f()'s round trip, timed as `what` (also when it throws).
  template <class F>
  decltype(auto) time(StoreCall what, F&& f) {
    struct Timed {
      Histogram& h;
      std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
      ~Timed() { h.observe_since(start); }
    } timed{of(what)};
    return f();
  }

  // Copies every histogram into `m`.
  void snapshot(MetricsSnapshot& m) const;
};

}  // namespace idem::detail
