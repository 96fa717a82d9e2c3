// Every SQL statement of the demo's checkout (seed 000's orders table: the application's
// own data, in the same database as idem's keys), in SQLite's dialect and PostgreSQL's.
#pragma once

#include <string_view>

namespace idem::demo::sql {

// One order per tenant and order_id: the business key. The order step inserts ignoring
// the conflict, as the seed does, so a second operation for the same order (a retry with a
// new key, a kill between the insert and the completion) never makes a second row.
inline constexpr std::string_view kOrdersSchema = R"sql(
CREATE TABLE IF NOT EXISTS demo_orders (
  seq        INTEGER PRIMARY KEY AUTOINCREMENT,
  tenant     TEXT    NOT NULL,
  order_id   TEXT    NOT NULL,
  charge_id  TEXT    NOT NULL,
  body       TEXT    NOT NULL,
  created_at INTEGER NOT NULL,
  UNIQUE (tenant, order_id)
);
)sql";

// ?1 tenant ?2 order_id ?3 charge_id ?4 body (JSON) ?5 created_at (epoch ms)
inline constexpr std::string_view kInsertOrder = R"sql(
INSERT INTO demo_orders (tenant, order_id, charge_id, body, created_at)
VALUES (?1, ?2, ?3, ?4, ?5)
ON CONFLICT (tenant, order_id) DO NOTHING)sql";

// ?1 tenant ?2 order_id
inline constexpr std::string_view kOrderId =
    "SELECT 'pay_' || seq FROM demo_orders WHERE tenant = ?1 AND order_id = ?2";

// ?1 seq ?2 tenant: the order's body with its id.
inline constexpr std::string_view kFindOrder =
    "SELECT json_set(body, '$.id', 'pay_' || seq) FROM demo_orders WHERE seq = ?1 AND tenant = ?2";

inline constexpr std::string_view kCountOrders = "SELECT count(*) FROM demo_orders";

// idem-demo migrate: whether the file has the table, and every order in it.
inline constexpr std::string_view kHasOrders =
    "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'demo_orders'";
inline constexpr std::string_view kAllOrders =
    "SELECT seq, tenant, order_id, charge_id, body, created_at FROM demo_orders ORDER BY seq";

// PostgreSQL: the same table in the store's schema (the search_path of PgStore's
// connection and of the demo's own). Nodes that start together create it one after another.
namespace pg {

// A format string: the schema, quoted.
inline constexpr std::string_view kSearchPath = "SET search_path = {}, public";
// A format string: milliseconds.
inline constexpr std::string_view kStatementTimeout = "SET statement_timeout = {}";

inline constexpr const char* kOrdersSchema = R"sql(
BEGIN;
SELECT pg_advisory_xact_lock(hashtext('idem-demo orders'));
CREATE TABLE IF NOT EXISTS demo_orders (
  seq        bigserial PRIMARY KEY,
  tenant     text      NOT NULL,
  order_id   text      NOT NULL,
  charge_id  text      NOT NULL,
  body       text      NOT NULL,
  created_at bigint    NOT NULL,
  UNIQUE (tenant, order_id)
);
COMMIT)sql";

// $1 tenant $2 order_id $3 charge_id $4 body (JSON) $5 created_at (epoch ms)
inline constexpr std::string_view kInsertOrder = R"sql(
INSERT INTO demo_orders (tenant, order_id, charge_id, body, created_at)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (tenant, order_id) DO NOTHING)sql";

// $1 tenant $2 order_id
inline constexpr std::string_view kOrderId =
    "SELECT 'pay_' || seq FROM demo_orders WHERE tenant = $1 AND order_id = $2";

// $1 seq $2 tenant: the order's body with its id.
inline constexpr const char* kFindOrder =
    "SELECT jsonb_set(body::jsonb, '{id}', to_jsonb('pay_' || seq))::text FROM demo_orders "
    "WHERE seq = $1::bigint AND tenant = $2";

inline constexpr const char* kCountOrders = "SELECT count(*) FROM demo_orders";

// idem-demo migrate: an order copied from SQLite with its id (left alone if there), then the
// id sequence moved past every copied id (in one pg::Connection::Transaction).
inline constexpr const char* kCopyOrder = R"sql(
INSERT INTO demo_orders (seq, tenant, order_id, charge_id, body, created_at)
VALUES ($1::bigint, $2, $3, $4, $5, $6::bigint)
ON CONFLICT DO NOTHING)sql";
inline constexpr const char* kMoveOrderIds =
    "SELECT setval(pg_get_serial_sequence('demo_orders', 'seq'), "
    "greatest((SELECT max(seq) FROM demo_orders), 1))";

}  // namespace pg

}  // namespace idem::demo::sql
