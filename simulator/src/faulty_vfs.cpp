#include "idem/sim/faulty_vfs.hpp"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <utility>

namespace idem::sim {

std::string_view to_string(IoCall call) noexcept {
  switch (call) {
    case IoCall::open:
      return "open";
    case IoCall::close:
      return "close";
    case IoCall::read:
      return "read";
    case IoCall::write:
      return "write";
    case IoCall::truncate:
      return "truncate";
    case IoCall::sync:
      return "sync";
    case IoCall::file_size:
      return "file_size";
    case IoCall::lock:
      return "lock";
    case IoCall::unlock:
      return "unlock";
    case IoCall::check_reserved_lock:
      return "check_reserved_lock";
    case IoCall::file_control:
      return "file_control";
    case IoCall::shm_map:
      return "shm_map";
    case IoCall::shm_lock:
      return "shm_lock";
    case IoCall::shm_barrier:
      return "shm_barrier";
    case IoCall::shm_unmap:
      return "shm_unmap";
    case IoCall::remove:
      return "delete";
    case IoCall::access:
      return "access";
  }
  return "?";
}

std::string_view to_string(FileRole role) noexcept {
  switch (role) {
    case FileRole::main_db:
      return "db";
    case FileRole::wal:
      return "wal";
    case FileRole::shm:
      return "shm";
    case FileRole::journal:
      return "journal";
    case FileRole::other:
      return "other";
    case FileRole::any:
      return "any";
  }
  return "?";
}

std::string to_string(const FailedIoCall& f) {
  return fmt::format("{} {} #{} -> {} ({}) {}", to_string(f.call), to_string(f.role), f.ordinal,
                     f.code, f.reason, f.path);
}

namespace {

constexpr unsigned kRoles = 5;  // every FileRole but any

bool never_failed(IoCall call) {
  return call == IoCall::close || call == IoCall::file_control || call == IoCall::shm_barrier;
}

int usual_code(IoCall call) {
  switch (call) {
    case IoCall::open:
      return SQLITE_CANTOPEN;
    case IoCall::read:
      return SQLITE_IOERR_READ;
    case IoCall::write:
      return SQLITE_IOERR_WRITE;
    case IoCall::truncate:
      return SQLITE_IOERR_TRUNCATE;
    case IoCall::sync:
      return SQLITE_IOERR_FSYNC;
    case IoCall::file_size:
      return SQLITE_IOERR_FSTAT;
    case IoCall::lock:
      return SQLITE_IOERR_LOCK;
    case IoCall::unlock:
      return SQLITE_IOERR_UNLOCK;
    case IoCall::check_reserved_lock:
      return SQLITE_IOERR_CHECKRESERVEDLOCK;
    case IoCall::shm_map:
      return SQLITE_IOERR_SHMMAP;
    case IoCall::shm_lock:
      return SQLITE_IOERR_SHMLOCK;
    case IoCall::shm_unmap:
      return SQLITE_IOERR_SHMOPEN;
    case IoCall::remove:
      return SQLITE_IOERR_DELETE;
    case IoCall::access:
      return SQLITE_IOERR_ACCESS;
    case IoCall::close:
    case IoCall::file_control:
    case IoCall::shm_barrier:
      break;
  }
  return SQLITE_IOERR;
}

FileRole role_of_flags(int flags) {
  if ((flags & SQLITE_OPEN_MAIN_DB) != 0) return FileRole::main_db;
  if ((flags & SQLITE_OPEN_WAL) != 0) return FileRole::wal;
  if ((flags & SQLITE_OPEN_MAIN_JOURNAL) != 0) return FileRole::journal;
  return FileRole::other;
}

FileRole role_of_path(std::string_view path) {
  const auto ends = [&](std::string_view suffix) {
    return path.size() >= suffix.size() && path.substr(path.size() - suffix.size()) == suffix;
  };
  if (ends("-wal")) return FileRole::wal;
  if (ends("-shm")) return FileRole::shm;
  if (ends("-journal")) return FileRole::journal;
  return FileRole::main_db;
}

// What the VFS knows about one file on disk (database, WAL or journal).
struct Tracked {
  std::uint64_t size = 0;         // now
  std::uint64_t synced_size = 0;  // at the last successful xSync
  // The bytes each write or truncation since then replaced, oldest first (only the part
  // below synced_size: what lies past it goes with the truncation to synced_size).
  std::vector<std::pair<std::uint64_t, std::string>> preimages;
  int open = 0;  // handles on it
};

// What the VFS keeps for one open file, beside the real VFS's own sqlite3_file.
struct Handle {
  FileRole role;
  std::uint64_t epoch;  // the power cycle it was opened in
  std::string path;
  Tracked* tracked;  // null for temporary files
};

struct ShimFile {
  sqlite3_file base;  // first: SQLite sees this
  FaultyVfs::Impl* owner;
  Handle* handle;
};
// The real VFS's sqlite3_file follows the shim, suitably aligned.
constexpr std::size_t kShimSize = (sizeof(ShimFile) + 15) / 16 * 16;

sqlite3_file* real_of(sqlite3_file* f) {
  return reinterpret_cast<sqlite3_file*>(reinterpret_cast<char*>(f) + kShimSize);
}
ShimFile* shim_of(sqlite3_file* f) { return reinterpret_cast<ShimFile*>(f); }

std::atomic<unsigned> instances{0};

}  // namespace

struct FaultyVfs::Impl {
  sqlite3_vfs vfs{};
  sqlite3_vfs* real = nullptr;
  std::string name;
  mutable std::mutex mutex;  // guards everything below, and every forwarded call

  struct Rule {
    IoCall call;
    FileRole role;
    std::uint64_t remaining;  // nth rule: matching calls until it fires
    bool every;
    int code;
    bool power = false;  // the power goes out instead
  };
  std::vector<Rule> rules;
  std::array<std::array<std::uint64_t, kRoles>, kIoCallKinds> counts{};
  bool recording = false;
  std::vector<IoCallRecord> records;
  std::vector<FailedIoCall> failures;
  std::uint64_t epoch = 0;
  std::map<std::string, Tracked> tracked;  // by path; node addresses are stable
  std::set<std::string> databases;         // main databases opened, for their -shm
  std::optional<std::uint64_t> quota;
  bool real_sync = true;

  // Counts a call and decides whether it fails: returns 0 to go on, else the code to return.
  // Requires `mutex`.
  int enter(IoCall call, FileRole role, std::string_view path, const Handle* h) {
    auto& n = counts[static_cast<unsigned>(call)][static_cast<unsigned>(role)];
    ++n;
    if (recording) records.push_back({call, role, n});
    int code = 0;
    bool power = false;
    for (auto it = rules.begin(); it != rules.end();) {
      if (it->call != call || (it->role != FileRole::any && it->role != role)) {
        ++it;
        continue;
      }
      if (it->every) {
        if (code == 0) code = it->code;
        ++it;
      } else if (--it->remaining == 0) {
        if (it->power) {
          power = true;
        } else if (code == 0) {
          code = it->code;
        }
        it = rules.erase(it);
      } else {
        ++it;
      }
    }
    if (power) lose_power();
    if (never_failed(call)) return 0;
    if (h != nullptr && h->epoch != epoch) {
      return fail(call, role, n, usual_code(call), "after power loss", path);
    }
    if (code == 0) return 0;
    return fail(call, role, n, code, "fault", path);
  }

  int fail(IoCall call, FileRole role, std::uint64_t ordinal, int code, const char* reason,
           std::string_view path) {
    failures.push_back({call, role, ordinal, code, reason, std::string(path)});
    return code;
  }

  std::uint64_t total_bytes() const {
    std::uint64_t total = 0;
    for (const auto& [path, t] : tracked) total += t.size;
    return total;
  }

  void add_rule(IoCall call, FileRole role, std::uint64_t n, bool every, int code,
                bool power = false) {
    if (never_failed(call) && !power) {
      throw std::invalid_argument(
          fmt::format("FaultyVfs: {} calls are never failed", to_string(call)));
    }
    if (!every && n == 0) throw std::invalid_argument("FaultyVfs: the first call is n = 1");
    std::lock_guard lock(mutex);
    rules.push_back({call, role, n, every, code != 0 ? code : usual_code(call), power});
  }

  // ---- sqlite3_io_methods ----

  static int x_close(sqlite3_file* f) {
    ShimFile* s = shim_of(f);
    Impl& d = *s->owner;
    int rc = SQLITE_OK;
    {
      std::lock_guard lock(d.mutex);
      d.enter(IoCall::close, s->handle->role, s->handle->path, s->handle);
      sqlite3_file* r = real_of(f);
      if (r->pMethods != nullptr) rc = r->pMethods->xClose(r);
    }
    {
      std::lock_guard lock(d.mutex);
      if (s->handle->tracked != nullptr) --s->handle->tracked->open;
    }
    delete s->handle;
    s->handle = nullptr;
    return rc;
  }

  static int x_read(sqlite3_file* f, void* buf, int amt, sqlite3_int64 off) {
    ShimFile* s = shim_of(f);
    Impl& d = *s->owner;
    std::lock_guard lock(d.mutex);
    if (const int code = d.enter(IoCall::read, s->handle->role, s->handle->path, s->handle))
      return code;
    sqlite3_file* r = real_of(f);
    return r->pMethods->xRead(r, buf, amt, off);
  }

  // Remembers what [from, to) holds now, clipped to the synced size. Requires `mutex`.
  static void keep_preimage(sqlite3_file* r, Tracked& t, std::uint64_t from, std::uint64_t to) {
    to = std::min(to, t.synced_size);
    if (from >= to) return;
    std::string bytes(to - from, '\0');
    // A short read zero-fills: bytes a truncation removed come back from its own pre-image,
    // which is older and restored later.
    r->pMethods->xRead(r, bytes.data(), static_cast<int>(bytes.size()),
                       static_cast<sqlite3_int64>(from));
    t.preimages.emplace_back(from, std::move(bytes));
  }

  static int x_write(sqlite3_file* f, const void* buf, int amt, sqlite3_int64 off) {
    ShimFile* s = shim_of(f);
    Impl& d = *s->owner;
    Handle& h = *s->handle;
    std::lock_guard lock(d.mutex);
    if (const int code = d.enter(IoCall::write, h.role, h.path, &h)) return code;
    sqlite3_file* r = real_of(f);
    const auto from = static_cast<std::uint64_t>(off);
    const auto to = from + static_cast<std::uint64_t>(amt);
    if (h.tracked != nullptr) {
      Tracked& t = *h.tracked;
      if (d.quota && to > t.size && d.total_bytes() + (to - t.size) > *d.quota) {
        return d.fail(IoCall::write, h.role,
                      d.counts[static_cast<unsigned>(IoCall::write)][static_cast<unsigned>(h.role)],
                      SQLITE_FULL, "disk full", h.path);
      }
      keep_preimage(r, t, from, to);
    }
    const int rc = r->pMethods->xWrite(r, buf, amt, off);
    if (rc == SQLITE_OK && h.tracked != nullptr) h.tracked->size = std::max(h.tracked->size, to);
    return rc;
  }

  static int x_truncate(sqlite3_file* f, sqlite3_int64 size) {
    ShimFile* s = shim_of(f);
    Impl& d = *s->owner;
    Handle& h = *s->handle;
    std::lock_guard lock(d.mutex);
    if (const int code = d.enter(IoCall::truncate, h.role, h.path, &h)) return code;
    sqlite3_file* r = real_of(f);
    const auto to = static_cast<std::uint64_t>(size);
    if (h.tracked != nullptr && to < h.tracked->size)
      keep_preimage(r, *h.tracked, to, h.tracked->size);
    const int rc = r->pMethods->xTruncate(r, size);
    if (rc == SQLITE_OK && h.tracked != nullptr) h.tracked->size = to;
    return rc;
  }

  static int x_sync(sqlite3_file* f, int flags) {
    ShimFile* s = shim_of(f);
    Impl& d = *s->owner;
    Handle& h = *s->handle;
    std::lock_guard lock(d.mutex);
    if (const int code = d.enter(IoCall::sync, h.role, h.path, &h)) return code;
    sqlite3_file* r = real_of(f);
    const int rc = d.real_sync ? r->pMethods->xSync(r, flags) : SQLITE_OK;
    if (rc == SQLITE_OK && h.tracked != nullptr) {
      h.tracked->synced_size = h.tracked->size;
      h.tracked->preimages.clear();
    }
    return rc;
  }

  static int x_file_size(sqlite3_file* f, sqlite3_int64* size) {
    ShimFile* s = shim_of(f);
    Impl& d = *s->owner;
    std::lock_guard lock(d.mutex);
    if (const int code = d.enter(IoCall::file_size, s->handle->role, s->handle->path, s->handle))
      return code;
    sqlite3_file* r = real_of(f);
    return r->pMethods->xFileSize(r, size);
  }

  static int x_lock(sqlite3_file* f, int level) {
    ShimFile* s = shim_of(f);
    Impl& d = *s->owner;
    std::lock_guard lock(d.mutex);
    if (const int code = d.enter(IoCall::lock, s->handle->role, s->handle->path, s->handle))
      return code;
    sqlite3_file* r = real_of(f);
    return r->pMethods->xLock(r, level);
  }

  static int x_unlock(sqlite3_file* f, int level) {
    ShimFile* s = shim_of(f);
    Impl& d = *s->owner;
    std::lock_guard lock(d.mutex);
    const int code = d.enter(IoCall::unlock, s->handle->role, s->handle->path, s->handle);
    sqlite3_file* r = real_of(f);
    const int rc = r->pMethods->xUnlock(r, level);
    return code != 0 ? code : rc;
  }

  static int x_check_reserved_lock(sqlite3_file* f, int* out) {
    ShimFile* s = shim_of(f);
    Impl& d = *s->owner;
    std::lock_guard lock(d.mutex);
    if (const int code =
            d.enter(IoCall::check_reserved_lock, s->handle->role, s->handle->path, s->handle))
      return code;
    sqlite3_file* r = real_of(f);
    return r->pMethods->xCheckReservedLock(r, out);
  }

  static int x_file_control(sqlite3_file* f, int op, void* arg) {
    ShimFile* s = shim_of(f);
    Impl& d = *s->owner;
    std::lock_guard lock(d.mutex);
    d.enter(IoCall::file_control, s->handle->role, s->handle->path, s->handle);
    if (s->handle->epoch != d.epoch) return SQLITE_NOTFOUND;  // the dead machine does nothing
    sqlite3_file* r = real_of(f);
    return r->pMethods->xFileControl(r, op, arg);
  }

  static int x_sector_size(sqlite3_file* f) {
    sqlite3_file* r = real_of(f);
    return r->pMethods->xSectorSize(r);
  }

  static int x_device_characteristics(sqlite3_file* f) {
    sqlite3_file* r = real_of(f);
    return r->pMethods->xDeviceCharacteristics(r);
  }

  static int x_shm_map(sqlite3_file* f, int page, int page_size, int extend, void volatile** pp) {
    ShimFile* s = shim_of(f);
    Impl& d = *s->owner;
    std::lock_guard lock(d.mutex);
    if (const int code = d.enter(IoCall::shm_map, FileRole::shm, s->handle->path, s->handle)) {
      *pp = nullptr;
      return code;
    }
    sqlite3_file* r = real_of(f);
    return r->pMethods->xShmMap(r, page, page_size, extend, pp);
  }

  static int x_shm_lock(sqlite3_file* f, int offset, int n, int flags) {
    ShimFile* s = shim_of(f);
    Impl& d = *s->owner;
    std::lock_guard lock(d.mutex);
    const int code = d.enter(IoCall::shm_lock, FileRole::shm, s->handle->path, s->handle);
    sqlite3_file* r = real_of(f);
    if ((flags & SQLITE_SHM_UNLOCK) != 0) {
      const int rc = r->pMethods->xShmLock(r, offset, n, flags);
      return code != 0 ? code : rc;
    }
    if (code != 0) return code;
    return r->pMethods->xShmLock(r, offset, n, flags);
  }

  static void x_shm_barrier(sqlite3_file* f) {
    ShimFile* s = shim_of(f);
    Impl& d = *s->owner;
    std::lock_guard lock(d.mutex);
    d.enter(IoCall::shm_barrier, FileRole::shm, s->handle->path, s->handle);
    sqlite3_file* r = real_of(f);
    r->pMethods->xShmBarrier(r);
  }

  static int x_shm_unmap(sqlite3_file* f, int delete_flag) {
    ShimFile* s = shim_of(f);
    Impl& d = *s->owner;
    std::lock_guard lock(d.mutex);
    const bool dead = s->handle->epoch != d.epoch;
    const int code = d.enter(IoCall::shm_unmap, FileRole::shm, s->handle->path, s->handle);
    sqlite3_file* r = real_of(f);
    const int rc = r->pMethods->xShmUnmap(r, dead ? 0 : delete_flag);
    return code != 0 ? code : rc;
  }

  static const sqlite3_io_methods* io_methods() {
    static const sqlite3_io_methods methods = {
        2,  // no xFetch/xUnfetch: no memory-mapped I/O bypassing the VFS
        &x_close,
        &x_read,
        &x_write,
        &x_truncate,
        &x_sync,
        &x_file_size,
        &x_lock,
        &x_unlock,
        &x_check_reserved_lock,
        &x_file_control,
        &x_sector_size,
        &x_device_characteristics,
        &x_shm_map,
        &x_shm_lock,
        &x_shm_barrier,
        &x_shm_unmap,
        nullptr,
        nullptr};
    return &methods;
  }

  // ---- sqlite3_vfs ----

  static Impl& of(sqlite3_vfs* v) { return *static_cast<Impl*>(v->pAppData); }

  static int x_open(sqlite3_vfs* v, const char* name, sqlite3_file* f, int flags, int* out_flags) {
    Impl& d = of(v);
    ShimFile* s = shim_of(f);
    s->base.pMethods = nullptr;
    s->owner = &d;
    s->handle = nullptr;
    const FileRole role = role_of_flags(flags);
    const std::string path = name != nullptr ? name : "";
    std::lock_guard lock(d.mutex);
    if (const int code = d.enter(IoCall::open, role, path, nullptr)) return code;
    const bool tracked = !path.empty() && role != FileRole::other;
    struct stat st {};
    const bool existed = tracked && ::stat(path.c_str(), &st) == 0;
    sqlite3_file* r = real_of(f);
    std::memset(r, 0, static_cast<std::size_t>(d.real->szOsFile));
    const int rc = d.real->xOpen(d.real, name, r, flags, out_flags);
    if (r->pMethods == nullptr) return rc;  // nothing to close
    s->handle = new Handle{role, d.epoch, path, nullptr};
    s->base.pMethods = io_methods();
    if (rc != SQLITE_OK || !tracked) return rc;
    auto [it, fresh] = d.tracked.try_emplace(path);
    if (fresh || (!existed && it->second.open == 0)) {
      // A file we never saw, or one created anew: all of it counts as durable.
      sqlite3_int64 size = 0;
      r->pMethods->xFileSize(r, &size);
      it->second = Tracked{};
      it->second.size = it->second.synced_size = static_cast<std::uint64_t>(size);
    }
    ++it->second.open;
    s->handle->tracked = &it->second;
    if (role == FileRole::main_db) d.databases.insert(path);
    return rc;
  }

  static int x_delete(sqlite3_vfs* v, const char* name, int sync_dir) {
    Impl& d = of(v);
    std::lock_guard lock(d.mutex);
    if (const int code = d.enter(IoCall::remove, role_of_path(name), name, nullptr)) return code;
    const int rc = d.real->xDelete(d.real, name, sync_dir);
    if (rc == SQLITE_OK) {
      const auto it = d.tracked.find(name);
      if (it != d.tracked.end() && it->second.open == 0) {
        d.tracked.erase(it);
      } else if (it != d.tracked.end()) {  // still open: an empty file from now on
        it->second.size = it->second.synced_size = 0;
        it->second.preimages.clear();
      }
    }
    return rc;
  }

  static int x_access(sqlite3_vfs* v, const char* name, int flags, int* out) {
    Impl& d = of(v);
    std::lock_guard lock(d.mutex);
    if (const int code = d.enter(IoCall::access, role_of_path(name), name, nullptr)) return code;
    return d.real->xAccess(d.real, name, flags, out);
  }

  static int x_full_pathname(sqlite3_vfs* v, const char* name, int n, char* out) {
    sqlite3_vfs* r = of(v).real;
    return r->xFullPathname(r, name, n, out);
  }
  static void* x_dl_open(sqlite3_vfs* v, const char* name) {
    sqlite3_vfs* r = of(v).real;
    return r->xDlOpen(r, name);
  }
  static void x_dl_error(sqlite3_vfs* v, int n, char* msg) {
    sqlite3_vfs* r = of(v).real;
    r->xDlError(r, n, msg);
  }
  static void (*x_dl_sym(sqlite3_vfs* v, void* lib, const char* sym))(void) {
    sqlite3_vfs* r = of(v).real;
    return r->xDlSym(r, lib, sym);
  }
  static void x_dl_close(sqlite3_vfs* v, void* lib) {
    sqlite3_vfs* r = of(v).real;
    r->xDlClose(r, lib);
  }
  static int x_randomness(sqlite3_vfs* v, int n, char* out) {
    sqlite3_vfs* r = of(v).real;
    return r->xRandomness(r, n, out);
  }
  static int x_sleep(sqlite3_vfs* v, int us) {
    sqlite3_vfs* r = of(v).real;
    return r->xSleep(r, us);
  }
  static int x_current_time(sqlite3_vfs* v, double* out) {
    sqlite3_vfs* r = of(v).real;
    return r->xCurrentTime(r, out);
  }
  static int x_get_last_error(sqlite3_vfs* v, int n, char* out) {
    sqlite3_vfs* r = of(v).real;
    return r->xGetLastError != nullptr ? r->xGetLastError(r, n, out) : 0;
  }
  static int x_current_time_int64(sqlite3_vfs* v, sqlite3_int64* out) {
    sqlite3_vfs* r = of(v).real;
    return r->xCurrentTimeInt64(r, out);
  }

  // ---- power loss ----

  // Requires `mutex`.
  void lose_power() {
    ++epoch;
    for (auto& [path, t] : tracked) {
      const int fd = ::open(path.c_str(), O_RDWR);
      if (fd < 0) continue;  // gone: nothing to restore
      for (auto it = t.preimages.rbegin(); it != t.preimages.rend(); ++it) {
        const auto& [offset, bytes] = *it;
        [[maybe_unused]] const ssize_t n =
            ::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(offset));
      }
      [[maybe_unused]] const int rc = ::ftruncate(fd, static_cast<off_t>(t.synced_size));
      ::close(fd);
      t.preimages.clear();
      t.size = t.synced_size;
    }
    for (const std::string& db : databases) ::unlink((db + "-shm").c_str());
  }
};

FaultyVfs::FaultyVfs() : impl_(std::make_unique<Impl>()) {
  Impl& d = *impl_;
  d.real = sqlite3_vfs_find(nullptr);
  if (d.real == nullptr) throw std::runtime_error("FaultyVfs: SQLite has no default VFS");
  d.name = fmt::format("idem-faulty-{}", instances.fetch_add(1) + 1);
  sqlite3_vfs& v = d.vfs;
  v.iVersion = 2;
  v.szOsFile = static_cast<int>(kShimSize) + d.real->szOsFile;
  v.mxPathname = d.real->mxPathname;
  v.zName = d.name.c_str();
  v.pAppData = &d;
  v.xOpen = &Impl::x_open;
  v.xDelete = &Impl::x_delete;
  v.xAccess = &Impl::x_access;
  v.xFullPathname = &Impl::x_full_pathname;
  v.xDlOpen = &Impl::x_dl_open;
  v.xDlError = &Impl::x_dl_error;
  v.xDlSym = &Impl::x_dl_sym;
  v.xDlClose = &Impl::x_dl_close;
  v.xRandomness = &Impl::x_randomness;
  v.xSleep = &Impl::x_sleep;
  v.xCurrentTime = &Impl::x_current_time;
  v.xGetLastError = &Impl::x_get_last_error;
  v.xCurrentTimeInt64 = &Impl::x_current_time_int64;
  if (sqlite3_vfs_register(&v, 0) != SQLITE_OK)
    throw std::runtime_error("FaultyVfs: sqlite3_vfs_register failed");
}

FaultyVfs::~FaultyVfs() { sqlite3_vfs_unregister(&impl_->vfs); }

const std::string& FaultyVfs::name() const noexcept { return impl_->name; }

void FaultyVfs::fail_nth(IoCall call, FileRole role, std::uint64_t n, int code) {
  impl_->add_rule(call, role, n, false, code);
}

void FaultyVfs::fail_every(IoCall call, FileRole role, int code) {
  impl_->add_rule(call, role, 0, true, code);
}

void FaultyVfs::clear_faults() {
  std::lock_guard lock(impl_->mutex);
  impl_->rules.clear();
}

std::vector<FailedIoCall> FaultyVfs::failed() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->failures;
}

std::uint64_t FaultyVfs::count(IoCall call, FileRole role) const {
  std::lock_guard lock(impl_->mutex);
  const auto& row = impl_->counts[static_cast<unsigned>(call)];
  if (role != FileRole::any) return row[static_cast<unsigned>(role)];
  std::uint64_t total = 0;
  for (const std::uint64_t n : row) total += n;
  return total;
}

std::vector<IoCallRecord> FaultyVfs::calls() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->records;
}

void FaultyVfs::reset_counts() {
  std::lock_guard lock(impl_->mutex);
  impl_->counts = {};
  impl_->records.clear();
  impl_->failures.clear();
}

void FaultyVfs::record_calls(bool on) {
  std::lock_guard lock(impl_->mutex);
  impl_->recording = on;
}

void FaultyVfs::power_loss() {
  std::lock_guard lock(impl_->mutex);
  impl_->lose_power();
}

void FaultyVfs::power_loss_at(IoCall call, FileRole role, std::uint64_t n) {
  impl_->add_rule(call, role, n, false, 0, true);
}

void FaultyVfs::set_real_sync(bool on) {
  std::lock_guard lock(impl_->mutex);
  impl_->real_sync = on;
}

void FaultyVfs::set_quota(std::optional<std::uint64_t> bytes) {
  std::lock_guard lock(impl_->mutex);
  impl_->quota = bytes;
}

std::uint64_t FaultyVfs::tracked_bytes() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->total_bytes();
}

std::uint64_t FaultyVfs::file_bytes(const std::string& path) const {
  std::lock_guard lock(impl_->mutex);
  const auto it = impl_->tracked.find(path);
  return it != impl_->tracked.end() ? it->second.size : 0;
}

ScopedDefaultVfs::ScopedDefaultVfs(FaultyVfs& vfs) : vfs_(vfs) {
  sqlite3_vfs* previous = sqlite3_vfs_find(nullptr);
  previous_ = previous != nullptr ? previous->zName : "";
  sqlite3_vfs_register(sqlite3_vfs_find(vfs_.name().c_str()), 1);
}

ScopedDefaultVfs::~ScopedDefaultVfs() {
  if (sqlite3_vfs* previous = sqlite3_vfs_find(previous_.c_str())) {
    sqlite3_vfs_register(previous, 1);
  }
}

}  // namespace idem::sim
