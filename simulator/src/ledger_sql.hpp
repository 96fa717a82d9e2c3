// Every SQL statement of the simulated provider's ledger.
#pragma once

#include <string_view>

namespace idem::sim::sql {

// A ledger in memory (no file given) uses 1 KiB pages: its rows are small, and each commit
// copies every page it changes twice (into the rollback journal, then the database).
inline constexpr std::string_view kMemoryPageSize = "PRAGMA page_size = 1024";

// A charge's seq (its id ch_<seq>) is one past the largest present: charges are only ever
// deleted all together, by clear(), so no id is reused while its charge stands, and
// AUTOINCREMENT's sequence table (an extra row to write per charge) is not needed. A ledger
// file made with AUTOINCREMENT by an older version keeps working.
inline constexpr std::string_view kLedgerSchema = R"sql(
CREATE TABLE IF NOT EXISTS charges (
  seq      INTEGER PRIMARY KEY,
  order_id TEXT    NOT NULL,
  amount   INTEGER NOT NULL,
  idem_key TEXT    NOT NULL,
  at       INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS charges_by_key ON charges (idem_key);
)sql";

// ?1 idempotency key: the first charge made with it ('' never matches).
inline constexpr std::string_view kFindByKey =
    "SELECT seq FROM charges WHERE idem_key = ?1 AND idem_key <> '' ORDER BY seq LIMIT 1";
// ?1 idempotency key: the whole first charge made with it ('' never matches).
inline constexpr std::string_view kChargeByKey =
    "SELECT seq, order_id, amount, idem_key, at FROM charges WHERE idem_key = ?1 AND "
    "idem_key <> '' ORDER BY seq LIMIT 1";
// ?1 order ?2 amount ?3 key ?4 at (epoch ms). The new charge's seq is the connection's last
// rowid (a RETURNING clause would build a temporary b-tree per charge).
inline constexpr std::string_view kInsert =
    "INSERT INTO charges (order_id, amount, idem_key, at) VALUES (?1, ?2, ?3, ?4)";
inline constexpr std::string_view kCount = "SELECT count(*) FROM charges";
// ?1 seq ?2 limit: the charges made after charge ch_<?1>, in order.
inline constexpr std::string_view kPage =
    "SELECT seq, order_id, amount, idem_key, at FROM charges WHERE seq > ?1 ORDER BY seq LIMIT ?2";
// Forget every charge; ids start again at ch_1 (a new seq is one past the largest present).
inline constexpr std::string_view kClearCharges = "DELETE FROM charges";
inline constexpr std::string_view kAll =
    "SELECT seq, order_id, amount, idem_key, at FROM charges ORDER BY seq";

}  // namespace idem::sim::sql
