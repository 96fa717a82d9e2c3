#include "database.hpp"

#include <fmt/format.h>

#include <array>
#include <mutex>
#include <utility>
#include <vector>

#include "checkout.hpp"
#include "checkout_sql.hpp"
#include "idem/errors.hpp"
#include "idem/internal/pg_connection.hpp"  // idem's libpq connection, for the orders table
#include "idem/internal/sqlite.hpp"  // idem's RAII wrappers over sqlite3, for the orders table
#include "idem/pg_store.hpp"
#include "idem/sqlite_store.hpp"

namespace idem::demo {

bool is_postgresql(std::string_view where) {
  return where.starts_with("postgresql://") || where.starts_with("postgres://");
}

struct Database::Orders {
  virtual ~Orders() = default;
  virtual std::optional<std::string> find(std::int64_t seq, const std::string& tenant) = 0;
  virtual std::size_t count() = 0;
};

namespace {

// The orders table in the keys' SQLite file.
class SqliteOrders final : public Database::Orders {
 public:
  explicit SqliteOrders(std::string path, std::chrono::milliseconds busy_timeout)
      : path_(std::move(path)), busy_{busy_timeout, {}} {
    create_orders_table(path_);
    db_ = sqlite::open_connection(path_, &busy_);
    find_ = std::make_unique<sqlite::Statement>(db_.get(), sql::kFindOrder);
  }

  std::optional<std::string> find(std::int64_t seq, const std::string& tenant) override {
    const std::lock_guard lock(mutex_);
    sqlite::ResetGuard reset(*find_);
    find_->bind(1, seq);
    find_->bind(2, tenant);
    if (!find_->step()) return std::nullopt;
    return find_->text(0);
  }

  std::size_t count() override { return count_orders(path_); }

 private:
  std::string path_;
  sqlite::BusyPolicy busy_;
  sqlite::Connection db_;
  std::unique_ptr<sqlite::Statement> find_;
  std::mutex mutex_;
};

// The orders table in the PostgreSQL database, beside idem's tables (in their schema), on a
// connection of its own with idem's session rules (lib/pg's pg::Connection: keepalives on both
// ends, every wait bounded by the statement timeout plus a second). A lost connection is
// opened again on the next read; after one that stopped answering, reads fail at once for a
// second first, so a stalled server costs one caller the wait, not each caller queued behind it.
class PgOrders final : public Database::Orders {
 public:
  PgOrders(std::string uri, std::chrono::milliseconds statement_timeout, std::string schema)
      : schema_(std::move(schema)),
        connection_({{std::move(uri), pg::Timeouts{.statement = statement_timeout}},
                     std::chrono::seconds(1),
                     std::chrono::seconds(1)},
                    [this](pg::Connection& c) { on_connect(c); }) {
    const std::lock_guard lock(mutex_);
    connection_.ensure();
    connection_.simple(sql::pg::kOrdersSchema);
  }

  std::optional<std::string> find(std::int64_t seq, const std::string& tenant) override {
    const std::string seq_text = std::to_string(seq);
    const char* values[] = {seq_text.c_str(), tenant.c_str()};
    const std::lock_guard lock(mutex_);
    pg::Result r = query(sql::pg::kFindOrder, 2, values);
    if (PQntuples(r.get()) == 0) return std::nullopt;
    return std::string(PQgetvalue(r.get(), 0, 0));
  }

  std::size_t count() override {
    const std::lock_guard lock(mutex_);
    pg::Result r = query(sql::pg::kCountOrders, 0, nullptr);
    return static_cast<std::size_t>(std::stoull(PQgetvalue(r.get(), 0, 0)));
  }

  // Copies `rows` (seq, tenant, order_id, charge_id, body, created_at as text) in one
  // transaction; returns how many were new here.
  std::size_t copy(const std::vector<std::array<std::string, 6>>& rows) {
    const std::lock_guard lock(mutex_);
    connection_.ensure();
    pg::Connection::Transaction t(connection_);
    std::size_t copied = 0;
    for (const auto& row : rows) {
      const char* values[6];
      for (std::size_t i = 0; i < 6; ++i) values[i] = row[i].c_str();
      pg::Result r =
          connection_.session().exec_params(sql::pg::kCopyOrder, 6, values, nullptr, nullptr, 0);
      if (PQresultStatus(r.get()) != PGRES_COMMAND_OK)
        throw connection_.failure("copying an order", r.get());
      if (std::string_view(PQcmdTuples(r.get())) == "1") ++copied;
    }
    connection_.simple(sql::pg::kMoveOrderIds);
    t.commit();
    return copied;
  }

 private:
  // Every new connection: no "already exists" notices, and idem's schema first.
  void on_connect(pg::Connection& c) {
    PQsetNoticeProcessor(
        c.get(), [](void*, const char*) {}, nullptr);
    char* quoted = PQescapeIdentifier(c.get(), schema_.data(), schema_.size());
    if (quoted == nullptr) throw c.failure("quoting the schema", nullptr);
    const std::string search_path = fmt::format(fmt::runtime(sql::pg::kSearchPath), quoted);
    PQfreemem(quoted);
    c.simple(search_path);
  }

  // A read; a connection found broken by it is opened again once.
  pg::Result query(const char* text, int n, const char* const* values) {
    for (int attempt = 0;; ++attempt) {
      connection_.ensure();
      try {
        pg::Result r = connection_.session().exec_params(text, n, values, nullptr, nullptr, 0);
        if (PQresultStatus(r.get()) == PGRES_TUPLES_OK) return r;
        if (attempt == 0 && PQstatus(connection_.get()) != CONNECTION_OK) {
          connection_.drop("the orders connection broke");
          continue;  // once more
        }
        throw connection_.failure("reading orders", r.get());
      } catch (const StoreError& e) {
        if (!connection_.connected()) connection_.lost(e.what());
        throw;
      }
    }
  }

  std::string schema_;
  pg::Connection connection_;  // guarded by mutex_
  std::mutex mutex_;
};

}  // namespace

Database::Database(const std::string& where, DatabaseOptions options) {
  if (is_postgresql(where)) {
    // A connection that cannot be made is given up on as soon as a statement would be: a node
    // whose server stops answering answers its requests within the statement timeout and a
    // second or two, whatever it was doing.
    const auto connect_timeout =
        std::max<std::chrono::milliseconds>(std::chrono::seconds(1), options.busy_timeout);
    store_ = std::make_shared<PgStore>(where, PgOptions{.schema = std::string(kPgSchema),
                                                        .local_clock = options.clock,
                                                        .statement_timeout = options.busy_timeout,
                                                        .connect_timeout = connect_timeout});
    orders_ = std::make_unique<PgOrders>(where, options.busy_timeout, std::string(kPgSchema));
  } else {
    store_ =
        std::make_shared<SqliteStore>(where, SqliteOptions{.busy_timeout = options.busy_timeout});
    orders_ = std::make_unique<SqliteOrders>(where, options.busy_timeout);
  }
}

Database::~Database() = default;

const std::shared_ptr<Store>& Database::store() const noexcept { return store_; }

std::optional<std::string> Database::find_order(std::int64_t seq, const std::string& tenant) {
  return orders_->find(seq, tenant);
}

std::size_t Database::count_orders() { return orders_->count(); }

std::size_t copy_orders_to_pg(const std::string& sqlite_file, const std::string& conninfo,
                              const std::string& schema) {
  std::vector<std::array<std::string, 6>> rows;
  {
    sqlite::BusyPolicy busy{std::chrono::seconds(5), {}};
    sqlite::Connection db = sqlite::open_connection(sqlite_file, &busy);
    sqlite::Statement has(db.get(), sql::kHasOrders);
    if (!has.step() || has.int64(0) == 0) return 0;
    sqlite::Statement all(db.get(), sql::kAllOrders);
    while (all.step()) {
      rows.push_back({std::to_string(all.int64(0)), all.text(1), all.text(2), all.text(3),
                      all.text(4), std::to_string(all.int64(5))});
    }
  }
  PgOrders orders(conninfo, std::chrono::seconds(5), schema);
  return orders.copy(rows);
}

}  // namespace idem::demo
