// idem-demo migrate: a SqliteStore's file into a PgStore (idem/migrate.hpp).
#pragma once

#include <cstddef>
#include <string>

namespace idem::demo {

struct MigrateArgs {
  std::string from;             // the SqliteStore's file
  std::string to;               // libpq conninfo or postgresql:// URI
  std::string schema = "idem";  // PgOptions::schema
  std::size_t batch = 256;      // MigrationOptions::batch
};

// Copies the keys and the undelivered outbox of `from` into `to`, and the demo's orders with
// their ids (copy_orders_to_pg), and prints the report as one JSON line: {"records_copied",
// "records_unchanged", "records_skipped_newer", "records_expired", "outbox_copied",
// "outbox_skipped", "orders_copied"}. Returns 0;
// on an error, prints it to stderr and returns 1 (a rerun is safe either way).
int run_migrate(const MigrateArgs& args);

}  // namespace idem::demo
