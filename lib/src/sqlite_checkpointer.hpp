// WAL checkpoints off the request path (SqliteOptions::background_checkpoint).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "fair_mutex.hpp"
#include "idem/internal/sqlite.hpp"
#include "idem/sqlite_store.hpp"

namespace idem::detail {

// Commits never checkpoint. Once the WAL holds checkpoint_pages pages, a thread with its
// own connection copies it into the database in PASSIVE rounds while writers go on, then
// copies the short rest with the store's writers held back (`writers`, the store's
// connection lock), so the next commit starts the WAL over and it stays near
// checkpoint_pages, rewritten in place. If other processes keep writing and the WAL cannot
// start over, a RESTART is tried, without waiting, each time it grows past four times
// checkpoint_pages.
//
// Thread-safety: the commit hook runs on committing threads; the rest is internal.
class Checkpointer {
 public:
  // Replaces SQLite's automatic checkpoint on `db` with a commit hook that wakes this
  // checkpointer; its thread starts with the first checkpoint due.
  Checkpointer(sqlite3* db, std::string path, const SqliteOptions& options, FairMutex& writers);
  ~Checkpointer();  // unhooks the store's connection, stops and joins the thread
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  std::uint64_t checkpoints() const noexcept {
    return checkpoints_.load(std::memory_order_relaxed);
  }

 private:
  static int on_commit(void* self, sqlite3* db, const char* name, int pages);
  void run();
  int checkpoint(sqlite3* conn, sqlite::BusyPolicy& busy);

  sqlite3* const db_;  // the store's connection, whose commits call on_commit
  const std::string path_;
  const SqliteOptions options_;
  FairMutex& writers_;
  std::atomic<int> next_at_;  // WAL pages at which the commit hook wakes the thread
  std::atomic<std::uint64_t> checkpoints_{0};

  std::mutex mutex_;
  std::condition_variable cv_;
  bool wanted_ = false;    // guarded by mutex_
  bool stopping_ = false;  // guarded by mutex_
  std::thread thread_;     // started under mutex_ by the first commit that wants a checkpoint
};

}  // namespace idem::detail
