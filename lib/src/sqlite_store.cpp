#include "idem/sqlite_store.hpp"

#include <sqlite3.h>

#include <algorithm>
#include <atomic>
#include <optional>

#include "fair_mutex.hpp"
#include "idem/errors.hpp"
#include "idem/internal/sqlite.hpp"
#include "sql.hpp"
#include "sqlite_checkpointer.hpp"
#include "sqlite_codec.hpp"
#include "sqlite_migrations.hpp"

namespace idem {

using sqlite::ResetGuard;
using sqlite::Statement;

struct SqliteStore::Impl {
  detail::FairMutex
      mutex;  // serialises every use of `db` and the statements, first come first served
  sqlite::BusyPolicy busy;
  sqlite::Connection db;
  sqlite::TransactionStatements tx;
  // Every statement, prepared once when the store opens and reused.
  Statement reserve, replace_dead, load, complete, release, renew, set_recovery_point,
      insert_completed, purge, reap;
  std::atomic<std::uint64_t> transactions{0}, committed_ops{0};
  std::optional<detail::Checkpointer> checkpointer;  // SqliteOptions::background_checkpoint

  Impl(const std::string& path, const SqliteOptions& o)
      : busy{o.busy_timeout, {}},
        db(open(path, o, busy)),
        tx(db.get()),
        reserve(migrated(db.get(), tx), sql::kReserve),
        replace_dead(db.get(), sql::kReplaceDead),
        load(db.get(), sql::kLoad),
        complete(db.get(), sql::kComplete),
        release(db.get(), sql::kRelease),
        renew(db.get(), sql::kRenew),
        set_recovery_point(db.get(), sql::kSetRecoveryPoint),
        insert_completed(db.get(), sql::kInsertCompleted),
        purge(db.get(), sql::kPurge),
        reap(db.get(), sql::kReap) {
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

  // ---- writes, inside a transaction the caller holds ----

  Reservation reserve_in_tx(const KeyId& id, const Fingerprint& fingerprint, TimePoint now,
                            TimePoint lease_until) {
    Reservation out;
    {
      ResetGuard reset(reserve);
      detail::bind_id(reserve, id);
      detail::bind_fingerprint(reserve, 4, fingerprint);
      reserve.bind(5, detail::ms(now));
      reserve.bind(6, detail::ms(lease_until));
      reserve.bind(7, detail::ms(now));
      if (changed(reserve)) {
        out.token = detail::ms(now);
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
    out.token = std::max(existing->token + 1, detail::ms(now));
    if (resume) out.recovery_point = existing->recovery_point;
    replace(id, fingerprint, out.token, now, lease_until, out.recovery_point, existing->token);
    return out;
  }

  void replace(const KeyId& id, const Fingerprint& fingerprint, std::int64_t token, TimePoint now,
               TimePoint lease_until, const std::optional<std::string>& recovery_point,
               std::int64_t old_token) {
    Statement& s = replace_dead;
    ResetGuard reset(s);
    detail::bind_id(s, id);
    detail::bind_fingerprint(s, 4, fingerprint);
    s.bind(5, token);
    s.bind(6, detail::ms(lease_until));
    s.bind(7, detail::ms(now));
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
    const std::string headers = detail::headers_to_json(response.response.headers);
    Statement& s = complete;
    ResetGuard reset(s);
    detail::bind_id(s, id);
    s.bind(4, token);
    detail::bind_response(s, 5, response, headers);
    s.bind(9, detail::ms(expires_at));
    return changed(s);
  }

  bool release_in_tx(const KeyId& id, std::int64_t token, TimePoint now) {
    Statement& s = release;
    ResetGuard reset(s);
    detail::bind_id(s, id);
    s.bind(4, token);
    s.bind(5, detail::ms(now));
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
    replace(id, fingerprint, token, now, now, std::nullopt, existing ? existing->token : 0);
    if (!complete_in_tx(id, token, response, expires_at)) {
      throw StoreError("sqlite: store_if_absent: record changed", 0);
    }
    return std::nullopt;
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
      case StoreOp::Kind::store_if_absent:
        if (std::optional<Record> winner = store_if_absent_in_tx(
                *op.id, *op.fingerprint, *op.response, op.now, op.expires_at)) {
          op.reservation.kind = Reservation::Kind::existing;
          op.reservation.existing = std::move(winner);
        }
        break;
    }
  }

  // One transaction for every op. If one op breaks it (a body too big, say), each op gets a
  // transaction of its own, so its neighbours still succeed. Requires `mutex`.
  void apply_locked(std::span<StoreOp* const> ops) {
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
        sqlite::Transaction single(tx);
        run_op(*op);
        single.commit();
        transactions.fetch_add(1, std::memory_order_relaxed);
        committed_ops.fetch_add(1, std::memory_order_relaxed);
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
  std::lock_guard lock(impl_->mutex);
  impl_->apply_locked(ops);
}

SqliteStore::CommitStats SqliteStore::commit_stats() const {
  return CommitStats{impl_->transactions.load(std::memory_order_relaxed),
                     impl_->committed_ops.load(std::memory_order_relaxed),
                     impl_->checkpointer ? impl_->checkpointer->checkpoints() : 0};
}

namespace {

// Runs one op through apply() and rethrows its error, for the single-op entry points.
StoreOp& apply_one(SqliteStore& store, StoreOp&& op) {
  StoreOp* one = &op;
  store.apply(std::span<StoreOp* const>(&one, 1));
  if (op.error) std::rethrow_exception(op.error);
  return op;
}

}  // namespace

Reservation SqliteStore::reserve(const KeyId& id, const Fingerprint& fingerprint, TimePoint now,
                                 TimePoint lease_until) {
  return std::move(apply_one(*this, StoreOp{.kind = StoreOp::Kind::reserve,
                                            .id = &id,
                                            .fingerprint = &fingerprint,
                                            .now = now,
                                            .lease_until = lease_until})
                       .reservation);
}

bool SqliteStore::complete(const KeyId& id, std::int64_t token, const StoredResponse& response,
                           TimePoint expires_at) {
  return apply_one(*this, StoreOp{.kind = StoreOp::Kind::complete,
                                  .id = &id,
                                  .expires_at = expires_at,
                                  .token = token,
                                  .response = &response})
      .applied;
}

bool SqliteStore::release(const KeyId& id, std::int64_t token, TimePoint now) {
  return apply_one(*this,
                   StoreOp{.kind = StoreOp::Kind::release, .id = &id, .now = now, .token = token})
      .applied;
}

std::optional<Record> SqliteStore::store_if_absent(const KeyId& id, const Fingerprint& fingerprint,
                                                   const StoredResponse& response, TimePoint now,
                                                   TimePoint expires_at) {
  return std::move(apply_one(*this, StoreOp{.kind = StoreOp::Kind::store_if_absent,
                                            .id = &id,
                                            .fingerprint = &fingerprint,
                                            .now = now,
                                            .expires_at = expires_at,
                                            .response = &response})
                       .reservation.existing);
}

bool SqliteStore::renew(const KeyId& id, std::int64_t token, TimePoint lease_until) {
  std::lock_guard lock(impl_->mutex);
  Statement& s = impl_->renew;
  ResetGuard reset(s);
  detail::bind_id(s, id);
  s.bind(4, token);
  s.bind(5, detail::ms(lease_until));
  return Impl::changed(s);
}

bool SqliteStore::set_recovery_point(const KeyId& id, std::int64_t token,
                                     const std::string& point) {
  std::lock_guard lock(impl_->mutex);
  Statement& s = impl_->set_recovery_point;
  ResetGuard reset(s);
  detail::bind_id(s, id);
  s.bind(4, token);
  s.bind(5, point);
  return Impl::changed(s);
}

std::optional<Record> SqliteStore::load(const KeyId& id) {
  std::lock_guard lock(impl_->mutex);
  return impl_->load_record(id);
}

std::size_t SqliteStore::purge_expired(TimePoint now, std::size_t limit) {
  std::lock_guard lock(impl_->mutex);
  Statement& s = impl_->purge;
  ResetGuard reset(s);
  s.bind(1, detail::ms(now));
  s.bind(2, static_cast<std::int64_t>(limit));
  s.step();
  return static_cast<std::size_t>(s.changes());
}

std::vector<ReapedRecord> SqliteStore::reap(TimePoint lease_ended_before, std::size_t limit) {
  std::lock_guard lock(impl_->mutex);
  Statement& s = impl_->reap;
  ResetGuard reset(s);
  s.bind(1, detail::ms(lease_ended_before));
  s.bind(2, static_cast<std::int64_t>(limit));
  std::vector<ReapedRecord> out;
  while (s.step()) {
    KeyId id{s.text(0), s.text(1), s.text(2)};
    out.push_back({short_hash(id), id.operation, s.int64(3), detail::at_ms(s.int64(4))});
  }
  return out;
}

}  // namespace idem
