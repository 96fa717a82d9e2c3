// Every SQL statement of the conformance fixture (conformance_app.cpp): what it does to idem's
// own table from outside the layer, in SQLite's dialect.
#pragma once

#include <string_view>

namespace idem::demo::sql {

// POST /_fixture/corrupt: the record's headers column made something that is not a JSON
// array, so the record no longer decodes (idem::CorruptRecordError). ?1 tenant ?2 operation
// ?3 key. One row changed: a record was damaged; none: there was no record.
inline constexpr std::string_view kCorruptHeaders =
    "UPDATE idem_keys SET headers = 'not json' WHERE tenant = ?1 AND operation = ?2 AND key = ?3";

// ConformanceOptions::handwritten: idempotency by hand, seed 000's design in its own table
// (no idem). ?1 tenant ?2 operation ?3 key.
inline constexpr std::string_view kHandSchema = R"sql(
CREATE TABLE IF NOT EXISTS hand_keys (
  tenant      TEXT    NOT NULL,
  operation   TEXT    NOT NULL,
  key         TEXT    NOT NULL,
  state       INTEGER NOT NULL,  -- 1 in flight, 2 answered
  fingerprint BLOB    NOT NULL,
  status      INTEGER,
  body        BLOB,
  PRIMARY KEY (tenant, operation, key)))sql";
// SqliteStore's default durability (WAL, synchronous=NORMAL), for a fair comparison.
inline constexpr std::string_view kHandSynchronous = "PRAGMA synchronous=NORMAL";
// ?4 fingerprint; returns a row when the key is new (this request runs).
inline constexpr std::string_view kHandReserve = R"sql(
INSERT INTO hand_keys (tenant, operation, key, state, fingerprint) VALUES (?1, ?2, ?3, 1, ?4)
ON CONFLICT (tenant, operation, key) DO NOTHING RETURNING state)sql";
inline constexpr std::string_view kHandLoad = R"sql(
SELECT state, fingerprint, status, body FROM hand_keys
WHERE tenant = ?1 AND operation = ?2 AND key = ?3)sql";
// ?4 status ?5 body.
inline constexpr std::string_view kHandComplete = R"sql(
UPDATE hand_keys SET state = 2, status = ?4, body = ?5
WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND state = 1)sql";
// A 5xx or an exception: the key is free again.
inline constexpr std::string_view kHandRelease = R"sql(
DELETE FROM hand_keys WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND state = 1)sql";

}  // namespace idem::demo::sql
