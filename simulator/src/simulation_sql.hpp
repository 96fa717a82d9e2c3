// Every SQL statement of the simulator's own: it empties idem's tables between scenarios,
// so one database and its connections serve a whole run of scenarios.
#pragma once

#include <string_view>

namespace idem::sim::sql {

// The shared in-memory database's pages: 1 KiB, not the default 4 KiB. A scenario's tables
// hold a few small rows, and every commit copies each page it changes into the rollback
// journal and then into the database, and every connection re-reads whole pages after
// another one wrote: smaller pages took 7 % off a scenario's instructions.
inline constexpr std::string_view kPageSize = "PRAGMA page_size = 1024";

// The shop's orders, written by the multi-step operation's local step (one row per run, so
// a step that ran twice shows as two rows).
inline constexpr std::string_view kCreateOrders =
    "CREATE TABLE IF NOT EXISTS sim_orders (order_key TEXT NOT NULL, charge_id TEXT NOT NULL)";
inline constexpr std::string_view kClearKeys = "DELETE FROM idem_keys";
inline constexpr std::string_view kClearDue = "DELETE FROM idem_due";
inline constexpr std::string_view kClearOutbox = "DELETE FROM idem_outbox";
inline constexpr std::string_view kClearOrders = "DELETE FROM sim_orders";
// ?1 the operation's key ?2 the charge it paid with.
inline constexpr std::string_view kInsertOrder =
    "INSERT INTO sim_orders (order_key, charge_id) VALUES (?1, ?2)";
inline constexpr std::string_view kOrders = "SELECT order_key, charge_id FROM sim_orders";
// The in-progress reservation with the oldest lease, as the table holds it (state 1 is
// in_progress), leaving out ?1's keys. Columns: tenant, operation, key, token, lease_until (ms),
// all NULL if there is none. min() takes its other columns from the row it picks (SQLite's
// rule for bare columns beside min), and costs a scan where ORDER BY ... LIMIT 1 built a sorter.
inline constexpr std::string_view kOldestReservation = R"sql(
SELECT tenant, operation, key, token, min(lease_until) FROM idem_keys
WHERE state = 1 AND operation <> ?1)sql";

}  // namespace idem::sim::sql
