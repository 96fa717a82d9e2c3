// The schema's versions: sql::kMigrations, applied in order, counted in PRAGMA user_version.
#pragma once

#include "idem/internal/sqlite.hpp"

namespace idem::detail {

// The schema version this library writes.
int schema_version() noexcept;

// Brings the database to schema_version() in one BEGIN IMMEDIATE transaction (so processes
// opening a new file at once migrate it once). Throws StoreError if the database's version
// is newer than this library knows; then nothing changed.
void migrate(sqlite3* db, sqlite::TransactionStatements& tx);

}  // namespace idem::detail
