// Every SQL statement PgStore runs, as named constants. `{s}` stands for the store's schema
// (a quoted identifier), put in when the store connects; parameters are $1..$N, with
// tenant $1, operation $2, key $3 wherever a statement names one record. Times are epoch
// milliseconds (bigint), as in SQLite's schema (sql.hpp), so a record moves between the two
// engines unchanged.
#pragma once

#include <array>
#include <string_view>

namespace idem::pg_sql {

// BEGIN, COMMIT and ROLLBACK are the connection's: idem/internal/connection_sql.hpp.

// Wake-ups (PgOptions::notify). A format string: the channel as a quoted identifier.
inline constexpr std::string_view kListen = "LISTEN {}";
// $1 the channel, $2 a JSON array of payloads (each [tenant, operation, key] as JSON): one
// statement per batch, so its transaction takes NOTIFY's commit lock once; delivered to the
// listeners when the batch commits, never if it rolls back.
inline constexpr const char* kNotify =
    "SELECT pg_notify($1, value) FROM json_array_elements_text($2::json)";
// A format string: the limit in milliseconds.
inline constexpr std::string_view kStatementTimeout = "SET statement_timeout = {}";
// idem_reserve and the token-checked writes are written for READ COMMITTED (each statement
// sees what committed before it); a database or role whose default is stricter would turn
// a duplicate's reservation into a serialization failure instead of "existing".
inline constexpr const char* kReadCommitted =
    "SET default_transaction_isolation = 'read committed'";
// A format string: the quoted schema. Local steps' unqualified names (the application's
// tables) resolve in the store's schema first; idem's own statements name it explicitly.
inline constexpr std::string_view kSearchPath = "SET search_path = {}, public";
// A format string: a quoted literal naming the schema. Nodes that start together migrate one
// after another; the lock ends with the transaction.
inline constexpr std::string_view kMigrationLock = "SELECT pg_advisory_xact_lock(hashtext({}))";

// The command tags (PQcmdStatus) of the statements whose changed rows a local step's
// changes() reports.
inline constexpr std::array<std::string_view, 4> kWriteCommandTags = {"INSERT", "UPDATE", "DELETE",
                                                                      "MERGE"};

// The version table, made before the migrations run (under the advisory lock).
inline constexpr std::string_view kCreateMeta = R"sql(
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.idem_meta (version integer NOT NULL))sql";
inline constexpr std::string_view kVersion = "SELECT version FROM {s}.idem_meta";
inline constexpr std::string_view kSetVersion = R"sql(
DELETE FROM {s}.idem_meta;
INSERT INTO {s}.idem_meta (version) VALUES ({v}))sql";

// Migrations, applied in order in one transaction; idem_meta.version is how many have run.
// Append, never edit.
inline constexpr std::array<std::string_view, 2> kMigrations = {
    // v1: the records, the outbox and the two write functions, as SQLite's schema v3 keeps
    // them (sql.hpp). state: 1 in_progress, 2 completed, 3 released. The body is bytea: a
    // replay is byte for byte.
    R"sql(
CREATE TABLE {s}.idem_keys (
  tenant         text     NOT NULL,
  operation      text     NOT NULL,
  key            text     NOT NULL,
  fingerprint    bytea    NOT NULL CHECK (length(fingerprint) = 32),
  state          smallint NOT NULL CHECK (state BETWEEN 1 AND 3),
  token          bigint   NOT NULL,
  lease_until    bigint   NOT NULL,
  created_at     bigint   NOT NULL,
  expires_at     bigint   NOT NULL,
  status         integer,
  headers        text,
  body           bytea,
  body_ref       text,
  recovery_point text,
  progress       text,
  request        bytea,
  PRIMARY KEY (tenant, operation, key)
);
CREATE INDEX idem_keys_expiry ON {s}.idem_keys (expires_at);
CREATE INDEX idem_keys_open ON {s}.idem_keys (lease_until) WHERE state <> 2 AND request IS NOT NULL;
CREATE TABLE {s}.idem_outbox (
  id         text     NOT NULL PRIMARY KEY,
  topic      text     NOT NULL,
  payload    bytea    NOT NULL,
  key_hash   text     NOT NULL,
  state      smallint NOT NULL CHECK (state BETWEEN 0 AND 2),
  attempts   integer  NOT NULL,
  next_at    bigint   NOT NULL,
  created_at bigint   NOT NULL,
  last_error text
);
CREATE INDEX idem_outbox_due ON {s}.idem_outbox (state, next_at);

-- The reservation in one statement (Store::reserve): a new record if the key is absent;
-- otherwise, under the row's lock, the live record back (o_kind 2), or a record that no
-- longer counts replaced by this reservation (o_kind 0, or 1 for a takeover of an expired
-- lease) with a token past every earlier one of the key and past the clock. A record with
-- progress keeps its key for its own request: the rule of reserve_rule.hpp, which
-- tests/reserve_rule_test.cpp holds this function to, case by case.
CREATE FUNCTION {s}.idem_reserve(
    p_tenant text, p_operation text, p_key text, p_fp bytea, p_now bigint, p_lease bigint,
    OUT o_kind smallint, OUT o_token bigint, OUT o_point text,
    OUT e_fingerprint bytea, OUT e_state smallint, OUT e_token bigint, OUT e_lease_until bigint,
    OUT e_created_at bigint, OUT e_expires_at bigint, OUT e_status integer, OUT e_headers text,
    OUT e_body bytea, OUT e_body_ref text, OUT e_recovery_point text)
LANGUAGE plpgsql AS $$
DECLARE
  r {s}.idem_keys%ROWTYPE;
  has_progress boolean;
  same boolean;
  takeover boolean;
  resume boolean;
BEGIN
  LOOP
    INSERT INTO {s}.idem_keys (tenant, operation, key, fingerprint, state, token, lease_until,
                               created_at, expires_at)
    VALUES (p_tenant, p_operation, p_key, p_fp, 1, p_now, p_lease, p_now, p_lease)
    ON CONFLICT (tenant, operation, key) DO NOTHING;
    IF FOUND THEN
      o_kind := 0;
      o_token := p_now;
      RETURN;
    END IF;
    SELECT * INTO r FROM {s}.idem_keys k
    WHERE k.tenant = p_tenant AND k.operation = p_operation AND k.key = p_key FOR UPDATE;
    EXIT WHEN FOUND;  -- else purged in between: insert again
  END LOOP;
  has_progress := r.progress IS NOT NULL;
  same := r.fingerprint = p_fp;
  IF (r.state = 1 AND p_now < r.lease_until) OR (r.state = 2 AND p_now < r.expires_at)
     OR (has_progress AND NOT same
         AND (r.state = 1 OR (r.state = 3 AND p_now < r.expires_at))) THEN
    o_kind := 2;
    e_fingerprint := r.fingerprint; e_state := r.state; e_token := r.token;
    e_lease_until := r.lease_until; e_created_at := r.created_at; e_expires_at := r.expires_at;
    e_status := r.status; e_headers := r.headers; e_body := r.body; e_body_ref := r.body_ref;
    e_recovery_point := r.recovery_point;
    RETURN;
  END IF;
  takeover := r.state = 1;
  resume := same AND (takeover OR (has_progress AND r.state = 3 AND p_now < r.expires_at));
  o_kind := CASE WHEN takeover THEN 1 ELSE 0 END;
  o_token := greatest(r.token + 1, p_now);
  IF resume THEN o_point := r.recovery_point; END IF;
  UPDATE {s}.idem_keys k
  SET fingerprint = p_fp, state = 1, token = o_token, lease_until = p_lease, created_at = p_now,
      expires_at = p_lease, status = NULL, headers = NULL, body = NULL, body_ref = NULL,
      recovery_point = CASE WHEN resume THEN k.recovery_point END,
      progress = CASE WHEN resume THEN k.progress END,
      request = CASE WHEN resume THEN k.request END
  WHERE k.tenant = p_tenant AND k.operation = p_operation AND k.key = p_key;
END $$;

-- InFlight::run's write (Store::store_if_absent): a completed record straight away, unless a
-- live record holds the key (then o_stored is false and the e_ columns are that record).
CREATE FUNCTION {s}.idem_store_if_absent(
    p_tenant text, p_operation text, p_key text, p_fp bytea, p_now bigint, p_expires bigint,
    p_status integer, p_headers text, p_body bytea, p_body_ref text,
    OUT o_stored boolean,
    OUT e_fingerprint bytea, OUT e_state smallint, OUT e_token bigint, OUT e_lease_until bigint,
    OUT e_created_at bigint, OUT e_expires_at bigint, OUT e_status integer, OUT e_headers text,
    OUT e_body bytea, OUT e_body_ref text, OUT e_recovery_point text)
LANGUAGE plpgsql AS $$
DECLARE
  r {s}.idem_keys%ROWTYPE;
BEGIN
  LOOP
    INSERT INTO {s}.idem_keys (tenant, operation, key, fingerprint, state, token, lease_until,
                               created_at, expires_at, status, headers, body, body_ref)
    VALUES (p_tenant, p_operation, p_key, p_fp, 2, p_now, p_now, p_now, p_expires, p_status,
            p_headers, p_body, p_body_ref)
    ON CONFLICT (tenant, operation, key) DO NOTHING;
    IF FOUND THEN
      o_stored := true;
      RETURN;
    END IF;
    SELECT * INTO r FROM {s}.idem_keys k
    WHERE k.tenant = p_tenant AND k.operation = p_operation AND k.key = p_key FOR UPDATE;
    EXIT WHEN FOUND;
  END LOOP;
  IF (r.state = 1 AND p_now < r.lease_until) OR (r.state = 2 AND p_now < r.expires_at) THEN
    o_stored := false;
    e_fingerprint := r.fingerprint; e_state := r.state; e_token := r.token;
    e_lease_until := r.lease_until; e_created_at := r.created_at; e_expires_at := r.expires_at;
    e_status := r.status; e_headers := r.headers; e_body := r.body; e_body_ref := r.body_ref;
    e_recovery_point := r.recovery_point;
    RETURN;
  END IF;
  UPDATE {s}.idem_keys k
  SET fingerprint = p_fp, state = 2, token = greatest(r.token + 1, p_now), lease_until = p_now,
      created_at = p_now, expires_at = p_expires, status = p_status, headers = p_headers,
      body = p_body, body_ref = p_body_ref, recovery_point = NULL, progress = NULL, request = NULL
  WHERE k.tenant = p_tenant AND k.operation = p_operation AND k.key = p_key;
  o_stored := true;
END $$;
)sql",
    // v2: the database's clock as a function; the claim a reservation's writer chose
    // (Record::claim); and idem_reserve on the database's clock: given no p_now, it judges the
    // record at the moment it runs and starts the lease (p_lease, a duration) then, so a
    // reservation that arrives late never writes a lease that has already ended. (v1's
    // idem_reserve stays, for nodes not yet upgraded.) Its rule is reserve_rule.hpp's, held to
    // it by tests/reserve_rule_test.cpp.
    R"sql(
ALTER TABLE {s}.idem_keys ADD COLUMN claim bigint;
CREATE FUNCTION {s}.idem_now() RETURNS bigint LANGUAGE sql VOLATILE
AS $$ SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint $$;

CREATE FUNCTION {s}.idem_reserve(
    p_tenant text, p_operation text, p_key text, p_fp bytea, p_now bigint, p_lease bigint,
    p_claim bigint,
    OUT o_kind smallint, OUT o_token bigint, OUT o_point text,
    OUT e_fingerprint bytea, OUT e_state smallint, OUT e_token bigint, OUT e_lease_until bigint,
    OUT e_created_at bigint, OUT e_expires_at bigint, OUT e_status integer, OUT e_headers text,
    OUT e_body bytea, OUT e_body_ref text, OUT e_recovery_point text, OUT e_claim bigint)
LANGUAGE plpgsql AS $$
DECLARE
  r {s}.idem_keys%ROWTYPE;
  v_now bigint := coalesce(p_now, {s}.idem_now());
  v_lease_until bigint := v_now + p_lease;
  has_progress boolean;
  same boolean;
  takeover boolean;
  resume boolean;
BEGIN
  LOOP
    INSERT INTO {s}.idem_keys (tenant, operation, key, fingerprint, state, token, lease_until,
                               created_at, expires_at, claim)
    VALUES (p_tenant, p_operation, p_key, p_fp, 1, v_now, v_lease_until, v_now, v_lease_until,
            p_claim)
    ON CONFLICT (tenant, operation, key) DO NOTHING;
    IF FOUND THEN
      o_kind := 0;
      o_token := v_now;
      RETURN;
    END IF;
    SELECT * INTO r FROM {s}.idem_keys k
    WHERE k.tenant = p_tenant AND k.operation = p_operation AND k.key = p_key FOR UPDATE;
    EXIT WHEN FOUND;  -- else purged in between: insert again
  END LOOP;
  has_progress := r.progress IS NOT NULL;
  same := r.fingerprint = p_fp;
  IF (r.state = 1 AND v_now < r.lease_until) OR (r.state = 2 AND v_now < r.expires_at)
     OR (has_progress AND NOT same
         AND (r.state = 1 OR (r.state = 3 AND v_now < r.expires_at))) THEN
    o_kind := 2;
    e_fingerprint := r.fingerprint; e_state := r.state; e_token := r.token;
    e_lease_until := r.lease_until; e_created_at := r.created_at; e_expires_at := r.expires_at;
    e_status := r.status; e_headers := r.headers; e_body := r.body; e_body_ref := r.body_ref;
    e_recovery_point := r.recovery_point; e_claim := r.claim;
    RETURN;
  END IF;
  takeover := r.state = 1;
  resume := same AND (takeover OR (has_progress AND r.state = 3 AND v_now < r.expires_at));
  o_kind := CASE WHEN takeover THEN 1 ELSE 0 END;
  o_token := greatest(r.token + 1, v_now);
  IF resume THEN o_point := r.recovery_point; END IF;
  UPDATE {s}.idem_keys k
  SET fingerprint = p_fp, state = 1, token = o_token, lease_until = v_lease_until,
      created_at = v_now, expires_at = v_lease_until, claim = p_claim, status = NULL,
      headers = NULL, body = NULL, body_ref = NULL,
      recovery_point = CASE WHEN resume THEN k.recovery_point END,
      progress = CASE WHEN resume THEN k.progress END,
      request = CASE WHEN resume THEN k.request END
  WHERE k.tenant = p_tenant AND k.operation = p_operation AND k.key = p_key;
END $$;
)sql",
};

// The database's clock, in epoch milliseconds.
inline constexpr std::string_view kNow =
    "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint";

// $4 fingerprint $5 now (NULL: the database's clock, as the statement runs) $6 the lease, in ms
// $7 claim (or NULL)
inline constexpr std::string_view kReserve =
    "SELECT * FROM {s}.idem_reserve($1, $2, $3, $4::bytea, $5::bigint, $6::bigint, $7::bigint)";

// $4 fingerprint $5 now $6 expires_at $7 status $8 headers $9 body $10 body_ref
inline constexpr std::string_view kStoreIfAbsent =
    "SELECT * FROM {s}.idem_store_if_absent($1, $2, $3, $4::bytea, $5::bigint, $6::bigint, "
    "$7::integer, $8::text, $9::bytea, $10::text)";

// The columns of a record, in the order idem_reserve's and idem_store_if_absent's e_ columns
// give them too (the latter without the claim).
inline constexpr std::string_view kLoad = R"sql(
SELECT fingerprint, state, token, lease_until, created_at, expires_at, status, headers, body,
       body_ref, recovery_point, claim
FROM {s}.idem_keys WHERE tenant = $1 AND operation = $2 AND key = $3)sql";

// $4 token $5 status $6 headers $7 body $8 body_ref $9 expires_at
inline constexpr std::string_view kComplete = R"sql(
UPDATE {s}.idem_keys
SET state = 2, status = $5::integer, headers = $6::text, body = $7::bytea, body_ref = $8::text,
    expires_at = $9::bigint
WHERE tenant = $1 AND operation = $2 AND key = $3 AND token = $4::bigint AND state = 1)sql";

// $4 token $5 now $6 the TTL in ms: as SQLite's kRelease (a record with progress is kept for
// its retry until the TTL counted from the operation's origin). json, not jsonb: jsonb refuses
// a \u0000 that a step's name or result may hold.
inline constexpr std::string_view kRelease = R"sql(
UPDATE {s}.idem_keys
SET state = 3, lease_until = $5::bigint,
    expires_at = CASE WHEN progress IS NULL THEN $5::bigint
                      ELSE greatest($5::bigint, (progress::json ->> 'origin')::bigint + $6::bigint) END
WHERE tenant = $1 AND operation = $2 AND key = $3 AND token = $4::bigint AND state = 1)sql";

// $4 token $5 lease_until
inline constexpr std::string_view kRenew = R"sql(
UPDATE {s}.idem_keys SET lease_until = $5::bigint, expires_at = $5::bigint
WHERE tenant = $1 AND operation = $2 AND key = $3 AND token = $4::bigint AND state = 1)sql";

// $1 now $2 limit. Rows another node is deleting or writing are skipped, not waited for.
inline constexpr std::string_view kPurge = R"sql(
DELETE FROM {s}.idem_keys
WHERE (tenant, operation, key) IN (
  SELECT tenant, operation, key FROM {s}.idem_keys
  WHERE expires_at <= $1::bigint AND state <> 1
  ORDER BY expires_at LIMIT $2::bigint FOR UPDATE SKIP LOCKED))sql";

// $1 lease ended before $2 limit
inline constexpr std::string_view kReap = R"sql(
DELETE FROM {s}.idem_keys
WHERE (tenant, operation, key) IN (
  SELECT tenant, operation, key FROM {s}.idem_keys
  WHERE expires_at < $1::bigint AND state = 1 AND progress IS NULL
  ORDER BY expires_at LIMIT $2::bigint FOR UPDATE SKIP LOCKED)
RETURNING tenant, operation, key, token, lease_until)sql";

// The record's progress, locked for the transaction: state, token, progress, request.
inline constexpr std::string_view kLoadProgress = R"sql(
SELECT state, token, progress, request FROM {s}.idem_keys
WHERE tenant = $1 AND operation = $2 AND key = $3 FOR UPDATE)sql";

// $4 token $5 request. Stores the request once (a resume keeps it) and returns what
// kLoadProgress returns.
inline constexpr std::string_view kBeginSteps = R"sql(
UPDATE {s}.idem_keys SET request = coalesce(request, $5::bytea)
WHERE tenant = $1 AND operation = $2 AND key = $3 AND token = $4::bigint AND state = 1
RETURNING state, token, progress, request)sql";

// An external step marked pending (StepStore::mark_pending), under the row's lock (kLoadProgress
// took it): $4 token $5 progress (JSON) $6 now (NULL: the database's clock) $7 how long from
// now the lease must still run, in ms $8 how long from now it is renewed to, if it ends sooner.
inline constexpr std::string_view kMarkPending = R"sql(
WITH t AS (SELECT coalesce($6::bigint, {s}.idem_now()) AS now)
UPDATE {s}.idem_keys k
SET progress = $5::text, lease_until = greatest(k.lease_until, t.now + $8::bigint),
    expires_at = greatest(k.lease_until, t.now + $8::bigint)
FROM t
WHERE k.tenant = $1 AND k.operation = $2 AND k.key = $3 AND k.token = $4::bigint AND k.state = 1
  AND k.lease_until >= t.now + $7::bigint)sql";

// $4 token $5 progress (JSON) $6 recovery point (or NULL)
inline constexpr std::string_view kSetProgress = R"sql(
UPDATE {s}.idem_keys SET progress = $5::text, recovery_point = coalesce($6::text, recovery_point)
WHERE tenant = $1 AND operation = $2 AND key = $3 AND token = $4::bigint AND state = 1)sql";

// $1 idle before $2 now $3 limit $4 the operations asked for (a JSON array). Uses
// idem_keys_open (its WHERE terms are repeated).
inline constexpr std::string_view kAbandoned = R"sql(
SELECT tenant, operation, key, fingerprint, state, request FROM {s}.idem_keys
WHERE state <> 2 AND request IS NOT NULL AND lease_until < $1::bigint
  AND progress IS NOT NULL AND (state = 1 OR expires_at > $2::bigint)
  AND operation IN (SELECT json_array_elements_text($4::json))
ORDER BY lease_until LIMIT $3::bigint)sql";

// $1 id $2 topic $3 payload $4 key_hash $5 now. The same message of a retried step is queued
// once.
inline constexpr std::string_view kOutboxInsert = R"sql(
INSERT INTO {s}.idem_outbox (id, topic, payload, key_hash, state, attempts, next_at, created_at)
VALUES ($1, $2, $3::bytea, $4, 0, 0, $5::bigint, $5::bigint)
ON CONFLICT (id) DO NOTHING)sql";

// $1 now $2 claimed until $3 limit. Messages another dispatcher is claiming are skipped.
inline constexpr std::string_view kOutboxClaim = R"sql(
UPDATE {s}.idem_outbox SET next_at = $2::bigint
WHERE id IN (SELECT id FROM {s}.idem_outbox WHERE state = 0 AND next_at <= $1::bigint
             ORDER BY next_at LIMIT $3::bigint FOR UPDATE SKIP LOCKED)
RETURNING id, topic, payload, attempts, created_at)sql";

// $1 the ids, a JSON array of strings $2 now
inline constexpr std::string_view kOutboxDelivered = R"sql(
UPDATE {s}.idem_outbox SET state = 1, next_at = $2::bigint, last_error = NULL
WHERE id IN (SELECT json_array_elements_text($1::json)) AND state = 0)sql";

// $1 id $2 due again at (or parked at) $3 1: park $4 why
inline constexpr std::string_view kOutboxFailed = R"sql(
UPDATE {s}.idem_outbox SET attempts = attempts + 1, next_at = $2::bigint, last_error = $4::text,
                           state = CASE WHEN $3::integer = 1 THEN 2 ELSE 0 END
WHERE id = $1 AND state = 0)sql";

inline constexpr std::string_view kOutboxCounts =
    "SELECT state, count(*) FROM {s}.idem_outbox GROUP BY state";

// $1 delivered before $2 limit
inline constexpr std::string_view kOutboxPurge = R"sql(
DELETE FROM {s}.idem_outbox
WHERE id IN (SELECT id FROM {s}.idem_outbox WHERE state = 1 AND next_at < $1::bigint
             LIMIT $2::bigint FOR UPDATE SKIP LOCKED))sql";

// migrate_sqlite_to_pg (idem/migrate.hpp): one record copied from SQLite, all its columns.
// $4 fingerprint $5 state $6 token $7 lease_until $8 created_at $9 expires_at $10 status
// $11 headers $12 body $13 body_ref $14 recovery_point $15 progress $16 request $19 claim $17 how
// many ms two times may differ and still count as one (two measurements of the clock's offset
// differ) $18 1: only bring an existing row up to date, never insert one. Written only over a row
// at a lower token, or at the same token (an earlier copy) that differs; never over a row at a
// higher token (reserved or taken over here since). Returns whether it wrote (0 or 1) and the
// row's token before (NULL: there was none; the main query sees what the WITH saw).
inline constexpr std::string_view kImportRecord = R"sql(
WITH written AS (
  INSERT INTO {s}.idem_keys AS k (tenant, operation, key, fingerprint, state, token, lease_until,
                                  created_at, expires_at, status, headers, body, body_ref,
                                  recovery_point, progress, request, claim)
  SELECT $1::text, $2::text, $3::text, $4::bytea, $5::smallint, $6::bigint, $7::bigint,
         $8::bigint, $9::bigint, $10::integer, $11::text, $12::bytea, $13::text, $14::text,
         $15::text, $16::bytea, $19::bigint
  WHERE $18::integer = 0
     OR EXISTS (SELECT 1 FROM {s}.idem_keys WHERE tenant = $1 AND operation = $2 AND key = $3)
  ON CONFLICT (tenant, operation, key) DO UPDATE
  SET fingerprint = EXCLUDED.fingerprint, state = EXCLUDED.state, token = EXCLUDED.token,
      lease_until = EXCLUDED.lease_until, created_at = EXCLUDED.created_at,
      expires_at = EXCLUDED.expires_at, status = EXCLUDED.status, headers = EXCLUDED.headers,
      body = EXCLUDED.body, body_ref = EXCLUDED.body_ref,
      recovery_point = EXCLUDED.recovery_point, progress = EXCLUDED.progress,
      request = EXCLUDED.request, claim = EXCLUDED.claim
  WHERE k.token < EXCLUDED.token
     OR (k.token = EXCLUDED.token
         AND ((k.fingerprint, k.state, k.status, k.headers, k.body, k.body_ref, k.recovery_point,
               k.progress, k.request, k.claim)
              IS DISTINCT FROM
              (EXCLUDED.fingerprint, EXCLUDED.state, EXCLUDED.status, EXCLUDED.headers,
               EXCLUDED.body, EXCLUDED.body_ref, EXCLUDED.recovery_point, EXCLUDED.progress,
               EXCLUDED.request, EXCLUDED.claim)
              OR abs(k.lease_until - EXCLUDED.lease_until) > $17::bigint
              OR abs(k.created_at - EXCLUDED.created_at) > $17::bigint
              OR abs(k.expires_at - EXCLUDED.expires_at) > $17::bigint))
  RETURNING 1)
SELECT (SELECT count(*) FROM written),
       (SELECT token FROM {s}.idem_keys WHERE tenant = $1 AND operation = $2 AND key = $3))sql";

// migrate_sqlite_to_pg: one outbox message copied from SQLite, as it is there. $1 id $2 topic
// $3 payload $4 key_hash $5 state $6 attempts $7 next_at $8 created_at $9 last_error. A message
// already here (an earlier run's copy, perhaps delivered since) is left alone.
inline constexpr std::string_view kImportMessage = R"sql(
INSERT INTO {s}.idem_outbox (id, topic, payload, key_hash, state, attempts, next_at, created_at,
                             last_error)
VALUES ($1, $2, $3::bytea, $4, $5::smallint, $6::integer, $7::bigint, $8::bigint, $9::text)
ON CONFLICT (id) DO NOTHING)sql";

}  // namespace idem::pg_sql
