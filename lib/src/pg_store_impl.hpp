// PgStore's insides, shared by its files: pg_store.cpp (the store interface: apply, load,
// renew, maintenance, wake-ups), pg_steps.cpp (multi-step operations and the outbox) and
// pg_import.cpp (migrate_sqlite_to_pg's writes). What a connection does on the wire
// (reconnecting, prepared statements, pipelines, the clock offset) is lib/pg's
// (idem/internal/pg_connection.hpp); what is here maps the store onto SQL.
#pragma once

#include <libpq-fe.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fair_mutex.hpp"
#include "idem/internal/pg_connection.hpp"
#include "idem/pg_store.hpp"
#include "pg_listener.hpp"
#include "record_codec.hpp"

namespace idem {
namespace pgstore {

using pg::Params;
using pg::Result;

// A batch goes in one pipeline and one transaction up to this many ops; a longer one is split
// (each part its own transaction), so neither side's socket buffer fills while the other waits.
constexpr std::size_t kMaxPipelineOps = 128;

// The statements, prepared on every connection under statement_name()'s names.
enum Stmt : int {
  kReserve,
  kStoreIfAbsent,
  kLoad,
  kComplete,
  kRelease,
  kRenew,
  kPurge,
  kReap,
  kLoadProgress,
  kBeginSteps,
  kMarkPending,
  kSetProgress,
  kAbandoned,
  kOutboxInsert,
  kOutboxClaim,
  kOutboxDelivered,
  kOutboxFailed,
  kOutboxCounts,
  kOutboxPurge,
  kNow,
  kImportRecord,
  kImportMessage,
  kStatementCount
};
const std::string& statement_name(Stmt s);

// The converse of a time the store wrote: times in the database are the caller's plus the
// clock offset (0 under PgClock::caller).
struct Shift {
  std::int64_t offset = 0;
  TimePoint from_db(std::int64_t v) const { return detail::at_ms(v - offset); }
  std::int64_t to_db(TimePoint t) const { return detail::ms(t) + offset; }
};

// The record in columns first..first+10 (pg_sql::kLoad's order), and its claim in first+11
// when the result has that column.
Record read_record(const PGresult* r, int row, int first, const Shift& shift);

// The row of kLoadProgress or kBeginSteps: state, token, progress, request.
struct ProgressRow {
  State state;
  std::int64_t token;
  std::optional<Progress> progress;
};
ProgressRow read_progress(const PGresult* r);

// `text` with every byte that is not valid UTF-8 replaced by U+FFFD: a text column takes
// nothing else, and a delivery's error message may come from anywhere.
std::string valid_utf8(const std::string& text);

Params& key_params(Params& p, const KeyId& k);

}  // namespace pgstore

// One connection of a PgStore and what the store keeps beside it. The main one (built from
// the conninfo) owns the batch connections, the upkeep connection, the clock offset and the
// wake-ups; each of those is an Impl too (BatchOf), sharing the main one's settings.
struct PgStore::Impl {
  std::string conninfo;
  PgOptions options;
  std::string schema;              // quoted
  std::vector<std::string> texts;  // the statements, with the schema put in
  detail::FairMutex mutex;         // serialises every use of `connection`, first come first served
  pg::Connection connection;       // guarded by `mutex`
  bool ready = false;              // the schema is migrated: a new connection prepares
  // The main Impl (this one, in the main one). The others use its clock offset.
  Impl* owner = this;
  pg::ClockOffset clock;  // the main one's is the store's
  std::atomic<std::uint64_t> committed_ops{0}, notify_batches{0}, wakeups{0}, listens{0};
  // In the main one: start_apply()'s batches, how many are in flight and the most ever.
  std::atomic<std::uint64_t> started{0};
  std::atomic<std::size_t> in_flight{0}, most_in_flight{0};
  // The batch connections (PgOptions::batch_connections), each connecting on first use;
  // empty in the others. Fixed after construction; declared before the listener, whose
  // thread reads it (own()), so it outlives that thread.
  std::vector<std::unique_ptr<Impl>> batch;
  // The connection of maintenance (purge, reap, the completer's search, the outbox), which
  // connects on first use: a request never waits behind a maintenance job's round trip, nor
  // for the lock a stalled one holds. Null in the others.
  std::unique_ptr<Impl> upkeep;
  // Wake-ups (PgOptions::notify): the channel (pg_notify's argument), this connection's
  // backend (its own notifications are not news to this process), the listeners and the
  // LISTEN connection, started with the first listener.
  const std::string channel;  // "idem:" and the schema's name
  std::atomic<int> own_backend{0};
  std::mutex listeners_mutex;  // held while a listener runs, so removing one waits for it
  std::map<std::uint64_t, ChangeListener> listeners;
  std::uint64_t next_listener = 1;
  std::unique_ptr<detail::PgListener> listener;  // guarded by listeners_mutex

  Impl(std::string conninfo, PgOptions options);
  // A batch or upkeep connection of `main`: the same server, schema and options; not
  // connected yet (its first use connects, prepares and measures the clock).
  struct BatchOf {
    Impl& main;
  };
  explicit Impl(BatchOf of);

  PGconn* conn() const noexcept { return connection.get(); }
  pg::Session& session() noexcept { return connection.session(); }
  pgstore::Shift shift() const { return pgstore::Shift{owner->clock.ms()}; }
  // What a connection of this store opens with (pg::Session::open adds idem's keepalives and
  // timeouts on both ends).
  pg::Parameters parameters() const;

  // A usable connection, reconnecting if it was lost, with a fresh clock offset when it is
  // due. Requires `mutex`.
  void ensure();
  // Runs a prepared statement; binary results.
  pg::Result run(pgstore::Stmt s, pg::Params& p) {
    return connection.run(pgstore::statement_name(s), p);
  }

  // `mutex`, waited for in line at most as long as one call ahead may hold it (connecting,
  // then its statement and the reply margin), so a slow server costs a call that wait and its
  // own statement, not the statements of everyone ahead. Throws StoreError when it was not
  // handed over by then (nothing was sent).
  std::unique_lock<detail::FairMutex> take();

  // Runs `f` on the connection, under `mutex` (take()). A failure that cost the connection (a
  // break, a reply that did not come in time) is noted for the reconnection.
  template <class F>
  auto locked(F&& f) -> decltype(f()) {
    const std::unique_lock lock = take();
    ensure();
    try {
      return f();
    } catch (const StoreError& e) {
      if (!connection.connected()) connection.lost(e.what());
      throw;
    }
  }

  // A batch connection that was free, now locked by the caller; null when all are busy.
  Impl* try_batch();
  // Whether `pid` is one of this store's connections (their notifications are not news).
  bool own(int pid) const;

  // ---- apply(): its ops in pipelines, one transaction each

  enum class Pipelined {
    committed,  // every op has its outcome
    op_failed,  // one op (or the COMMIT) failed: nothing was committed, the ops are untouched
  };
  // The batch's ops in the order they are sent (sorted by key) and their parameters. Ops whose
  // inputs cannot be sent fail alone.
  struct Plan {
    std::vector<StoreOp*> sendable;
    std::vector<pg::Params> params;
  };
  Plan plan(std::span<StoreOp* const> ops) const;
  // Sends the ops in one pipeline: BEGIN, each op, [the NOTIFY of `payload`,] COMMIT, one
  // sync, one round trip. Requires `mutex` and a connection (ensure()).
  pg::Pipeline send_pipeline(std::span<StoreOp* const> ops, std::span<pg::Params> params,
                             const std::string& payload);
  // Ends a pipeline whose sync came: the ops get their outcomes. Throws StoreError if it
  // broke before its end (then whether the COMMIT took effect is unknown, and running the ops
  // again could find their own writes). Requires `mutex`.
  Pipelined conclude(std::span<StoreOp* const> ops, pg::Pipeline& in, bool notified);
  // One pipeline's outcome: on a broken connection every op fails alike; when one op broke
  // the transaction, each op runs on its own, so its neighbours still succeed. Requires
  // `mutex`.
  void settle(std::span<StoreOp* const> part, const std::function<Pipelined()>& run_it);
  // apply() on this connection. Requires `mutex`.
  void apply_all(std::span<StoreOp* const> ops);
  // The payload of the batch's NOTIFY: a JSON array of [tenant, operation, key] texts; empty
  // when no op wakes anyone (or notify is off).
  std::string notify_payload(std::span<StoreOp* const> ops) const;
  // A notification reached the listener's thread.
  void notified(std::string_view payload, int sender);
  // The channel as LISTEN names it.
  std::string quoted_channel() const;

  // ---- multi-step operations (pg_steps.cpp)

  std::optional<pgstore::ProgressRow> load_progress(const KeyId& id);
  bool write_progress(const KeyId& id, std::int64_t token, const Progress& progress,
                      const std::string* recovery_point);

 private:
  void on_connect();          // settings, and once migrated the statements and the clock
  void prepare_statements();  // every Stmt, under statement_name()
  void measure_clock();
  void migrate();
  std::string literal(const std::string& s);
  pg::Params params_of(const StoreOp& op) const;
  void take(StoreOp& op, const PGresult* r) const;
  void apply_single(StoreOp& op);
  Pipelined apply_pipelined(std::span<StoreOp* const> ops, std::span<pg::Params> params);
};

}  // namespace idem
