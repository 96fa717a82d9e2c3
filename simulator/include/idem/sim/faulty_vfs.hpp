// idem::sim — a SQLite VFS that fails chosen I/O calls, loses power and fills the disk.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace idem::sim {

// The I/O calls SQLite makes through a VFS (sqlite.org/c3ref/vfs.html, c3ref/io_methods.html).
enum class IoCall : unsigned {
  open,                 // xOpen
  close,                // xClose (counted, never failed: SQLite ignores its result)
  read,                 // xRead
  write,                // xWrite
  truncate,             // xTruncate
  sync,                 // xSync
  file_size,            // xFileSize
  lock,                 // xLock
  unlock,               // xUnlock
  check_reserved_lock,  // xCheckReservedLock
  file_control,         // xFileControl (counted, never failed)
  shm_map,              // xShmMap
  shm_lock,             // xShmLock (both locking and unlocking)
  shm_barrier,          // xShmBarrier (counted, never failed: it returns nothing)
  shm_unmap,            // xShmUnmap
  remove,               // xDelete
  access,               // xAccess
};
inline constexpr unsigned kIoCallKinds = 17;

// Which file a call is about. The -shm file is reached through the database file's xShm*
// methods, which count under Role::shm; xDelete and xAccess take the role of their path.
enum class FileRole : unsigned { main_db, wal, shm, journal, other, any };

std::string_view to_string(IoCall call) noexcept;
std::string_view to_string(FileRole role) noexcept;

// One call made through the VFS: its kind, its file's role and its ordinal among the calls
// of that kind and role since the counts were last reset (1 for the first).
struct IoCallRecord {
  IoCall call;
  FileRole role;
  std::uint64_t ordinal;
};

// A call the VFS failed, and why: a fault rule ("fault"), the quota ("disk full"), or a
// power loss that happened before ("after power loss").
struct FailedIoCall {
  IoCall call;
  FileRole role;
  std::uint64_t ordinal;  // as in IoCallRecord
  int code;               // the SQLite result code returned
  std::string reason;
  std::string path;
};
// "write wal #3 -> 778 (fault) /tmp/.../k.db-wal"
std::string to_string(const FailedIoCall& failed);

// A shim VFS over SQLite's default one (the unix VFS): it forwards every call, counts each by
// kind and by file role, and can
//  - fail chosen calls: the nth call of a kind (on a role) from the moment the fault is set,
//    or every such call until the faults are cleared, with a chosen SQLite result code.
//    The failed call is not forwarded (nothing is read, written or locked), except an unlock
//    (xUnlock, or xShmLock releasing), which releases and then reports the error: a lock
//    that is never released is a wedged process, not an I/O error;
//  - lose power (power_loss()): every write made to a file since that file's last successful
//    xSync is undone, and the file gets back the size it had then; the -shm file is deleted.
//    Files are tracked from their first open through this VFS (their content then counts as
//    synced) until SQLite deletes them (a deletion counts as durable);
//  - run out of space (set_quota()): a write that would grow the files it tracks (database,
//    WAL, journals; not the -shm file) past the quota fails with SQLITE_FULL, as a full disk
//    would; raising the quota lets writes succeed again.
// It registers itself (not as the default) under name() when built and unregisters when
// destroyed; it must outlive every connection opened through it. Memory-mapped I/O is not
// offered (xFetch), so every read and write passes through it.
//
// Thread-safety: safe for concurrent use; every call through the VFS and every method here
// takes one internal lock.
class FaultyVfs {
 public:
  FaultyVfs();
  ~FaultyVfs();
  FaultyVfs(const FaultyVfs&) = delete;
  FaultyVfs& operator=(const FaultyVfs&) = delete;

  // The name it is registered under (for sqlite3_open_v2), unique per instance.
  const std::string& name() const noexcept;

  // Fails the nth call of `call` on `role` (FileRole::any: on any file) counted from now,
  // once, with `code` (0: the usual code for the call: SQLITE_IOERR_READ for read,
  // SQLITE_IOERR_WRITE for write, SQLITE_IOERR_FSYNC for sync, SQLITE_IOERR_LOCK for lock,
  // SQLITE_IOERR_SHMLOCK for shm_lock, SQLITE_CANTOPEN for open, ...). Pass SQLITE_FULL for a
  // write that finds the disk full, SQLITE_BUSY for a lock another process holds. Throws
  // std::invalid_argument for a call that is never failed (close, file_control, shm_barrier)
  // or n == 0.
  void fail_nth(IoCall call, FileRole role, std::uint64_t n, int code = 0);
  // Fails every call of `call` on `role` from now until clear_faults(). Throws as fail_nth.
  void fail_every(IoCall call, FileRole role = FileRole::any, int code = 0);
  // Removes every fault rule (not the quota, not a power loss).
  void clear_faults();

  // The calls failed so far (by rules, the quota and power loss), oldest first.
  std::vector<FailedIoCall> failed() const;

  // Calls of `call` on `role` since the last reset_counts().
  std::uint64_t count(IoCall call, FileRole role = FileRole::any) const;
  // Every call since the last reset_counts(), in order (recorded only while recording).
  std::vector<IoCallRecord> calls() const;
  // Zeroes the counts and empties calls() and failed(); the fault rules stay.
  void reset_counts();
  // Whether calls() records (off by default: a long run would record a lot).
  void record_calls(bool on);

  // Power goes out: for every tracked file, the writes (and truncations) since its last
  // successful sync are undone and its synced size restored, and the -shm file of every
  // database opened through this VFS is deleted. Files open at that moment belong to the dead
  // machine: every later call on them fails (SQLITE_IOERR_*; close and unlocks still work and
  // change nothing on disk), so closing them cannot checkpoint or delete anything. Close every
  // connection opened before the power loss before opening the files again (SQLite shares
  // per-file state between the connections of one process).
  void power_loss();
  // Power goes out just before the nth call of `call` on `role` counted from now (that call
  // and every later one on the files open then fail, as after power_loss()). Throws
  // std::invalid_argument if n == 0.
  void power_loss_at(IoCall call, FileRole role, std::uint64_t n);

  // Whether a successful xSync also reaches the real disk (fsync). Default: true. Off, a sync
  // is only the VFS's own model of one (counted, failable, and what power_loss() honours), which
  // keeps tests that commit many transactions under synchronous=FULL fast.
  void set_real_sync(bool on);

  // The space the tracked files may take, in bytes (nullopt: unlimited, the default).
  void set_quota(std::optional<std::uint64_t> bytes);
  // What the tracked files take now, in bytes.
  std::uint64_t tracked_bytes() const;
  // What one tracked file takes now (0 if not tracked), by the path SQLite opened it with.
  std::uint64_t file_bytes(const std::string& path) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Makes `vfs` SQLite's default VFS for its scope (every sqlite3_open without a VFS name uses
// it), then restores the previous default. Not thread-safe against other threads opening
// connections meanwhile; meant for a test's scope.
class ScopedDefaultVfs {
 public:
  explicit ScopedDefaultVfs(FaultyVfs& vfs);
  ~ScopedDefaultVfs();
  ScopedDefaultVfs(const ScopedDefaultVfs&) = delete;
  ScopedDefaultVfs& operator=(const ScopedDefaultVfs&) = delete;

 private:
  FaultyVfs& vfs_;
  std::string previous_;  // the default's name before
};

}  // namespace idem::sim
