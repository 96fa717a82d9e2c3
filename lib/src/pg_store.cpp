#include "idem/pg_store.hpp"

#include <fmt/format.h>
#include <libpq-fe.h>

#include <poll.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>
#include <type_traits>

#include "fair_mutex.hpp"
#include "idem/errors.hpp"
#include "idem/internal/pg.hpp"
#include "idem/key.hpp"
#include "pg_import.hpp"
#include "pg_listener.hpp"
#include "pg_sql.hpp"
#include "record_codec.hpp"

namespace idem {
namespace {

using SteadyClock = std::chrono::steady_clock;

// PostgreSQL's type OIDs (pg_type.dat) of the columns decoded here.
constexpr Oid kBoolOid = 16, kByteaOid = 17, kInt8Oid = 20, kInt2Oid = 21, kInt4Oid = 23,
              kFloat4Oid = 700, kFloat8Oid = 701;

// A batch goes in one pipeline and one transaction up to this many ops; a longer one is split
// (each part its own transaction), so neither side's socket buffer fills while the other waits.
constexpr std::size_t kMaxPipelineOps = 128;
constexpr std::size_t kMaxBatchConnections = 64;

// On the database's clock, how far apart an imported time and an earlier copy of it may be and
// still count as the same time (PgImport::records): each run measures the clock's offset anew,
// within half a round trip. A real change moves a time further (a renewal: by a heartbeat) or
// changes another column too (a completion, a release).
constexpr std::chrono::milliseconds kImportClockSlack{1000};

using pg::Result;

StoreError pg_error(std::string_view what, const PGresult* r, PGconn* c) {
  return StoreError(pg::describe(what, r, c), 0);
}

// A statement's parameters: integers as text, strings as raw bytes (binary format, so a text
// or bytea column takes them unescaped), NULL.
class Params {
 public:
  Params& integer(std::int64_t v) {
    add(std::to_string(v), 0);
    return *this;
  }
  Params& text(std::string_view v) {
    add(std::string(v), 1);
    return *this;
  }
  Params& bytes(std::string_view v) { return text(v); }
  Params& real(double v) {
    add(fmt::format("{}", v), 0);
    return *this;
  }
  Params& null() {
    values_.emplace_back();
    formats_.push_back(0);
    return *this;
  }
  Params& id(const KeyId& k) { return text(k.tenant).text(k.operation).text(k.key); }

  // The arrays libpq takes, valid while this object is neither changed nor destroyed. (Either
  // may be called first: a call's arguments are evaluated in any order.)
  int count() const { return static_cast<int>(values_.size()); }
  const char* const* values() {
    build();
    return pointers_.data();
  }
  const int* lengths() {
    build();
    return lengths_.data();
  }
  const int* formats() const { return formats_.data(); }

 private:
  void build() {
    if (pointers_.size() == values_.size()) return;
    pointers_.clear();
    lengths_.clear();
    for (const auto& v : values_) {
      pointers_.push_back(v ? v->data() : nullptr);
      lengths_.push_back(v ? static_cast<int>(v->size()) : 0);
    }
  }
  void add(std::string v, int format) {
    values_.emplace_back(std::move(v));
    formats_.push_back(format);
  }
  std::vector<std::optional<std::string>> values_;
  std::vector<int> formats_;
  std::vector<const char*> pointers_;
  std::vector<int> lengths_;
};

// Reading binary-format results.
bool is_null(const PGresult* r, int row, int col) { return PQgetisnull(r, row, col) != 0; }

std::string_view bytes_at(const PGresult* r, int row, int col) {
  return {PQgetvalue(r, row, col), static_cast<std::size_t>(PQgetlength(r, row, col))};
}

// A signed big-endian integer of v.size() bytes (2, 4 or 8).
template <class T>
std::int64_t big_endian(std::string_view v) {
  std::make_unsigned_t<T> u = 0;
  for (const char c : v)
    u = static_cast<std::make_unsigned_t<T>>((u << 8) | static_cast<unsigned char>(c));
  return static_cast<T>(u);
}

std::int64_t int_at(const PGresult* r, int row, int col) {
  const std::string_view v = bytes_at(r, row, col);
  switch (PQftype(r, col)) {
    case kInt8Oid:
      if (v.size() == 8) return big_endian<std::int64_t>(v);
      break;
    case kInt4Oid:
      if (v.size() == 4) return big_endian<std::int32_t>(v);
      break;
    case kInt2Oid:
      if (v.size() == 2) return big_endian<std::int16_t>(v);
      break;
    case kBoolOid:
      if (v.size() == 1) return v[0] != 0;
      break;
    default:
      break;
  }
  throw CorruptRecordError(fmt::format("postgresql: column {} is not an integer", PQfname(r, col)));
}

// The converse of a time the store wrote: see Impl::to_db.
struct Shift {
  std::int64_t offset = 0;
  TimePoint from_db(std::int64_t v) const { return detail::at_ms(v - offset); }
  std::int64_t to_db(TimePoint t) const { return detail::ms(t) + offset; }
};

// The record in columns first..first+10 (pg_sql::kLoad's order), and its claim in first+11
// when the result has that column.
Record read_record(const PGresult* r, int row, int first, const Shift& shift) {
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

// The statements, prepared on every connection under these names.
enum Stmt : int {
  kReserve,
  kStoreIfAbsent,
  kLoad,
  kComplete,
  kRelease,
  kRenew,
  kSetRecoveryPoint,
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

constexpr std::array<std::string_view, kStatementCount> kTexts = {
    pg_sql::kReserve,          pg_sql::kStoreIfAbsent,   pg_sql::kLoad,
    pg_sql::kComplete,         pg_sql::kRelease,         pg_sql::kRenew,
    pg_sql::kSetRecoveryPoint, pg_sql::kPurge,           pg_sql::kReap,
    pg_sql::kLoadProgress,     pg_sql::kBeginSteps,      pg_sql::kMarkPending,
    pg_sql::kSetProgress,      pg_sql::kAbandoned,       pg_sql::kOutboxInsert,
    pg_sql::kOutboxClaim,      pg_sql::kOutboxDelivered, pg_sql::kOutboxFailed,
    pg_sql::kOutboxCounts,     pg_sql::kOutboxPurge,     pg_sql::kNow,
    pg_sql::kImportRecord,     pg_sql::kImportMessage};

std::string statement_name(Stmt s) { return fmt::format("idem_{}", static_cast<int>(s)); }

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

// `text` with every byte that is not valid UTF-8 replaced by U+FFFD: a text column takes
// nothing else, and a delivery's error message may come from anywhere.
std::string valid_utf8(const std::string& text) {
  const std::string quoted =
      nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return nlohmann::json::parse(quoted).get<std::string>();
}

// The row of kLoadProgress or kBeginSteps: state, token, progress, request.
struct ProgressRow {
  State state;
  std::int64_t token;
  std::optional<Progress> progress;
};

ProgressRow read_progress(const PGresult* r) {
  ProgressRow row{static_cast<State>(int_at(r, 0, 0)), int_at(r, 0, 1), std::nullopt};
  if (!is_null(r, 0, 2)) {
    row.progress = detail::progress_from_json(bytes_at(r, 0, 2));
    if (!is_null(r, 0, 3)) row.progress->request = std::string(bytes_at(r, 0, 3));
  }
  return row;
}

}  // namespace

struct PgStore::Impl {
  std::string conninfo;
  PgOptions options;
  std::string schema;  // quoted
  std::vector<std::string> texts;
  detail::FairMutex mutex;  // serialises every use of `session`, first come first served
  pg::Session session;      // guarded by `mutex`; not connected while disconnected
  // Reconnection, guarded by `mutex`.
  std::chrono::milliseconds backoff;
  SteadyClock::time_point next_attempt{};
  std::string last_failure;
  // The main session (this one, in the main session). The batch sessions use its clock
  // offset: when it was last measured (SteadyClock ticks) and the server's clock minus
  // local_clock's, in ms.
  Impl* owner = this;
  std::atomic<SteadyClock::rep> measured{0};
  std::atomic<std::int64_t> offset{0};
  std::atomic<std::uint64_t> transactions{0}, committed_ops{0}, round_trips{0}, connects{0};
  std::atomic<std::uint64_t> notify_batches{0}, wakeups{0}, listens{0};
  // In the main session: start_apply()'s batches, how many are in flight and the most ever.
  std::atomic<std::uint64_t> started{0};
  std::atomic<std::size_t> in_flight{0}, most_in_flight{0};
  // The batch connections (PgOptions::batch_connections), each a session of its own that
  // connects on first use; empty in a batch session. Fixed after construction;
  // declared before the listener, whose thread reads it (own()), so it outlives that thread.
  std::vector<std::unique_ptr<Impl>> batch;
  // The session of maintenance (purge, reap, the completer's search, the outbox), which
  // connects on first use: a request never waits behind a maintenance job's round trip, nor
  // for the lock a stalled one holds. Null in a batch session.
  std::unique_ptr<Impl> upkeep;
  // Wake-ups (PgOptions::notify): the channel (pg_notify's argument), the write
  // connection's backend (its own notifications are not news to this process), the
  // listeners and the LISTEN connection, started with the first listener.
  const std::string channel;  // "idem:" and the schema's name
  std::atomic<int> own_backend{0};
  std::mutex listeners_mutex;  // held while a listener runs, so removing one waits for it
  std::map<std::uint64_t, ChangeListener> listeners;
  std::uint64_t next_listener = 1;
  std::unique_ptr<detail::PgListener> listener;  // guarded by listeners_mutex

  Impl(std::string info, PgOptions o)
      : conninfo(std::move(info)), options(std::move(o)), channel("idem:" + options.schema) {
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
    backoff = options.reconnect_min;
    connect();
    migrate();  // a half-built Impl's session closes its connection as the Impl unwinds
    for (std::size_t i = 0; i < options.batch_connections; ++i)
      batch.push_back(std::make_unique<Impl>(BatchOf{*this}));
    upkeep = std::make_unique<Impl>(BatchOf{*this});
  }

  // A batch session of `main`: the same server, schema and options; not connected yet (its
  // first use connects, prepares and measures the clock).
  struct BatchOf {
    Impl& main;
  };
  explicit Impl(BatchOf of)
      : conninfo(of.main.conninfo),
        options(of.main.options),
        schema(of.main.schema),
        texts(of.main.texts),
        channel(of.main.channel) {
    owner = &of.main;
    backoff = options.reconnect_min;
    last_failure = "not connected yet";
  }

  // A batch connection that was free, now locked by the caller; null when all are busy.
  Impl* try_batch() {
    // The first free one: under a light load the first stays busy and warm, and the others
    // connect only when batches overlap.
    for (const auto& s : batch) {
      if (s->mutex.try_lock()) return s.get();
    }
    return nullptr;
  }

  // Whether `pid` is one of this store's connections (their notifications are not news).
  bool own(int pid) const {
    if (pid == own_backend.load(std::memory_order_relaxed)) return true;
    return std::any_of(batch.begin(), batch.end(), [pid](const auto& s) {
      return pid == s->own_backend.load(std::memory_order_relaxed);
    });
  }

  Shift shift() const { return Shift{owner->offset.load(std::memory_order_relaxed)}; }

  // Whether the shared offset is older than PgOptions::clock_refresh (or was never measured).
  bool clock_stale() const {
    const SteadyClock::rep at = owner->measured.load(std::memory_order_relaxed);
    return at == 0 || SteadyClock::now() - SteadyClock::time_point(SteadyClock::duration(at)) >
                          options.clock_refresh;
  }

  // ---- the connection ----

  PGconn* conn() const noexcept { return session.get(); }

  // The connection is gone (closed here or by the session); the next use reconnects. A server
  // that stopped answering gets a backoff first, so the calls queued behind this one fail at
  // once instead of each waiting out a connect timeout; one that closed the connection is tried
  // again at once.
  void lost(std::string why) {
    last_failure = std::move(why);
    next_attempt =
        SteadyClock::now() + (session.timed_out() ? backoff : std::chrono::milliseconds(0));
  }

  void drop(std::string why) {
    session.close();
    lost(std::move(why));
  }

  // What a connection of this store opens with (pg::Session::open adds idem's keepalives and
  // timeouts on both ends).
  pg::Parameters parameters() const {
    return pg::Parameters{conninfo, pg::Timeouts{.connect = options.connect_timeout,
                                                 .statement = options.statement_timeout,
                                                 .margin = options.reply_margin}};
  }

  void connect() {
    session.open(parameters());
    try {
      if (schema.empty()) {
        char* quoted = PQescapeIdentifier(conn(), options.schema.data(), options.schema.size());
        if (quoted == nullptr) throw pg_error("quoting the schema name", nullptr, conn());
        schema = quoted;
        PQfreemem(quoted);
        for (std::string_view t : kTexts) texts.push_back(with_schema(t, schema));
      }
      simple(pg_sql::kReadCommitted);
      simple(fmt::format(fmt::runtime(pg_sql::kSearchPath), schema));
      own_backend.store(PQbackendPID(conn()), std::memory_order_relaxed);
      connects.fetch_add(1, std::memory_order_relaxed);
    } catch (...) {
      session.close();
      throw;
    }
  }

  // Prepares the statements on this connection (after the migrations made what they use).
  void prepare() {
    for (int i = 0; i < kStatementCount; ++i) {
      Result r = session.prepare(statement_name(static_cast<Stmt>(i)).c_str(),
                                 texts[static_cast<std::size_t>(i)].c_str());
      round_trips.fetch_add(1, std::memory_order_relaxed);
      if (PQresultStatus(r.get()) != PGRES_COMMAND_OK)
        throw failure("preparing statements", r.get());
    }
  }

  // A usable connection, reconnecting (at most once per backoff) if it was lost. Requires
  // `mutex`.
  void ensure() {
    if (session.connected() && PQstatus(conn()) == CONNECTION_BAD) drop(PQerrorMessage(conn()));
    if (session.connected()) {
      if (options.clock == PgClock::database && clock_stale()) measure_clock();
      return;
    }
    if (SteadyClock::now() < next_attempt) {
      throw StoreError(fmt::format("postgresql: not connected ({}); reconnecting", last_failure),
                       0);
    }
    try {
      connect();
      prepare();
      // A batch session keeps its main's offset unless it is due.
      if (options.clock == PgClock::database && (owner == this || clock_stale())) measure_clock();
      backoff = options.reconnect_min;
    } catch (const StoreError& e) {
      session.close();
      last_failure = e.what();
      next_attempt = SteadyClock::now() + backoff;
      backoff = std::min(backoff * 2, options.reconnect_max);
      throw;
    }
  }

  // The StoreError for a failed result; drops the connection if it broke.
  StoreError failure(std::string_view what, const PGresult* r) {
    StoreError e = pg_error(what, r, conn());
    if (session.connected() && PQstatus(conn()) != CONNECTION_OK) drop(e.what());
    return e;
  }

  void simple(const std::string& sql) {
    Result r = session.exec(sql);
    round_trips.fetch_add(1, std::memory_order_relaxed);
    if (PQresultStatus(r.get()) != PGRES_COMMAND_OK && PQresultStatus(r.get()) != PGRES_TUPLES_OK)
      throw failure(sql.substr(0, sql.find(' ')), r.get());
  }

  // Runs a prepared statement; binary results.
  Result run(Stmt s, Params& p) {
    Result r = session.exec_prepared(statement_name(s).c_str(), p.count(), p.values(), p.lengths(),
                                     p.formats(), 1);
    round_trips.fetch_add(1, std::memory_order_relaxed);
    const ExecStatusType status = PQresultStatus(r.get());
    if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK)
      throw failure("statement", r.get());
    return r;
  }

  static std::int64_t changed(const PGresult* r) {
    const char* n = PQcmdTuples(const_cast<PGresult*>(r));
    return n != nullptr && *n != '\0' ? std::stoll(n) : 0;
  }

  // ---- the clock ----

  // The database's clock minus this machine's, from the midpoint of one round trip.
  void measure_clock() {
    const TimePoint before = options.local_clock->now();
    Params none;
    Result r = run(kNow, none);
    const TimePoint after = options.local_clock->now();
    const std::int64_t db = int_at(r.get(), 0, 0);
    const std::int64_t local = detail::ms(before + (after - before) / 2);
    owner->offset.store(db - local, std::memory_order_relaxed);
    owner->measured.store(SteadyClock::now().time_since_epoch().count(), std::memory_order_relaxed);
  }

  // ---- the schema ----

  void migrate() {
    simple(pg_sql::kBegin);
    try {
      simple(fmt::format(fmt::runtime(pg_sql::kMigrationLock),
                         literal("idem migrations " + options.schema)));
      simple(with_schema(pg_sql::kCreateMeta, schema));
      Result v = session.exec(with_schema(pg_sql::kVersion, schema));
      round_trips.fetch_add(1, std::memory_order_relaxed);
      if (PQresultStatus(v.get()) != PGRES_TUPLES_OK)
        throw failure("reading the schema version", v.get());
      const int version = PQntuples(v.get()) > 0 ? std::atoi(PQgetvalue(v.get(), 0, 0)) : 0;
      const int known = static_cast<int>(pg_sql::kMigrations.size());
      if (version > known) {
        throw StoreError(fmt::format("postgresql: schema {} is at version {}, newer than this "
                                     "library's {}: upgrade idem before opening it",
                                     options.schema, version, known),
                         0);
      }
      for (int i = version; i < known; ++i)
        simple(with_schema(pg_sql::kMigrations[static_cast<std::size_t>(i)], schema));
      if (version < known) {
        std::string set = with_schema(pg_sql::kSetVersion, schema);
        set.replace(set.find("{v}"), 3, std::to_string(known));
        simple(set);
      }
      simple(pg_sql::kCommit);
    } catch (...) {
      if (session.connected()) rollback();
      throw;
    }
    prepare();
    if (options.clock == PgClock::database) measure_clock();
  }

  std::string literal(const std::string& s) {
    char* q = PQescapeLiteral(conn(), s.data(), s.size());
    if (q == nullptr) throw pg_error("quoting", nullptr, conn());
    std::string out = q;
    PQfreemem(q);
    return out;
  }

  // ---- transactions ----

  // Rolls the open transaction back; a failure to do so (the connection broke or stopped
  // answering) has closed the connection, which ends the transaction on the server too.
  void rollback() noexcept {
    try {
      session.exec(pg_sql::kRollback);
    } catch (const StoreError& e) {
      lost(e.what());
    }
  }

  // BEGIN now, ROLLBACK unless commit() ran (a failed statement aborts the transaction).
  class Transaction {
   public:
    explicit Transaction(Impl& d) : d_(d) { d_.simple(pg_sql::kBegin); }
    ~Transaction() {
      if (!done_ && d_.session.connected()) d_.rollback();
    }
    Transaction(const Transaction&) = delete;
    Transaction& operator=(const Transaction&) = delete;
    void commit() {
      d_.simple(pg_sql::kCommit);
      done_ = true;
      d_.transactions.fetch_add(1, std::memory_order_relaxed);
    }

   private:
    Impl& d_;
    bool done_ = false;
  };

  // Runs `f` on the connection, under `mutex`. A failure that cost the connection (a break,
  // a reply that did not come in time) is noted for the reconnection.
  template <class F>
  auto locked(F&& f) -> decltype(f()) {
    std::lock_guard lock(mutex);
    ensure();
    try {
      return f();
    } catch (const StoreError& e) {
      if (!session.connected()) lost(e.what());
      throw;
    }
  }

  // ---- the ops of apply() ----

  Stmt statement_of(const StoreOp& op) const {
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

  static void response_params(Params& p, const StoredResponse& r) {
    p.integer(r.response.status);
    const std::string headers = detail::headers_to_json(r.response.headers);
    if (headers.empty()) {
      p.null();
    } else {
      p.text(headers);
    }
    p.bytes(r.response.body);
    if (r.body_ref.empty()) {
      p.null();
    } else {
      p.text(r.body_ref);
    }
  }

  Params params_of(const StoreOp& op) const {
    const Shift sh = shift();
    Params p;
    p.id(*op.id);
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
  void take(StoreOp& op, const PGresult* r) const {
    const Shift sh = shift();
    switch (op.kind) {
      case StoreOp::Kind::reserve: {
        if (PQntuples(r) != 1) throw StoreError("postgresql: idem_reserve returned no row", 0);
        const std::int64_t kind = int_at(r, 0, 0);
        op.reservation = {};
        if (kind == 2) {
          op.reservation.kind = Reservation::Kind::existing;
          op.reservation.existing = read_record(r, 0, 3, sh);
        } else {
          op.reservation.kind =
              kind == 1 ? Reservation::Kind::taken_over : Reservation::Kind::reserved;
          op.reservation.token = int_at(r, 0, 1);
          if (!is_null(r, 0, 2)) op.reservation.recovery_point = std::string(bytes_at(r, 0, 2));
        }
        break;
      }
      case StoreOp::Kind::complete:
      case StoreOp::Kind::release:
        op.applied = changed(r) == 1;
        break;
      case StoreOp::Kind::store_if_absent:
        if (PQntuples(r) != 1)
          throw StoreError("postgresql: idem_store_if_absent returned no row", 0);
        op.reservation = {};
        if (int_at(r, 0, 0) == 0) {
          op.reservation.kind = Reservation::Kind::existing;
          op.reservation.existing = read_record(r, 0, 1, sh);
        }
        break;
    }
  }

  // One op on its own (its statement is its own transaction). Requires `mutex`.
  void apply_single(StoreOp& op) {
    op.reservation = {};
    op.applied = false;
    try {
      ensure();
      Params p = params_of(op);
      Result r = run(statement_of(op), p);
      take(op, r.get());
      transactions.fetch_add(1, std::memory_order_relaxed);
      committed_ops.fetch_add(1, std::memory_order_relaxed);
    } catch (...) {
      op.error = std::current_exception();
    }
  }

  enum class Pipelined {
    committed,  // every op has its outcome
    op_failed,  // one op (or the COMMIT) failed: nothing was committed, the ops are untouched
  };

  // A pipeline's results as they arrive: BEGIN, each op, [the NOTIFY,] COMMIT (each followed
  // by a null), then the sync.
  struct Incoming {
    std::size_t commands = 0;
    std::vector<Result> results;
    bool ok = true;  // every command succeeded
    bool synced = false;

    // Takes every result that has arrived, without blocking for more. Returns false if the
    // connection broke (or answered out of turn).
    bool take(PGconn* c) {
      if (PQconsumeInput(c) == 0) return false;
      int nulls = 0;
      while (!synced && PQisBusy(c) == 0) {
        Result r(PQgetResult(c));
        if (!r) {
          if (++nulls > 1) return false;  // nothing more is queued, yet no sync came
          continue;
        }
        nulls = 0;
        const ExecStatusType status = PQresultStatus(r.get());
        if (status == PGRES_PIPELINE_SYNC) {
          synced = true;
        } else if (results.size() < commands) {
          if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) ok = false;
          results.push_back(std::move(r));
        } else {
          return false;
        }
      }
      return true;
    }
  };

  // A StoreError for a pipeline that broke on its way; drops the connection.
  [[noreturn]] void broken(std::string_view what) {
    StoreError e = pg_error(what, nullptr, conn());
    drop(e.what());
    throw e;
  }

  // A StoreError for a pipeline whose replies did not come in time; drops the connection,
  // with the backoff of a server that stopped answering.
  [[noreturn]] void stalled(std::string_view what) {
    StoreError e(fmt::format("postgresql: {}: no reply within {} ms; the connection was dropped, "
                             "and whether the batch committed is unknown",
                             what, session.timeouts().reply().count()),
                 0);
    session.close();
    next_attempt = SteadyClock::now() + backoff;
    last_failure = e.what();
    throw e;
  }

  // Sends the ops in one pipeline: BEGIN, each op, COMMIT, one sync, one round trip. Throws
  // StoreError if it cannot be sent (the connection is dropped). Requires `mutex` and a
  // connection (ensure()).
  Incoming send_pipeline(std::span<StoreOp* const> ops, std::span<Params> params,
                         const std::string& payload) {
    PGconn* const c = conn();
    if (PQenterPipelineMode(c) != 1) throw failure("entering pipeline mode", nullptr);
    bool sent = PQsendQueryParams(c, pg_sql::kBegin, 0, nullptr, nullptr, nullptr, nullptr, 0) == 1;
    for (std::size_t i = 0; sent && i < ops.size(); ++i) {
      Params& p = params[i];
      sent = PQsendQueryPrepared(c, statement_name(statement_of(*ops[i])).c_str(), p.count(),
                                 p.values(), p.lengths(), p.formats(), 1) == 1;
    }
    if (sent && !payload.empty()) {
      const char* values[] = {channel.c_str(), payload.c_str()};
      sent = PQsendQueryParams(c, pg_sql::kNotify, 2, nullptr, values, nullptr, nullptr, 0) == 1;
    }
    sent = sent &&
           PQsendQueryParams(c, pg_sql::kCommit, 0, nullptr, nullptr, nullptr, nullptr, 0) == 1;
    sent = sent && PQpipelineSync(c) == 1;
    round_trips.fetch_add(1, std::memory_order_relaxed);
    if (!sent) broken("sending a pipeline");
    // Non-blocking: what did not fit the socket is sent now, waiting at most for a reply's time.
    if (!session.flush(session.reply_deadline())) {
      if (PQstatus(c) != CONNECTION_OK) broken("sending a pipeline");
      stalled("sending a pipeline");
    }
    Incoming in;
    in.commands = ops.size() + 2 + (payload.empty() ? 0 : 1);
    return in;
  }

  // Ends a pipeline whose sync came: the ops get their outcomes. Throws StoreError if it
  // broke before its end (then whether the COMMIT took effect is unknown, and running the ops
  // again could find their own writes). Requires `mutex`.
  Pipelined conclude(std::span<StoreOp* const> ops, Incoming& in, bool notified) {
    if (!in.synced || PQexitPipelineMode(conn()) != 1)
      broken("a pipeline broke before its end (its outcome is unknown)");
    if (!in.ok) {
      // The sync ends the pipeline, not the transaction BEGIN opened: it is left aborted.
      if (PQtransactionStatus(conn()) != PQTRANS_IDLE) simple(pg_sql::kRollback);
      return Pipelined::op_failed;
    }
    for (std::size_t i = 0; i < ops.size(); ++i) {
      try {
        take(*ops[i], in.results[i + 1].get());
      } catch (...) {
        ops[i]->error = std::current_exception();
      }
    }
    transactions.fetch_add(1, std::memory_order_relaxed);
    committed_ops.fetch_add(ops.size(), std::memory_order_relaxed);
    if (notified) notify_batches.fetch_add(1, std::memory_order_relaxed);
    return Pipelined::committed;
  }

  // The ops in one pipeline and one transaction, waiting for the results on this thread.
  // Throws StoreError as send_pipeline() and conclude(). Requires `mutex`.
  Pipelined apply_pipelined(std::span<StoreOp* const> ops, std::span<Params> params) {
    ensure();
    const std::string payload = notify_payload(ops);
    Incoming in = send_pipeline(ops, params, payload);
    const pg::Deadline deadline = session.reply_deadline();
    while (in.take(conn()) && !in.synced) {
      if (!session.wait(POLLIN, deadline)) stalled("waiting for a batch's results");
    }
    return conclude(ops, in, !payload.empty());
  }

  // What apply() does with a batch of ops, in pipelines of at most kMaxPipelineOps ops (their
  // order: sorted by key, see PgStore::apply). Ops whose inputs cannot be sent fail alone.
  struct Plan {
    std::vector<StoreOp*> sendable;
    std::vector<Params> params;
  };
  Plan plan(std::span<StoreOp* const> ops) const {
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

  // One pipeline's outcome: on a broken connection every op fails alike; when one op broke
  // the transaction, each op runs on its own, so its neighbours still succeed. Requires
  // `mutex`.
  void settle(std::span<StoreOp* const> part, const std::function<Pipelined()>& run_it) {
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

  // apply() on this connection. Requires `mutex`.
  void apply_all(std::span<StoreOp* const> ops) {
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

  // The channel as LISTEN names it (an identifier, quoted by hand: the listener's thread has
  // no connection yet to quote it with).
  std::string quoted_channel() const {
    std::string q = "\"";
    for (char ch : channel) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
    return q + "\"";
  }

  static bool wakes(const StoreOp& op) {
    return op.kind == StoreOp::Kind::complete || op.kind == StoreOp::Kind::release;
  }

  // The payload of the batch's NOTIFY: a JSON array of [tenant, operation, key] texts; empty
  // when no op wakes anyone (or notify is off).
  std::string notify_payload(std::span<StoreOp* const> ops) const {
    if (!options.notify) return {};
    nlohmann::json all = nlohmann::json::array();
    for (const StoreOp* op : ops) {
      if (wakes(*op))
        all.push_back(
            nlohmann::json::array({op->id->tenant, op->id->operation, op->id->key}).dump());
    }
    return all.empty() ? std::string() : all.dump();
  }

  // A notification reached the listener's thread.
  void notified(std::string_view payload, int sender) {
    if (own(sender)) return;  // our own commit
    const nlohmann::json j = nlohmann::json::parse(payload, nullptr, false);
    if (!j.is_array() || j.size() != 3 || !j[0].is_string() || !j[1].is_string() ||
        !j[2].is_string())
      return;  // not idem's: ignore
    const KeyId id{j[0].get<std::string>(), j[1].get<std::string>(), j[2].get<std::string>()};
    wakeups.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard lock(listeners_mutex);
    for (const auto& entry : listeners) entry.second(id);
  }

  // ---- multi-step operations ----

  std::optional<ProgressRow> load_progress(const KeyId& id) {
    Params p;
    p.id(id);
    Result r = run(kLoadProgress, p);
    if (PQntuples(r.get()) == 0) return std::nullopt;
    return read_progress(r.get());
  }

  bool write_progress(const KeyId& id, std::int64_t token, const Progress& progress,
                      const std::string* recovery_point) {
    Params p;
    p.id(id).integer(token).text(detail::progress_to_json(progress));
    if (recovery_point != nullptr) {
      p.text(*recovery_point);
    } else {
      p.null();
    }
    return changed(run(kSetProgress, p).get()) == 1;
  }
};

namespace {

// A local step's handle on the store's open transaction. Text-format results, decoded by
// type, so any column type comes back readable.
class PgLocal final : public LocalTransaction {
 public:
  PgLocal(pg::Session& session, std::string outbox_insert, const KeyId& id, std::int64_t origin,
          std::string_view step, std::int64_t now_db)
      : session_(session),
        outbox_insert_(std::move(outbox_insert)),
        id_(id),
        origin_(origin),
        step_(step),
        now_db_(now_db) {}

  Dialect dialect() const noexcept override { return Dialect::postgresql; }

  std::vector<Row> execute(std::string_view sql, std::initializer_list<Value> params) override {
    Params p;
    for (const Value& v : params) {
      if (std::holds_alternative<std::nullptr_t>(v)) {
        p.null();
      } else if (const auto* n = std::get_if<std::int64_t>(&v)) {
        p.integer(*n);
      } else if (const auto* d = std::get_if<double>(&v)) {
        p.real(*d);
      } else {
        p.bytes(std::get<std::string>(v));
      }
    }
    const std::string text(sql);
    Result r =
        session_.exec_params(text.c_str(), p.count(), p.values(), p.lengths(), p.formats(), 0);
    const ExecStatusType status = PQresultStatus(r.get());
    if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) {
      throw pg_error("a local step's statement", r.get(), session_.get());
    }
    // As sqlite3_changes(): rows the last INSERT, UPDATE or DELETE changed (PQcmdTuples also
    // counts the rows of a SELECT, which leaves the count as it was).
    const std::string_view command = PQcmdStatus(r.get());
    if (std::any_of(pg_sql::kWriteCommandTags.begin(), pg_sql::kWriteCommandTags.end(),
                    [&](std::string_view tag) { return command.starts_with(tag); })) {
      const char* n = PQcmdTuples(r.get());
      changes_ = n != nullptr && *n != '\0' ? std::stoll(n) : 0;
    }
    std::vector<Row> rows;
    for (int row = 0; row < PQntuples(r.get()); ++row) {
      Row out;
      for (int col = 0; col < PQnfields(r.get()); ++col) out.push_back(value(r.get(), row, col));
      rows.push_back(std::move(out));
    }
    return rows;
  }

  std::int64_t changes() const override { return changes_; }

  std::string enqueue(std::string_view topic, std::string_view payload) override {
    std::string id = outbox_message_id(id_, origin_, step_, sent_++);
    Params p;
    p.text(id).text(topic).bytes(payload).text(short_hash(id_)).integer(now_db_);
    Result r = session_.exec_prepared(outbox_insert_.c_str(), p.count(), p.values(), p.lengths(),
                                      p.formats(), 1);
    if (PQresultStatus(r.get()) != PGRES_COMMAND_OK)
      throw pg_error("queueing a message", r.get(), session_.get());
    return id;
  }

 private:
  static Value value(const PGresult* r, int row, int col) {
    if (PQgetisnull(r, row, col)) return nullptr;
    const char* text = PQgetvalue(r, row, col);
    switch (PQftype(r, col)) {
      case kInt2Oid:
      case kInt4Oid:
      case kInt8Oid:
        return std::int64_t{std::stoll(text)};
      case kFloat4Oid:
      case kFloat8Oid:
        return std::stod(text);
      case kBoolOid:
        return std::int64_t{text[0] == 't' ? 1 : 0};
      case kByteaOid: {
        std::size_t n = 0;
        unsigned char* raw = PQunescapeBytea(reinterpret_cast<const unsigned char*>(text), &n);
        if (raw == nullptr) throw StoreError("postgresql: a bytea column does not decode", 0);
        std::string out(reinterpret_cast<const char*>(raw), n);
        PQfreemem(raw);
        return out;
      }
      default:
        return std::string(text, static_cast<std::size_t>(PQgetlength(r, row, col)));
    }
  }

  pg::Session& session_;
  std::string outbox_insert_;  // the prepared statement's name
  const KeyId& id_;
  std::int64_t origin_;
  std::string_view step_;
  std::int64_t now_db_;
  std::size_t sent_ = 0;
  std::int64_t changes_ = 0;
};

}  // namespace

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
    if (!done_) s_.drop("a batch was abandoned before its results came");
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
      s_.session.close();  // stalled: the next use waits out the backoff first
      s_.next_attempt = SteadyClock::now() + s_.backoff;
      s_.last_failure = "a batch's results did not come in time";
    } else {
      s_.drop("the wait for a batch's results failed");
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
        deadline_ = s_.session.reply_deadline();
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
  Impl::Incoming in_;
  std::chrono::steady_clock::time_point deadline_ = std::chrono::steady_clock::time_point::max();
  bool done_ = false;
};

}  // namespace detail

PgStore::PgStore(const std::string& conninfo, PgOptions options)
    : impl_(std::make_unique<Impl>(conninfo, std::move(options))) {}

PgStore::~PgStore() = default;

int PgStore::schema_version() noexcept { return static_cast<int>(pg_sql::kMigrations.size()); }

PgStore::Stats PgStore::stats() const {
  Stats out;
  const auto add = [&out](const Impl& d) {
    out.transactions += d.transactions.load(std::memory_order_relaxed);
    out.ops += d.committed_ops.load(std::memory_order_relaxed);
    out.round_trips += d.round_trips.load(std::memory_order_relaxed);
    out.connects += d.connects.load(std::memory_order_relaxed);
    out.notify_batches += d.notify_batches.load(std::memory_order_relaxed);
  };
  add(*impl_);
  for (const auto& s : impl_->batch) add(*s);
  add(*impl_->upkeep);
  out.async_batches = impl_->started.load(std::memory_order_relaxed);
  out.most_batches_in_flight = impl_->most_in_flight.load(std::memory_order_relaxed);
  out.wakeups = impl_->wakeups.load(std::memory_order_relaxed);
  out.listens = impl_->listens.load(std::memory_order_relaxed);
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
  return std::chrono::milliseconds(impl_->offset.load(std::memory_order_relaxed));
}

void PgStore::apply(std::span<StoreOp* const> ops) {
  if (ops.empty()) return;
  Impl& d = *impl_;
  // A free batch connection, or else the main one, waiting for it.
  Impl* s = d.try_batch();
  std::unique_lock<detail::FairMutex> lock;
  if (s == nullptr) {
    s = &d;
    lock = std::unique_lock(d.mutex);
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
    p.id(id).integer(token).integer(d.shift().to_db(lease_until));
    return Impl::changed(d.run(kRenew, p).get()) == 1;
  });
}

bool PgStore::set_recovery_point(const KeyId& id, std::int64_t token, const std::string& point) {
  Impl& d = *impl_;
  return d.locked([&] {
    Params p;
    p.id(id).integer(token).text(point);
    return Impl::changed(d.run(kSetRecoveryPoint, p).get()) == 1;
  });
}

std::optional<Record> PgStore::load(const KeyId& id) {
  Impl& d = *impl_;
  return d.locked([&]() -> std::optional<Record> {
    Params p;
    p.id(id);
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
    return static_cast<std::size_t>(Impl::changed(d.run(kPurge, p).get()));
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
      const KeyId id{std::string(bytes_at(r.get(), row, 0)), std::string(bytes_at(r.get(), row, 1)),
                     std::string(bytes_at(r.get(), row, 2))};
      out.push_back({short_hash(id), id.operation, int_at(r.get(), row, 3),
                     sh.from_db(int_at(r.get(), row, 4))});
    }
    return out;
  });
}

std::optional<Progress> PgStore::begin_steps(const KeyId& id, std::int64_t token,
                                             const std::string& request) {
  Impl& d = *impl_;
  return d.locked([&]() -> std::optional<Progress> {
    Params p;
    p.id(id).integer(token).bytes(request);
    Result r = d.run(kBeginSteps, p);
    if (PQntuples(r.get()) == 0) return std::nullopt;
    ProgressRow row = read_progress(r.get());
    if (row.progress) return std::move(row.progress);
    Progress fresh;  // nothing happened yet: this attempt is the operation's origin
    fresh.origin = token;
    fresh.request = request;
    return fresh;
  });
}

bool PgStore::mark_pending(const KeyId& id, std::int64_t token, std::int64_t origin,
                           const std::string& step, const LeaseCheck& lease) {
  Impl& d = *impl_;
  return d.locked([&] {
    Impl::Transaction t(d);
    std::optional<ProgressRow> row = d.load_progress(id);
    if (!row || row->token != token || row->state != State::in_progress) return false;
    Params p;
    p.id(id).integer(token).text(
        detail::progress_to_json(detail::with_pending(std::move(row->progress), origin, step)));
    // On the database's clock, the lease is judged (and renewed) when the statement runs.
    if (d.options.clock == PgClock::database) {
      p.null();
    } else {
      p.integer(d.shift().to_db(lease.now));
    }
    p.integer((lease.needed - lease.now).count()).integer((lease.renew_to - lease.now).count());
    if (Impl::changed(d.run(kMarkPending, p).get()) != 1) return false;  // the lease ends too soon
    t.commit();
    return true;
  });
}

bool PgStore::commit_step(const KeyId& id, std::int64_t token, std::int64_t origin,
                          const StepCommit& step) {
  Impl& d = *impl_;
  return d.locked([&] {
    Impl::Transaction t(d);
    std::optional<ProgressRow> row = d.load_progress(id);
    if (!row || row->token != token || row->state != State::in_progress)
      return false;  // a zombie: nothing of its step runs
    if (step.local) {
      PgLocal local(d.session, statement_name(kOutboxInsert), id, origin, step.result.step,
                    d.shift().to_db(step.now));
      step.local(local);
    }
    const Progress p = detail::with_step(std::move(row->progress), origin, step.result);
    if (!d.write_progress(id, token, p, &step.result.step))
      throw StoreError("postgresql: commit_step: record changed inside its transaction", 0);
    t.commit();
    return true;
  });
}

std::vector<AbandonedOperation> PgStore::abandoned(TimePoint idle_before, TimePoint now,
                                                   std::size_t limit,
                                                   std::span<const std::string> operations) {
  nlohmann::json names = nlohmann::json::array();
  for (const std::string& op : operations) names.push_back(op);
  Impl& d = *impl_->upkeep;
  return d.locked([&] {
    const Shift sh = d.shift();
    Params p;
    p.integer(sh.to_db(idle_before))
        .integer(sh.to_db(now))
        .integer(static_cast<std::int64_t>(limit))
        .text(names.dump());
    Result r = d.run(kAbandoned, p);
    std::vector<AbandonedOperation> out;
    for (int row = 0; row < PQntuples(r.get()); ++row) {
      AbandonedOperation a;
      a.id = KeyId{std::string(bytes_at(r.get(), row, 0)), std::string(bytes_at(r.get(), row, 1)),
                   std::string(bytes_at(r.get(), row, 2))};
      const std::string_view fp = bytes_at(r.get(), row, 3);
      Fingerprint::Bytes bytes{};
      std::copy_n(fp.begin(), std::min(fp.size(), bytes.size()), bytes.begin());
      a.fingerprint = Fingerprint(bytes);
      a.state = static_cast<State>(int_at(r.get(), row, 4));
      a.request = std::string(bytes_at(r.get(), row, 5));
      out.push_back(std::move(a));
    }
    return out;
  });
}

std::vector<OutboxMessage> PgStore::claim_outbox(TimePoint now, TimePoint claim_until,
                                                 std::size_t limit) {
  Impl& d = *impl_->upkeep;
  std::vector<OutboxMessage> out = d.locked([&] {
    const Shift sh = d.shift();
    Params p;
    p.integer(sh.to_db(now))
        .integer(sh.to_db(claim_until))
        .integer(static_cast<std::int64_t>(limit));
    Result r = d.run(kOutboxClaim, p);
    std::vector<OutboxMessage> claimed;
    for (int row = 0; row < PQntuples(r.get()); ++row) {
      claimed.push_back(OutboxMessage{
          std::string(bytes_at(r.get(), row, 0)), std::string(bytes_at(r.get(), row, 1)),
          std::string(bytes_at(r.get(), row, 2)), static_cast<int>(int_at(r.get(), row, 3)),
          sh.from_db(int_at(r.get(), row, 4))});
    }
    return claimed;
  });
  std::stable_sort(out.begin(), out.end(), [](const OutboxMessage& a, const OutboxMessage& b) {
    return a.created_at < b.created_at;
  });
  return out;
}

bool PgStore::outbox_delivered(const std::string& id, TimePoint now) {
  Impl& d = *impl_->upkeep;
  return d.locked([&] {
    Params p;
    p.text(id).integer(d.shift().to_db(now));
    return Impl::changed(d.run(kOutboxDelivered, p).get()) == 1;
  });
}

void PgStore::outbox_failed(const std::string& id, TimePoint retry_at, bool park,
                            const std::string& why) {
  Impl& d = *impl_->upkeep;
  d.locked([&] {
    Params p;
    p.text(id).integer(d.shift().to_db(retry_at)).integer(park ? 1 : 0).text(valid_utf8(why));
    d.run(kOutboxFailed, p);
  });
}

OutboxCounts PgStore::outbox_counts() {
  Impl& d = *impl_->upkeep;
  return d.locked([&] {
    Params none;
    Result r = d.run(kOutboxCounts, none);
    OutboxCounts c;
    for (int row = 0; row < PQntuples(r.get()); ++row) {
      detail::add_outbox_count(c, int_at(r.get(), row, 0),
                               static_cast<std::size_t>(int_at(r.get(), row, 1)));
    }
    return c;
  });
}

std::size_t PgStore::purge_outbox(TimePoint delivered_before, std::size_t limit) {
  Impl& d = *impl_->upkeep;
  return d.locked([&] {
    Params p;
    p.integer(d.shift().to_db(delivered_before)).integer(static_cast<std::int64_t>(limit));
    return static_cast<std::size_t>(Impl::changed(d.run(kOutboxPurge, p).get()));
  });
}

// ---- migrate_sqlite_to_pg's writes ----

namespace detail {
namespace {

void optional_text(Params& p, const std::optional<std::string>& v) {
  if (v) {
    p.text(*v);
  } else {
    p.null();
  }
}

}  // namespace

std::vector<PgImport::Outcome> PgImport::records(PgStore& store, std::span<const RecordRow> rows) {
  PgStore::Impl& d = *store.impl_;
  return d.locked([&] {
    const Shift sh = d.shift();
    const std::int64_t slack = d.options.clock == PgClock::caller ? 0 : kImportClockSlack.count();
    std::vector<Outcome> out;
    out.reserve(rows.size());
    PgStore::Impl::Transaction t(d);
    for (const RecordRow& row : rows) {
      Params p;
      p.id(row.id)
          .bytes(row.fingerprint)
          .integer(row.state)
          .integer(row.token)
          .integer(sh.to_db(row.lease_until))
          .integer(sh.to_db(row.created_at))
          .integer(sh.to_db(row.expires_at));
      if (row.status) {
        p.integer(*row.status);
      } else {
        p.null();
      }
      optional_text(p, row.headers);
      optional_text(p, row.body);
      optional_text(p, row.body_ref);
      optional_text(p, row.recovery_point);
      optional_text(p, row.progress);
      optional_text(p, row.request);
      p.integer(slack).integer(row.refresh_only ? 1 : 0);
      if (row.claim) {
        p.integer(*row.claim);
      } else {
        p.null();
      }
      Result r = d.run(kImportRecord, p);
      if (PQntuples(r.get()) != 1) throw StoreError("postgresql: an import returned no row", 0);
      if (int_at(r.get(), 0, 0) == 1) {
        out.push_back(Outcome::written);
      } else if (is_null(r.get(), 0, 1)) {
        out.push_back(Outcome::absent);
      } else {
        out.push_back(int_at(r.get(), 0, 1) > row.token ? Outcome::newer : Outcome::unchanged);
      }
    }
    t.commit();
    return out;
  });
}

std::vector<bool> PgImport::messages(PgStore& store, std::span<const MessageRow> rows) {
  PgStore::Impl& d = *store.impl_;
  return d.locked([&] {
    const Shift sh = d.shift();
    std::vector<bool> out;
    out.reserve(rows.size());
    PgStore::Impl::Transaction t(d);
    for (const MessageRow& row : rows) {
      Params p;
      p.text(row.id)
          .text(row.topic)
          .bytes(row.payload)
          .text(row.key_hash)
          .integer(row.state)
          .integer(row.attempts)
          .integer(sh.to_db(row.next_at))
          .integer(sh.to_db(row.created_at));
      if (row.last_error) {
        p.text(valid_utf8(*row.last_error));
      } else {
        p.null();
      }
      out.push_back(PgStore::Impl::changed(d.run(kImportMessage, p).get()) == 1);
    }
    t.commit();
    return out;
  });
}

}  // namespace detail

}  // namespace idem
