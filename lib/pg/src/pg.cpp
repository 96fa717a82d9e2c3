#include "idem/internal/pg.hpp"

#include <fmt/format.h>
#include <poll.h>

#include <cerrno>
#include <vector>

#include "idem/errors.hpp"

namespace idem::pg {
namespace {

void ignore_notice(void*, const char*) {}

// Milliseconds left until `deadline` for poll(2), rounded up; 0 once it passed.
int poll_timeout(Deadline deadline) {
  const auto left = deadline - SteadyClock::now();
  if (left <= SteadyClock::duration::zero()) return 0;
  return static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(left).count());
}

// The `options` keyword of `conninfo`, or "". Throws StoreError if it does not parse.
std::string options_of(const std::string& conninfo) {
  char* error = nullptr;
  PQconninfoOption* all = PQconninfoParse(conninfo.c_str(), &error);
  if (all == nullptr) {
    const std::string why = error != nullptr ? error : "out of memory";
    PQfreemem(error);
    throw StoreError(fmt::format("postgresql: the connection string does not parse: {}", why), 0);
  }
  std::string options;
  for (const PQconninfoOption* o = all; o->keyword != nullptr; ++o) {
    if (std::string_view(o->keyword) == "options" && o->val != nullptr) options = o->val;
  }
  PQconninfoFree(all);
  return options;
}

}  // namespace

std::string describe(std::string_view what, const PGresult* r, PGconn* c) {
  const char* state = r != nullptr ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : nullptr;
  std::string message = r != nullptr ? PQresultErrorMessage(r) : "";
  if (message.empty() && c != nullptr) message = PQerrorMessage(c);
  while (!message.empty() && (message.back() == '\n' || message.back() == ' ')) message.pop_back();
  return fmt::format("postgresql: {}: {}{}", what, state ? fmt::format("[{}] ", state) : "",
                     message);
}

Session::~Session() { close(); }

void Session::close() noexcept {
  if (conn_ != nullptr) PQfinish(conn_);
  conn_ = nullptr;
}

void Session::open(const Parameters& p) {
  close();
  timeouts_ = p.timeouts;
  timed_out_ = false;
  const Deadline deadline = SteadyClock::now() + timeouts_.connect;
  const auto ms = [](std::chrono::milliseconds d) { return std::to_string(d.count()); };
  const std::chrono::milliseconds user_timeout = timeouts_.reply() + std::chrono::seconds(5);
  // The server's side: its keepalives, how long its unacknowledged sends may wait, and how long
  // a session may sit idle inside a transaction (a client gone mid-transaction holds row locks).
  std::string server = fmt::format(
      "-c tcp_keepalives_idle=5 -c tcp_keepalives_interval=2 -c tcp_keepalives_count=3 "
      "-c tcp_user_timeout={} -c idle_in_transaction_session_timeout={}",
      user_timeout.count(), user_timeout.count());
  if (const std::string own = options_of(p.conninfo); !own.empty()) server += " " + own;
  const std::string connect_seconds =
      std::to_string(std::max<long long>(1, (timeouts_.connect.count() + 999) / 1000));
  const std::string tcp_user_timeout = ms(user_timeout);
  // Keywords are applied in order, so the conninfo (expanded from dbname) overrides the
  // defaults before it, and the merged options after it carry the conninfo's own last.
  const char* keywords[] = {"connect_timeout",
                            "keepalives_idle",
                            "keepalives_interval",
                            "keepalives_count",
                            "tcp_user_timeout",
                            "dbname",
                            "options",
                            nullptr};
  const char* values[] = {
      connect_seconds.c_str(), "5",    "2", "3", tcp_user_timeout.c_str(), p.conninfo.c_str(),
      server.c_str(),          nullptr};
  conn_ = PQconnectStartParams(keywords, values, 1);
  if (conn_ == nullptr) throw StoreError("postgresql: cannot connect: out of memory", 0);
  // libpq does not keep connect_timeout for a connection driven by PQconnectPoll: the deadline
  // is this loop's.
  PostgresPollingStatusType polling = PGRES_POLLING_WRITING;
  while (PQstatus(conn_) != CONNECTION_BAD && polling != PGRES_POLLING_OK &&
         polling != PGRES_POLLING_FAILED) {
    const short events = polling == PGRES_POLLING_READING ? POLLIN : POLLOUT;
    if (!wait(events, deadline)) {
      close();
      timed_out_ = true;
      throw StoreError(fmt::format("postgresql: cannot connect: no answer within {} ms",
                                   timeouts_.connect.count()),
                       0);
    }
    polling = PQconnectPoll(conn_);
  }
  if (PQstatus(conn_) != CONNECTION_OK) {
    const std::string why = PQerrorMessage(conn_);
    close();
    throw StoreError(fmt::format("postgresql: cannot connect: {}", why), 0);
  }
  PQsetNoticeProcessor(conn_, ignore_notice, nullptr);
  // Sends never block: every wait for the socket is this session's, with a deadline.
  if (PQsetnonblocking(conn_, 1) != 0) fail("setting the connection non-blocking", false);
  const Result set = exec(fmt::format("SET statement_timeout = {}", timeouts_.statement.count()));
  if (PQresultStatus(set.get()) != PGRES_COMMAND_OK) {
    const std::string why = describe("SET statement_timeout", set.get(), conn_);
    close();
    throw StoreError(why, 0);
  }
}

bool Session::wait(short events, Deadline deadline) const {
  // poll(2) skips an entry whose descriptor is negative: without an interrupt, the socket alone.
  pollfd p[2] = {{PQsocket(conn_), events, 0}, {interrupt_, POLLIN, 0}};
  if (p[0].fd < 0) return true;  // no socket: libpq's next call reports the broken connection
  for (;;) {
    const int n = ::poll(p, 2, poll_timeout(deadline));
    if (n > 0) return p[1].revents == 0;
    if (n == 0) return false;
    if (errno != EINTR) return true;
  }
}

bool Session::flush(Deadline deadline) const {
  for (;;) {
    const int rc = PQflush(conn_);
    if (rc == 0) return true;
    if (rc < 0) return false;
    // libpq may need to read (the server's replies) before it can write more.
    if (!wait(POLLIN | POLLOUT, deadline)) return false;
    if (PQconsumeInput(conn_) == 0) return false;
  }
}

void Session::fail(std::string_view what, bool timed_out) {
  const std::string why =
      timed_out ? fmt::format(
                      "postgresql: {}: no reply within {} ms; the connection was dropped, "
                      "and whether the statement took effect is unknown",
                      what, timeouts_.reply().count())
                : describe(what, nullptr, conn_);
  close();
  timed_out_ = timed_out;
  throw StoreError(why, 0);
}

Result Session::finish(bool sent, std::string_view what) {
  if (conn_ == nullptr) throw StoreError(fmt::format("postgresql: {}: not connected", what), 0);
  if (!sent) fail(what, false);
  const Deadline deadline = reply_deadline();
  if (!flush(deadline)) fail(what, PQstatus(conn_) == CONNECTION_OK);
  Result last, failed;
  for (;;) {
    while (PQisBusy(conn_) != 0) {
      if (!wait(POLLIN, deadline)) fail(what, true);
      if (PQconsumeInput(conn_) == 0) fail(what, false);
    }
    Result r(PQgetResult(conn_));
    if (!r) break;
    const ExecStatusType status = PQresultStatus(r.get());
    if (!failed && status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK &&
        status != PGRES_EMPTY_QUERY) {
      failed = std::move(r);
    } else {
      last = std::move(r);
    }
  }
  if (failed) return failed;
  if (!last) fail(what, false);  // no result at all: the connection broke
  return last;
}

Result Session::exec(const std::string& sql) {
  const bool sent = conn_ != nullptr && PQsendQuery(conn_, sql.c_str()) == 1;
  return finish(sent, sql.substr(0, sql.find(' ')));
}

Result Session::exec_params(const char* sql, int n, const char* const* values, const int* lengths,
                            const int* formats, int result_format) {
  const bool sent = conn_ != nullptr && PQsendQueryParams(conn_, sql, n, nullptr, values, lengths,
                                                          formats, result_format) == 1;
  return finish(sent, "statement");
}

Result Session::exec_prepared(const char* name, int n, const char* const* values,
                              const int* lengths, const int* formats, int result_format) {
  const bool sent = conn_ != nullptr && PQsendQueryPrepared(conn_, name, n, values, lengths,
                                                            formats, result_format) == 1;
  return finish(sent, "statement");
}

Result Session::prepare(const char* name, const char* sql) {
  const bool sent = conn_ != nullptr && PQsendPrepare(conn_, name, sql, 0, nullptr) == 1;
  return finish(sent, "preparing statements");
}

}  // namespace idem::pg
