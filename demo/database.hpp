// Where idem-demo keeps what it keeps: the idempotency keys (idem's store), the orders
// (seed 000's payments table, written by the checkout's local steps in the keys' own
// transactions) and the outbox. Either one SQLite file (--db FILE), for one machine, or one
// PostgreSQL database (--store postgresql://...), shared by any number of nodes; never both.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "idem/clock.hpp"
#include "idem/store.hpp"

namespace idem::demo {

// True for a libpq URI: "postgresql://..." or "postgres://...".
bool is_postgresql(std::string_view where);

// The PostgreSQL schema idem-demo keeps its keys, orders and outbox in (PgStore's default).
inline constexpr std::string_view kPgSchema = "idem";

struct DatabaseOptions {
  // The Coordinator's clock: PgStore measures the database clock's offset against it.
  // Default (null): the system clock.
  std::shared_ptr<Clock> clock{};
  // SQLite's busy timeout; PostgreSQL's statement timeout.
  std::chrono::milliseconds busy_timeout{std::chrono::seconds(5)};
};

// Thread-safety: store() is safe for concurrent use; the order reads lock one connection.
class Database {
 public:
  // Opens `where` (a postgresql:// URI, else a SQLite file path), migrates idem's schema and
  // creates the orders table if it is missing (nodes that start together create it once).
  // Throws StoreError (retryable) when the database cannot be reached or used.
  explicit Database(const std::string& where, DatabaseOptions options = {});
  ~Database();
  Database(const Database&) = delete;
  Database& operator=(const Database&) = delete;

  const std::shared_ptr<Store>& store() const noexcept;

  // The order `seq` of `tenant` (GET /v1/payments/pay_<seq>) as the JSON the checkout
  // answered with, or nullopt. Throws StoreError.
  std::optional<std::string> find_order(std::int64_t seq, const std::string& tenant);
  // How many orders there are (every tenant's). Throws StoreError.
  std::size_t count_orders();

  struct Orders;  // the engine's reads of the orders table

 private:
  std::shared_ptr<Store> store_;
  std::unique_ptr<Orders> orders_;
};

// idem-demo migrate: copies the orders table of the SQLite file `sqlite_file`, if it has
// one, into the PostgreSQL database `conninfo` (libpq's keywords or a URI), into `schema`
// (which must exist: PgStore makes it), each order with its id, in one transaction; an order
// already there is left as it is, and new orders get ids after the copied ones. Returns how
// many were copied. Throws StoreError (a rerun is safe).
std::size_t copy_orders_to_pg(const std::string& sqlite_file, const std::string& conninfo,
                              const std::string& schema);

}  // namespace idem::demo
