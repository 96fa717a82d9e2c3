#include "idem/sqlite_store.hpp"

#include <fmt/format.h>
#include <sqlite3.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_set>

#include "fair_mutex.hpp"
#include "idem/errors.hpp"
#include "idem/internal/sqlite.hpp"
#include "idem/internal/store_stats.hpp"
#include "idem/test_control.hpp"
#include "reserve_rule.hpp"
#include "sql.hpp"
#include "sqlite_checkpointer.hpp"
#include "sqlite_codec.hpp"
#include "sqlite_migrations.hpp"

namespace idem {

using sqlite::ResetGuard;
using sqlite::Statement;

namespace {

// A local step's handle on the store's open transaction.
class SqliteLocal final : public LocalTransaction {
 public:
  using Cache = std::map<std::string, std::unique_ptr<Statement>, std::less<>>;
  SqliteLocal(sqlite3* db, Cache& cache, Statement& outbox_insert, const KeyId& id,
              std::int64_t origin, std::string_view step, TimePoint now)
      : db_(db),
        cache_(cache),
        outbox_insert_(outbox_insert),
        id_(id),
        origin_(origin),
        step_(step),
        now_(now) {}

  Dialect dialect() const noexcept override { return Dialect::sqlite; }

  std::vector<Row> execute(std::string_view sql, std::initializer_list<Value> params) override {
    auto it = cache_.find(sql);
    if (it == cache_.end())
      it = cache_.emplace(std::string(sql), std::make_unique<Statement>(db_, sql)).first;
    Statement& s = *it->second;
    ResetGuard reset(s);
    int i = 1;
    for (const Value& v : params) {
      if (std::holds_alternative<std::nullptr_t>(v)) {
        s.bind_null(i);
      } else if (const auto* n = std::get_if<std::int64_t>(&v)) {
        s.bind(i, *n);
      } else if (const auto* d = std::get_if<double>(&v)) {
        s.bind(i, *d);
      } else {
        s.bind(i, std::get<std::string>(v));
      }
      ++i;
    }
    std::vector<Row> rows;
    while (s.step()) {
      Row row;
      for (int c = 0; c < s.column_count(); ++c) {
        switch (s.type(c)) {
          case Statement::Type::integer:
            row.emplace_back(s.int64(c));
            break;
          case Statement::Type::real:
            row.emplace_back(s.real(c));
            break;
          case Statement::Type::text:
            row.emplace_back(s.text(c));
            break;
          case Statement::Type::blob:
            row.emplace_back(s.blob(c));
            break;
          case Statement::Type::null:
            row.emplace_back(nullptr);
            break;
        }
      }
      rows.push_back(std::move(row));
    }
    changes_ = s.changes();
    return rows;
  }

  std::int64_t changes() const override { return changes_; }

  std::string enqueue(std::string_view topic, std::string_view payload) override {
    std::string id = outbox_message_id(id_, origin_, step_, sent_++);
    const std::string hash = short_hash(id_);
    Statement& s = outbox_insert_;
    ResetGuard reset(s);
    s.bind(1, id);
    s.bind(2, topic);
    s.bind_blob(3, payload.data(), payload.size());
    s.bind(4, hash);
    s.bind(5, detail::ms(now_));
    s.step();
    return id;
  }

 private:
  sqlite3* db_;
  Cache& cache_;
  Statement& outbox_insert_;
  const KeyId& id_;
  std::int64_t origin_;
  std::string_view step_;
  TimePoint now_;
  std::size_t sent_ = 0;
  std::int64_t changes_ = 0;
};

}  // namespace

struct SqliteStore::Impl {
  detail::FairMutex
      mutex;  // serialises every use of `db` and the statements, first come first served
  sqlite::BusyPolicy busy;
  // How long a call waits in line for `mutex` (SqliteOptions::busy_timeout).
  const std::chrono::milliseconds patience;
  sqlite::Connection db;
  sqlite::TransactionStatements tx;
  // Every statement, prepared once when the store opens and reused.
  Statement reserve, replace_dead, load, complete, release, renew, insert_completed;
  // Maintenance's walk over the due times (purge and the reaper).
  Statement due_scan, due_delete, due_insert, delete_record;
  // Multi-step operations and the outbox.
  Statement has_progress, load_progress, begin_steps, mark_pending, set_progress, abandoned,
      outbox_insert, outbox_any_due, outbox_claim, outbox_delivered, outbox_failed, outbox_counts,
      outbox_purge;
  // The statements local steps ran, by text, prepared once.
  std::map<std::string, std::unique_ptr<Statement>, std::less<>> local_statements;
  std::atomic<std::uint64_t> transactions{0}, committed_ops{0};
  std::optional<detail::Checkpointer> checkpointer;  // SqliteOptions::background_checkpoint
  // Set when a write failed with SQLITE_FULL; guarded by `mutex`. Checkpoints follow commits,
  // so a WAL that cannot grow is never checkpointed by itself: every byte freed on the disk
  // would then go to more WAL frames (a whole page per changed page per commit) and the WAL's
  // own bytes would stay taken, across restarts too. While it is set, each write first tries
  // reclaim_wal(); the first that succeeds clears it.
  bool disk_full = false;

  Impl(const std::string& path, const SqliteOptions& o)
      : busy{o.busy_timeout, {}},
        patience(o.busy_timeout),
        db(open(path, o, busy)),
        tx(db.get()),
        reserve(migrated(db.get(), tx), sql::kReserve),
        replace_dead(db.get(), sql::kReplaceDead),
        load(db.get(), sql::kLoad),
        complete(db.get(), sql::kComplete),
        release(db.get(), sql::kRelease),
        renew(db.get(), sql::kRenew),
        insert_completed(db.get(), sql::kInsertCompleted),
        due_scan(db.get(), sql::kDueScan),
        due_delete(db.get(), sql::kDueDelete),
        due_insert(db.get(), sql::kDueInsert),
        delete_record(db.get(), sql::kDeleteRecord),
        has_progress(db.get(), sql::kHasProgress),
        load_progress(db.get(), sql::kLoadProgress),
        begin_steps(db.get(), sql::kBeginSteps),
        mark_pending(db.get(), sql::kMarkPending),
        set_progress(db.get(), sql::kSetProgress),
        abandoned(db.get(), sql::kAbandoned),
        outbox_insert(db.get(), sql::kOutboxInsert),
        outbox_any_due(db.get(), sql::kOutboxAnyDue),
        outbox_claim(db.get(), sql::kOutboxClaim),
        outbox_delivered(db.get(), sql::kOutboxDelivered),
        outbox_failed(db.get(), sql::kOutboxFailed),
        outbox_counts(db.get(), sql::kOutboxCounts),
        outbox_purge(db.get(), sql::kOutboxPurge) {
    if (o.background_checkpoint) {
      checkpointer.emplace(db.get(), path, o, mutex);
    } else {
      sqlite3_wal_autocheckpoint(db.get(), o.checkpoint_pages);
    }
  }

  static sqlite::Connection open(const std::string& path, const SqliteOptions& o,
                                 sqlite::BusyPolicy& busy) {
    sqlite::Connection db = sqlite::open_connection(path, &busy);
    sqlite::enable_wal(db.get(), busy);
    sqlite::exec(db.get(), o.synchronous == Synchronous::full ? sql::kSynchronousFull
                                                              : sql::kSynchronousNormal);
    return db;
  }

  // The schema is brought up to date before the statements that use it are prepared.
  static sqlite3* migrated(sqlite3* db, sqlite::TransactionStatements& tx) {
    detail::migrate(db, tx);
    return db;
  }

  // A TRUNCATE checkpoint: the WAL is copied into the database (which grows only by the pages
  // it lacks) and cut to zero bytes, giving its space back. It does not wait for other
  // connections: if one is reading or writing, a later write tries again. Requires `mutex`
  // and no open transaction.
  void reclaim_wal() {
    if (!disk_full) return;
    busy.timeout = std::chrono::milliseconds(0);
    const int rc =
        sqlite3_wal_checkpoint_v2(db.get(), nullptr, SQLITE_CHECKPOINT_TRUNCATE, nullptr, nullptr);
    busy.timeout = patience;
    if (rc == SQLITE_OK) disk_full = false;
  }

  void note_failure(const StoreError& e) {
    if ((e.sqlite_code() & 0xff) != SQLITE_FULL) return;
    disk_full = true;
    reclaim_wal();  // often the space the database needs is there already
  }

  // Takes `mutex` in turn, as every call does, waiting in line at most `patience`, as long as a
  // statement waits for another connection's write lock: a call of this process that holds
  // the connection longer (a local step that does not end, a disk that does not answer) fails
  // the ones behind it with StoreError, nothing done, and never holds their threads for ever.
  std::unique_lock<detail::FairMutex> line() {
    if (!mutex.try_lock_for(patience)) {
      throw StoreError(fmt::format("sqlite: the store's connection stayed busy with another call "
                                   "of this process for {} ms (busy_timeout); nothing was done",
                                   patience.count()),
                       SQLITE_BUSY);
    }
    return std::unique_lock(mutex, std::adopt_lock);
  }

  // Runs one write under `mutex`, reclaiming the WAL's space first after a full disk.
  template <class F>
  auto write(F&& f) -> decltype(f()) {
    const auto lock = line();
    reclaim_wal();
    try {
      return f();
    } catch (const StoreError& e) {
      note_failure(e);
      throw;
    }
  }

  std::optional<Record> load_record(const KeyId& id) {
    ResetGuard reset(load);
    detail::bind_id(load, id);
    if (!load.step()) return std::nullopt;
    return detail::read_record(load);
  }

  // Runs a token-checked UPDATE; true when it changed the row.
  static bool changed(Statement& s) {
    s.step();
    return s.changes() == 1;
  }

  // ---- maintenance: the due times (sql.hpp, migration v5) ----

  // A due entry and its record as kDueScan read them.
  struct Due {
    std::int64_t due_at = 0;
    KeyId id;
    bool present = false;  // the record is still there
    State state = State::in_progress;
    std::int64_t token = 0, lease_until = 0, expires_at = 0;
    bool progress = false;
  };

  // Takes the entries of idem_due due at or before `until` in time order, in short
  // transactions of at most `limit` entries each, until `take` has taken `limit` records or no
  // entry is left. For each entry: its record gone, the entry is dropped; its record's
  // expires_at after `until`, the entry moves there (nothing is due yet); otherwise
  // `take(due)` says whether to delete the record (with the entry) or leave both. Returns how
  // many records it deleted. Each batch holds the lock for one transaction only, so calls wait
  // for one batch at most.
  template <class Take>
  std::size_t sweep_due(std::int64_t until, std::size_t limit, Take take) {
    std::size_t taken = 0;
    Due after;         // the last entry looked at (0, '', '', '' at first)
    bool more = true;  // the last batch was full: entries may be left
    while (more && taken < limit) {
      more = write([&] {
        std::vector<Due> batch = scan_due(until, after, limit);
        if (batch.empty()) return false;
        bool full = batch.size() == limit;
        sqlite::Transaction t(tx);
        std::unordered_set<KeyId, KeyIdHash> deleted;  // a record may have several entries
        for (Due& d : batch) {
          if (taken == limit) {
            full = true;
            break;
          }
          after.due_at = d.due_at;
          after.id = d.id;
          if (!d.present || deleted.contains(d.id)) {
            drop_due(d.due_at, d.id);
          } else if (d.expires_at > until) {
            insert_due(d.expires_at, d.id);
            drop_due(d.due_at, d.id);
          } else if (take(d)) {
            ResetGuard reset(delete_record);
            detail::bind_id(delete_record, d.id);
            delete_record.bind(4, d.token);
            if (!changed(delete_record))
              throw StoreError("sqlite: purge: record changed inside its transaction", 0);
            drop_due(d.due_at, d.id);
            deleted.insert(std::move(d.id));
            ++taken;
          }
        }
        t.commit();
        return full;
      });
    }
    return taken;
  }

  std::vector<Due> scan_due(std::int64_t until, const Due& after, std::size_t limit) {
    Statement& s = due_scan;
    ResetGuard reset(s);
    s.bind(1, until);
    s.bind(2, after.due_at);
    detail::bind_id(s, after.id, 3);
    s.bind(6, static_cast<std::int64_t>(limit));
    std::vector<Due> out;
    while (s.step()) {
      Due& d = out.emplace_back();
      d.due_at = s.int64(0);
      d.id = KeyId{s.text(1), s.text(2), s.text(3)};
      d.present = !s.is_null(4);
      if (!d.present) continue;
      d.state = static_cast<State>(s.int64(4));
      d.token = s.int64(5);
      d.lease_until = s.int64(6);
      d.expires_at = s.int64(7);
      d.progress = s.int64(8) != 0;
    }
    return out;
  }

  void drop_due(std::int64_t due_at, const KeyId& id) {
    ResetGuard reset(due_delete);
    due_delete.bind(1, due_at);
    detail::bind_id(due_delete, id, 2);
    due_delete.step();
  }

  void insert_due(std::int64_t due_at, const KeyId& id) {
    ResetGuard reset(due_insert);
    due_insert.bind(1, due_at);
    detail::bind_id(due_insert, id, 2);
    due_insert.step();
  }

  // ---- writes, inside a transaction the caller holds (or alone(): one statement that
  //      SQLite commits by itself) ----

  // The reservation of a key no record holds, or nothing (no change) when a record holds it.
  std::optional<Reservation> reserve_free(const KeyId& id, const Fingerprint& fingerprint,
                                          TimePoint now, TimePoint lease_until,
                                          std::int64_t claim) {
    ResetGuard reset(reserve);
    detail::bind_id(reserve, id);
    detail::bind_fingerprint(reserve, 4, fingerprint);
    reserve.bind(5, detail::ms(now));
    reserve.bind(6, detail::ms(lease_until));
    reserve.bind(7, detail::ms(now));
    bind_claim(reserve, 8, claim);
    if (!changed(reserve)) return std::nullopt;
    Reservation out;  // there was no record: reserve_rule's answer is a fresh token
    out.token = detail::ms(now);
    return out;
  }

  Reservation reserve_in_tx(const KeyId& id, const Fingerprint& fingerprint, TimePoint now,
                            TimePoint lease_until, std::int64_t claim) {
    if (std::optional<Reservation> fresh = reserve_free(id, fingerprint, now, lease_until, claim))
      return *fresh;
    Reservation out;
    std::optional<Record> existing = load_record(id);
    if (!existing) throw StoreError("sqlite: reserve: conflicting row vanished", 0);
    const detail::ReserveAnswer rule =
        detail::reserve_rule(&*existing, !existing->live_at(now) && record_has_progress(id),
                             fingerprint, now, detail::ms(now));
    out.kind = rule.kind;
    if (rule.kind == Reservation::Kind::existing) {
      out.existing = std::move(existing);
      return out;
    }
    out.token = rule.token;
    if (rule.kind == Reservation::Kind::taken_over &&
        test_control::enabled(test_control::Mutation::takeover_reuses_token))
      out.token = existing->token;
    replace(id, fingerprint, out.token, now, lease_until, rule.resume, existing->token, claim);
    return out;
  }

  static void bind_claim(Statement& s, int index, std::int64_t claim) {
    if (claim == 0) {
      s.bind_null(index);
    } else {
      s.bind(index, claim);
    }
  }

  bool record_has_progress(const KeyId& id) {
    ResetGuard reset(has_progress);
    detail::bind_id(has_progress, id);
    return has_progress.step() && has_progress.int64(0) != 0;
  }

  void replace(const KeyId& id, const Fingerprint& fingerprint, std::int64_t token, TimePoint now,
               TimePoint lease_until, bool resume, std::int64_t old_token, std::int64_t claim) {
    Statement& s = replace_dead;
    ResetGuard reset(s);
    detail::bind_id(s, id);
    detail::bind_fingerprint(s, 4, fingerprint);
    s.bind(5, token);
    s.bind(6, detail::ms(lease_until));
    s.bind(7, detail::ms(now));
    s.bind(8, std::int64_t{resume ? 1 : 0});
    s.bind(9, old_token);
    bind_claim(s, 10, claim);
    if (!changed(s)) throw StoreError("sqlite: reserve: record changed inside its transaction", 0);
  }

  bool complete_in_tx(const KeyId& id, std::int64_t token, const StoredResponse& response,
                      TimePoint expires_at) {
    const std::string headers = detail::headers_to_json(response.response.headers);
    Statement& s = complete;
    ResetGuard reset(s);
    detail::bind_id(s, id);
    s.bind(4, token);
    if (test_control::enabled(test_control::Mutation::complete_without_token_check)) {
      const std::optional<Record> current = load_record(id);
      if (current) s.bind(4, current->token);
    }
    detail::bind_response(s, 5, response, headers);
    s.bind(9, detail::ms(expires_at));
    return changed(s);
  }

  bool release_in_tx(const KeyId& id, std::int64_t token, TimePoint now,
                     std::chrono::milliseconds keep_for) {
    Statement& s = release;
    ResetGuard reset(s);
    detail::bind_id(s, id);
    s.bind(4, token);
    s.bind(5, detail::ms(now));
    s.bind(6, static_cast<std::int64_t>(keep_for.count()));
    return changed(s);
  }

  // InFlight::run: a completed record straight away, unless a live record holds the key.
  std::optional<Record> store_if_absent_in_tx(const KeyId& id, const Fingerprint& fingerprint,
                                              const StoredResponse& response, TimePoint now,
                                              TimePoint expires_at) {
    {
      const std::string headers = detail::headers_to_json(response.response.headers);
      Statement& s = insert_completed;
      ResetGuard reset(s);
      detail::bind_id(s, id);
      detail::bind_fingerprint(s, 4, fingerprint);
      s.bind(5, detail::ms(now));
      s.bind(6, detail::ms(now));
      s.bind(7, detail::ms(expires_at));
      detail::bind_response(s, 8, response, headers);
      if (changed(s)) return std::nullopt;
    }
    std::optional<Record> existing = load_record(id);
    if (existing && existing->live_at(now)) return existing;
    // A dead record: overwrite it with a completed one (reserve, then complete).
    const std::int64_t token = std::max(existing ? existing->token + 1 : 0, detail::ms(now));
    replace(id, fingerprint, token, now, now, false, existing ? existing->token : 0, 0);
    if (!complete_in_tx(id, token, response, expires_at)) {
      throw StoreError("sqlite: store_if_absent: record changed", 0);
    }
    return std::nullopt;
  }

  void run_op(StoreOp& op) {
    switch (op.kind) {
      case StoreOp::Kind::reserve:
        op.reservation = reserve_in_tx(*op.id, *op.fingerprint, op.now, op.lease_until, op.claim);
        break;
      case StoreOp::Kind::complete:
        op.applied = complete_in_tx(*op.id, op.token, *op.response, op.expires_at);
        break;
      case StoreOp::Kind::release:
        op.applied = release_in_tx(*op.id, op.token, op.now,
                                   std::max(std::chrono::milliseconds(0),
                                            std::chrono::duration_cast<std::chrono::milliseconds>(
                                                op.expires_at - op.now)));
        break;
      case StoreOp::Kind::store_if_absent:
        if (std::optional<Record> winner = store_if_absent_in_tx(
                *op.id, *op.fingerprint, *op.response, op.now, op.expires_at)) {
          op.reservation.kind = Reservation::Kind::existing;
          op.reservation.existing = std::move(winner);
        }
        break;
    }
  }

  // An op with no neighbours, made by one statement where one statement does it: a
  // completion or a release is one UPDATE, a reservation of a free key one INSERT, and SQLite
  // commits a statement made outside a transaction by itself, with its triggers, as one
  // transaction. That spares a lone op the BEGIN and COMMIT around it (docs/performance.md).
  // False, with nothing written, when the op needs a transaction: a reservation that meets a
  // record (it reads the record and decides before it writes), a store_if_absent, or a test
  // mutation that reads first. Requires `mutex`.
  bool alone(StoreOp& op) {
    const std::uint64_t before = busy.waits;
    try {
      switch (op.kind) {
        case StoreOp::Kind::reserve: {
          std::optional<Reservation> fresh =
              reserve_free(*op.id, *op.fingerprint, op.now, op.lease_until, op.claim);
          if (!fresh) return false;
          op.reservation = std::move(*fresh);
          break;
        }
        case StoreOp::Kind::complete:
          if (test_control::enabled(test_control::Mutation::complete_without_token_check))
            return false;
          [[fallthrough]];
        case StoreOp::Kind::release:
          run_op(op);
          break;
        case StoreOp::Kind::store_if_absent:
          return false;
      }
    } catch (...) {  // the statement's own transaction was rolled back
      op.error = std::current_exception();
      return true;
    }
    committed_alone(op, before);
    return true;
  }

  // Counts `op`, committed in a transaction of its own, which began when busy.waits was
  // `waits_before`.
  void committed_alone(StoreOp& op, std::uint64_t waits_before) {
    op.contended = busy.waits != waits_before;
    transactions.fetch_add(1, std::memory_order_relaxed);
    committed_ops.fetch_add(1, std::memory_order_relaxed);
  }

  // One transaction for every op. If one op breaks it (a body too big, say), each op gets a
  // transaction of its own, so its neighbours still succeed. A lone op goes alone() when it
  // can. Requires `mutex`.
  void apply_locked(std::span<StoreOp* const> ops) {
    const std::uint64_t waits = busy.waits;
    if (ops.size() == 1 && alone(*ops[0])) return;
    std::optional<sqlite::Transaction> batch;
    try {
      batch.emplace(tx);
    } catch (const StoreError&) {
      // The write lock could not be had: every op fails the same way.
      for (StoreOp* op : ops) op->error = std::current_exception();
      return;
    }
    try {
      for (StoreOp* op : ops) run_op(*op);
      batch->commit();
      if (busy.waits != waits) {
        for (StoreOp* op : ops) op->contended = true;
      }
      transactions.fetch_add(1, std::memory_order_relaxed);
      committed_ops.fetch_add(ops.size(), std::memory_order_relaxed);
      return;
    } catch (...) {   // a StoreError, or anything else one op threw: never its neighbours' fault
      batch.reset();  // rolls back
    }
    for (StoreOp* op : ops) {
      op->reservation = {};
      op->applied = false;
      try {
        const std::uint64_t before = busy.waits;
        sqlite::Transaction single(tx);
        run_op(*op);
        single.commit();
        committed_alone(*op, before);
      } catch (...) {
        op->error = std::current_exception();
      }
    }
  }
};

SqliteStore::SqliteStore(const std::string& path, SqliteOptions options)
    : impl_(std::make_unique<Impl>(path, options)) {}

SqliteStore::~SqliteStore() = default;

int SqliteStore::schema_version() noexcept { return detail::schema_version(); }

void SqliteStore::apply(std::span<StoreOp* const> ops) {
  if (ops.empty()) return;
  std::unique_lock<detail::FairMutex> lock;
  try {
    lock = impl_->line();
  } catch (const StoreError&) {  // never throws: each op fails with it
    for (StoreOp* op : ops) op->error = std::current_exception();
    return;
  }
  impl_->reclaim_wal();
  impl_->apply_locked(ops);
  for (StoreOp* op : ops) {
    if (!op->error) continue;
    try {
      std::rethrow_exception(op->error);
    } catch (const StoreError& e) {
      impl_->note_failure(e);
    } catch (...) {  // not the store's: nothing to note
    }
  }
}

detail::SqliteStats detail::StoreStats::of(const SqliteStore& store) {
  const SqliteStore::Impl& d = *store.impl_;
  return SqliteStats{d.transactions.load(std::memory_order_relaxed),
                     d.committed_ops.load(std::memory_order_relaxed),
                     d.checkpointer ? d.checkpointer->checkpoints() : 0};
}

bool SqliteStore::renew(const KeyId& id, std::int64_t token, TimePoint lease_until) {
  return impl_->write([&]() -> bool {
    Statement& s = impl_->renew;
    ResetGuard reset(s);
    detail::bind_id(s, id);
    s.bind(4, token);
    s.bind(5, detail::ms(lease_until));
    return Impl::changed(s);
  });
}

std::optional<Record> SqliteStore::load(const KeyId& id) {
  const auto lock = impl_->line();
  return impl_->load_record(id);
}

void SqliteStore::load_many(std::span<StoreRead* const> reads) {
  if (reads.size() < 2) return Store::load_many(reads);
  const auto lock = impl_->line();
  try {
    sqlite::Transaction snapshot(impl_->tx, sqlite::Transaction::Kind::read);
    for (StoreRead* r : reads) {
      try {
        r->record = impl_->load_record(*r->id);
      } catch (...) {  // CorruptRecordError included: this read's own
        r->error = std::current_exception();
      }
    }
  } catch (const StoreError&) {  // BEGIN failed: no read was made
    for (StoreRead* r : reads) r->error = std::current_exception();
  }
}

std::size_t SqliteStore::purge_expired(TimePoint now, std::size_t limit) {
  return impl_->sweep_due(detail::ms(now), limit,
                          [](const Impl::Due& d) { return d.state != State::in_progress; });
}

std::vector<ReapedRecord> SqliteStore::reap(TimePoint lease_ended_before, std::size_t limit) {
  std::vector<ReapedRecord> out;
  // In progress, expires_at is the lease's end.
  impl_->sweep_due(detail::ms(lease_ended_before) - 1, limit, [&](const Impl::Due& d) {
    if (d.state != State::in_progress || d.progress) return false;  // progress: the completer's
    out.push_back({short_hash(d.id), d.id.operation, d.token, detail::at_ms(d.lease_until)});
    return true;
  });
  return out;
}

// ---- multi-step operations and the outbox ----

namespace {

// The row kLoadProgress read.
struct ProgressRow {
  State state;
  std::int64_t token;
  std::optional<Progress> progress;
};

std::optional<ProgressRow> read_progress(Statement& s, const KeyId& id) {
  ResetGuard reset(s);
  detail::bind_id(s, id);
  if (!s.step()) return std::nullopt;
  ProgressRow row{static_cast<State>(s.int64(0)), s.int64(1), std::nullopt};
  if (!s.is_null(2)) {
    row.progress = detail::progress_from_json(s.text(2));
    if (!s.is_null(3)) row.progress->request = s.blob(3);
  }
  return row;
}

// Writes `p` (and the recovery point, if given) on the record `token` holds.
bool write_progress(Statement& s, const KeyId& id, std::int64_t token, const Progress& p,
                    const std::string* recovery_point) {
  const std::string text = detail::progress_to_json(p);
  ResetGuard reset(s);
  detail::bind_id(s, id);
  s.bind(4, token);
  s.bind(5, text);
  if (recovery_point != nullptr) {
    s.bind(6, *recovery_point);
  } else {
    s.bind_null(6);
  }
  s.step();
  return s.changes() == 1;
}

}  // namespace

std::optional<Progress> SqliteStore::begin_steps(const KeyId& id, std::int64_t token,
                                                 const std::string& request) {
  Impl& d = *impl_;
  return d.write([&]() -> std::optional<Progress> {
    sqlite::Transaction t(d.tx);
    {
      Statement& s = d.begin_steps;
      ResetGuard reset(s);
      detail::bind_id(s, id);
      s.bind(4, token);
      s.bind_blob(5, request.data(), request.size());
      s.step();
      if (s.changes() != 1) return std::nullopt;
    }
    std::optional<ProgressRow> row = read_progress(d.load_progress, id);
    if (!row) throw StoreError("sqlite: begin_steps: the record vanished", 0);
    t.commit();
    if (row->progress) return std::move(row->progress);
    Progress fresh;  // nothing happened yet: this attempt is the operation's origin
    fresh.origin = token;
    fresh.request = request;
    return fresh;
  });
}

bool SqliteStore::mark_pending(const KeyId& id, std::int64_t token, std::int64_t origin,
                               const std::string& step, const LeaseCheck& lease) {
  Impl& d = *impl_;
  return d.write([&]() -> bool {
    sqlite::Transaction t(d.tx);
    std::optional<ProgressRow> row = read_progress(d.load_progress, id);
    if (!row || row->token != token || row->state != State::in_progress) return false;
    const std::string text =
        detail::progress_to_json(detail::with_pending(std::move(row->progress), origin, step));
    Statement& s = d.mark_pending;
    ResetGuard reset(s);
    detail::bind_id(s, id);
    s.bind(4, token);
    s.bind(5, text);
    s.bind(6, detail::ms(lease.needed));
    s.bind(7, detail::ms(lease.renew_to));
    if (!Impl::changed(s)) return false;  // the lease ends too soon
    t.commit();
    return true;
  });
}

bool SqliteStore::commit_step(const KeyId& id, std::int64_t token, std::int64_t origin,
                              const StepCommit& step) {
  Impl& d = *impl_;
  return d.write([&]() -> bool {
    sqlite::Transaction t(d.tx);
    std::optional<ProgressRow> row = read_progress(d.load_progress, id);
    if (!row || row->token != token || row->state != State::in_progress)
      return false;  // a zombie: nothing of its step runs
    if (step.local) {
      SqliteLocal local(d.db.get(), d.local_statements, d.outbox_insert, id, origin,
                        step.result.step, step.now);
      step.local(local);
    }
    const Progress p = detail::with_step(std::move(row->progress), origin, step.result);
    if (!write_progress(d.set_progress, id, token, p, &step.result.step))
      throw StoreError("sqlite: commit_step: record changed inside its transaction", 0);
    t.commit();
    return true;
  });
}

std::vector<AbandonedOperation> SqliteStore::abandoned(TimePoint idle_before, TimePoint now,
                                                       std::size_t limit,
                                                       std::span<const std::string> operations) {
  nlohmann::json names = nlohmann::json::array();
  for (const std::string& op : operations) names.push_back(op);
  const std::string wanted = names.dump();
  Impl& d = *impl_;
  const auto lock = d.line();
  Statement& s = d.abandoned;
  ResetGuard reset(s);
  s.bind(1, detail::ms(idle_before));
  s.bind(2, detail::ms(now));
  s.bind(3, static_cast<std::int64_t>(limit));
  s.bind(4, wanted);
  std::vector<AbandonedOperation> out;
  while (s.step()) {
    AbandonedOperation a;
    a.id = KeyId{s.text(0), s.text(1), s.text(2)};
    const std::string_view fp = s.blob_view(3);
    Fingerprint::Bytes bytes{};
    std::copy_n(fp.begin(), std::min(fp.size(), bytes.size()), bytes.begin());
    a.fingerprint = Fingerprint(bytes);
    a.state = static_cast<State>(s.int64(4));
    a.request = s.blob(5);
    out.push_back(std::move(a));
  }
  return out;
}

std::vector<OutboxMessage> SqliteStore::claim_outbox(TimePoint now, TimePoint claim_until,
                                                     std::size_t limit) {
  Impl& d = *impl_;
  return d.write([&]() -> std::vector<OutboxMessage> {
    {
      ResetGuard reset(d.outbox_any_due);
      d.outbox_any_due.bind(1, detail::ms(now));
      if (!d.outbox_any_due.step()) return {};
    }
    sqlite::Transaction t(d.tx);
    std::vector<OutboxMessage> out;
    {
      Statement& s = d.outbox_claim;
      ResetGuard reset(s);
      s.bind(1, detail::ms(now));
      s.bind(2, detail::ms(claim_until));
      s.bind(3, static_cast<std::int64_t>(limit));
      while (s.step()) {
        out.push_back(OutboxMessage{s.text(0), s.text(1), s.blob(2), static_cast<int>(s.int64(3)),
                                    detail::at_ms(s.int64(4))});
      }
    }
    t.commit();
    std::stable_sort(out.begin(), out.end(), [](const OutboxMessage& a, const OutboxMessage& b) {
      return a.created_at < b.created_at;
    });
    return out;
  });
}

std::size_t SqliteStore::outbox_delivered(std::span<const std::string> ids, TimePoint now) {
  if (ids.empty()) return 0;
  Impl& d = *impl_;
  return d.write([&]() -> std::size_t {
    sqlite::Transaction t(d.tx);
    Statement& s = d.outbox_delivered;
    const std::int64_t at = detail::ms(now);
    std::size_t marked = 0;
    for (const std::string& id : ids) {
      ResetGuard reset(s);
      s.bind(1, id);
      s.bind(2, at);
      if (Impl::changed(s)) ++marked;
    }
    t.commit();
    return marked;
  });
}

void SqliteStore::outbox_failed(const std::string& id, TimePoint retry_at, bool park,
                                const std::string& why) {
  Impl& d = *impl_;
  return d.write([&]() -> void {
    Statement& s = d.outbox_failed;
    ResetGuard reset(s);
    s.bind(1, id);
    s.bind(2, detail::ms(retry_at));
    s.bind(3, std::int64_t{park ? 1 : 0});
    s.bind(4, why);
    s.step();
  });
}

OutboxCounts SqliteStore::outbox_counts() {
  Impl& d = *impl_;
  const auto lock = d.line();
  Statement& s = d.outbox_counts;
  ResetGuard reset(s);
  OutboxCounts c;
  while (s.step()) {
    detail::add_outbox_count(c, s.int64(0), static_cast<std::size_t>(s.int64(1)));
  }
  return c;
}

std::size_t SqliteStore::purge_outbox(TimePoint delivered_before, std::size_t limit) {
  Impl& d = *impl_;
  return d.write([&]() -> std::size_t {
    Statement& s = d.outbox_purge;
    ResetGuard reset(s);
    s.bind(1, detail::ms(delivered_before));
    s.bind(2, static_cast<std::int64_t>(limit));
    s.step();
    return static_cast<std::size_t>(s.changes());
  });
}

}  // namespace idem
