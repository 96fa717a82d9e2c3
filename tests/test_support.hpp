// Shared helpers for idem's tests: temporary databases, a simulated world, raw SQLite.
#pragma once

#include <fmt/format.h>
#include <libpq-fe.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/coordinator.hpp"
#include "idem/pg_store.hpp"
#include "idem/sim/faulty_store.hpp"
#include "idem/sim/provider.hpp"
#include "idem/sim/simulated_clock.hpp"
#include "idem/sqlite_store.hpp"

namespace idem::test {

// A fresh directory under the system temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "idem-test-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// A raw SQLite connection, for looking at (or locking) what the store wrote.
class RawDb {
 public:
  explicit RawDb(const std::string& path) {
    if (sqlite3_open(path.c_str(), &db_) != SQLITE_OK) throw std::runtime_error("open failed");
  }
  ~RawDb() { sqlite3_close_v2(db_); }
  RawDb(const RawDb&) = delete;
  RawDb& operator=(const RawDb&) = delete;

  // Runs `sql`; returns SQLite's result code.
  int exec(const std::string& sql) {
    return sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, nullptr);
  }

  // The first column of the first row of `sql` as an integer (-1 if no row).
  long long scalar(const std::string& sql) {
    sqlite3_stmt* s = nullptr;
    if (sqlite3_prepare_v2(db_, sql.c_str(), -1, &s, nullptr) != SQLITE_OK) {
      throw std::runtime_error(sqlite3_errmsg(db_));
    }
    long long v = -1;
    if (sqlite3_step(s) == SQLITE_ROW) v = sqlite3_column_int64(s, 0);
    sqlite3_finalize(s);
    return v;
  }

  // The first column of the first row of `sql` as text ("" if no row).
  std::string text(const std::string& sql) {
    sqlite3_stmt* s = nullptr;
    if (sqlite3_prepare_v2(db_, sql.c_str(), -1, &s, nullptr) != SQLITE_OK) {
      throw std::runtime_error(sqlite3_errmsg(db_));
    }
    std::string v;
    if (sqlite3_step(s) == SQLITE_ROW && sqlite3_column_text(s, 0) != nullptr) {
      v = reinterpret_cast<const char*>(sqlite3_column_text(s, 0));
    }
    sqlite3_finalize(s);
    return v;
  }

  long long rows() { return scalar("SELECT count(*) FROM idem_keys"); }

 private:
  sqlite3* db_ = nullptr;
};

// A PostgreSQL schema name no other test of any process uses (the cluster is thrown away).
// (The process id alone repeats once the kernel reuses it, and the cluster outlives processes:
// a random part keeps a later process with the same id off an earlier one's schema.)
inline std::string fresh_pg_name() {
  static const unsigned run = std::random_device{}();
  static std::atomic<unsigned> next{0};
  return fmt::format("t_{}_{:08x}_{}", getpid(), run, next++);
}

inline std::string fresh_pg_schema() { return fresh_pg_name(); }

// The text of the first column of the first row of `sql` on the PostgreSQL server `conninfo`
// (libpq's keywords or a URI); "" if no row. Throws std::runtime_error when it fails.
inline std::string pg_text(const std::string& conninfo, const std::string& sql) {
  PGconn* c = PQconnectdb(conninfo.c_str());
  PGresult* r = PQexec(c, sql.c_str());
  const ExecStatusType status = PQresultStatus(r);
  std::string v = status == PGRES_TUPLES_OK && PQntuples(r) > 0 ? PQgetvalue(r, 0, 0) : "";
  const std::string why = PQerrorMessage(c);
  PQclear(r);
  PQfinish(c);
  if (status != PGRES_TUPLES_OK && status != PGRES_COMMAND_OK)
    throw std::runtime_error("postgresql: " + why);
  return v;
}

// The server IDEM_TEST_PG names (scripts/test starts one).
inline std::string test_pg_conninfo() {
  const char* conninfo = std::getenv("IDEM_TEST_PG");
  if (conninfo == nullptr)
    throw std::runtime_error("IDEM_TEST_PG is not set (scripts/test sets it)");
  return conninfo;
}

// A fresh database on that server, as the postgresql:// URI idem-demo's --store takes.
inline std::string fresh_pg_database() {
  const std::string name = fresh_pg_name();
  const std::string conninfo = test_pg_conninfo();
  pg_text(conninfo, "CREATE DATABASE " + name);
  PGconn* c = PQconnectdb(conninfo.c_str());
  const std::string uri = fmt::format("postgresql:///{}?host={}&port={}&user={}", name, PQhost(c),
                                      PQport(c), PQuser(c));
  PQfinish(c);
  return uri;
}

// How many records idem's store at `where` holds, live or not: a SQLite file, or a
// postgresql:// URI (idem-demo's schema, "idem").
inline long long key_rows(const std::string& where) {
  if (where.starts_with("postgresql://"))
    return std::stoll(pg_text(where, "SELECT count(*) FROM idem.idem_keys"));
  return RawDb(where).rows();
}

// Whether this test process runs its Worlds on PostgreSQL: ctest registers the coordinator's
// tests a second time with IDEM_TEST_ENGINE=postgresql (tests/CMakeLists.txt).
inline bool worlds_on_postgresql() {
  const char* engine = std::getenv("IDEM_TEST_ENGINE");
  return engine != nullptr && std::string(engine) == "postgresql";
}

// One simulated world: a clock, a store, a provider and a coordinator. The store is a
// SQLite file in a temporary directory, or, when worlds_on_postgresql(), a fresh schema on
// the server IDEM_TEST_PG names (the caller's clock: the world's simulated one).
struct World {
  TempDir dir;
  std::shared_ptr<sim::SimulatedClock> clock = std::make_shared<sim::SimulatedClock>();
  std::string db_path = dir.file("keys.db");  // SQLite only
  std::string pg_schema;                      // PostgreSQL only
  std::shared_ptr<SqliteStore> sqlite;        // null on PostgreSQL
  std::shared_ptr<Store> store;
  std::shared_ptr<sim::Provider> provider;
  std::unique_ptr<Coordinator> idem;

  std::shared_ptr<sim::FaultyStore> faulty;  // wraps `store`; the coordinator uses it

  explicit World(Options options = {}, sim::ProviderOptions provider_options = {},
                 SqliteOptions store_options = {}) {
    if (worlds_on_postgresql()) {
      pg_schema = fresh_pg_schema();
      store = std::make_shared<PgStore>(test_pg_conninfo(),
                                        PgOptions{.schema = pg_schema, .clock = PgClock::caller});
    } else {
      sqlite = std::make_shared<SqliteStore>(db_path, store_options);
      store = sqlite;
    }
    faulty = std::make_shared<sim::FaultyStore>(store);
    provider = std::make_shared<sim::Provider>(clock, std::move(provider_options));
    options.clock = clock;
    idem = std::make_unique<Coordinator>(faulty, std::move(options));
  }

  // An action that takes `duration` of simulated time (the clock is advanced by the
  // calling thread), then charges the provider (instantly) and answers with the charge id.
  std::function<Response()> charge_action(
      std::chrono::milliseconds duration = std::chrono::milliseconds(300),
      std::string provider_key = "") {
    return [this, duration, provider_key] {
      clock->advance(duration);
      const sim::ChargeResult r = provider->charge("A-10023", 4990, provider_key);
      if (r.declined) {
        return Response{
            402, nlohmann::json{{"error", "payment_declined"}, {"reason", r.reason}}.dump(), {}};
      }
      return Response{200, nlohmann::json{{"charge_id", r.charge_id}}.dump(), {}};
    };
  }

  std::size_t charges() const { return provider->charge_count(); }

  // How many records the store holds, live or not, asked of the database itself.
  long long rows() const {
    if (!worlds_on_postgresql()) return RawDb(db_path).rows();
    return std::stoll(
        pg_text(test_pg_conninfo(), fmt::format("SELECT count(*) FROM {}.idem_keys", pg_schema)));
  }

  TimePoint t(long long ms) const { return sim::kSimulationStart + std::chrono::milliseconds(ms); }
  long long elapsed_ms() const { return (clock->now() - sim::kSimulationStart).count(); }
};

// Polls `done` until it holds or `bound` passes (a failure bound, not a measurement).
template <class Predicate>
bool eventually(Predicate done, std::chrono::seconds bound = std::chrono::seconds(30)) {
  const auto give_up = std::chrono::steady_clock::now() + bound;
  while (!done()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::yield();
  }
  return true;
}

// How many trials a pause test runs (a frozen owner, a stalled connection): a few in the
// suite; scripts/probe-faults sets IDEM_PAUSE_TRIALS=50.
inline int pause_trials() {
  const char* n = std::getenv("IDEM_PAUSE_TRIALS");
  return n != nullptr ? std::max(1, std::atoi(n)) : 3;
}

inline Request request(std::string key, long long amount = 4990, std::string tenant = "alpha",
                       std::string operation = "payment.charge") {
  Request r;
  r.tenant = std::move(tenant);
  r.operation = std::move(operation);
  r.key = std::move(key);
  r.fingerprint = Fingerprint::of(nlohmann::json{{"amount", amount}, {"currency", "RUB"}});
  return r;
}

}  // namespace idem::test
