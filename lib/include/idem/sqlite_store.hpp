// idem — the SQLite store.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "idem/store.hpp"

namespace idem {
namespace detail {
struct StoreStats;  // idem/internal/store_stats.hpp
}  // namespace detail

// SQLite's synchronous setting in WAL mode.
//  - normal: a commit is durable once the WAL is checkpointed or the next sync; a power
//    loss may roll back the last transactions, never corrupt the file. An application
//    crash loses nothing.
//  - full: every commit is synced to disk before it returns; survives power loss.
enum class Synchronous { normal, full };

struct SqliteOptions {
  // How long a statement waits for another connection's write lock before the store
  // reports StoreError (SQLITE_BUSY). The wait polls every 50 µs to 1 ms (every 50 µs once
  // it has lasted 10 ms), so one busy process cannot starve another for long. Also how long
  // a call waits in line for the store's own connection while other calls of this process
  // use it: past it, StoreError (SQLITE_BUSY, nothing done; retry later). Default: 5 s.
  std::chrono::milliseconds busy_timeout{5000};
  // Default: Synchronous::normal.
  Synchronous synchronous = Synchronous::normal;
  // Take WAL checkpoints off the request path: commits never checkpoint; once the WAL
  // holds checkpoint_pages pages a background thread with its own connection copies it into
  // the database in PASSIVE rounds (writers go on), then copies the short rest with this
  // store's writers held back for that moment, so the next commit starts the WAL over (it
  // stays near checkpoint_pages, rewritten in place). If other processes keep writing and it
  // cannot start over, a RESTART checkpoint is tried, without waiting, each time it grows past
  // four times checkpoint_pages. false: SQLite's automatic checkpoint on the committing
  // thread every checkpoint_pages. Defaults: true, 1000.
  bool background_checkpoint = true;
  int checkpoint_pages = 1000;
};

// A Store on one SQLite database file in WAL mode, shared safely by threads of this
// process (one connection behind a first-come-first-served lock) and by other processes
// opening the same file. The schema is versioned with PRAGMA user_version and migrated on
// open, in one transaction; processes sharing a file run the same library version (an older
// one refuses a newer schema). Version 5 fills its table of due times from every record, one
// pass over the table.
//
// Purge and the reaper find their records through that table of due times, which the
// request path writes once per reservation and a completion does not touch (so a
// completion's commit writes its record's page only). purge_expired() and reap() take the
// due entries in time order, in transactions of at most `limit` entries each (the lock is
// held for one such batch at a time), until `limit` records are deleted or nothing is due. A
// completed record is looked at twice: when its reservation's lease ends its entry moves to
// the TTL's end (with its neighbours, a few pages per batch), and then it is deleted.
//
// A full disk is a StoreError with SQLITE_FULL ("database or disk is full"); what was
// committed stays. From then on each write first tries, without waiting for other
// connections, a checkpoint that copies the WAL into the database and truncates the WAL, so
// once the disk has room again the store serves by itself (no restart) and the space the WAL
// held is usable too.
//
// apply() commits all the ops it is given in one transaction (each op keeps its own
// outcome); the Coordinator's group commit hands it the writes of every call that is ready
// at once.
//
// Thread-safety: safe for concurrent use. The calls of one SqliteStore take its connection in
// turn, first come first served; one that holds it longer than busy_timeout (a local step
// that does not end, a disk that does not answer) fails the calls waiting behind it with
// StoreError (SQLITE_BUSY), nothing done, as another process's lock would.
class SqliteStore final : public Store, public StepStore {
 public:
  // Opens (creating if needed) `path`, sets WAL, busy handling and synchronous, migrates
  // the schema and prepares every statement. ":memory:" gives a private in-memory store.
  // Throws StoreError if the file cannot be opened or its schema is newer than this
  // library knows; then no SqliteStore exists.
  explicit SqliteStore(const std::string& path, SqliteOptions options = {});
  ~SqliteStore() override;
  SqliteStore(const SqliteStore&) = delete;
  SqliteStore& operator=(const SqliteStore&) = delete;

  // The schema version this library writes.
  static int schema_version() noexcept;

  bool renew(const KeyId& id, std::int64_t token, TimePoint lease_until) override;
  std::optional<Record> load(const KeyId& id) override;
  // Two reads or more: one read transaction.
  void load_many(std::span<StoreRead* const> reads) override;
  StepStore* steps() noexcept override { return this; }
  std::optional<Progress> begin_steps(const KeyId& id, std::int64_t token,
                                      const std::string& request) override;
  bool mark_pending(const KeyId& id, std::int64_t token, std::int64_t origin,
                    const std::string& step, const LeaseCheck& lease) override;
  // Local steps run their statements on this store's connection inside its transaction;
  // they must not begin, commit or roll back transactions of their own.
  bool commit_step(const KeyId& id, std::int64_t token, std::int64_t origin,
                   const StepCommit& step) override;
  std::vector<AbandonedOperation> abandoned(TimePoint idle_before, TimePoint now, std::size_t limit,
                                            std::span<const std::string> operations) override;
  std::vector<OutboxMessage> claim_outbox(TimePoint now, TimePoint claim_until,
                                          std::size_t limit) override;
  std::size_t outbox_delivered(std::span<const std::string> ids, TimePoint now) override;
  void outbox_failed(const std::string& id, TimePoint retry_at, bool park,
                     const std::string& why) override;
  OutboxCounts outbox_counts() override;
  std::size_t purge_outbox(TimePoint delivered_before, std::size_t limit) override;
  std::size_t purge_expired(TimePoint now, std::size_t limit) override;
  std::vector<ReapedRecord> reap(TimePoint lease_ended_before, std::size_t limit) override;
  void apply(std::span<StoreOp* const> ops) override;

 private:
  friend struct detail::StoreStats;  // idem/internal/store_stats.hpp, for tests and benchmarks
  struct Impl;
  std::unique_ptr<Impl> impl_;  // its connection is guarded by its own first-come lock
};

}  // namespace idem
