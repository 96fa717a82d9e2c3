// RAII wrappers over the sqlite3 C API, in the manner of SQLiteCpp: a statement is
// prepared in its constructor and finalized in its destructor; a transaction rolls back
// in its destructor unless committed. Every failure throws idem::StoreError carrying
// SQLite's extended result code. Only lib/src/sqlite_*.cpp include this file.
#pragma once

#include <sqlite3.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace idem::detail {

[[noreturn]] void throw_sqlite(sqlite3* db, int rc, std::string_view what);

struct ConnectionDeleter {
  void operator()(sqlite3* db) const noexcept { sqlite3_close_v2(db); }
};
using Connection = std::unique_ptr<sqlite3, ConnectionDeleter>;

// How long a connection retries a locked database. Owned by the connection's user and
// outliving the connection.
struct BusyPolicy {
  std::chrono::milliseconds timeout;
  std::chrono::steady_clock::time_point started;  // of the current wait
};

// Opens `path` read-write (creating it), extended result codes on, and installs a busy
// handler that retries with short growing sleeps (50 us to 1 ms) until `busy->timeout`.
// (SQLite's default handler sleeps in coarse steps and can starve one of two writers.)
Connection open_connection(const std::string& path, BusyPolicy* busy);

// Puts the database in WAL mode. Switching needs a moment of exclusive access, and SQLite
// reports SQLITE_BUSY for it without calling the busy handler when several processes open a
// new file at once, so this retries on its own until `busy.timeout`. In-memory databases
// stay in "memory" mode.
void enable_wal(sqlite3* db, const BusyPolicy& busy);

// A mutex that serves waiters in arrival order (a ticket lock). The connection's lock is
// one: a thread that loops (purge batches, a busy leader) cannot starve the others,
// because releasing and re-locking puts it behind everyone already waiting.
class FairMutex {
 public:
  void lock() {
    std::unique_lock guard(mutex_);
    const std::uint64_t ticket = next_++;
    cv_.wait(guard, [&] { return serving_ == ticket; });
  }
  void unlock() {
    {
      std::lock_guard guard(mutex_);
      ++serving_;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::uint64_t next_ = 0;     // guarded by mutex_
  std::uint64_t serving_ = 0;  // guarded by mutex_
};

// Runs statements that return no rows we need (PRAGMAs, DDL).
void exec(sqlite3* db, std::string_view sql);

class Statement {
 public:
  Statement(sqlite3* db, std::string_view sql);
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  void bind(int index, std::string_view text);
  void bind(int index, std::int64_t value);
  void bind_blob(int index, const void* data, std::size_t size);
  void bind_null(int index);

  // Steps once: true when a row is ready, false when done. Throws StoreError.
  bool step();
  // Resets and clears bindings; the statement is ready for reuse.
  void reset() noexcept;

  bool is_null(int column) const;
  std::int64_t int64(int column) const;
  std::string text(int column) const;
  std::string blob(int column) const;
  // The blob's bytes, valid until the statement steps, resets or is read as another type.
  std::string_view blob_view(int column) const;

 private:
  struct Finalizer {
    void operator()(sqlite3_stmt* s) const noexcept { sqlite3_finalize(s); }
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

// BEGIN IMMEDIATE in the constructor (so a read-then-write cannot fail to upgrade its
// lock), ROLLBACK in the destructor unless commit() ran.
class Transaction {
 public:
  Transaction(Statement& begin, Statement& commit, Statement& rollback);
  ~Transaction();
  Transaction(const Transaction&) = delete;
  Transaction& operator=(const Transaction&) = delete;
  void commit();

 private:
  Statement& commit_;
  Statement& rollback_;
  bool done_ = false;
};

}  // namespace idem::detail
