// idem (internal) — what the engines count of their own work, for idem's tests and benchmarks
// (group commit's batching, PostgreSQL's round trips and wake-ups). Not installed; not part of
// the API: a service reads Coordinator::metrics() instead.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace idem {

class SqliteStore;
class PgStore;

namespace detail {

// SqliteStore: how many write transactions committed, and how many ops they carried; how many
// background checkpoints ran.
struct SqliteStats {
  std::uint64_t transactions = 0;
  std::uint64_t ops = 0;
  std::uint64_t checkpoints = 0;
};

// PgStore: how many write transactions committed, how many ops they carried, how many round
// trips the store made and how often it connected; how many batches sent notifications and how
// many notifications from other processes reached the listeners, and how many times the
// listening connection's LISTEN took effect (first and after each reconnect; a notification
// committed before it is not seen, and that waiter polls).
struct PgStats {
  std::uint64_t transactions = 0;
  std::uint64_t ops = 0;
  std::uint64_t round_trips = 0;
  std::uint64_t connects = 0;
  std::uint64_t notify_batches = 0;
  std::uint64_t wakeups = 0;
  std::uint64_t listens = 0;
  // Batches an event loop waited for (start_apply()), and the most that were in the database
  // at once.
  std::uint64_t async_batches = 0;
  std::size_t most_batches_in_flight = 0;
};

struct StoreStats {
  static SqliteStats of(const SqliteStore& store);  // in libidem
  static PgStats of(const PgStore& store);          // in libidem_pg
};

}  // namespace detail
}  // namespace idem
