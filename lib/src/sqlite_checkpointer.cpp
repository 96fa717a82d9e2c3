#include "sqlite_checkpointer.hpp"

#include <sqlite3.h>

#include <algorithm>

#include "idem/errors.hpp"

namespace idem::detail {

Checkpointer::Checkpointer(sqlite3* db, std::string path, const SqliteOptions& options,
                           FairMutex& writers)
    : db_(db),
      path_(std::move(path)),
      options_(options),
      writers_(writers),
      next_at_(std::max(options.checkpoint_pages, 1)) {
  sqlite3_wal_hook(db_, &Checkpointer::on_commit, this);
}

Checkpointer::~Checkpointer() {
  sqlite3_wal_hook(db_, nullptr, nullptr);
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

// Called by SQLite after each commit with the WAL's size in pages: cheap unless a checkpoint
// is due, then it wakes the thread. A WAL that did not start over after the last checkpoint
// (another process kept writing, or a reader held an old snapshot) asks again only once it
// has grown by another checkpoint_pages / 4, not at every commit.
int Checkpointer::on_commit(void* arg, sqlite3*, const char*, int pages) {
  auto* self = static_cast<Checkpointer*>(arg);
  if (pages < self->next_at_.load(std::memory_order_relaxed)) return SQLITE_OK;
  {
    std::lock_guard lock(self->mutex_);
    if (self->wanted_ || self->stopping_) return SQLITE_OK;
    self->wanted_ = true;
    if (!self->thread_.joinable()) self->thread_ = std::thread([self] { self->run(); });
  }
  self->cv_.notify_one();
  return SQLITE_OK;
}

void Checkpointer::run() {
  sqlite::BusyPolicy busy{options_.busy_timeout, {}};
  sqlite::Connection conn;
  try {
    conn = sqlite::open_connection(path_, &busy);
    // A connection knows the file is in WAL mode only once it has read it; until then a
    // checkpoint is a no-op.
    sqlite::enable_wal(conn.get(), busy);
  } catch (const StoreError&) {
    return;  // no checkpoints from here: the WAL grows until the store closes, which checkpoints
  }
  std::unique_lock lock(mutex_);
  for (;;) {
    cv_.wait(lock, [this] { return wanted_ || stopping_; });
    if (stopping_) return;
    lock.unlock();
    const int kept = checkpoint(conn.get(), busy);
    next_at_.store(
        kept == 0 ? options_.checkpoint_pages : kept + std::max(options_.checkpoint_pages / 4, 1),
        std::memory_order_relaxed);
    checkpoints_.fetch_add(1, std::memory_order_relaxed);
    lock.lock();
    wanted_ = false;
  }
}

// One checkpoint, shaped so this process's writers barely notice it:
//  1. PASSIVE rounds copy the WAL into the database while writers go on (a round takes two
//     fsyncs; the next copies what was written meanwhile), until little is left;
//  2. the little that is left is copied with this process's writers held back (the store's
//     lock, taken in turn like any writer). With the WAL fully copied, the next commit starts
//     it over from its beginning.
//  3. If another process kept writing, or a reader held an old snapshot, the WAL could not
//     start over; once it reaches four times checkpoint_pages, a RESTART checkpoint is tried,
//     which takes the write lock from every process, copies the rest and lets the WAL start
//     over. It is tried without waiting (a busy write lock or reader makes it give up until
//     the WAL has grown by another quarter): waiting would hold this process's writers for
//     as long.
// Returns 0 when the WAL will start over, else its size in pages.
int Checkpointer::checkpoint(sqlite3* conn, sqlite::BusyPolicy& busy) {
  constexpr int kRounds = 6;
  const int short_tail = std::max(options_.checkpoint_pages / 8, 16);
  int log = 0, copied = 0;
  for (int round = 0, done = 0; round < kRounds; ++round) {
    if (sqlite3_wal_checkpoint_v2(conn, nullptr, SQLITE_CHECKPOINT_PASSIVE, &log, &copied) !=
        SQLITE_OK) {
      return std::max(log, 1);  // another connection is checkpointing: try again later
    }
    // `log` is the WAL as this round found it; what it had to copy was written while the
    // previous round ran. Once that is little, so is what the next round would find.
    const int found = log - done;
    done = copied;
    if (found <= short_tail) break;
  }
  {
    std::lock_guard hold(writers_);
    sqlite3_wal_checkpoint_v2(conn, nullptr, SQLITE_CHECKPOINT_PASSIVE, &log, &copied);
  }
  if (log == copied) return 0;
  if (log >= 4 * options_.checkpoint_pages) {
    busy.timeout = std::chrono::milliseconds(0);
    std::lock_guard hold(writers_);
    const int rc =
        sqlite3_wal_checkpoint_v2(conn, nullptr, SQLITE_CHECKPOINT_RESTART, &log, &copied);
    busy.timeout = options_.busy_timeout;
    if (rc == SQLITE_OK) return 0;
  }
  return log;
}

}  // namespace idem::detail
