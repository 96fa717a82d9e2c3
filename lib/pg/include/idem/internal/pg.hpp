// idem's libpq session: one connection whose every wait has a deadline. Connecting, sending
// and waiting for a reply each end by themselves: a server that stops answering (a partition
// that drops every packet, a stuck pooler or a frozen backend that still acknowledges at the
// TCP level, where keepalives never fire) costs a caller Timeouts::reply() at most, after which
// the connection is dropped and the call is a StoreError, never a thread that waits forever.
//
// An internal target (idem::pg_internal), shared by PgStore, its listener and the demo's orders
// table; it is not part of idem's public API and its header is not installed.
#pragma once

#include <libpq-fe.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

namespace idem::pg {

using SteadyClock = std::chrono::steady_clock;
using Deadline = SteadyClock::time_point;

struct ResultDeleter {
  void operator()(PGresult* r) const noexcept { PQclear(r); }
};
using Result = std::unique_ptr<PGresult, ResultDeleter>;

// How long a session waits for the server.
struct Timeouts {
  // A whole connection's startup (TCP, authentication, the first settings). Default: 5 s.
  std::chrono::milliseconds connect{5000};
  // The server's statement_timeout, set on every connection: a statement the server runs (or
  // waits for a lock) longer is cancelled there. Default: 5 s.
  std::chrono::milliseconds statement{5000};
  // How much longer than `statement` the client waits for a reply before it gives up on the
  // connection (the server may need a moment to cancel; a reply may be on its way). Default: 1 s.
  std::chrono::milliseconds margin{1000};

  std::chrono::milliseconds reply() const { return statement + margin; }
};

// What Session::open connects with: `conninfo` is libpq's keywords or a URI.
struct Parameters {
  std::string conninfo;
  Timeouts timeouts;
};

// Thread-safety: none; a session belongs to its user (PgStore keeps each behind a lock).
class Session {
 public:
  Session() = default;
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Connects with `p` (closing any connection this session had), waiting at most
  // p.timeouts.connect in all, and sets statement_timeout. Under the conninfo's own values it
  // puts idem's, so that a server that vanishes is noticed by both ends: libpq's TCP
  // keepalives and tcp_user_timeout on this side; and, asked for in the startup packet
  // (options "-c ..."), the server's keepalives, tcp_user_timeout and
  // idle_in_transaction_session_timeout, so that a partitioned client's session, and the row
  // locks of a transaction it left open, do not outlive it by the OS default of hours. The
  // conninfo's values win, and its own `options` follow idem's (so its "-c" settings win too).
  // The connection is non-blocking: every wait is this session's, with a deadline. Throws
  // StoreError ("postgresql: cannot connect: ...", or a conninfo that does not parse) and then
  // has no connection.
  void open(const Parameters& p);
  // Closes the connection, if any.
  void close() noexcept;
  bool connected() const noexcept { return conn_ != nullptr; }
  // A descriptor that, once readable, ends every wait of this session as its deadline would
  // (connecting or a statement then fails with StoreError and the connection is closed): for
  // a thread that must stop at once whatever the server does. The caller owns it and keeps it
  // open while the session may wait. -1 (the default): none.
  void interrupt_on(int fd) noexcept { interrupt_ = fd; }
  // The connection (null when there is none): for libpq calls that do not wait.
  PGconn* get() const noexcept { return conn_; }
  const Timeouts& timeouts() const noexcept { return timeouts_; }

  // A statement and its reply, waiting at most timeouts().reply(). Returns the last result
  // (or the first that failed), whatever its status: the caller judges it. Throws StoreError
  // when the connection broke (the connection is then closed), or when no reply came in time:
  // the connection is closed, and whether the statement took effect is unknown (`timed_out()`
  // is then true until the next open()).
  Result exec(const std::string& sql);
  Result exec_params(const char* sql, int n, const char* const* values, const int* lengths,
                     const int* formats, int result_format);
  Result exec_prepared(const char* name, int n, const char* const* values, const int* lengths,
                       const int* formats, int result_format);
  Result prepare(const char* name, const char* sql);

  // For pipelines and other waits of the caller's own: waits until the socket is ready for
  // `events` (POLLIN, POLLOUT) or `deadline` passes. True when ready (or the socket failed:
  // libpq's next call tells); false at the deadline.
  bool wait(short events, Deadline deadline) const;  // false as well once interrupted
  // Sends what libpq has buffered, waiting for room until `deadline`. False if it could not
  // (the deadline passed, or the connection broke).
  bool flush(Deadline deadline) const;
  // A deadline timeouts().reply() from now.
  Deadline reply_deadline() const { return SteadyClock::now() + timeouts_.reply(); }

  // Whether the last failure was a wait that ran out (the server may be alive but stalled).
  bool timed_out() const noexcept { return timed_out_; }

 private:
  // After a PQsend* call that returned `sent`: flushes, then takes results until the command
  // is done. Throws as exec().
  Result finish(bool sent, std::string_view what);
  [[noreturn]] void fail(std::string_view what, bool timed_out);

  PGconn* conn_ = nullptr;
  Timeouts timeouts_;
  bool timed_out_ = false;
  int interrupt_ = -1;
};

// "postgresql: <what>: [SQLSTATE] <message>" from a failed result, or from the connection's
// last error when `r` is null.
std::string describe(std::string_view what, const PGresult* r, PGconn* c);

}  // namespace idem::pg
