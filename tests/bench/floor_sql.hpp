// Every SQL statement of the benchmark. The floor runs idem's own statements (a ctest entry,
// "bench: the floor runs idem's own statements", checks they are the same text as
// lib/src/sql.hpp's and lib/src/pg_sql.hpp's), so schema and statement costs cancel out of
// the ratios.
#pragma once

#include <string_view>

namespace idem::bench::sql {

// Transactions are the wrappers' (sqlite::Transaction: BEGIN IMMEDIATE ... COMMIT).
inline constexpr std::string_view kSynchronousNormal = "PRAGMA synchronous=NORMAL";
inline constexpr std::string_view kSynchronousFull = "PRAGMA synchronous=FULL";
inline constexpr std::string_view kSynchronousOff = "PRAGMA synchronous=OFF";
inline constexpr std::string_view kBigCache = "PRAGMA cache_size=-262144";
inline constexpr std::string_view kCheckpointTruncate = "PRAGMA wal_checkpoint(TRUNCATE)";

// idem's reservation, completion and load (lib/src/sql.hpp), verbatim.
inline constexpr std::string_view kReserve = R"sql(
INSERT INTO idem_keys (tenant, operation, key, fingerprint, state, token, lease_until, created_at, expires_at, claim)
VALUES (?1, ?2, ?3, ?4, 1, ?5, ?6, ?7, ?6, ?8)
ON CONFLICT (tenant, operation, key) DO NOTHING)sql";

inline constexpr std::string_view kComplete = R"sql(
UPDATE idem_keys
SET state = 2, status = ?5, headers = ?6, body = ?7, body_ref = ?8, expires_at = ?9
WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND token = ?4 AND state = 1)sql";

inline constexpr std::string_view kLoad = R"sql(
SELECT fingerprint, state, token, lease_until, created_at, expires_at, status, headers, body,
       body_ref, recovery_point, claim
FROM idem_keys WHERE tenant = ?1 AND operation = ?2 AND key = ?3)sql";

// The design a user would write from seed 000's SQL without idem: a minimal table (no expiry
// index, no CHECKs, no created_at, headers or recovery point), the reservation with
// INSERT ... ON CONFLICT DO NOTHING RETURNING in one transaction, the token-checked UPDATE in
// a second. ?1 tenant ?2 operation ?3 key.
inline constexpr std::string_view kMinimalSchema = R"sql(
CREATE TABLE IF NOT EXISTS naive_keys (
  tenant      TEXT    NOT NULL,
  operation   TEXT    NOT NULL,
  key         TEXT    NOT NULL,
  state       INTEGER NOT NULL,
  fingerprint BLOB    NOT NULL,
  lease_until INTEGER NOT NULL,
  token       INTEGER NOT NULL,
  status      INTEGER,
  body        BLOB,
  PRIMARY KEY (tenant, operation, key)))sql";
// ?4 fingerprint ?5 lease_until ?6 token; returns the token when the row is new.
inline constexpr std::string_view kMinimalReserve = R"sql(
INSERT INTO naive_keys (tenant, operation, key, state, fingerprint, lease_until, token)
VALUES (?1, ?2, ?3, 1, ?4, ?5, ?6)
ON CONFLICT (tenant, operation, key) DO NOTHING
RETURNING token)sql";
// ?4 token ?5 status ?6 body.
inline constexpr std::string_view kMinimalComplete = R"sql(
UPDATE naive_keys SET state = 2, status = ?5, body = ?6
WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND token = ?4 AND state = 1)sql";
inline constexpr std::string_view kMinimalLoad = R"sql(
SELECT state, token, fingerprint, status, body
FROM naive_keys WHERE tenant = ?1 AND operation = ?2 AND key = ?3)sql";

// Sizing: completed records written straight into idem's table. ?1 key ?2 fingerprint
// ?3 expires_at ?4 body.
inline constexpr std::string_view kBulkInsert = R"sql(
INSERT INTO idem_keys (tenant, operation, key, fingerprint, state, token, lease_until, created_at,
                       expires_at, status, body)
VALUES ('alpha', 'payment.charge', ?1, ?2, 2, 1, 0, 0, ?3, 200, ?4))sql";

// ---- PostgreSQL (the pg section) ----------------------------------------------------------
// idem's reservation, completion and load on PostgreSQL (lib/src/pg_sql.hpp), verbatim, run
// through libpq one statement per round trip, each its own autocommit transaction. `{s}`
// stands for the schema (a quoted identifier), as in pg_sql.hpp.
// $4 fingerprint $5 now (NULL: the database's clock) $6 the lease in ms $7 claim (or NULL);
// returns o_kind (0: reserved) and o_token.
inline constexpr std::string_view kPgReserve =
    "SELECT * FROM {s}.idem_reserve($1, $2, $3, $4::bytea, $5::bigint, $6::bigint, $7::bigint)";

// $4 token $5 status $6 headers $7 body $8 body_ref $9 expires_at
inline constexpr std::string_view kPgComplete = R"sql(
UPDATE {s}.idem_keys
SET state = 2, status = $5::integer, headers = $6::text, body = $7::bytea, body_ref = $8::text,
    expires_at = $9::bigint
WHERE tenant = $1 AND operation = $2 AND key = $3 AND token = $4::bigint AND state = 1)sql";

inline constexpr std::string_view kPgLoad = R"sql(
SELECT fingerprint, state, token, lease_until, created_at, expires_at, status, headers, body,
       body_ref, recovery_point, claim
FROM {s}.idem_keys WHERE tenant = $1 AND operation = $2 AND key = $3)sql";

// Every scenario starts on an empty schema, which PgStore then makes again.
inline constexpr std::string_view kPgDropSchema = "DROP SCHEMA IF EXISTS {s} CASCADE";

}  // namespace idem::bench::sql
