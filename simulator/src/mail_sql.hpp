// Every SQL statement of the simulated mail sender's journal.
#pragma once

#include <string_view>

namespace idem::sim::sql {

// Its own table: the journal may share a file with the provider's ledger.
inline constexpr std::string_view kMailSchema = R"sql(
CREATE TABLE IF NOT EXISTS sim_mail_journal (
  seq        INTEGER PRIMARY KEY AUTOINCREMENT,
  message_id TEXT    NOT NULL UNIQUE,
  recipient  TEXT    NOT NULL,
  body       TEXT    NOT NULL,
  at         INTEGER NOT NULL
);
)sql";

// ?1 message id ?2 recipient ?3 body ?4 at (epoch ms); the new mail's seq, or no row if a
// mail with that message id is already journaled.
inline constexpr std::string_view kMailInsert =
    "INSERT INTO sim_mail_journal (message_id, recipient, body, at) VALUES (?1, ?2, ?3, ?4) "
    "ON CONFLICT (message_id) DO NOTHING RETURNING seq";
inline constexpr std::string_view kMailCount = "SELECT count(*) FROM sim_mail_journal";
inline constexpr std::string_view kMailAll =
    "SELECT seq, message_id, recipient, body, at FROM sim_mail_journal ORDER BY seq";

}  // namespace idem::sim::sql
