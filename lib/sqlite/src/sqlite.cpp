#include "idem/internal/sqlite.hpp"

#include <sqlite3.h>

#include <fmt/format.h>

#include <algorithm>
#include <thread>

#include "idem/errors.hpp"
#include "sql.hpp"

namespace idem::sqlite {
namespace {

// SQLite calls this with the number of earlier calls for the same lock; returning 0 makes
// the statement fail with BUSY (once `timeout` has passed). Another process's write lock is
// only ever seen free in the short gaps between its transactions, so a poll's chance is
// small and a long wait is a run of bad luck. Polls start at 50 µs and double up to 1 ms
// (cheap, and a process that owns the lock for a while keeps its page cache warm); a wait
// that has lasted kImpatient polls every 50 µs, which keeps the worst wait near it instead of
// the 100 ms and more that 1 ms polls reached against one busy process under
// synchronous=FULL.
constexpr std::chrono::milliseconds kImpatient{10};

int on_busy(void* arg, int count) {
  auto* policy = static_cast<BusyPolicy*>(arg);
  const auto now = std::chrono::steady_clock::now();
  if (count == 0) {
    policy->started = now;
    ++policy->waits;
  }
  const auto waited = now - policy->started;
  if (waited >= policy->timeout) return 0;
  const auto step = waited >= kImpatient
                        ? std::chrono::microseconds(50)
                        : std::min<std::chrono::microseconds>(
                              std::chrono::microseconds(50) * (1 << std::min(count, 5)),
                              std::chrono::milliseconds(1));
  std::this_thread::sleep_for(step);
  return 1;
}

}  // namespace

void throw_error(sqlite3* db, int rc, std::string_view what) {
  const int code = db != nullptr ? sqlite3_extended_errcode(db) : rc;
  const char* msg = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  throw StoreError(fmt::format("sqlite: {}: {} (code {})", what, msg, code), code);
}

Connection open_connection(const std::string& path, BusyPolicy* busy) {
  sqlite3* raw = nullptr;
  const int rc =
      sqlite3_open_v2(path.c_str(), &raw,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  Connection db(raw);
  if (rc != SQLITE_OK) throw_error(raw, rc, fmt::format("open {}", path));
  sqlite3_extended_result_codes(raw, 1);
  sqlite3_busy_handler(raw, &on_busy, busy);
  return db;
}

void enable_wal(sqlite3* db, const BusyPolicy& busy) {
  const auto deadline = std::chrono::steady_clock::now() + busy.timeout;
  for (int attempt = 0;; ++attempt) {
    try {
      Statement mode(db, sql::kJournalModeWal);
      mode.step();
      return;
    } catch (const StoreError& e) {
      if ((e.sqlite_code() & 0xff) != SQLITE_BUSY || std::chrono::steady_clock::now() >= deadline)
        throw;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100) * std::min(attempt + 1, 10));
  }
}

void exec(sqlite3* db, std::string_view sql) {
  char* err = nullptr;
  const int rc = sqlite3_exec(db, std::string(sql).c_str(), nullptr, nullptr, &err);
  if (rc != SQLITE_OK) {
    std::string msg = err != nullptr ? err : sqlite3_errstr(rc);
    sqlite3_free(err);
    throw StoreError(fmt::format("sqlite: {}: {} (code {})", sql.substr(0, 40), msg,
                                 sqlite3_extended_errcode(db)),
                     sqlite3_extended_errcode(db));
  }
}

void ConnectionCloser::operator()(sqlite3* db) const noexcept { sqlite3_close_v2(db); }

void Statement::Finalizer::operator()(sqlite3_stmt* s) const noexcept { sqlite3_finalize(s); }

Statement::Statement(sqlite3* db, std::string_view sql) : db_(db) {
  sqlite3_stmt* raw = nullptr;
  const int rc = sqlite3_prepare_v3(db, sql.data(), static_cast<int>(sql.size()),
                                    SQLITE_PREPARE_PERSISTENT, &raw, nullptr);
  stmt_.reset(raw);
  if (rc != SQLITE_OK) throw_error(db, rc, fmt::format("prepare {}", sql.substr(0, 60)));
}

void Statement::bind(int index, std::string_view text) {
  const int rc = sqlite3_bind_text(stmt_.get(), index, text.data(), static_cast<int>(text.size()),
                                   SQLITE_STATIC);
  if (rc != SQLITE_OK) throw_error(db_, rc, "bind text");
}

void Statement::bind(int index, std::int64_t value) {
  const int rc = sqlite3_bind_int64(stmt_.get(), index, value);
  if (rc != SQLITE_OK) throw_error(db_, rc, "bind int");
}

void Statement::bind(int index, double value) {
  const int rc = sqlite3_bind_double(stmt_.get(), index, value);
  if (rc != SQLITE_OK) throw_error(db_, rc, "bind double");
}

void Statement::bind_blob(int index, const void* data, std::size_t size) {
  const int rc = sqlite3_bind_blob64(stmt_.get(), index, data, size, SQLITE_STATIC);
  if (rc != SQLITE_OK) throw_error(db_, rc, "bind blob");
}

void Statement::bind_null(int index) {
  const int rc = sqlite3_bind_null(stmt_.get(), index);
  if (rc != SQLITE_OK) throw_error(db_, rc, "bind null");
}

bool Statement::step() {
  const int rc = sqlite3_step(stmt_.get());
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  throw_error(db_, rc, "step");
}

void Statement::reset() noexcept {
  sqlite3_reset(stmt_.get());
  sqlite3_clear_bindings(stmt_.get());
}

int Statement::changes() const noexcept { return sqlite3_changes(db_); }

std::int64_t Statement::last_insert_rowid() const noexcept {
  return sqlite3_last_insert_rowid(db_);
}

int Statement::column_count() const noexcept { return sqlite3_column_count(stmt_.get()); }

Statement::Type Statement::type(int column) const {
  switch (sqlite3_column_type(stmt_.get(), column)) {
    case SQLITE_INTEGER:
      return Type::integer;
    case SQLITE_FLOAT:
      return Type::real;
    case SQLITE_TEXT:
      return Type::text;
    case SQLITE_BLOB:
      return Type::blob;
    default:
      return Type::null;
  }
}

double Statement::real(int column) const { return sqlite3_column_double(stmt_.get(), column); }

bool Statement::is_null(int column) const {
  return sqlite3_column_type(stmt_.get(), column) == SQLITE_NULL;
}

std::int64_t Statement::int64(int column) const {
  return sqlite3_column_int64(stmt_.get(), column);
}

std::string Statement::text(int column) const { return std::string(text_view(column)); }

std::string_view Statement::text_view(int column) const {
  const auto* p = sqlite3_column_text(stmt_.get(), column);
  const int n = sqlite3_column_bytes(stmt_.get(), column);
  return p != nullptr
             ? std::string_view(reinterpret_cast<const char*>(p), static_cast<std::size_t>(n))
             : std::string_view();
}

std::string_view Statement::blob_view(int column) const {
  const void* p = sqlite3_column_blob(stmt_.get(), column);
  const int n = sqlite3_column_bytes(stmt_.get(), column);
  return p != nullptr ? std::string_view(static_cast<const char*>(p), static_cast<std::size_t>(n))
                      : std::string_view();
}

std::string Statement::blob(int column) const { return std::string(blob_view(column)); }

TransactionStatements::TransactionStatements(sqlite3* db)
    : begin(db, sql::kBeginImmediate),
      begin_read(db, sql::kBegin),
      commit(db, sql::kCommit),
      rollback(db, sql::kRollback) {}

Transaction::Transaction(TransactionStatements& s, Kind kind) : s_(s) {
  Statement& begin = kind == Kind::write ? s_.begin : s_.begin_read;
  ResetGuard reset(begin);
  begin.step();
}

Transaction::~Transaction() {
  if (done_) return;
  try {
    ResetGuard reset(s_.rollback);
    s_.rollback.step();
  } catch (const StoreError&) {
    // The connection is already in trouble; SQLite rolls back on its own when a statement
    // fails inside a transaction that cannot continue.
  }
}

void Transaction::commit() {
  ResetGuard reset(s_.commit);
  s_.commit.step();
  done_ = true;
}

}  // namespace idem::sqlite
