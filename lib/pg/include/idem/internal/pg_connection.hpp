// idem's PostgreSQL connection as a store uses it: a Session (pg.hpp) that reconnects with a
// backoff, prepares its statements on every new connection, sends parameters in binary, reads
// binary results, runs transactions and pipelines, and measures the server's clock. PgStore
// keeps one per connection (its main one, its batch connections, its upkeep one) and maps the
// store interface onto SQL; what a connection does on the wire lives here.
//
// Internal (idem::pg_internal): not part of idem's public API; the header is not installed.
#pragma once

#include <libpq-fe.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/errors.hpp"
#include "idem/internal/pg.hpp"

namespace idem::pg {

// PostgreSQL's type OIDs (pg_type.dat) of the columns decoded here.
constexpr Oid kBoolOid = 16, kByteaOid = 17, kInt8Oid = 20, kInt2Oid = 21, kInt4Oid = 23,
              kFloat4Oid = 700, kFloat8Oid = 701;

// A statement's parameters: integers as text, strings as raw bytes (binary format, so a text
// or bytea column takes them unescaped), NULL. Their bytes are copied into one buffer, each
// followed by a NUL, so a statement's parameters cost a few allocations whatever their number.
// (A string per parameter cost a PgStore call of one caller 5,000 of its 41,700 instructions
// in the client, callgrind, 2026-12-05.)
class Params {
 public:
  Params() {
    bytes_.reserve(kBytes);
    slots_.reserve(kSlots);
    formats_.reserve(kSlots);
  }
  Params& integer(std::int64_t v);
  Params& text(std::string_view v) {
    add(v, 1);
    return *this;
  }
  Params& bytes(std::string_view v) { return text(v); }
  Params& real(double v);
  Params& null() {
    slots_.push_back(Slot{.null = true});
    formats_.push_back(0);
    return *this;
  }
  // `v` as text, or NULL when it is empty.
  Params& text_or_null(std::string_view v) { return v.empty() ? null() : text(v); }

  // The arrays libpq takes, valid while this object is neither changed nor destroyed. (Either
  // may be called first: a call's arguments are evaluated in any order.)
  int count() const { return static_cast<int>(slots_.size()); }
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
  static constexpr std::size_t kBytes = 256, kSlots = 16;  // most statements fit
  struct Slot {
    std::size_t offset = 0;  // in bytes_
    int length = 0;
    bool null = false;
  };
  void build();
  void add(std::string_view v, int format);
  std::string bytes_;  // every value's bytes, one after another
  std::vector<Slot> slots_;
  std::vector<int> formats_;
  std::vector<const char*> pointers_;  // built from bytes_ once the values are in
  std::vector<int> lengths_;
};

// Reading binary-format results.
inline bool is_null(const PGresult* r, int row, int col) { return PQgetisnull(r, row, col) != 0; }
inline std::string_view bytes_at(const PGresult* r, int row, int col) {
  return {PQgetvalue(r, row, col), static_cast<std::size_t>(PQgetlength(r, row, col))};
}
// An integer column (int2, int4, int8 or bool). Throws CorruptRecordError for another type or
// a value of the wrong size.
std::int64_t int_at(const PGresult* r, int row, int col);
// Rows the command changed (PQcmdTuples), 0 when it says none.
std::int64_t changed(const PGresult* r);

// The offset between the server's clock and this machine's, shared by the connections of
// one store: the first measures it, the others use it until it is older than `refresh`.
class ClockOffset {
 public:
  std::int64_t ms() const noexcept { return offset_.load(std::memory_order_relaxed); }
  bool stale(std::chrono::milliseconds refresh) const noexcept;
  // The server said `server_ms` between the local readings `before_ms` and `after_ms`: the
  // offset is taken from the midpoint of that round trip.
  void measured(std::int64_t server_ms, std::int64_t before_ms, std::int64_t after_ms) noexcept;

 private:
  std::atomic<SteadyClock::rep> at_{0};  // when it was measured (SteadyClock ticks); 0: never
  std::atomic<std::int64_t> offset_{0};  // the server's clock minus this machine's, in ms
};

// The results of one pipeline as they arrive: `commands` commands, each followed by a null,
// then the sync.
struct Pipeline {
  std::size_t commands = 0;
  std::vector<Result> results;
  bool ok = true;  // every command succeeded
  bool synced = false;

  // Takes every result that has arrived, without blocking for more. Returns false if the
  // connection broke (or answered out of turn).
  bool take(PGconn* c);
};

struct ConnectionOptions {
  Parameters parameters;
  // The backoff after a failed connection attempt: from `reconnect_min`, doubling up to
  // `reconnect_max`; back to the minimum once a connection is made.
  std::chrono::milliseconds reconnect_min{100};
  std::chrono::milliseconds reconnect_max{5000};
};

// A connection that comes back. Thread-safety: none (its owner keeps it behind a lock).
class Connection {
 public:
  // Runs on every new connection before it is used (settings, prepared statements); what it
  // throws fails the attempt like a connection that could not be made.
  using OnConnect = std::function<void(Connection&)>;

  Connection(ConnectionOptions options, OnConnect on_connect);

  Session& session() noexcept { return session_; }
  PGconn* get() const noexcept { return session_.get(); }
  bool connected() const noexcept { return session_.connected(); }

  // A usable connection: reconnects (at most once per backoff) if it was lost. Returns true
  // when it connected just now. Throws StoreError while the backoff runs ("not connected
  // (why); reconnecting") or when the attempt fails.
  bool ensure();

  // The connection is gone (closed here or by the session); the next use reconnects. A server
  // that stopped answering gets a backoff first, so the calls queued behind this one fail at
  // once instead of each waiting out a connect timeout; one that closed the connection is
  // tried again at once.
  void lost(std::string why);
  void drop(std::string why);
  // Closes a connection whose replies did not come in time: the next use waits out the
  // backoff first.
  void drop_stalled(std::string why) noexcept;

  // The StoreError for a failed result; drops the connection if it broke.
  StoreError failure(std::string_view what, const PGresult* r);
  // A StoreError for a pipeline that broke on its way; drops the connection.
  [[noreturn]] void broken(std::string_view what);
  // A StoreError for replies that did not come in time; drops the connection as stalled.
  [[noreturn]] void stalled(std::string_view what);

  // A statement without parameters that must succeed (BEGIN, COMMIT, SET ...).
  void simple(const std::string& sql);
  // Prepares `text` under `name`.
  void prepare(const std::string& name, const std::string& text);
  // Runs a prepared statement; binary results. Throws failure() for a result that failed.
  Result run(const std::string& name, Params& p);
  // Rolls the open transaction back; a failure to do so (the connection broke or stopped
  // answering) has closed the connection, which ends the transaction on the server too.
  void rollback() noexcept;

  // BEGIN now, ROLLBACK unless commit() ran (a failed statement aborts the transaction).
  class Transaction {
   public:
    explicit Transaction(Connection& c);
    ~Transaction();
    Transaction(const Transaction&) = delete;
    Transaction& operator=(const Transaction&) = delete;
    void commit();

   private:
    Connection& c_;
    bool done_ = false;
  };

  // What this connection did: round trips, connections made, transactions committed.
  std::atomic<std::uint64_t> round_trips{0}, connects{0}, transactions{0};

 private:
  ConnectionOptions options_;
  OnConnect on_connect_;
  Session session_;
  std::chrono::milliseconds backoff_;
  SteadyClock::time_point next_attempt_{};
  std::string last_failure_ = "not connected yet";
};

}  // namespace idem::pg
