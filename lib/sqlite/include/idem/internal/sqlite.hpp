// idem's RAII wrappers over the sqlite3 C API, in the manner of SQLiteCpp: a connection is
// closed by its destructor; a statement is prepared in its constructor and finalized in its
// destructor; a transaction rolls back in its destructor unless committed. Every failure
// throws idem::StoreError carrying SQLite's extended result code.
//
// An internal target (idem::sqlite_internal), shared by the library's SqliteStore, the
// simulator's ledger, the demo's payments table and the benchmark's floor; it is not part of
// idem's public API and its header is not installed. Like SQLiteCpp's, this header does not
// include <sqlite3.h>.
//
// Why not Debian's libsqlitecpp-dev (3.2.1): idem prepares every statement once with
// SQLITE_PREPARE_PERSISTENT (SQLiteCpp uses sqlite3_prepare_v2), installs its own bounded
// busy handler, reads blobs without copying, reports failures as idem::StoreError, and its
// hot path (a replay is ~3 us) cannot afford SQLiteCpp's shared_ptr copy per column read.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

struct sqlite3;
struct sqlite3_stmt;

namespace idem::sqlite {

// Throws StoreError "sqlite: <what>: <SQLite's message> (code N)" with the extended code.
[[noreturn]] void throw_error(sqlite3* db, int rc, std::string_view what);

// How long a connection retries a locked database. Owned by the connection's user and
// outliving the connection; `timeout` may be changed between statements.
struct BusyPolicy {
  std::chrono::milliseconds timeout;
  std::chrono::steady_clock::time_point started;  // of the current wait
  std::uint64_t waits = 0;                        // waits begun (a lock was busy)
};

struct ConnectionCloser {
  void operator()(sqlite3* db) const noexcept;
};
using Connection = std::unique_ptr<sqlite3, ConnectionCloser>;

// Opens `path` read-write (creating it), extended result codes on, and installs a busy
// handler that retries with short growing sleeps (50 us to 1 ms; every 50 us once a wait
// has lasted 10 ms) until `busy->timeout`. SQLite's default handler sleeps in coarse steps
// and can starve one of two writers.
Connection open_connection(const std::string& path, BusyPolicy* busy);

// Puts the database in WAL mode. Switching needs a moment of exclusive access, and SQLite
// reports SQLITE_BUSY for it without calling the busy handler when several processes open a
// new file at once, so this retries on its own until `busy.timeout`. In-memory databases
// stay in "memory" mode.
void enable_wal(sqlite3* db, const BusyPolicy& busy);

// Runs statements that return no rows we need (PRAGMAs, DDL).
void exec(sqlite3* db, std::string_view sql);

// Thread-safety: none; a statement belongs to its connection's user.
class Statement {
 public:
  Statement(sqlite3* db, std::string_view sql);
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  void bind(int index, std::string_view text);  // not copied: must outlive the step
  void bind(int index, std::int64_t value);
  void bind(int index, double value);
  void bind_blob(int index, const void* data, std::size_t size);  // not copied either
  void bind_null(int index);

  // Steps once: true when a row is ready, false when done. Throws StoreError.
  bool step();
  // Resets and clears bindings; the statement is ready for reuse.
  void reset() noexcept;
  // Rows changed by the last INSERT, UPDATE or DELETE on this statement's connection.
  int changes() const noexcept;
  // The rowid of the last row an INSERT added on this statement's connection.
  std::int64_t last_insert_rowid() const noexcept;

  enum class Type { integer, real, text, blob, null };
  int column_count() const noexcept;
  Type type(int column) const;
  bool is_null(int column) const;
  double real(int column) const;
  std::int64_t int64(int column) const;
  std::string text(int column) const;
  std::string blob(int column) const;
  // The text's or the blob's bytes, valid until the statement steps, resets or is read as
  // another type.
  std::string_view text_view(int column) const;
  std::string_view blob_view(int column) const;

 private:
  struct Finalizer {
    void operator()(sqlite3_stmt* s) const noexcept;
  };
  sqlite3* db_;
  std::unique_ptr<sqlite3_stmt, Finalizer> stmt_;
};

// Resets a reused statement when the scope ends, whatever happens in it.
class ResetGuard {
 public:
  explicit ResetGuard(Statement& s) : s_(s) {}
  ~ResetGuard() { s_.reset(); }
  ResetGuard(const ResetGuard&) = delete;
  ResetGuard& operator=(const ResetGuard&) = delete;

 private:
  Statement& s_;
};

// BEGIN IMMEDIATE, BEGIN, COMMIT and ROLLBACK, prepared once per connection.
struct TransactionStatements {
  explicit TransactionStatements(sqlite3* db);
  Statement begin, begin_read, commit, rollback;
};

// BEGIN IMMEDIATE in the constructor (so a read-then-write cannot fail to upgrade its
// lock), or for reads only BEGIN (Kind::read: the first read takes the read lock and those
// after it see its snapshot, without each beginning and ending a transaction of its own);
// ROLLBACK in the destructor unless commit() ran (for reads, either only ends them).
class Transaction {
 public:
  enum class Kind { write, read };
  explicit Transaction(TransactionStatements& s, Kind kind = Kind::write);
  ~Transaction();
  Transaction(const Transaction&) = delete;
  Transaction& operator=(const Transaction&) = delete;
  void commit();

 private:
  TransactionStatements& s_;
  bool done_ = false;
};

}  // namespace idem::sqlite
