#include "idem/internal/pg_connection.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <type_traits>

#include "idem/internal/connection_sql.hpp"

namespace idem::pg {
namespace {

// A signed big-endian integer of v.size() bytes (2, 4 or 8).
template <class T>
std::int64_t big_endian(std::string_view v) {
  std::make_unsigned_t<T> u = 0;
  for (const char c : v)
    u = static_cast<std::make_unsigned_t<T>>((u << 8) | static_cast<unsigned char>(c));
  return static_cast<T>(u);
}

StoreError error_of(std::string_view what, const PGresult* r, PGconn* c) {
  return StoreError(describe(what, r, c), 0);
}

}  // namespace

// ---- Params and results

Params& Params::integer(std::int64_t v) {
  char digits[24];
  const auto end = std::to_chars(digits, digits + sizeof digits, v).ptr;
  add(std::string_view(digits, static_cast<std::size_t>(end - digits)), 0);
  return *this;
}

Params& Params::real(double v) {
  add(fmt::format("{}", v), 0);
  return *this;
}

void Params::add(std::string_view v, int format) {
  slots_.push_back(Slot{.offset = bytes_.size(), .length = static_cast<int>(v.size())});
  formats_.push_back(format);
  bytes_.append(v);
  bytes_.push_back('\0');  // libpq reads a text-format value up to its NUL, not its length
}

void Params::build() {
  if (pointers_.size() == slots_.size()) return;
  pointers_.clear();
  lengths_.clear();
  pointers_.reserve(slots_.size());
  lengths_.reserve(slots_.size());
  for (const Slot& s : slots_) {
    pointers_.push_back(s.null ? nullptr : bytes_.data() + s.offset);
    lengths_.push_back(s.length);
  }
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

std::int64_t changed(const PGresult* r) {
  const char* n = PQcmdTuples(const_cast<PGresult*>(r));
  return n != nullptr && *n != '\0' ? std::stoll(n) : 0;
}

// ---- ClockOffset

bool ClockOffset::stale(std::chrono::milliseconds refresh) const noexcept {
  const SteadyClock::rep at = at_.load(std::memory_order_relaxed);
  return at == 0 ||
         SteadyClock::now() - SteadyClock::time_point(SteadyClock::duration(at)) > refresh;
}

void ClockOffset::measured(std::int64_t server_ms, std::int64_t before_ms,
                           std::int64_t after_ms) noexcept {
  offset_.store(server_ms - (before_ms + (after_ms - before_ms) / 2), std::memory_order_relaxed);
  at_.store(SteadyClock::now().time_since_epoch().count(), std::memory_order_relaxed);
}

// ---- Pipeline

bool Pipeline::take(PGconn* c) {
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

// ---- Connection

Connection::Connection(ConnectionOptions options, OnConnect on_connect)
    : options_(std::move(options)),
      on_connect_(std::move(on_connect)),
      backoff_(options_.reconnect_min) {}

bool Connection::ensure() {
  if (session_.connected() && PQstatus(get()) == CONNECTION_BAD) drop(PQerrorMessage(get()));
  if (session_.connected()) return false;
  if (SteadyClock::now() < next_attempt_) {
    throw StoreError(fmt::format("postgresql: not connected ({}); reconnecting", last_failure_), 0);
  }
  try {
    session_.open(options_.parameters);
    connects.fetch_add(1, std::memory_order_relaxed);
    if (on_connect_) on_connect_(*this);
    backoff_ = options_.reconnect_min;
  } catch (const StoreError& e) {
    session_.close();
    last_failure_ = e.what();
    next_attempt_ = SteadyClock::now() + backoff_;
    backoff_ = std::min(backoff_ * 2, options_.reconnect_max);
    throw;
  }
  return true;
}

void Connection::lost(std::string why) {
  last_failure_ = std::move(why);
  next_attempt_ =
      SteadyClock::now() + (session_.timed_out() ? backoff_ : std::chrono::milliseconds(0));
}

void Connection::drop(std::string why) {
  session_.close();
  lost(std::move(why));
}

void Connection::drop_stalled(std::string why) noexcept {
  session_.close();
  next_attempt_ = SteadyClock::now() + backoff_;
  last_failure_ = std::move(why);
}

StoreError Connection::failure(std::string_view what, const PGresult* r) {
  StoreError e = error_of(what, r, get());
  if (session_.connected() && PQstatus(get()) != CONNECTION_OK) drop(e.what());
  return e;
}

void Connection::broken(std::string_view what) {
  StoreError e = error_of(what, nullptr, get());
  drop(e.what());
  throw e;
}

void Connection::stalled(std::string_view what) {
  StoreError e(fmt::format("postgresql: {}: no reply within {} ms; the connection was dropped, "
                           "and whether the batch committed is unknown",
                           what, session_.timeouts().reply().count()),
               0);
  drop_stalled(e.what());
  throw e;
}

void Connection::simple(const std::string& sql) {
  Result r = session_.exec(sql);
  round_trips.fetch_add(1, std::memory_order_relaxed);
  if (PQresultStatus(r.get()) != PGRES_COMMAND_OK && PQresultStatus(r.get()) != PGRES_TUPLES_OK)
    throw failure(sql.substr(0, sql.find(' ')), r.get());
}

void Connection::prepare(const std::string& name, const std::string& text) {
  Result r = session_.prepare(name.c_str(), text.c_str());
  round_trips.fetch_add(1, std::memory_order_relaxed);
  if (PQresultStatus(r.get()) != PGRES_COMMAND_OK) throw failure("preparing statements", r.get());
}

Result Connection::run(const std::string& name, Params& p) {
  Result r =
      session_.exec_prepared(name.c_str(), p.count(), p.values(), p.lengths(), p.formats(), 1);
  round_trips.fetch_add(1, std::memory_order_relaxed);
  const ExecStatusType status = PQresultStatus(r.get());
  if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) throw failure("statement", r.get());
  return r;
}

void Connection::rollback() noexcept {
  try {
    session_.exec(sql::kRollback);
  } catch (const StoreError& e) {
    lost(e.what());
  }
}

Connection::Transaction::Transaction(Connection& c) : c_(c) { c_.simple(sql::kBegin); }

Connection::Transaction::~Transaction() {
  if (!done_ && c_.connected()) c_.rollback();
}

void Connection::Transaction::commit() {
  c_.simple(sql::kCommit);
  done_ = true;
  c_.transactions.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace idem::pg
