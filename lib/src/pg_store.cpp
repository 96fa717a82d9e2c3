// PgStore: the store interface on PostgreSQL. This file: the connections a store keeps, its
// schema, apply() (batches in pipelines), the reads, maintenance and wake-ups. Multi-step
// operations and the outbox are in pg_steps.cpp, migrate_sqlite_to_pg's writes in
// pg_import.cpp; the connection itself is lib/pg's.
#include "idem/pg_store.hpp"

#include <fmt/format.h>
#include <libpq-fe.h>
#include <poll.h>

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>
#include <tuple>

#include "idem/errors.hpp"
#include "idem/internal/connection_sql.hpp"
#include "idem/internal/store_stats.hpp"
#include "idem/key.hpp"
#include "pg_sql.hpp"
#include "pg_store_impl.hpp"

namespace idem {
namespace pgstore {
namespace {

constexpr std::array<std::string_view, kStatementCount> kTexts = {
    pg_sql::kReserve,      pg_sql::kStoreIfAbsent, pg_sql::kLoad,        pg_sql::kComplete,
    pg_sql::kRelease,      pg_sql::kRenew,         pg_sql::kPurge,       pg_sql::kReap,
    pg_sql::kLoadProgress, pg_sql::kBeginSteps,    pg_sql::kMarkPending, pg_sql::kSetProgress,
    pg_sql::kAbandoned,    pg_sql::kOutboxInsert,  pg_sql::kOutboxClaim, pg_sql::kOutboxDelivered,
    pg_sql::kOutboxFailed, pg_sql::kOutboxCounts,  pg_sql::kOutboxPurge, pg_sql::kNow,
    pg_sql::kImportRecord, pg_sql::kImportMessage};

constexpr std::size_t kMaxBatchConnections = 64;

std::string with_schema(std::string_view text, const std::string& schema) {
  std::string out;
  out.reserve(text.size() + 64);
  for (std::size_t i = 0; i < text.size();) {
    if (text.compare(i, 3, "{s}") == 0) {
      out += schema;
      i += 3;
    } else {
      out += text[i++];
    }
  }
  return out;
}

Stmt statement_of(const StoreOp& op) {
  switch (op.kind) {
    case StoreOp::Kind::reserve:
      return kReserve;
    case StoreOp::Kind::complete:
      return kComplete;
    case StoreOp::Kind::release:
      return kRelease;
    case StoreOp::Kind::store_if_absent:
      return kStoreIfAbsent;
  }
  return kReserve;
}

void response_params(Params& p, const StoredResponse& r) {
  p.integer(r.response.status);
  p.text_or_null(detail::headers_to_json(r.response.headers));
  p.bytes(r.response.body);
  p.text_or_null(r.body_ref);
}

bool wakes(const StoreOp& op) {
  return op.kind == StoreOp::Kind::complete || op.kind == StoreOp::Kind::release;
}

}  // namespace

const std::string& statement_name(Stmt s) {
  static const std::array<std::string, kStatementCount> names = [] {
    std::array<std::string, kStatementCount> out;
    for (int i = 0; i < kStatementCount; ++i)
      out[static_cast<std::size_t>(i)] = fmt::format("idem_{}", i);
    return out;
  }();
  return names[static_cast<std::size_t>(s)];
}

Record read_record(const PGresult* r, int row, int first, const Shift& shift) {
  using pg::bytes_at;
  using pg::int_at;
  using pg::is_null;
  Record out;
  const std::string_view fp = bytes_at(r, row, first);
  Fingerprint::Bytes raw{};
  if (fp.size() != raw.size())
    throw CorruptRecordError("postgresql: a stored fingerprint is not 32 bytes");
  std::copy_n(fp.begin(), raw.size(), raw.begin());
  out.fingerprint = Fingerprint(raw);
  const std::int64_t state = int_at(r, row, first + 1);
  if (state < 1 || state > 3) {
    throw CorruptRecordError(fmt::format("postgresql: a stored state is {}, not 1, 2 or 3", state));
  }
  out.state = static_cast<State>(state);
  out.token = int_at(r, row, first + 2);
  out.lease_until = shift.from_db(int_at(r, row, first + 3));
  out.created_at = shift.from_db(int_at(r, row, first + 4));
  out.expires_at = shift.from_db(int_at(r, row, first + 5));
  if (!is_null(r, row, first + 6))
    out.response.status = static_cast<int>(int_at(r, row, first + 6));
  if (!is_null(r, row, first + 7))
    out.response.headers = detail::headers_from_json(bytes_at(r, row, first + 7));
  out.response.body = std::string(bytes_at(r, row, first + 8));
  if (!is_null(r, row, first + 9)) out.body_ref = std::string(bytes_at(r, row, first + 9));
  if (!is_null(r, row, first + 10)) out.recovery_point = std::string(bytes_at(r, row, first + 10));
  if (PQnfields(r) > first + 11 && !is_null(r, row, first + 11))
    out.claim = int_at(r, row, first + 11);
  return out;
}

ProgressRow read_progress(const PGresult* r) {
  ProgressRow row{static_cast<State>(pg::int_at(r, 0, 0)), pg::int_at(r, 0, 1), std::nullopt};
  if (!pg::is_null(r, 0, 2)) {
    row.progress = detail::progress_from_json(pg::bytes_at(r, 0, 2));
    if (!pg::is_null(r, 0, 3)) row.progress->request = std::string(pg::bytes_at(r, 0, 3));
  }
  return row;
}

std::string valid_utf8(const std::string& text) {
  const std::string quoted =
      nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return nlohmann::json::parse(quoted).get<std::string>();
}

Params& key_params(Params& p, const KeyId& k) {
  return p.text(k.tenant).text(k.operation).text(k.key);
}

}  // namespace pgstore

using namespace pgstore;

// ---- the connections ----

PgStore::Impl::Impl(std::string info, PgOptions o)
    : conninfo(std::move(info)),
      options(std::move(o)),
      connection({parameters(), options.reconnect_min, options.reconnect_max},
                 [this](pg::Connection&) { on_connect(); }),
      channel("idem:" + options.schema) {
  if (options.schema.empty() || options.schema.find('$') != std::string::npos) {
    // '$' could end the $$-quoted function bodies the schema's name is put in.
    throw error(errc::invalid_argument,
                "idem: PgOptions::schema must be a non-empty name without '$'");
  }
  if (options.batch_connections > kMaxBatchConnections) {
    throw error(errc::invalid_argument,
                fmt::format("idem: PgOptions::batch_connections is {}, more than {}",
                            options.batch_connections, kMaxBatchConnections));
  }
  if (!options.local_clock) options.local_clock = std::make_shared<SystemClock>();
  connection.ensure();
  migrate();  // a half-built Impl's connection closes as the Impl unwinds
  ready = true;
  for (std::size_t i = 0; i < options.batch_connections; ++i)
    batch.push_back(std::make_unique<Impl>(BatchOf{*this}));
  upkeep = std::make_unique<Impl>(BatchOf{*this});
}

PgStore::Impl::Impl(BatchOf of)
    : conninfo(of.main.conninfo),
      options(of.main.options),
      schema(of.main.schema),
      texts(of.main.texts),
      connection({parameters(), options.reconnect_min, options.reconnect_max},
                 [this](pg::Connection&) { on_connect(); }),
      ready(true),
      owner(&of.main),
      channel(of.main.channel) {}

pg::Parameters PgStore::Impl::parameters() const {
  return pg::Parameters{conninfo, pg::Timeouts{.connect = options.connect_timeout,
                                               .statement = options.statement_timeout,
                                               .margin = options.reply_margin}};
}

void PgStore::Impl::on_connect() {
  if (schema.empty()) {
    char* quoted = PQescapeIdentifier(conn(), options.schema.data(), options.schema.size());
    if (quoted == nullptr) throw connection.failure("quoting the schema name", nullptr);
    schema = quoted;
    PQfreemem(quoted);
    for (std::string_view t : kTexts) texts.push_back(with_schema(t, schema));
  }
  connection.simple(pg_sql::kReadCommitted);
  connection.simple(fmt::format(fmt::runtime(pg_sql::kSearchPath), schema));
  own_backend.store(PQbackendPID(conn()), std::memory_order_relaxed);
  if (!ready) return;  // the main connection's first: migrate() prepares once the schema is there
  prepare_statements();
  // Another connection keeps the main one's offset unless it is due.
  if (options.clock == PgClock::database &&
      (owner == this || owner->clock.stale(options.clock_refresh)))
    measure_clock();
}

void PgStore::Impl::prepare_statements() {
  for (int i = 0; i < kStatementCount; ++i)
    connection.prepare(statement_name(static_cast<Stmt>(i)), texts[static_cast<std::size_t>(i)]);
}

void PgStore::Impl::ensure() {
  if (!connection.ensure() && options.clock == PgClock::database &&
      owner->clock.stale(options.clock_refresh))
    measure_clock();
}

// The database's clock minus this machine's, from the midpoint of one round trip.
void PgStore::Impl::measure_clock() {
  const TimePoint before = options.local_clock->now();
  Params none;
  Result r = run(kNow, none);
  const TimePoint after = options.local_clock->now();
  owner->clock.measured(pg::int_at(r.get(), 0, 0), detail::ms(before), detail::ms(after));
}

void PgStore::Impl::migrate() {
  connection.simple(pg::sql::kBegin);
  try {
    connection.simple(fmt::format(fmt::runtime(pg_sql::kMigrationLock),
                                  literal("idem migrations " + options.schema)));
    connection.simple(with_schema(pg_sql::kCreateMeta, schema));
    Result v = session().exec(with_schema(pg_sql::kVersion, schema));
    connection.round_trips.fetch_add(1, std::memory_order_relaxed);
    if (PQresultStatus(v.get()) != PGRES_TUPLES_OK)
      throw connection.failure("reading the schema version", v.get());
    const int version = PQntuples(v.get()) > 0 ? std::atoi(PQgetvalue(v.get(), 0, 0)) : 0;
    const int known = static_cast<int>(pg_sql::kMigrations.size());
    if (version > known) {
      throw StoreError(fmt::format("postgresql: schema {} is at version {}, newer than this "
                                   "library's {}: upgrade idem before opening it",
                                   options.schema, version, known),
                       0);
    }
    for (int i = version; i < known; ++i)
      connection.simple(with_schema(pg_sql::kMigrations[static_cast<std::size_t>(i)], schema));
    if (version < known) {
      std::string set = with_schema(pg_sql::kSetVersion, schema);
      set.replace(set.find("{v}"), 3, std::to_string(known));
      connection.simple(set);
    }
    connection.simple(pg::sql::kCommit);
  } catch (...) {
    if (connection.connected()) connection.rollback();
    throw;
  }
  prepare_statements();
  if (options.clock == PgClock::database) measure_clock();
}

std::string PgStore::Impl::literal(const std::string& s) {
  char* q = PQescapeLiteral(conn(), s.data(), s.size());
  if (q == nullptr) throw connection.failure("quoting", nullptr);
  std::string out = q;
  PQfreemem(q);
  return out;
}

std::unique_lock<detail::FairMutex> PgStore::Impl::take() {
  const std::chrono::milliseconds longest =
      options.connect_timeout + options.statement_timeout + options.reply_margin;
  if (!mutex.try_lock_until(std::chrono::steady_clock::now() + longest)) {
    throw StoreError(fmt::format("postgresql: waited {} ms in line for the connection, busy with "
                                 "the calls ahead of this one (a slow or stalled server); "
                                 "nothing was sent",
                                 longest.count()),
                     0);
  }
  return std::unique_lock(mutex, std::adopt_lock);
}

PgStore::Impl* PgStore::Impl::try_batch() {
  // The first free one: under a light load the first stays busy and warm, and the others
  // connect only when batches overlap.
  for (const auto& s : batch) {
    if (s->mutex.try_lock()) return s.get();
  }
  return nullptr;
}

bool PgStore::Impl::own(int pid) const {
  if (pid == own_backend.load(std::memory_order_relaxed)) return true;
  return std::any_of(batch.begin(), batch.end(), [pid](const auto& s) {
    return pid == s->own_backend.load(std::memory_order_relaxed);
  });
}

// ---- the ops of apply() ----

Params PgStore::Impl::params_of(const StoreOp& op) const {
  const Shift sh = shift();
  Params p;
  key_params(p, *op.id);
  const auto fp = [&] {
    const auto& b = op.fingerprint->bytes();
    p.bytes(std::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
  };
  switch (op.kind) {
    case StoreOp::Kind::reserve:
      fp();
      // On the database's clock, the reservation is judged and its lease starts when it runs.
      if (options.clock == PgClock::database) {
        p.null();
      } else {
        p.integer(sh.to_db(op.now));
      }
      p.integer(std::max<std::int64_t>(0, (op.lease_until - op.now).count()));
      if (op.claim == 0) {
        p.null();
      } else {
        p.integer(op.claim);
      }
      break;
    case StoreOp::Kind::complete:
      p.integer(op.token);
      response_params(p, *op.response);
      p.integer(sh.to_db(op.expires_at));
      break;
    case StoreOp::Kind::release:
      p.integer(op.token)
          .integer(sh.to_db(op.now))
          .integer(std::max<std::int64_t>(0, detail::ms(op.expires_at) - detail::ms(op.now)));
      break;
    case StoreOp::Kind::store_if_absent:
      fp();
      p.integer(sh.to_db(op.now)).integer(sh.to_db(op.expires_at));
      response_params(p, *op.response);
      break;
  }
  return p;
}

// Puts a successful result into its op.
void PgStore::Impl::take(StoreOp& op, const PGresult* r) const {
  const Shift sh = shift();
  switch (op.kind) {
    case StoreOp::Kind::reserve: {
      if (PQntuples(r) != 1) throw StoreError("postgresql: idem_reserve returned no row", 0);
      const std::int64_t kind = pg::int_at(r, 0, 0);
      op.reservation = {};
      if (kind == 2) {
        op.reservation.kind = Reservation::Kind::existing;
        op.reservation.existing = read_record(r, 0, 3, sh);
      } else {
        op.reservation.kind =
            kind == 1 ? Reservation::Kind::taken_over : Reservation::Kind::reserved;
        op.reservation.token = pg::int_at(r, 0, 1);
      }
      break;
    }
    case StoreOp::Kind::complete:
    case StoreOp::Kind::release:
      op.applied = pg::changed(r) == 1;
      break;
    case StoreOp::Kind::store_if_absent:
      if (PQntuples(r) != 1)
        throw StoreError("postgresql: idem_store_if_absent returned no row", 0);
      op.reservation = {};
      if (pg::int_at(r, 0, 0) == 0) {
        op.reservation.kind = Reservation::Kind::existing;
        op.reservation.existing = read_record(r, 0, 1, sh);
      }
      break;
  }
}

// One op on its own (its statement is its own transaction). Requires `mutex`.
void PgStore::Impl::apply_single(StoreOp& op) {
  op.reservation = {};
  op.applied = false;
  try {
    ensure();
    Params p = params_of(op);
    Result r = run(statement_of(op), p);
    take(op, r.get());
    connection.transactions.fetch_add(1, std::memory_order_relaxed);
    committed_ops.fetch_add(1, std::memory_order_relaxed);
  } catch (...) {
    op.error = std::current_exception();
  }
}

pg::Pipeline PgStore::Impl::send_pipeline(std::span<StoreOp* const> ops, std::span<Params> params,
                                          const std::string& payload) {
  PGconn* const c = conn();
  if (PQenterPipelineMode(c) != 1) throw connection.failure("entering pipeline mode", nullptr);
  bool sent = PQsendQueryParams(c, pg::sql::kBegin, 0, nullptr, nullptr, nullptr, nullptr, 0) == 1;
  for (std::size_t i = 0; sent && i < ops.size(); ++i) {
    Params& p = params[i];
    sent = PQsendQueryPrepared(c, statement_name(statement_of(*ops[i])).c_str(), p.count(),
                               p.values(), p.lengths(), p.formats(), 1) == 1;
  }
  if (sent && !payload.empty()) {
    const char* values[] = {channel.c_str(), payload.c_str()};
    sent = PQsendQueryParams(c, pg_sql::kNotify, 2, nullptr, values, nullptr, nullptr, 0) == 1;
  }
  sent =
      sent && PQsendQueryParams(c, pg::sql::kCommit, 0, nullptr, nullptr, nullptr, nullptr, 0) == 1;
  sent = sent && PQpipelineSync(c) == 1;
  connection.round_trips.fetch_add(1, std::memory_order_relaxed);
  if (!sent) connection.broken("sending a pipeline");
  // Non-blocking: what did not fit the socket is sent now, waiting at most for a reply's time.
  if (!session().flush(session().reply_deadline())) {
    if (PQstatus(c) != CONNECTION_OK) connection.broken("sending a pipeline");
    connection.stalled("sending a pipeline");
  }
  pg::Pipeline in;
  in.commands = ops.size() + 2 + (payload.empty() ? 0 : 1);
  return in;
}

PgStore::Impl::Pipelined PgStore::Impl::conclude(std::span<StoreOp* const> ops, pg::Pipeline& in,
                                                 bool notified) {
  if (!in.synced || PQexitPipelineMode(conn()) != 1)
    connection.broken("a pipeline broke before its end (its outcome is unknown)");
  if (!in.ok) {
    // The sync ends the pipeline, not the transaction BEGIN opened: it is left aborted.
    if (PQtransactionStatus(conn()) != PQTRANS_IDLE) connection.simple(pg::sql::kRollback);
    return Pipelined::op_failed;
  }
  for (std::size_t i = 0; i < ops.size(); ++i) {
    try {
      take(*ops[i], in.results[i + 1].get());
    } catch (...) {
      ops[i]->error = std::current_exception();
    }
  }
  connection.transactions.fetch_add(1, std::memory_order_relaxed);
  committed_ops.fetch_add(ops.size(), std::memory_order_relaxed);
  if (notified) notify_batches.fetch_add(1, std::memory_order_relaxed);
  return Pipelined::committed;
}

// The ops in one pipeline and one transaction, waiting for the results on this thread.
// Throws StoreError as send_pipeline() and conclude(). Requires `mutex`.
PgStore::Impl::Pipelined PgStore::Impl::apply_pipelined(std::span<StoreOp* const> ops,
                                                        std::span<Params> params) {
  ensure();
  const std::string payload = notify_payload(ops);
  pg::Pipeline in = send_pipeline(ops, params, payload);
  const pg::Deadline deadline = session().reply_deadline();
  while (in.take(conn()) && !in.synced) {
    if (!session().wait(POLLIN, deadline)) connection.stalled("waiting for a batch's results");
  }
  return conclude(ops, in, !payload.empty());
}

PgStore::Impl::Plan PgStore::Impl::plan(std::span<StoreOp* const> ops) const {
  // Rows are locked in key order, so two nodes' batches never wait for each other in a
  // cycle; ops on one key keep their order (a stable sort).
  std::vector<StoreOp*> sorted(ops.begin(), ops.end());
  std::stable_sort(sorted.begin(), sorted.end(), [](const StoreOp* a, const StoreOp* b) {
    return std::tie(a->id->tenant, a->id->operation, a->id->key) <
           std::tie(b->id->tenant, b->id->operation, b->id->key);
  });
  // An op whose inputs cannot be sent (a header that is not UTF-8) fails alone, before any
  // round trip.
  Plan out;
  for (StoreOp* op : sorted) {
    try {
      out.params.push_back(params_of(*op));
      out.sendable.push_back(op);
    } catch (...) {
      op->error = std::current_exception();
    }
  }
  return out;
}

void PgStore::Impl::settle(std::span<StoreOp* const> part,
                           const std::function<Pipelined()>& run_it) {
  Pipelined outcome{};
  try {
    outcome = run_it();
  } catch (...) {
    for (StoreOp* op : part) op->error = std::current_exception();
    return;
  }
  if (outcome == Pipelined::op_failed) {
    for (StoreOp* op : part) apply_single(*op);
  }
}

void PgStore::Impl::apply_all(std::span<StoreOp* const> ops) {
  // One op alone is one statement; one that wakes others goes with its NOTIFY in a pipeline.
  if (ops.size() == 1 && (!options.notify || !wakes(*ops[0]))) {
    apply_single(*ops[0]);
    return;
  }
  try {
    ensure();  // first: a reconnection may measure a new clock offset, which the params use
  } catch (...) {
    for (StoreOp* op : ops) op->error = std::current_exception();
    return;
  }
  Plan pl = plan(ops);
  for (std::size_t first = 0; first < pl.sendable.size(); first += kMaxPipelineOps) {
    const std::size_t n = std::min(kMaxPipelineOps, pl.sendable.size() - first);
    const std::span<StoreOp* const> part(pl.sendable.data() + first, n);
    settle(part,
           [&] { return apply_pipelined(part, std::span<Params>(pl.params.data() + first, n)); });
  }
}

// ---- wake-ups ----

// An identifier, quoted by hand: the listener's thread has no connection yet to quote it with.
std::string PgStore::Impl::quoted_channel() const {
  std::string q = "\"";
  for (char ch : channel) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return q + "\"";
}

std::string PgStore::Impl::notify_payload(std::span<StoreOp* const> ops) const {
  if (!options.notify) return {};
  nlohmann::json all = nlohmann::json::array();
  for (const StoreOp* op : ops) {
    if (wakes(*op))
      all.push_back(nlohmann::json::array({op->id->tenant, op->id->operation, op->id->key}).dump());
  }
  return all.empty() ? std::string() : all.dump();
}

void PgStore::Impl::notified(std::string_view payload, int sender) {
  if (own(sender)) return;  // our own commit
  const nlohmann::json j = nlohmann::json::parse(payload, nullptr, false);
  if (!j.is_array() || j.size() != 3 || !j[0].is_string() || !j[1].is_string() || !j[2].is_string())
    return;  // not idem's: ignore
  const KeyId id{j[0].get<std::string>(), j[1].get<std::string>(), j[2].get<std::string>()};
  wakeups.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard lock(listeners_mutex);
  for (const auto& entry : listeners) entry.second(id);
}

namespace detail {

// PgStore::start_apply's batch: its pipelines on one batch connection, whose lock it holds
// from construction until it is done; their results are taken as they arrive (advance()),
// each pipeline sent when the one before it has ended.
class PgPending final : public PendingApply {
 public:
  using Impl = PgStore::Impl;

  // `s`'s lock is held by the caller and passes to this object.
  PgPending(Impl& s, std::span<StoreOp* const> ops) : s_(s) {
    Impl& main = *s_.owner;
    main.started.fetch_add(1, std::memory_order_relaxed);
    const std::size_t now = main.in_flight.fetch_add(1, std::memory_order_relaxed) + 1;
    std::size_t most = main.most_in_flight.load(std::memory_order_relaxed);
    while (now > most && !main.most_in_flight.compare_exchange_weak(most, now)) {
    }
    try {
      s_.ensure();  // first: a reconnection may measure a new clock offset, which the params use
    } catch (...) {
      for (StoreOp* op : ops) op->error = std::current_exception();
      finish();
      return;
    }
    plan_ = s_.plan(ops);
    send_next();
  }

  ~PgPending() override {
    if (!done_) s_.connection.drop("a batch was abandoned before its results came");
    finish();
  }

  PgPending(const PgPending&) = delete;
  PgPending& operator=(const PgPending&) = delete;

  int descriptor() const noexcept override { return done_ ? -1 : PQsocket(s_.conn()); }
  std::chrono::steady_clock::time_point deadline() const noexcept override { return deadline_; }
  bool done() const noexcept override { return done_; }

  void advance() noexcept override {
    if (done_) return;
    if (in_.take(s_.conn()) && !in_.synced) return;  // more to come
    end_pipeline();
  }

  void fail(std::exception_ptr why) noexcept override {
    if (done_) return;
    for (std::size_t i = first_; i < plan_.sendable.size(); ++i) plan_.sendable[i]->error = why;
    if (std::chrono::steady_clock::now() >= deadline_) {
      // Stalled: the next use waits out the backoff first.
      s_.connection.drop_stalled("a batch's results did not come in time");
    } else {
      s_.connection.drop("the wait for a batch's results failed");
    }
    finish();
  }

 private:
  std::span<StoreOp* const> part() const { return {plan_.sendable.data() + first_, count_}; }

  // Sends the next pipeline, or finishes when none is left.
  void send_next() noexcept {
    while (first_ < plan_.sendable.size()) {
      count_ = std::min(kMaxPipelineOps, plan_.sendable.size() - first_);
      try {
        s_.ensure();
        payload_ = s_.notify_payload(part());
        in_ = s_.send_pipeline(part(), std::span<Params>(plan_.params.data() + first_, count_),
                               payload_);
        deadline_ = s_.session().reply_deadline();
        return;
      } catch (...) {
        for (StoreOp* op : part()) op->error = std::current_exception();
        first_ += count_;
      }
    }
    finish();
  }

  // The current pipeline's sync came, or its connection broke.
  void end_pipeline() noexcept {
    s_.settle(part(), [this] { return s_.conclude(part(), in_, !payload_.empty()); });
    first_ += count_;
    send_next();
  }

  void finish() noexcept {
    if (done_) return;
    done_ = true;
    s_.owner->in_flight.fetch_sub(1, std::memory_order_relaxed);
    s_.mutex.unlock();
  }

  Impl& s_;
  Impl::Plan plan_;
  std::size_t first_ = 0;  // the current pipeline's first op in plan_.sendable
  std::size_t count_ = 0;  // and how many it carries
  std::string payload_;
  pg::Pipeline in_;
  std::chrono::steady_clock::time_point deadline_ = std::chrono::steady_clock::time_point::max();
  bool done_ = false;
};

}  // namespace detail

// ---- PgStore ----

PgStore::PgStore(const std::string& conninfo, PgOptions options)
    : impl_(std::make_unique<Impl>(conninfo, std::move(options))) {}

PgStore::~PgStore() = default;

int PgStore::schema_version() noexcept { return static_cast<int>(pg_sql::kMigrations.size()); }

detail::PgStats detail::StoreStats::of(const PgStore& store) {
  using Impl = PgStore::Impl;
  PgStats out;
  const auto add = [&out](const Impl& d) {
    out.transactions += d.connection.transactions.load(std::memory_order_relaxed);
    out.ops += d.committed_ops.load(std::memory_order_relaxed);
    out.round_trips += d.connection.round_trips.load(std::memory_order_relaxed);
    out.connects += d.connection.connects.load(std::memory_order_relaxed);
    out.notify_batches += d.notify_batches.load(std::memory_order_relaxed);
  };
  add(*store.impl_);
  for (const auto& s : store.impl_->batch) add(*s);
  add(*store.impl_->upkeep);
  out.async_batches = store.impl_->started.load(std::memory_order_relaxed);
  out.most_batches_in_flight = store.impl_->most_in_flight.load(std::memory_order_relaxed);
  out.wakeups = store.impl_->wakeups.load(std::memory_order_relaxed);
  out.listens = store.impl_->listens.load(std::memory_order_relaxed);
  return out;
}

std::uint64_t PgStore::add_change_listener(ChangeListener listener) {
  Impl& d = *impl_;
  if (!d.options.notify) return 0;
  std::lock_guard lock(d.listeners_mutex);
  const std::uint64_t id = d.next_listener++;
  d.listeners.emplace(id, std::move(listener));
  if (!d.listener) {
    d.listener = std::make_unique<detail::PgListener>(
        d.parameters(), fmt::format(fmt::runtime(pg_sql::kListen), d.quoted_channel()),
        [&d](std::string_view payload, int sender) { d.notified(payload, sender); },
        [&d] { d.listens.fetch_add(1, std::memory_order_relaxed); }, d.options.reconnect_min,
        d.options.reconnect_max);
  }
  return id;
}

void PgStore::remove_change_listener(std::uint64_t id) {
  Impl& d = *impl_;
  std::unique_ptr<detail::PgListener> stopped;
  {
    std::lock_guard lock(d.listeners_mutex);  // waits for a listener that is running
    d.listeners.erase(id);
    if (d.listeners.empty()) stopped = std::move(d.listener);
  }
  stopped.reset();  // joins the thread, outside the lock its callback takes
}

std::chrono::milliseconds PgStore::clock_offset() const {
  return std::chrono::milliseconds(impl_->clock.ms());
}

void PgStore::apply(std::span<StoreOp* const> ops) {
  if (ops.empty()) return;
  Impl& d = *impl_;
  // A free batch connection, or else the main one, waiting for it.
  Impl* s = d.try_batch();
  std::unique_lock<detail::FairMutex> lock;
  if (s == nullptr) {
    s = &d;
    try {
      lock = d.take();
    } catch (const StoreError&) {
      for (StoreOp* op : ops) op->error = std::current_exception();
      return;
    }
  } else {
    lock = std::unique_lock(s->mutex, std::adopt_lock);
  }
  s->apply_all(ops);
}

std::unique_ptr<PendingApply> PgStore::start_apply(std::span<StoreOp* const> ops) {
  if (ops.empty()) return nullptr;
  Impl* s = impl_->try_batch();
  if (s == nullptr) return nullptr;  // every batch connection is busy: apply() waits
  return std::make_unique<detail::PgPending>(*s, ops);
}

std::size_t PgStore::concurrent_applies() const noexcept {
  return std::max<std::size_t>(1, impl_->batch.size());
}

bool PgStore::renew(const KeyId& id, std::int64_t token, TimePoint lease_until) {
  Impl& d = *impl_;
  return d.locked([&] {
    Params p;
    key_params(p, id).integer(token).integer(d.shift().to_db(lease_until));
    return pg::changed(d.run(kRenew, p).get()) == 1;
  });
}

std::optional<Record> PgStore::load(const KeyId& id) {
  Impl& d = *impl_;
  return d.locked([&]() -> std::optional<Record> {
    Params p;
    key_params(p, id);
    Result r = d.run(kLoad, p);
    if (PQntuples(r.get()) == 0) return std::nullopt;
    return read_record(r.get(), 0, 0, d.shift());
  });
}

std::size_t PgStore::purge_expired(TimePoint now, std::size_t limit) {
  Impl& d = *impl_->upkeep;
  return d.locked([&] {
    Params p;
    p.integer(d.shift().to_db(now)).integer(static_cast<std::int64_t>(limit));
    return static_cast<std::size_t>(pg::changed(d.run(kPurge, p).get()));
  });
}

std::vector<ReapedRecord> PgStore::reap(TimePoint lease_ended_before, std::size_t limit) {
  Impl& d = *impl_->upkeep;
  return d.locked([&] {
    const Shift sh = d.shift();
    Params p;
    p.integer(sh.to_db(lease_ended_before)).integer(static_cast<std::int64_t>(limit));
    Result r = d.run(kReap, p);
    std::vector<ReapedRecord> out;
    for (int row = 0; row < PQntuples(r.get()); ++row) {
      const KeyId id{std::string(pg::bytes_at(r.get(), row, 0)),
                     std::string(pg::bytes_at(r.get(), row, 1)),
                     std::string(pg::bytes_at(r.get(), row, 2))};
      out.push_back({short_hash(id), id.operation, pg::int_at(r.get(), row, 3),
                     sh.from_db(pg::int_at(r.get(), row, 4))});
    }
    return out;
  });
}

}  // namespace idem
