// Every SQL statement and pragma SqliteStore runs, as named constants. The store prepares
// the statements when it opens, so a typo fails the first test that opens a store.
// (Transactions and the WAL switch are the wrappers': lib/sqlite/src/sql.hpp.)
#pragma once

#include <array>
#include <string_view>

namespace idem::sql {

// Migrations, applied in order inside one BEGIN IMMEDIATE transaction; the database's
// PRAGMA user_version is how many have run. Append, never edit.
inline constexpr std::array<std::string_view, 5> kMigrations = {
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
    // v3: multi-step operations. progress is JSON {"origin", "steps":
    // [[step, result, reconciled]...], "pending"}; request is what the completer resumes
    // with. The partial index holds only unfinished multi-step records, for the completer.
    // The outbox: state 0 pending, 1 delivered, 2 parked; next_at is when a pending message
    // is due (or, once delivered or parked, when that happened).
    R"sql(
ALTER TABLE idem_keys ADD COLUMN progress TEXT;
ALTER TABLE idem_keys ADD COLUMN request BLOB;
CREATE INDEX idem_keys_open ON idem_keys (lease_until) WHERE state <> 2 AND request IS NOT NULL;
CREATE TABLE idem_outbox (
  id         TEXT    NOT NULL PRIMARY KEY,
  topic      TEXT    NOT NULL,
  payload    BLOB    NOT NULL,
  key_hash   TEXT    NOT NULL,
  state      INTEGER NOT NULL CHECK (state BETWEEN 0 AND 2),
  attempts   INTEGER NOT NULL,
  next_at    INTEGER NOT NULL,
  created_at INTEGER NOT NULL,
  last_error TEXT
) STRICT, WITHOUT ROWID;
CREATE INDEX idem_outbox_due ON idem_outbox (state, next_at);
)sql",
    // v4: the claim a reservation's writer chose (Record::claim), so that a writer whose reply
    // was lost can tell its own reservation from another's.
    R"sql(
ALTER TABLE idem_keys ADD COLUMN claim INTEGER;
)sql",
    // v5: the expiry index becomes a table of due times that a completion does not touch. The
    // index moved a record's entry from its lease's end to its TTL's end on every completion
    // (and on every renewal): two more index pages in the completion's commit, on the request
    // path. idem_due holds, for each record, at least one time no later than its expires_at:
    // the triggers add one whenever a write makes expires_at earlier than it was (or inserts
    // a record), and nothing else on the request path writes here. Maintenance takes the due
    // entries in time order (sql::kDueScan) and, for each, deletes the record if it is dead,
    // reaps it if its lease ended long ago, or moves the entry to the record's expires_at when
    // that is later (a completed record's entry, made at its reservation, moves once, in a
    // batch of neighbouring entries; a renewed lease's entry moves once per lease at most).
    // An entry whose record is gone is dropped when its time comes.
    R"sql(
CREATE TABLE idem_due (
  due_at    INTEGER NOT NULL,
  tenant    TEXT    NOT NULL,
  operation TEXT    NOT NULL,
  key       TEXT    NOT NULL,
  PRIMARY KEY (due_at, tenant, operation, key)
) STRICT, WITHOUT ROWID;
INSERT INTO idem_due SELECT expires_at, tenant, operation, key FROM idem_keys;
DROP INDEX idem_keys_expiry;
CREATE TRIGGER idem_keys_due_on_insert AFTER INSERT ON idem_keys BEGIN
  INSERT OR IGNORE INTO idem_due VALUES (NEW.expires_at, NEW.tenant, NEW.operation, NEW.key);
END;
CREATE TRIGGER idem_keys_due_sooner AFTER UPDATE OF expires_at ON idem_keys
WHEN NEW.expires_at < OLD.expires_at BEGIN
  INSERT OR IGNORE INTO idem_due VALUES (NEW.expires_at, NEW.tenant, NEW.operation, NEW.key);
END;
)sql",
};

inline constexpr std::string_view kSynchronousNormal = "PRAGMA synchronous=NORMAL";
inline constexpr std::string_view kSynchronousFull = "PRAGMA synchronous=FULL";
inline constexpr std::string_view kUserVersion = "PRAGMA user_version";
// A format string: the version is an integer the migration driver writes.
inline constexpr std::string_view kSetUserVersion = "PRAGMA user_version = {}";

// ?1 tenant ?2 operation ?3 key ?4 fingerprint ?5 token (= now) ?6 lease_until ?7 now
// ?8 claim. Changes one row only if the key was absent (sqlite3_changes() says which; a
// RETURNING clause would cost a temporary b-tree per call).
inline constexpr std::string_view kReserve = R"sql(
INSERT INTO idem_keys (tenant, operation, key, fingerprint, state, token, lease_until, created_at, expires_at, claim)
VALUES (?1, ?2, ?3, ?4, 1, ?5, ?6, ?7, ?6, ?8)
ON CONFLICT (tenant, operation, key) DO NOTHING)sql";

// Replaces a record that no longer counts with a new reservation. ?4 fingerprint
// ?5 new token ?6 lease_until ?7 now ?8 1: resume (keep the recovery point and progress),
// 0: start afresh ?9 the token read in the same transaction ?10 claim.
inline constexpr std::string_view kReplaceDead = R"sql(
UPDATE idem_keys
SET fingerprint = ?4, state = 1, token = ?5, lease_until = ?6, created_at = ?7, expires_at = ?6,
    claim = ?10, status = NULL, headers = NULL, body = NULL, body_ref = NULL,
    recovery_point = CASE WHEN ?8 THEN recovery_point END,
    progress = CASE WHEN ?8 THEN progress END,
    request = CASE WHEN ?8 THEN request END
WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND token = ?9)sql";

// Whether the record has progress (a multi-step operation under way).
inline constexpr std::string_view kHasProgress = R"sql(
SELECT progress IS NOT NULL FROM idem_keys WHERE tenant = ?1 AND operation = ?2 AND key = ?3)sql";

// ?1..?3 the key: state, token, progress, request.
inline constexpr std::string_view kLoadProgress = R"sql(
SELECT state, token, progress, request FROM idem_keys
WHERE tenant = ?1 AND operation = ?2 AND key = ?3)sql";

// ?4 token ?5 request. Stores the request once; a resume keeps it. (progress stays NULL until
// the first step is recorded or marked pending: NULL means nothing happened yet.)
inline constexpr std::string_view kBeginSteps = R"sql(
UPDATE idem_keys SET request = coalesce(request, ?5)
WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND token = ?4 AND state = 1)sql";

// An external step marked pending (StepStore::mark_pending): ?4 token ?5 progress (JSON) ?6 the
// time the lease must still run at ?7 the time it is renewed to, if it ends sooner. (SQLite
// evaluates every SET expression on the row as it was.)
inline constexpr std::string_view kMarkPending = R"sql(
UPDATE idem_keys SET progress = ?5, lease_until = max(lease_until, ?7), expires_at = max(lease_until, ?7)
WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND token = ?4 AND state = 1 AND lease_until >= ?6)sql";

// ?4 token ?5 progress (JSON) ?6 recovery point (or NULL)
inline constexpr std::string_view kSetProgress = R"sql(
UPDATE idem_keys SET progress = ?5, recovery_point = coalesce(?6, recovery_point)
WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND token = ?4 AND state = 1)sql";

// ?1 idle before ?2 now ?3 limit ?4 the operations asked for (a JSON array). Operations that
// made progress only (one that never began is the reaper's). Uses idem_keys_open (its WHERE
// terms are repeated).
inline constexpr std::string_view kAbandoned = R"sql(
SELECT tenant, operation, key, fingerprint, state, request FROM idem_keys
WHERE state <> 2 AND request IS NOT NULL AND lease_until < ?1
  AND progress IS NOT NULL AND (state = 1 OR expires_at > ?2)
  AND operation IN (SELECT value FROM json_each(?4))
ORDER BY lease_until LIMIT ?3)sql";

// ?1 id ?2 topic ?3 payload ?4 key_hash ?5 now. The same message of a retried step is
// queued once.
inline constexpr std::string_view kOutboxInsert = R"sql(
INSERT INTO idem_outbox (id, topic, payload, key_hash, state, attempts, next_at, created_at)
VALUES (?1, ?2, ?3, ?4, 0, 0, ?5, ?5)
ON CONFLICT (id) DO NOTHING)sql";

// ?1 now: whether a message is due (a read, so an idle dispatcher never takes the write lock)
inline constexpr std::string_view kOutboxAnyDue =
    "SELECT 1 FROM idem_outbox WHERE state = 0 AND next_at <= ?1 LIMIT 1";

// ?1 now ?2 claimed until ?3 limit
inline constexpr std::string_view kOutboxClaim = R"sql(
UPDATE idem_outbox SET next_at = ?2
WHERE id IN (SELECT id FROM idem_outbox WHERE state = 0 AND next_at <= ?1
             ORDER BY next_at LIMIT ?3)
RETURNING id, topic, payload, attempts, created_at)sql";

// ?1 id ?2 now
inline constexpr std::string_view kOutboxDelivered = R"sql(
UPDATE idem_outbox SET state = 1, next_at = ?2, last_error = NULL WHERE id = ?1 AND state = 0)sql";

// ?1 id ?2 due again at (or parked at) ?3 1: park ?4 why
inline constexpr std::string_view kOutboxFailed = R"sql(
UPDATE idem_outbox SET attempts = attempts + 1, next_at = ?2, last_error = ?4,
                       state = CASE WHEN ?3 THEN 2 ELSE 0 END
WHERE id = ?1 AND state = 0)sql";

inline constexpr std::string_view kOutboxCounts =
    "SELECT state, count(*) FROM idem_outbox GROUP BY state";

// ?1 delivered before ?2 limit
inline constexpr std::string_view kOutboxPurge = R"sql(
DELETE FROM idem_outbox
WHERE id IN (SELECT id FROM idem_outbox WHERE state = 1 AND next_at < ?1 LIMIT ?2))sql";

inline constexpr std::string_view kLoad = R"sql(
SELECT fingerprint, state, token, lease_until, created_at, expires_at, status, headers, body,
       body_ref, recovery_point, claim
FROM idem_keys WHERE tenant = ?1 AND operation = ?2 AND key = ?3)sql";

// ?4 token ?5 status ?6 headers ?7 body ?8 body_ref ?9 expires_at
inline constexpr std::string_view kComplete = R"sql(
UPDATE idem_keys
SET state = 2, status = ?5, headers = ?6, body = ?7, body_ref = ?8, expires_at = ?9
WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND token = ?4 AND state = 1)sql";

// ?4 token ?5 now ?6 the TTL in ms. A record with progress is kept for its retry until the
// TTL counted from the operation's origin (a token, which is at least the epoch ms of its
// reservation), so failing again never extends it. lease_until becomes the release time
// (the completer's "idle since").
inline constexpr std::string_view kRelease = R"sql(
UPDATE idem_keys
SET state = 3, lease_until = ?5,
    expires_at = CASE WHEN progress IS NULL THEN ?5
                      ELSE max(?5, json_extract(progress, '$.origin') + ?6) END
WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND token = ?4 AND state = 1)sql";

// ?4 token ?5 lease_until
inline constexpr std::string_view kRenew = R"sql(
UPDATE idem_keys SET lease_until = ?5, expires_at = ?5
WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND token = ?4 AND state = 1)sql";

// InFlight::run: a completed record straight away. ?4 fingerprint ?5 token (= now)
// ?6 now ?7 expires_at ?8 status ?9 headers ?10 body ?11 body_ref. Changes one row only if
// the key was absent.
inline constexpr std::string_view kInsertCompleted = R"sql(
INSERT INTO idem_keys (tenant, operation, key, fingerprint, state, token, lease_until, created_at,
                       expires_at, status, headers, body, body_ref)
VALUES (?1, ?2, ?3, ?4, 2, ?5, ?6, ?6, ?7, ?8, ?9, ?10, ?11)
ON CONFLICT (tenant, operation, key) DO NOTHING)sql";

// Maintenance's walk over idem_due (see migration v5): ?1 the latest due time taken ?2..?5 the
// last entry of the previous batch (0, '', '', '' for the first) ?6 limit. Each entry with its
// record's state, token, lease_until, expires_at and whether it has progress (NULLs when the
// record is gone).
inline constexpr std::string_view kDueScan = R"sql(
SELECT d.due_at, d.tenant, d.operation, d.key, k.state, k.token, k.lease_until, k.expires_at,
       k.progress IS NOT NULL
FROM idem_due d LEFT JOIN idem_keys k
  ON k.tenant = d.tenant AND k.operation = d.operation AND k.key = d.key
WHERE d.due_at <= ?1 AND (d.due_at, d.tenant, d.operation, d.key) > (?2, ?3, ?4, ?5)
ORDER BY d.due_at, d.tenant, d.operation, d.key LIMIT ?6)sql";

// ?1 due_at ?2..?4 the key
inline constexpr std::string_view kDueDelete = R"sql(
DELETE FROM idem_due WHERE due_at = ?1 AND tenant = ?2 AND operation = ?3 AND key = ?4)sql";

// ?1 due_at ?2..?4 the key. Another entry of the record may be there already.
inline constexpr std::string_view kDueInsert = R"sql(
INSERT INTO idem_due (due_at, tenant, operation, key) VALUES (?1, ?2, ?3, ?4)
ON CONFLICT DO NOTHING)sql";

// ?1..?3 the key ?4 token: purge and the reaper delete the record they read.
inline constexpr std::string_view kDeleteRecord = R"sql(
DELETE FROM idem_keys WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND token = ?4)sql";

// migrate_sqlite_to_pg (idem/migrate.hpp) reads the store with these.
// The tables an idem store has (2 in one of schema version 3 or later).
inline constexpr std::string_view kIdemTables = R"sql(
SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name IN ('idem_keys', 'idem_outbox'))sql";

// ?1..?3 the last key of the previous batch ('', '', '' for the first) ?4 limit. Every column,
// in key order (the primary key's).
inline constexpr std::string_view kExportRecords = R"sql(
SELECT tenant, operation, key, fingerprint, state, token, lease_until, created_at, expires_at,
       status, headers, body, body_ref, recovery_point, progress, request, claim
FROM idem_keys WHERE (tenant, operation, key) > (?1, ?2, ?3)
ORDER BY tenant, operation, key LIMIT ?4)sql";

// ?1 the last id of the previous batch ('' for the first) ?2 limit. Messages not yet
// delivered (pending or parked), in id order.
inline constexpr std::string_view kExportOutbox = R"sql(
SELECT id, topic, payload, key_hash, state, attempts, next_at, created_at, last_error
FROM idem_outbox WHERE state <> 1 AND id > ?1 ORDER BY id LIMIT ?2)sql";

}  // namespace idem::sql
