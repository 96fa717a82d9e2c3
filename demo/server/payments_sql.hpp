// Every SQL statement of the demo's payments table (the application's own data, beside
// idem's keys in the same database file).
#pragma once

#include <string_view>

namespace idem::demo::sql {

inline constexpr std::string_view kPaymentsSchema = R"sql(
CREATE TABLE IF NOT EXISTS demo_payments (
  seq        INTEGER PRIMARY KEY AUTOINCREMENT,
  tenant     TEXT    NOT NULL,
  body       TEXT    NOT NULL,
  created_at INTEGER NOT NULL
);
)sql";

// ?1 tenant ?2 body (JSON) ?3 created_at (epoch ms); the new row's seq.
inline constexpr std::string_view kInsertPayment =
    "INSERT INTO demo_payments (tenant, body, created_at) VALUES (?1, ?2, ?3) RETURNING seq";
// ?1 seq: writes the payment's id ("pay_<seq>") into its body; the body.
inline constexpr std::string_view kNamePayment =
    "UPDATE demo_payments SET body = json_set(body, '$.id', 'pay_' || seq) WHERE seq = ?1 "
    "RETURNING body";
// ?1 seq ?2 tenant
inline constexpr std::string_view kFindPayment =
    "SELECT body FROM demo_payments WHERE seq = ?1 AND tenant = ?2";

}  // namespace idem::demo::sql
