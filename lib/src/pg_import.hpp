// migrate_sqlite_to_pg's way into a PgStore (a friend of it): rows as an engine's columns
// hold them (sql.hpp's idem_keys and idem_outbox), written in one transaction per batch with
// pg_sql::kImportRecord and kImportMessage.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "idem/key.hpp"
#include "idem/pg_store.hpp"

namespace idem::detail {

// One record's columns. Times are on the caller's clock (PgOptions::local_clock), as every
// time a PgStore is given; NULL columns are nullopt.
struct RecordRow {
  KeyId id;
  std::string fingerprint;  // 32 bytes
  std::int64_t state = 0;   // 1 in_progress, 2 completed, 3 released
  std::int64_t token = 0;   // written as given
  TimePoint lease_until, created_at, expires_at;
  std::optional<std::int64_t> status;
  std::optional<std::string> headers;  // JSON, as record_codec.hpp keeps them
  std::optional<std::string> body;
  std::optional<std::string> body_ref;
  std::optional<std::string> recovery_point;
  std::optional<std::string> progress;  // JSON, as record_codec.hpp keeps it
  std::optional<std::string> request;
  std::optional<std::int64_t> claim;
  bool refresh_only = false;  // bring an existing row up to date; never insert one
};

// One outbox message's columns; times on the caller's clock.
struct MessageRow {
  std::string id;
  std::string topic;
  std::string payload;
  std::string key_hash;
  std::int64_t state = 0;  // 0 pending, 2 parked
  std::int64_t attempts = 0;
  TimePoint next_at, created_at;
  std::optional<std::string> last_error;
};

struct PgImport {
  enum class Outcome {
    written,    // inserted, or written over a row at a lower token or an older copy
    unchanged,  // an earlier copy, the same
    newer,      // a row at a higher token: left alone
    absent,     // refresh_only, and there was no row
  };
  // Writes `rows` in one transaction, in their order (key order keeps the locks in the order
  // PgStore::apply takes them). Throws StoreError; then nothing of the batch was written.
  static std::vector<Outcome> records(PgStore& store, std::span<const RecordRow> rows);
  // Inserts `rows` in one transaction; true for each message inserted, false for one that
  // was there already. Throws StoreError; then nothing of the batch was written.
  static std::vector<bool> messages(PgStore& store, std::span<const MessageRow> rows);
};

}  // namespace idem::detail
