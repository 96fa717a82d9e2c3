#include "sqlite_migrations.hpp"

#include <fmt/format.h>

#include "idem/errors.hpp"
#include "sql.hpp"

namespace idem::detail {

int schema_version() noexcept { return static_cast<int>(sql::kMigrations.size()); }

void migrate(sqlite3* db, sqlite::TransactionStatements& statements) {
  sqlite::Transaction tx(statements);
  const auto current = [&] {
    sqlite::Statement version(db, sql::kUserVersion);
    version.step();
    return version.int64(0);  // finalized here: a pending statement would block DROP TABLE
  }();
  const std::int64_t known = schema_version();
  if (current > known) {
    throw StoreError(fmt::format("sqlite: database schema version {} is newer than this "
                                 "library supports ({}); upgrade idem",
                                 current, known),
                     0);
  }
  for (auto v = current; v < known; ++v) {
    sqlite::exec(db, sql::kMigrations[static_cast<std::size_t>(v)]);
  }
  if (current != known) sqlite::exec(db, fmt::format(fmt::runtime(sql::kSetUserVersion), known));
  tx.commit();
}

}  // namespace idem::detail
