// The engines of the store contract (store_contract_test.cpp): each fixture gives one test a
// database of its own and opens stores on it, so one test body runs against every engine.
#pragma once

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "idem/pg_store.hpp"
#include "idem/sqlite_store.hpp"
#include "test_support.hpp"

namespace idem::test {

// SQLite: a file in a temporary directory of its own.
struct SqliteEngine {
  static constexpr const char* name = "sqlite";

  TempDir dir;
  std::string path = dir.file("keys.db");

  bool available() const { return true; }
  // A second call opens a second store on the same file, as another process would.
  std::shared_ptr<SqliteStore> open() const { return std::make_shared<SqliteStore>(path); }
  // SQL for a local step (LocalTransaction::execute) in this engine's dialect.
  static std::string sql(std::string_view sqlite_text, std::string_view /*pg_text*/) {
    return std::string(sqlite_text);
  }
  // An application table's name as a local step writes it.
  static std::string table(std::string_view table_name) { return std::string(table_name); }
};

// PostgreSQL: the cluster named by IDEM_TEST_PG (libpq's conninfo), a fresh schema per fixture.
// Schemas are never dropped: scripts/test's cluster is thrown away after the run.
struct PgEngine {
  static constexpr const char* name = "postgresql";

  std::string conninfo = env("IDEM_TEST_PG");
  // Unique across the processes ctest runs at once and the fixtures of one process.
  std::string schema = fresh_pg_schema();

  bool available() const { return !conninfo.empty(); }
  // The caller's clock: the tests pass simulated times. A second call opens a second store
  // on the same schema, as another node would.
  std::shared_ptr<PgStore> open() const {
    return std::make_shared<PgStore>(conninfo,
                                     PgOptions{.schema = schema, .clock = PgClock::caller});
  }
  static std::string sql(std::string_view /*sqlite_text*/, std::string_view pg_text) {
    return std::string(pg_text);
  }
  // Qualified with the fixture's schema, so fixtures never share an application table
  // (whatever search_path the store's connection has).
  std::string table(std::string_view table_name) const {
    return fmt::format("{}.{}", schema, table_name);
  }

 private:
  static std::string env(const char* var) {
    const char* v = std::getenv(var);
    return v == nullptr ? std::string() : std::string(v);
  }
};

// Whether a test can run on `engine`. An engine without its server skips the test with a
// message, unless IDEM_REQUIRE_PG says the run must cover PostgreSQL (scripts/test sets it):
// then the test fails, so a run that silently skipped PostgreSQL cannot pass.
template <class Engine>
bool engine_ready(const Engine& engine) {
  if (engine.available()) return true;
  if (std::getenv("IDEM_REQUIRE_PG") != nullptr) {
    FAIL("IDEM_TEST_PG is not set: scripts/test starts a throwaway PostgreSQL and sets it");
  }
  MESSAGE("IDEM_TEST_PG is not set: the PostgreSQL cases of the store contract are skipped");
  return false;
}

}  // namespace idem::test

// The first line of each contract test: returns from it when its engine cannot run.
#define IDEM_ENGINE_OR_SKIP(engine)                  \
  do {                                               \
    if (!::idem::test::engine_ready(engine)) return; \
  } while (false)

// Test names end in the engine: "store contract: ...<sqlite>", "...<postgresql>".
TYPE_TO_STRING_AS(idem::test::SqliteEngine::name, idem::test::SqliteEngine);
TYPE_TO_STRING_AS(idem::test::PgEngine::name, idem::test::PgEngine);
