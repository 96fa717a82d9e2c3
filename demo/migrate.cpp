#include "migrate.hpp"

#include <exception>
#include <iostream>
#include <nlohmann/json.hpp>

#include "database.hpp"
#include "idem/migrate.hpp"
#include "idem/pg_store.hpp"

namespace idem::demo {

int run_migrate(const MigrateArgs& args) {
  try {
    PgStore to(args.to, PgOptions{.schema = args.schema});
    const MigrationReport r =
        migrate_sqlite_to_pg(args.from, to, MigrationOptions{.batch = args.batch});
    // The demo's own table: a payment's id answers GET /v1/payments/{id} on either engine.
    const std::size_t orders = copy_orders_to_pg(args.from, args.to, args.schema);
    std::cout << nlohmann::json{{"records_copied", r.records_copied},
                                {"records_unchanged", r.records_unchanged},
                                {"records_skipped_newer", r.records_skipped_newer},
                                {"records_expired", r.records_expired},
                                {"outbox_copied", r.outbox_copied},
                                {"outbox_skipped", r.outbox_skipped},
                                {"orders_copied", orders}}
                     .dump()
              << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "idem-demo migrate: " << e.what() << '\n';
    return 1;
  }
}

}  // namespace idem::demo
