#include "database.hpp"

#include <fmt/format.h>
#include <libpq-fe.h>

#include <array>
#include <mutex>
#include <utility>
#include <vector>

#include "checkout.hpp"
#include "checkout_sql.hpp"
#include "idem/errors.hpp"
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
// connection of its own; reconnects once when the connection was lost.
class PgOrders final : public Database::Orders {
 public:
  PgOrders(std::string uri, std::chrono::milliseconds statement_timeout, std::string schema)
      : uri_(std::move(uri)), timeout_(statement_timeout), schema_(std::move(schema)) {
    const std::lock_guard lock(mutex_);
    connect();
    exec(sql::pg::kOrdersSchema);
  }
  ~PgOrders() override {
    if (conn_ != nullptr) PQfinish(conn_);
  }

  std::optional<std::string> find(std::int64_t seq, const std::string& tenant) override {
    const std::string seq_text = std::to_string(seq);
    const char* values[] = {seq_text.c_str(), tenant.c_str()};
    const std::lock_guard lock(mutex_);
    Result r = query(sql::pg::kFindOrder, 2, values);
    if (PQntuples(r.get()) == 0) return std::nullopt;
    return std::string(PQgetvalue(r.get(), 0, 0));
  }

  std::size_t count() override {
    const std::lock_guard lock(mutex_);
    Result r = query(sql::pg::kCountOrders, 0, nullptr);
    return static_cast<std::size_t>(std::stoull(PQgetvalue(r.get(), 0, 0)));
  }

 private:
  struct Clear {
    void operator()(PGresult* r) const { PQclear(r); }
  };
  using Result = std::unique_ptr<PGresult, Clear>;

  [[noreturn]] void fail(std::string_view what, const PGresult* r) {
    std::string why = r != nullptr ? PQresultErrorMessage(r) : PQerrorMessage(conn_);
    while (!why.empty() && why.back() == '\n') why.pop_back();
    throw StoreError(fmt::format("postgresql: {}: {}", what, why), 0);
  }

  void connect() {
    if (conn_ != nullptr) PQfinish(conn_);
    conn_ = PQconnectdb(uri_.c_str());
    if (conn_ == nullptr) throw StoreError("postgresql: cannot connect: out of memory", 0);
    if (PQstatus(conn_) != CONNECTION_OK) fail("cannot connect", nullptr);
    PQsetNoticeProcessor(
        conn_, [](void*, const char*) {}, nullptr);  // "already exists"
    char* quoted = PQescapeIdentifier(conn_, schema_.data(), schema_.size());
    if (quoted == nullptr) fail("quoting the schema", nullptr);
    const std::string search_path = fmt::format(fmt::runtime(sql::pg::kSearchPath), quoted);
    PQfreemem(quoted);
    exec(search_path.c_str());
    exec(fmt::format(fmt::runtime(sql::pg::kStatementTimeout), timeout_.count()).c_str());
  }

  void exec(const char* text) {
    Result r(PQexec(conn_, text));
    if (PQresultStatus(r.get()) != PGRES_COMMAND_OK && PQresultStatus(r.get()) != PGRES_TUPLES_OK)
      fail("the orders table", r.get());
  }

  Result query(const char* text, int n, const char* const* values) {
    for (int attempt = 0;; ++attempt) {
      if (conn_ == nullptr || PQstatus(conn_) != CONNECTION_OK) connect();
      Result r(PQexecParams(conn_, text, n, nullptr, values, nullptr, nullptr, 0));
      if (PQresultStatus(r.get()) == PGRES_TUPLES_OK) return r;
      if (attempt == 0 && PQstatus(conn_) != CONNECTION_OK) continue;  // lost: once more
      fail("reading orders", r.get());
    }
  }

 public:
  // Copies `rows` (seq, tenant, order_id, charge_id, body, created_at as text) in one
  // transaction; returns how many were new here.
  std::size_t copy(const std::vector<std::array<std::string, 6>>& rows) {
    const std::lock_guard lock(mutex_);
    if (conn_ == nullptr || PQstatus(conn_) != CONNECTION_OK) connect();
    exec(sql::pg::kBegin);
    std::size_t copied = 0;
    try {
      for (const auto& row : rows) {
        const char* values[6];
        for (std::size_t i = 0; i < 6; ++i) values[i] = row[i].c_str();
        Result r(PQexecParams(conn_, sql::pg::kCopyOrder, 6, nullptr, values, nullptr, nullptr, 0));
        if (PQresultStatus(r.get()) != PGRES_COMMAND_OK) fail("copying an order", r.get());
        if (std::string_view(PQcmdTuples(r.get())) == "1") ++copied;
      }
      exec(sql::pg::kMoveOrderIds);
      exec(sql::pg::kCommit);
    } catch (...) {
      PQfinish(conn_);  // the transaction goes with the connection
      conn_ = nullptr;
      throw;
    }
    return copied;
  }

 private:
  std::string uri_;
  std::chrono::milliseconds timeout_;
  std::string schema_;
  PGconn* conn_ = nullptr;
  std::mutex mutex_;
};

}  // namespace

Database::Database(const std::string& where, DatabaseOptions options) {
  if (is_postgresql(where)) {
    store_ = std::make_shared<PgStore>(where, PgOptions{.schema = std::string(kPgSchema),
                                                        .local_clock = options.clock,
                                                        .statement_timeout = options.busy_timeout});
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
