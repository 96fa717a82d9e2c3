// Every SQL statement and pragma SqliteStore runs, as named constants. The store prepares
// the statements when it opens, so a typo fails the first test that opens a store.
// (Transactions and the WAL switch are the wrappers': lib/sqlite/src/sql.hpp.)
#pragma once

#include <array>
#include <string_view>

namespace idem::sql {

// Migrations, applied in order inside one BEGIN IMMEDIATE transaction; the database's
// PRAGMA user_version is how many have run. Append, never edit.
inline constexpr std::array<std::string_view, 2> kMigrations = {
    // v1: one record per (tenant, operation, key). state: 1 in_progress, 2 completed,
    // 3 released. Times are milliseconds since the Unix epoch. expires_at is when the
    // record stops counting (the lease's end while in progress, the TTL's end once
    // completed, the release time once released); its one index serves both purge and
    // the reaper, and costs one index page per write.
    R"sql(
CREATE TABLE idem_keys (
  tenant         TEXT    NOT NULL,
  operation      TEXT    NOT NULL,
  key            TEXT    NOT NULL,
  fingerprint    BLOB    NOT NULL CHECK (length(fingerprint) = 32),
  state          INTEGER NOT NULL CHECK (state IN (1, 2, 3)),
  token          INTEGER NOT NULL,
  lease_until    INTEGER NOT NULL,
  created_at     INTEGER NOT NULL,
  expires_at     INTEGER NOT NULL,
  status         INTEGER,
  headers        TEXT,
  body           BLOB,
  body_ref       TEXT,
  recovery_point TEXT,
  PRIMARY KEY (tenant, operation, key)
) STRICT, WITHOUT ROWID;
CREATE INDEX idem_keys_expiry ON idem_keys (expires_at);
)sql",
    // v2: the state CHECK as a range. SQLite evaluates `state IN (1, 2, 3)` by building a
    // temporary b-tree of the three values on every INSERT and UPDATE (a fifth of the CPU of
    // a protected call). A CHECK cannot be altered, so the table is rebuilt.
    R"sql(
CREATE TABLE idem_keys_v2 (
  tenant         TEXT    NOT NULL,
  operation      TEXT    NOT NULL,
  key            TEXT    NOT NULL,
  fingerprint    BLOB    NOT NULL CHECK (length(fingerprint) = 32),
  state          INTEGER NOT NULL CHECK (state BETWEEN 1 AND 3),
  token          INTEGER NOT NULL,
  lease_until    INTEGER NOT NULL,
  created_at     INTEGER NOT NULL,
  expires_at     INTEGER NOT NULL,
  status         INTEGER,
  headers        TEXT,
  body           BLOB,
  body_ref       TEXT,
  recovery_point TEXT,
  PRIMARY KEY (tenant, operation, key)
) STRICT, WITHOUT ROWID;
INSERT INTO idem_keys_v2 SELECT * FROM idem_keys;
DROP TABLE idem_keys;
ALTER TABLE idem_keys_v2 RENAME TO idem_keys;
CREATE INDEX idem_keys_expiry ON idem_keys (expires_at);
)sql",
};

inline constexpr std::string_view kSynchronousNormal = "PRAGMA synchronous=NORMAL";
inline constexpr std::string_view kSynchronousFull = "PRAGMA synchronous=FULL";
inline constexpr std::string_view kUserVersion = "PRAGMA user_version";
// A format string: the version is an integer the migration driver writes.
inline constexpr std::string_view kSetUserVersion = "PRAGMA user_version = {}";

// ?1 tenant ?2 operation ?3 key ?4 fingerprint ?5 token (= now) ?6 lease_until ?7 now.
// Changes one row only if the key was absent (sqlite3_changes() says which; a RETURNING
// clause would cost a temporary b-tree per call).
inline constexpr std::string_view kReserve = R"sql(
INSERT INTO idem_keys (tenant, operation, key, fingerprint, state, token, lease_until, created_at, expires_at)
VALUES (?1, ?2, ?3, ?4, 1, ?5, ?6, ?7, ?6)
ON CONFLICT (tenant, operation, key) DO NOTHING)sql";

// Replaces a record that no longer counts with a new reservation. ?4 fingerprint
// ?5 new token ?6 lease_until ?7 now ?8 recovery point to keep (or NULL) ?9 the token
// read in the same transaction.
inline constexpr std::string_view kReplaceDead = R"sql(
UPDATE idem_keys
SET fingerprint = ?4, state = 1, token = ?5, lease_until = ?6, created_at = ?7, expires_at = ?6,
    status = NULL, headers = NULL, body = NULL, body_ref = NULL, recovery_point = ?8
WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND token = ?9)sql";

inline constexpr std::string_view kLoad = R"sql(
SELECT fingerprint, state, token, lease_until, created_at, expires_at, status, headers, body,
       body_ref, recovery_point
FROM idem_keys WHERE tenant = ?1 AND operation = ?2 AND key = ?3)sql";

// ?4 token ?5 status ?6 headers ?7 body ?8 body_ref ?9 expires_at
inline constexpr std::string_view kComplete = R"sql(
UPDATE idem_keys
SET state = 2, status = ?5, headers = ?6, body = ?7, body_ref = ?8, expires_at = ?9
WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND token = ?4 AND state = 1)sql";

// ?4 token ?5 now
inline constexpr std::string_view kRelease = R"sql(
UPDATE idem_keys SET state = 3, expires_at = ?5
WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND token = ?4 AND state = 1)sql";

// ?4 token ?5 lease_until
inline constexpr std::string_view kRenew = R"sql(
UPDATE idem_keys SET lease_until = ?5, expires_at = ?5
WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND token = ?4 AND state = 1)sql";

// ?4 token ?5 recovery point
inline constexpr std::string_view kSetRecoveryPoint = R"sql(
UPDATE idem_keys SET recovery_point = ?5
WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND token = ?4 AND state = 1)sql";

// InFlight::run: a completed record straight away. ?4 fingerprint ?5 token (= now)
// ?6 now ?7 expires_at ?8 status ?9 headers ?10 body ?11 body_ref. Changes one row only if
// the key was absent.
inline constexpr std::string_view kInsertCompleted = R"sql(
INSERT INTO idem_keys (tenant, operation, key, fingerprint, state, token, lease_until, created_at,
                       expires_at, status, headers, body, body_ref)
VALUES (?1, ?2, ?3, ?4, 2, ?5, ?6, ?6, ?7, ?8, ?9, ?10, ?11)
ON CONFLICT (tenant, operation, key) DO NOTHING)sql";

// ?1 now ?2 limit
inline constexpr std::string_view kPurge = R"sql(
DELETE FROM idem_keys
WHERE (tenant, operation, key) IN (
  SELECT tenant, operation, key FROM idem_keys
  WHERE expires_at <= ?1 AND state <> 1
  ORDER BY expires_at LIMIT ?2))sql";

// ?1 lease ended before ?2 limit
inline constexpr std::string_view kReap = R"sql(
DELETE FROM idem_keys
WHERE (tenant, operation, key) IN (
  SELECT tenant, operation, key FROM idem_keys
  WHERE expires_at < ?1 AND state = 1
  ORDER BY expires_at LIMIT ?2)
RETURNING tenant, operation, key, token, lease_until)sql";

}  // namespace idem::sql
