// idem — the PostgreSQL store (target idem::pg; links libpq).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "idem/clock.hpp"
#include "idem/store.hpp"

namespace idem {

namespace detail {
struct PgImport;    // migrate_sqlite_to_pg's writes (idem/migrate.hpp)
class PgPending;    // start_apply()'s batch
struct StoreStats;  // idem/internal/store_stats.hpp
}  // namespace detail

// Whose clock the times in the database are on.
//  - database: the server's (clock_timestamp()). Every node's times are moved onto it by an
//    offset between PgOptions::local_clock and the server's clock, measured on connect and
//    every PgOptions::clock_refresh (the midpoint of a round trip), and moved back when
//    read. So nodes whose clocks disagree still agree on when a lease or a TTL ends, to
//    within half a round trip plus their drift since the last measurement.
//  - caller: the times the Coordinator passes, unchanged, as SqliteStore keeps them. For a
//    single node, or tests that want the stored times to be their simulated ones.
enum class PgClock { database, caller };

struct PgOptions {
  // The schema idem's tables live in; created if missing. Each schema is an independent
  // store (tests use one per case). Default: "idem".
  std::string schema = "idem";
  // Default: PgClock::database.
  PgClock clock = PgClock::database;
  // The clock the Coordinator's times come from (its Options::clock): the offset is measured
  // against it. Default (null): a SystemClock, the Coordinator's default.
  std::shared_ptr<Clock> local_clock{};
  std::chrono::milliseconds clock_refresh{30'000};
  // How long one statement may run before the server cancels it (statement_timeout); a lock
  // held by another node counts. Default: 5 s, as SqliteOptions::busy_timeout.
  std::chrono::milliseconds statement_timeout{5000};
  // How much longer than statement_timeout this side waits for any reply before it gives the
  // connection up: the connection is dropped, the operation is a StoreError (whether a write
  // committed is then unknown), and the next use reconnects after reconnect_min. So a server
  // that stops answering while its sockets stay open (a stuck pooler or proxy, a frozen
  // backend: keepalives never fire then) costs a call statement_timeout + reply_margin at most.
  // Default: 1 s.
  std::chrono::milliseconds reply_margin{1000};
  // How long connecting may take in all (TCP, authentication, settings), whatever the
  // conninfo's connect_timeout says. Default: 5 s. Not bounded by it: a host name's lookup,
  // which libpq makes with the system resolver, blocking, before it connects (the resolver's
  // own timeouts, /etc/resolv.conf), and GSSAPI's calls to a Kerberos server. Give `hostaddr`
  // (an IP address) beside or instead of `host`, and `gssencmode=disable` where GSSAPI is not
  // used, to keep every wait of a connect within this deadline.
  std::chrono::milliseconds connect_timeout{5000};
  // After a lost connection, reconnection is tried on the next use, at most once per backoff:
  // from reconnect_min, doubling up to reconnect_max, reset by a success. Meanwhile every
  // operation fails at once with StoreError (retryable).
  std::chrono::milliseconds reconnect_min{50};
  std::chrono::milliseconds reconnect_max{2000};
  // Connections beside the main one that carry the group commit's batches, each batch in one
  // pipeline and one transaction: up to this many batches are in the database at once
  // (Store::concurrent_applies()), while the next one gathers. A coroutine front end waits for
  // them on its io_context (Store::start_apply()), so its thread goes on with other calls;
  // threads use them too. Each connects on first use. The main connection carries
  // everything else (reads, renewals, steps, the outbox, purges) and batches when every
  // batch connection is busy. 0: every batch on the main connection, one at a time, a
  // coroutine's thread waiting for it. At most 64. Default: 2.
  std::size_t batch_connections = 2;
  // Wake duplicates waiting in other processes (LISTEN/NOTIFY): each batch that completes or
  // releases keys notifies them in its own transaction (one NOTIFY statement per batch, in
  // the same round trip), and each Coordinator on this store gets them on a second
  // connection that LISTENs, opened with its first Coordinator. Waiters poll the store all
  // the same (Options::poll_max), so a notification lost (a listener reconnecting, a
  // transaction-pooling proxy, which does not carry them) costs latency, never correctness.
  // A listening connection that has said nothing for statement_timeout + reply_margin is
  // sent an empty statement, and opened again when that gets no answer in as long: a frozen
  // backend or a stuck pooler, which TCP keepalives do not see, silences it for that long.
  // Cost: every completion and release pays for it, waited for or not: NOTIFY takes a
  // database-wide lock while its transaction commits, serialising the commits of every node
  // that notifies, a lone completion becomes a pipeline with its NOTIFY, and every
  // listening session is signalled. scripts/bench measured one blocking caller at 0.7 to
  // 0.9 of its speed without it (docs/postgresql.md). So it is off by default: waiters in other
  // processes poll (1 ms doubling to 8 ms by default), which keeps a hand-off near 10 ms.
  // Turn it on when duplicates often wait across nodes and you would rather they polled
  // seldom (a long Options::poll_max). Default: false.
  bool notify = false;
};

// A Store on a PostgreSQL database (libpq), shared by threads of this process (a main
// connection behind a first-come-first-served lock, and PgOptions::batch_connections for the
// group commit's batches) and by any number of processes and nodes on the same database and
// schema. The schema is versioned in its idem_meta table and
// migrated on open under an advisory lock, so nodes that start together migrate once.
//
// Every write is one statement (reservation and store_if_absent are server-side functions),
// and apply() sends all the ops it is given in one pipeline, one transaction and one round
// trip (each op keeps its own outcome); the Coordinator's group commit hands it the writes
// of every call that is ready at once. Rows are locked in key order within a batch, so
// batches of several nodes never deadlock.
//
// Errors: every operation throws StoreError when the database cannot be used (connection
// lost or refused, statement timeout, a serialization failure); sqlite_code() is 0 and
// what() starts with "postgresql:" and carries the server's SQLSTATE. StoreError is
// retryable; an operation that throws changed nothing, except that a write whose COMMIT was
// sent when the connection broke may have committed (as for any database client): its
// reservation then expires with its lease, a completion is replayed.
//
// Calls that find the connection busy (the main one, or maintenance's) wait in line, first
// come first served, at most connect_timeout + statement_timeout + reply_margin (what one call
// ahead may hold it for), then fail with StoreError without sending anything: a slow server
// (statements that wait for a lock until statement_timeout) costs a call that wait and its
// own statement, not the statements of everyone queued ahead of it.
//
// Thread-safety: safe for concurrent use.
class PgStore final : public Store, public StepStore {
 public:
  // Connects with `conninfo` (libpq's "host=... dbname=..." or a postgresql:// URI),
  // migrates the schema and measures the clock offset. Throws StoreError if the server cannot
  // be reached or the schema is newer than this library knows; then no PgStore exists.
  // Throws idem::error(errc::invalid_argument) for an empty schema name or one with a '$', or
  // more than 64 batch connections.
  // The connection gets defaults for what `conninfo` leaves unset: connect_timeout 5 s, TCP
  // keepalives after 5 s idle, tcp_user_timeout statement_timeout + 5 s, so a server that
  // vanishes is a StoreError within seconds; and READ COMMITTED, which the store relies on.
  explicit PgStore(const std::string& conninfo, PgOptions options = {});
  ~PgStore() override;
  PgStore(const PgStore&) = delete;
  PgStore& operator=(const PgStore&) = delete;

  // The schema version this library writes.
  static int schema_version() noexcept;

  bool renew(const KeyId& id, std::int64_t token, TimePoint lease_until) override;
  std::optional<Record> load(const KeyId& id) override;
  StepStore* steps() noexcept override { return this; }
  std::optional<Progress> begin_steps(const KeyId& id, std::int64_t token,
                                      const std::string& request) override;
  bool mark_pending(const KeyId& id, std::int64_t token, std::int64_t origin,
                    const std::string& step, const LeaseCheck& lease) override;
  // Local steps run their statements (PostgreSQL's dialect, parameters $1..$N, search_path
  // the store's schema then public, so the application's tables may live beside idem's) on
  // this store's connection inside its transaction; they must not begin, commit or roll back
  // transactions of their own. Unlike SQLite, a statement that fails aborts the whole
  // transaction: a step that catches execute()'s StoreError cannot go on (the step fails). Integers
  // and doubles are sent as text and strings as raw bytes, so a string parameter fits a text or a
  // bytea column; results come back as integers (int2/4/8), doubles (float4/8), bytes (bytea) or
  // text (anything else).
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
  // On a free batch connection (PgOptions::batch_connections): sends the batch and returns
  // its wait on that connection's socket; null when every batch connection is busy, or
  // there is none.
  std::unique_ptr<PendingApply> start_apply(std::span<StoreOp* const> ops) override;
  // PgOptions::batch_connections (at least 1).
  std::size_t concurrent_applies() const noexcept override;
  // True: every call may wait on the server (up to statement_timeout + reply_margin, after
  // its wait in line for the connection).
  bool remote() const noexcept override { return true; }
  // PgOptions::notify: wake-ups from other processes (Store::add_change_listener). Throws
  // std::system_error if the listener's thread cannot start.
  std::uint64_t add_change_listener(ChangeListener listener) override;
  void remove_change_listener(std::uint64_t id) override;

  // The offset added to the caller's times to put them on the database's clock (0 with
  // PgClock::caller): the server's clock minus local_clock's.
  std::chrono::milliseconds clock_offset() const;

 private:
  friend struct detail::PgImport;
  friend struct detail::StoreStats;  // idem/internal/store_stats.hpp, for tests and benchmarks
  friend class detail::PgPending;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem
