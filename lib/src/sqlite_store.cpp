#include "idem/sqlite_store.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <thread>
#include <nlohmann/json.hpp>

#include "idem/errors.hpp"
#include "sql.hpp"
#include "sqlite_handle.hpp"

namespace idem {
namespace {

using detail::ResetGuard;
using detail::Statement;

std::int64_t ms(TimePoint t) { return t.time_since_epoch().count(); }
TimePoint at_ms(std::int64_t v) { return TimePoint(std::chrono::milliseconds(v)); }

void bind_id(Statement& s, const KeyId& id) {
  s.bind(1, id.tenant);
  s.bind(2, id.operation);
  s.bind(3, id.key);
}

void bind_fingerprint(Statement& s, int index, const Fingerprint& fp) {
  s.bind_blob(index, fp.bytes().data(), fp.bytes().size());
}

std::string headers_to_json(const std::vector<Header>& headers) {
  nlohmann::json arr = nlohmann::json::array();
  for (const Header& h : headers) arr.push_back({h.name, h.value});
  return arr.dump();
}

std::vector<Header> headers_from_json(const std::string& text) {
  std::vector<Header> out;
  if (text.empty()) return out;
  for (const auto& pair : nlohmann::json::parse(text)) {
    out.push_back({pair.at(0).get<std::string>(), pair.at(1).get<std::string>()});
  }
  return out;
}

// Binds status ?first, headers ?first+1, body ?first+2, body_ref ?first+3. The strings
// bound are owned by `headers_json` and `response`, which outlive the statement's step.
void bind_response(Statement& s, int first, const StoredResponse& r, const std::string& headers_json) {
  s.bind(first, static_cast<std::int64_t>(r.response.status));
  if (r.response.headers.empty()) {
    s.bind_null(first + 1);
  } else {
    s.bind(first + 1, headers_json);
  }
  s.bind_blob(first + 2, r.response.body.data(), r.response.body.size());
  if (r.body_ref.empty()) {
    s.bind_null(first + 3);
  } else {
    s.bind(first + 3, r.body_ref);
  }
}

}  // namespace

struct SqliteStore::Impl {
  detail::FairMutex mutex;  // serialises every use of `db` and the statements, first come first served
  SqliteOptions options;
  std::string path;
  detail::BusyPolicy busy;
  detail::Connection db;
  // Every statement, prepared once when the store opens and reused.
  std::unique_ptr<Statement> begin, commit, rollback, reserve, replace_dead, load, complete,
      release, renew, set_recovery_point, insert_completed, purge, reap;
  std::atomic<std::uint64_t> transactions{0}, ops{0}, checkpoints{0};
  std::atomic<int> next_checkpoint_at;  // WAL pages at which the commit hook wakes the checkpointer

  // The background checkpointer (SqliteOptions::background_checkpoint).
  std::mutex checkpoint_mutex;
  std::condition_variable checkpoint_cv;
  bool checkpoint_wanted = false; // guarded by checkpoint_mutex
  bool stopping = false;          // guarded by checkpoint_mutex
  std::thread checkpointer;       // started on the first request

  Impl(const std::string& p, const SqliteOptions& o)
      : options(o),
        path(p),
        busy{o.busy_timeout, {}},
        db(detail::open_connection(p, &busy)),
        next_checkpoint_at(std::max(o.checkpoint_pages, 1)) {
    detail::enable_wal(db.get(), busy);
    detail::exec(db.get(), options.synchronous == Synchronous::full ? "PRAGMA synchronous=FULL"
                                                                    : "PRAGMA synchronous=NORMAL");
    if (options.background_checkpoint) {
      // Replaces SQLite's automatic checkpoint, which would run on the committing thread.
      sqlite3_wal_hook(db.get(), &Impl::on_wal_commit, this);
    } else {
      sqlite3_wal_autocheckpoint(db.get(), options.checkpoint_pages);
    }
    auto make = [this](std::string_view sql) { return std::make_unique<Statement>(db.get(), sql); };
    begin = make(sql::kBeginImmediate);
    commit = make(sql::kCommit);
    rollback = make(sql::kRollback);
    migrate();
    reserve = make(sql::kReserve);
    replace_dead = make(sql::kReplaceDead);
    load = make(sql::kLoad);
    complete = make(sql::kComplete);
    release = make(sql::kRelease);
    renew = make(sql::kRenew);
    set_recovery_point = make(sql::kSetRecoveryPoint);
    insert_completed = make(sql::kInsertCompleted);
    purge = make(sql::kPurge);
    reap = make(sql::kReap);
  }

  ~Impl() {
    {
      std::lock_guard lock(checkpoint_mutex);
      stopping = true;
    }
    checkpoint_cv.notify_all();
    if (checkpointer.joinable()) checkpointer.join();
  }

  // Called by SQLite after each commit with the WAL's size in pages: cheap unless a
  // checkpoint is due, then it wakes the checkpointer. A WAL that did not start over after
  // the last checkpoint (another process kept writing, or a reader held an old snapshot)
  // asks again only once it has grown by another checkpoint_pages / 4, not at every commit.
  static int on_wal_commit(void* arg, sqlite3*, const char*, int pages) {
    auto* self = static_cast<Impl*>(arg);
    if (pages < self->next_checkpoint_at.load(std::memory_order_relaxed)) return SQLITE_OK;
    {
      std::lock_guard lock(self->checkpoint_mutex);
      if (self->checkpoint_wanted) return SQLITE_OK;
      self->checkpoint_wanted = true;
      if (!self->checkpointer.joinable()) self->checkpointer = std::thread([self] { self->run_checkpointer(); });
    }
    self->checkpoint_cv.notify_one();
    return SQLITE_OK;
  }

  void run_checkpointer() {
    detail::BusyPolicy own_busy{options.busy_timeout, {}};
    detail::Connection conn;
    try {
      conn = detail::open_connection(path, &own_busy);
      // A connection knows the file is in WAL mode only once it has read it; until then a
      // checkpoint is a no-op.
      detail::enable_wal(conn.get(), own_busy);
    } catch (const StoreError&) {
      return;  // no checkpoints from here: the WAL grows until the store closes, which checkpoints
    }
    std::unique_lock lock(checkpoint_mutex);
    for (;;) {
      checkpoint_cv.wait(lock, [this] { return checkpoint_wanted || stopping; });
      if (stopping) return;
      lock.unlock();
      const int kept = checkpoint(conn.get(), own_busy);
      next_checkpoint_at.store(kept == 0 ? options.checkpoint_pages : kept + std::max(options.checkpoint_pages / 4, 1),
                               std::memory_order_relaxed);
      checkpoints.fetch_add(1, std::memory_order_relaxed);
      lock.lock();
      checkpoint_wanted = false;
    }
  }

  // One checkpoint, shaped so this process's writers barely notice it:
  //  1. PASSIVE rounds copy the WAL into the database while writers go on (a round takes
  //     two fsyncs; the next copies what was written meanwhile), until little is left;
  //  2. the little that is left is copied with this process's writers held back (the store's
  //     mutex, taken in turn like any writer). With the WAL fully copied, the next commit
  //     starts it over from its beginning: the file stays near checkpoint_pages and its
  //     pages are rewritten in place, never appended.
  //  3. If another process kept writing, or a reader held an old snapshot, the WAL could
  //     not start over; once it reaches four times checkpoint_pages, a RESTART checkpoint
  //     is tried, which takes the write lock from every process, copies the rest and lets
  //     the WAL start over. It is tried without waiting (a busy write lock or reader makes
  //     it give up until the WAL has grown by another quarter): waiting would hold this
  //     process's writers for as long.
  // Returns 0 when the WAL will start over, else its size in pages.
  int checkpoint(sqlite3* conn, detail::BusyPolicy& conn_busy) {
    constexpr int kRounds = 6;
    const int short_tail = std::max(options.checkpoint_pages / 8, 16);
    int log = 0, copied = 0;
    for (int round = 0, done = 0; round < kRounds; ++round) {
      if (sqlite3_wal_checkpoint_v2(conn, nullptr, SQLITE_CHECKPOINT_PASSIVE, &log, &copied) != SQLITE_OK) {
        return std::max(log, 1);  // another connection is checkpointing: try again later
      }
      // `log` is the WAL as this round found it; what it had to copy was written while the
      // previous round ran. Once that is little, so is what the next round would find.
      const int found = log - done;
      done = copied;
      if (found <= short_tail) break;
    }
    {
      std::lock_guard hold(mutex);
      sqlite3_wal_checkpoint_v2(conn, nullptr, SQLITE_CHECKPOINT_PASSIVE, &log, &copied);
    }
    if (log == copied) return 0;
    if (log >= 4 * options.checkpoint_pages) {
      conn_busy.timeout = std::chrono::milliseconds(0);
      std::lock_guard hold(mutex);
      const int rc = sqlite3_wal_checkpoint_v2(conn, nullptr, SQLITE_CHECKPOINT_RESTART, &log, &copied);
      conn_busy.timeout = options.busy_timeout;
      if (rc == SQLITE_OK) return 0;
    }
    return log;
  }

  void migrate() {
    detail::Transaction tx(*begin, *commit, *rollback);
    const auto current = [&] {
      Statement version(db.get(), sql::kUserVersion);
      version.step();
      return version.int64(0);  // finalized here: a pending statement would block DROP TABLE
    }();
    const auto known = static_cast<std::int64_t>(sql::kMigrations.size());
    if (current > known) {
      throw StoreError(fmt::format("sqlite: database schema version {} is newer than this "
                                   "library supports ({}); upgrade idem",
                                   current, known),
                       0);
    }
    for (auto v = current; v < known; ++v) {
      detail::exec(db.get(), sql::kMigrations[static_cast<std::size_t>(v)]);
    }
    if (current != known) detail::exec(db.get(), fmt::format("PRAGMA user_version = {}", known));
    tx.commit();
  }

  // Reads the current row of `load` (which must have stepped onto a row).
  Record read_record() const {
    const Statement& s = *load;
    Record r;
    const std::string_view fp = s.blob_view(0);
    Fingerprint::Bytes bytes{};
    std::copy_n(fp.begin(), std::min(fp.size(), bytes.size()), bytes.begin());
    r.fingerprint = Fingerprint(bytes);
    r.state = static_cast<State>(s.int64(1));
    r.token = s.int64(2);
    r.lease_until = at_ms(s.int64(3));
    r.created_at = at_ms(s.int64(4));
    r.expires_at = at_ms(s.int64(5));
    if (!s.is_null(6)) r.response.status = static_cast<int>(s.int64(6));
    if (!s.is_null(7)) r.response.headers = headers_from_json(s.text(7));
    r.response.body = s.blob(8);
    if (!s.is_null(9)) r.body_ref = s.text(9);
    if (!s.is_null(10)) r.recovery_point = s.text(10);
    return r;
  }

  std::optional<Record> load_record(const KeyId& id) {
    ResetGuard reset(*load);
    bind_id(*load, id);
    if (!load->step()) return std::nullopt;
    return read_record();
  }

  // Runs a token-checked UPDATE; true when it changed the row.
  bool changed(Statement& s) {
    s.step();
    return sqlite3_changes(db.get()) == 1;
  }

  // ---- writes, inside a transaction the caller holds ----

  Reservation reserve_in_tx(const KeyId& id, const Fingerprint& fingerprint, TimePoint now,
                            TimePoint lease_until) {
    Reservation out;
    {
      Statement& s = *reserve;
      ResetGuard reset(s);
      bind_id(s, id);
      bind_fingerprint(s, 4, fingerprint);
      s.bind(5, ms(now));
      s.bind(6, ms(lease_until));
      s.bind(7, ms(now));
      if (changed(s)) {
        out.token = ms(now);
        return out;
      }
    }
    std::optional<Record> existing = load_record(id);
    if (!existing) throw StoreError("sqlite: reserve: conflicting row vanished", 0);
    if (existing->live_at(now)) {
      out.kind = Reservation::Kind::existing;
      out.existing = std::move(existing);
      return out;
    }
    // The record no longer counts: replace it with our reservation. The token grows past
    // every earlier token of this key, and past the clock, so a token stays unique even
    // after a purge deleted the row.
    const bool takeover = existing->state == State::in_progress;
    const bool resume = takeover && existing->fingerprint == fingerprint;
    out.kind = takeover ? Reservation::Kind::taken_over : Reservation::Kind::reserved;
    out.token = std::max(existing->token + 1, ms(now));
    if (resume) out.recovery_point = existing->recovery_point;
    replace(id, fingerprint, out.token, now, lease_until, out.recovery_point, existing->token);
    return out;
  }

  void replace(const KeyId& id, const Fingerprint& fingerprint, std::int64_t token, TimePoint now,
               TimePoint lease_until, const std::optional<std::string>& recovery_point,
               std::int64_t old_token) {
    Statement& s = *replace_dead;
    ResetGuard reset(s);
    bind_id(s, id);
    bind_fingerprint(s, 4, fingerprint);
    s.bind(5, token);
    s.bind(6, ms(lease_until));
    s.bind(7, ms(now));
    if (recovery_point) {
      s.bind(8, *recovery_point);
    } else {
      s.bind_null(8);
    }
    s.bind(9, old_token);
    if (!changed(s)) throw StoreError("sqlite: reserve: record changed inside its transaction", 0);
  }

  bool complete_in_tx(const KeyId& id, std::int64_t token, const StoredResponse& response,
                      TimePoint expires_at) {
    const std::string headers = headers_to_json(response.response.headers);
    Statement& s = *complete;
    ResetGuard reset(s);
    bind_id(s, id);
    s.bind(4, token);
    bind_response(s, 5, response, headers);
    s.bind(9, ms(expires_at));
    return changed(s);
  }

  bool release_in_tx(const KeyId& id, std::int64_t token, TimePoint now) {
    Statement& s = *release;
    ResetGuard reset(s);
    bind_id(s, id);
    s.bind(4, token);
    s.bind(5, ms(now));
    return changed(s);
  }

  void run_op(StoreOp& op) {
    switch (op.kind) {
      case StoreOp::Kind::reserve:
        op.reservation = reserve_in_tx(*op.id, *op.fingerprint, op.now, op.lease_until);
        break;
      case StoreOp::Kind::complete:
        op.applied = complete_in_tx(*op.id, op.token, *op.response, op.expires_at);
        break;
      case StoreOp::Kind::release:
        op.applied = release_in_tx(*op.id, op.token, op.now);
        break;
    }
  }
};

// A caller's ops waiting in the group-commit queue.
struct SqliteStore::Batch {
  std::span<StoreOp* const> ops;
  bool done = false;  // guarded by queue_mutex_
};

SqliteStore::SqliteStore(const std::string& path, SqliteOptions options)
    : impl_(std::make_unique<Impl>(path, options)) {}

SqliteStore::~SqliteStore() = default;

int SqliteStore::schema_version() noexcept { return static_cast<int>(sql::kMigrations.size()); }

void SqliteStore::apply(std::span<StoreOp* const> ops) {
  if (ops.empty()) return;
  Batch mine{ops};
  std::unique_lock queue(queue_mutex_);
  queue_.push_back(&mine);
  while (!mine.done) {
    if (leader_active_) {
      queue_cv_.wait(queue);
      continue;
    }
    // Lead: commit everything queued so far (ours included) in one transaction.
    leader_active_ = true;
    std::vector<Batch*> batches;
    batches.swap(queue_);
    queue.unlock();
    run_batches(batches);
    queue.lock();
    for (Batch* b : batches) b->done = true;
    leader_active_ = false;
    queue_cv_.notify_all();
  }
}

void SqliteStore::run_batches(const std::vector<Batch*>& batches) {
  std::lock_guard lock(impl_->mutex);
  Impl& d = *impl_;
  std::size_t count = 0;
  for (const Batch* b : batches) count += b->ops.size();
  std::optional<detail::Transaction> tx;
  try {
    tx.emplace(*d.begin, *d.commit, *d.rollback);
  } catch (const StoreError&) {
    // The write lock could not be had: every op fails the same way.
    for (Batch* b : batches) {
      for (StoreOp* op : b->ops) op->error = std::current_exception();
    }
    return;
  }
  try {
    for (Batch* b : batches) {
      for (StoreOp* op : b->ops) d.run_op(*op);
    }
    tx->commit();
    d.transactions.fetch_add(1, std::memory_order_relaxed);
    d.ops.fetch_add(count, std::memory_order_relaxed);
    return;
  } catch (const StoreError&) {
    tx.reset();  // rolls back
  }
  // One op broke the shared transaction (a body too big, say): give each op its own, so
  // its neighbours still succeed.
  for (Batch* b : batches) {
    for (StoreOp* op : b->ops) {
      op->reservation = {};
      op->applied = false;
      try {
        detail::Transaction single(*d.begin, *d.commit, *d.rollback);
        d.run_op(*op);
        single.commit();
        d.transactions.fetch_add(1, std::memory_order_relaxed);
        d.ops.fetch_add(1, std::memory_order_relaxed);
      } catch (const StoreError&) {
        op->error = std::current_exception();
      }
    }
  }
}

SqliteStore::CommitStats SqliteStore::commit_stats() const {
  return CommitStats{impl_->transactions.load(std::memory_order_relaxed),
                     impl_->ops.load(std::memory_order_relaxed),
                     impl_->checkpoints.load(std::memory_order_relaxed)};
}

namespace {

// Runs one op through apply() and rethrows its error, for the single-op entry points.
void apply_one(SqliteStore& store, StoreOp& op) {
  StoreOp* one = &op;
  store.apply(std::span<StoreOp* const>(&one, 1));
  if (op.error) std::rethrow_exception(op.error);
}

}  // namespace

Reservation SqliteStore::reserve(const KeyId& id, const Fingerprint& fingerprint, TimePoint now,
                                 TimePoint lease_until) {
  StoreOp op;
  op.kind = StoreOp::Kind::reserve;
  op.id = &id;
  op.fingerprint = &fingerprint;
  op.now = now;
  op.lease_until = lease_until;
  apply_one(*this, op);
  return std::move(op.reservation);
}

bool SqliteStore::complete(const KeyId& id, std::int64_t token, const StoredResponse& response,
                           TimePoint expires_at) {
  StoreOp op;
  op.kind = StoreOp::Kind::complete;
  op.id = &id;
  op.token = token;
  op.response = &response;
  op.expires_at = expires_at;
  apply_one(*this, op);
  return op.applied;
}

bool SqliteStore::release(const KeyId& id, std::int64_t token, TimePoint now) {
  StoreOp op;
  op.kind = StoreOp::Kind::release;
  op.id = &id;
  op.token = token;
  op.now = now;
  apply_one(*this, op);
  return op.applied;
}

bool SqliteStore::renew(const KeyId& id, std::int64_t token, TimePoint lease_until) {
  std::lock_guard lock(impl_->mutex);
  Statement& s = *impl_->renew;
  ResetGuard reset(s);
  bind_id(s, id);
  s.bind(4, token);
  s.bind(5, ms(lease_until));
  return impl_->changed(s);
}

bool SqliteStore::set_recovery_point(const KeyId& id, std::int64_t token, const std::string& point) {
  std::lock_guard lock(impl_->mutex);
  Statement& s = *impl_->set_recovery_point;
  ResetGuard reset(s);
  bind_id(s, id);
  s.bind(4, token);
  s.bind(5, point);
  return impl_->changed(s);
}

std::optional<Record> SqliteStore::load(const KeyId& id) {
  std::lock_guard lock(impl_->mutex);
  return impl_->load_record(id);
}

std::optional<Record> SqliteStore::store_if_absent(const KeyId& id, const Fingerprint& fingerprint,
                                                   const StoredResponse& response, TimePoint now,
                                                   TimePoint expires_at) {
  const std::string headers = headers_to_json(response.response.headers);
  std::lock_guard lock(impl_->mutex);
  Impl& d = *impl_;
  detail::Transaction tx(*d.begin, *d.commit, *d.rollback);
  {
    Statement& s = *d.insert_completed;
    ResetGuard reset(s);
    bind_id(s, id);
    bind_fingerprint(s, 4, fingerprint);
    s.bind(5, ms(now));
    s.bind(6, ms(now));
    s.bind(7, ms(expires_at));
    bind_response(s, 8, response, headers);
    if (d.changed(s)) {
      tx.commit();
      return std::nullopt;
    }
  }
  std::optional<Record> existing = d.load_record(id);
  if (existing && existing->live_at(now)) {
    tx.commit();
    return existing;
  }
  // A dead record: overwrite it with a completed one (the statements of reserve, then
  // complete, inside this one transaction).
  const std::int64_t token = std::max(existing ? existing->token + 1 : 0, ms(now));
  d.replace(id, fingerprint, token, now, now, std::nullopt, existing ? existing->token : 0);
  if (!d.complete_in_tx(id, token, response, expires_at)) {
    throw StoreError("sqlite: store_if_absent: record changed", 0);
  }
  tx.commit();
  return std::nullopt;
}

std::size_t SqliteStore::purge_expired(TimePoint now, std::size_t limit) {
  std::lock_guard lock(impl_->mutex);
  Statement& s = *impl_->purge;
  ResetGuard reset(s);
  s.bind(1, ms(now));
  s.bind(2, static_cast<std::int64_t>(limit));
  s.step();
  return static_cast<std::size_t>(sqlite3_changes(impl_->db.get()));
}

std::vector<ReapedRecord> SqliteStore::reap(TimePoint lease_ended_before, std::size_t limit) {
  std::lock_guard lock(impl_->mutex);
  Statement& s = *impl_->reap;
  ResetGuard reset(s);
  s.bind(1, ms(lease_ended_before));
  s.bind(2, static_cast<std::int64_t>(limit));
  std::vector<ReapedRecord> out;
  while (s.step()) {
    KeyId id{s.text(0), s.text(1), s.text(2)};
    out.push_back({short_hash(id), id.operation, s.int64(3), at_ms(s.int64(4))});
  }
  return out;
}

}  // namespace idem
