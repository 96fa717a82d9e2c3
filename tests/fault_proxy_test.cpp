// FaultProxy (fault_proxy.hpp): each fault it injects (a stall, a cut, a lost reply) as a libpq
// client sees it, against the real PostgreSQL IDEM_TEST_PG names, with the server checked on a
// direct connection; and its parsers and plumbing on their own. Every wait is bounded (poll() on
// libpq's socket): "nothing arrived" is kSilence of silence, "it arrives" is at most kPatience;
// both are failure bounds, never speed measurements, and no test sleeps to synchronise.
#include <doctest/doctest.h>
#include <libpq-fe.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fault_proxy.hpp"

using namespace std::chrono_literals;
using idem::test::FaultProxy;

namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;
using Fd = idem::test::fault_proxy_detail::Fd;

// How long a test waits for what must not come, and at most for what must come.
constexpr Millis kSilence = 300ms;
constexpr Millis kPatience = 5000ms;

// The server's conninfo (IDEM_TEST_PG), or "" when it is not set: the test is then skipped with
// a message, or fails when IDEM_REQUIRE_PG says the run must cover PostgreSQL.
std::string server_conninfo() {
  const char* conninfo = std::getenv("IDEM_TEST_PG");
  if (conninfo != nullptr && *conninfo != '\0') return conninfo;
  if (std::getenv("IDEM_REQUIRE_PG") != nullptr) {
    FAIL("IDEM_TEST_PG is not set: scripts/test starts a throwaway PostgreSQL and sets it");
  }
  MESSAGE("IDEM_TEST_PG is not set: the fault proxy's PostgreSQL tests are skipped");
  return "";
}

// The first line of a test that needs the server: `name` is its conninfo.
#define FAULT_PROXY_SERVER_OR_SKIP(name)      \
  const std::string name = server_conninfo(); \
  if (name.empty()) return

// The proxy target for the server `conninfo` names: its Unix socket.
std::string unix_target(const std::string& conninfo) {
  return "unix:" + idem::test::pg_socket_path(conninfo);
}

// `server`'s conninfo, through the proxy listening on `port` (libpq: the last host= and port=
// win), with SSL negotiated as `sslmode` says and no GSS encryption.
std::string through(const std::string& server, std::uint16_t port,
                    const std::string& sslmode = "disable") {
  return server + " host=127.0.0.1 port=" + std::to_string(port) + " sslmode=" + sslmode +
         " gssencmode=disable connect_timeout=10";
}

// Milliseconds left until `deadline` (0 once it passed).
int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
  return left > 0 ? static_cast<int>(left) : 0;
}

// Polls `fd` for `events` at most `timeout`; returns its revents (0: nothing came).
short wait_fd(int fd, short events, Millis timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  while (true) {
    pollfd p{fd, events, 0};
    const int ready = ::poll(&p, 1, remaining_ms(deadline));
    if (ready > 0) return p.revents;
    if (ready == 0 || errno != EINTR || remaining_ms(deadline) == 0) return 0;
  }
}

struct ConnCloser {
  void operator()(PGconn* c) const { PQfinish(c); }
};
using Conn = std::unique_ptr<PGconn, ConnCloser>;

// Polls libpq's socket for `events` at most `timeout`; returns its revents (0: nothing came, or
// there is no socket).
short wait_socket(PGconn* c, short events, Millis timeout) {
  const int fd = PQsocket(c);
  return fd < 0 ? short{0} : wait_fd(fd, events, timeout);
}

// A connection to `conninfo` (REQUIREd to succeed; connect_timeout bounds it).
Conn connect(const std::string& conninfo) {
  Conn c(PQconnectdb(conninfo.c_str()));
  REQUIRE(c != nullptr);
  REQUIRE_MESSAGE(PQstatus(c.get()) == CONNECTION_OK, PQerrorMessage(c.get()));
  return c;
}

// Drives a PQconnectStart() connection from `status` for `timeout` at most; returns where it
// got: PGRES_POLLING_OK or _FAILED when it finished, _READING or _WRITING when time ran out.
PostgresPollingStatusType drive(PGconn* c, PostgresPollingStatusType status, Millis timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  while (status == PGRES_POLLING_READING || status == PGRES_POLLING_WRITING) {
    const short events = status == PGRES_POLLING_READING ? POLLIN : POLLOUT;
    if (wait_socket(c, events, Millis(remaining_ms(deadline))) == 0) {
      if (remaining_ms(deadline) == 0) return status;
      continue;
    }
    status = PQconnectPoll(c);
  }
  return status;
}

// One result of a query, as libpq gave it.
struct Result {
  ExecStatusType status;
  std::string tag;    // PQcmdStatus: "COMMIT", "SELECT 1", ...
  std::string value;  // first column of the first row ("" when no row)
  std::string error;
};

// What came back for a query within a bounded wait.
struct Answer {
  bool complete = false;  // every result arrived (PQgetResult gave null), or the connection ended
  bool connection_bad = false;  // the connection ended
  std::vector<Result> results;
};

// Sends `sql` without waiting for its answer.
void send_query(PGconn* c, const std::string& sql) {
  REQUIRE_MESSAGE(PQsendQuery(c, sql.c_str()) == 1, PQerrorMessage(c));
}

// Collects the results of what was sent, waiting `timeout` at most for them.
Answer collect(PGconn* c, Millis timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  Answer answer;
  while (true) {
    const bool bad = PQstatus(c) == CONNECTION_BAD;
    // Every result that is in (on a bad connection PQgetResult does not wait: it gives the
    // error, then null).
    for (int k = 0; k < 1000 && (bad || PQisBusy(c) == 0); ++k) {
      PGresult* r = PQgetResult(c);
      if (r == nullptr) {
        answer.complete = true;
        answer.connection_bad = PQstatus(c) == CONNECTION_BAD;
        return answer;
      }
      answer.results.push_back(Result{PQresultStatus(r), PQcmdStatus(r),
                                      PQntuples(r) > 0 ? PQgetvalue(r, 0, 0) : "",
                                      PQresultErrorMessage(r)});
      PQclear(r);
    }
    if (remaining_ms(deadline) == 0) return answer;
    if (wait_socket(c, POLLIN, Millis(remaining_ms(deadline))) != 0) PQconsumeInput(c);
  }
}

// Whether a result is a success (rows or a command's completion).
bool succeeded(const Result& r) {
  return r.status == PGRES_TUPLES_OK || r.status == PGRES_COMMAND_OK;
}

// Runs `sql` (kPatience at most); REQUIREs every result and none failed; returns them.
std::vector<Result> run(PGconn* c, const std::string& sql) {
  send_query(c, sql);
  const Answer answer = collect(c, kPatience);
  REQUIRE_MESSAGE(answer.complete, "no complete answer within 5 s to " << sql.substr(0, 80));
  REQUIRE_MESSAGE(!answer.connection_bad, PQerrorMessage(c));
  REQUIRE(!answer.results.empty());
  for (const Result& r : answer.results) REQUIRE_MESSAGE(succeeded(r), r.error);
  return answer.results;
}

// The first column of the first row of `sql`'s last result.
std::string scalar(PGconn* c, const std::string& sql) { return run(c, sql).back().value; }

// A fresh schema holding a table t (v int), created on a direct connection to the server (the
// test's view of what the server has committed), dropped at the end.
class Scratch {
 public:
  explicit Scratch(const std::string& server) : direct_(connect(server)) {
    static int made = 0;
    schema_ = "fault_proxy_" + std::to_string(::getpid()) + "_" + std::to_string(++made);
    run(direct_.get(), "CREATE SCHEMA " + schema_ + "; CREATE TABLE " + table() + " (v int)");
  }
  ~Scratch() {
    const std::string drop =
        "SET client_min_messages = warning; SET lock_timeout = '5s'; DROP SCHEMA " + schema_ +
        " CASCADE";
    PQclear(PQexec(direct_.get(), drop.c_str()));
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  // The table, qualified.
  std::string table() const { return schema_ + ".t"; }
  // How many committed rows of t have v = `v`, read directly from the server.
  std::string count(int v) {
    return scalar(direct_.get(),
                  "SELECT count(*) FROM " + table() + " WHERE v = " + std::to_string(v));
  }
  // The direct connection.
  PGconn* direct() const { return direct_.get(); }

 private:
  Conn direct_;
  std::string schema_;
};

// Reads `fd` until EOF, kPatience at most; `eof` says whether EOF came.
std::string read_to_eof(int fd, bool& eof) {
  const Clock::time_point deadline = Clock::now() + kPatience;
  std::string out;
  eof = false;
  char buf[4096];
  while (remaining_ms(deadline) > 0) {
    if (wait_fd(fd, POLLIN, Millis(remaining_ms(deadline))) == 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0) {
      eof = true;
      break;
    }
    if (n > 0) out.append(buf, static_cast<std::size_t>(n));
    if (n < 0 && errno != EAGAIN && errno != EINTR) break;
  }
  return out;
}

// Reads `fd` until `n` bytes came, EOF, or `timeout`; returns what came.
std::string read_exactly(int fd, std::size_t n, Millis timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  std::string out;
  char buf[4096];
  while (out.size() < n && remaining_ms(deadline) > 0) {
    if (wait_fd(fd, POLLIN, Millis(remaining_ms(deadline))) == 0) continue;
    const ssize_t got = ::recv(fd, buf, std::min(sizeof buf, n - out.size()), MSG_DONTWAIT);
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) break;
    if (got > 0) out.append(buf, static_cast<std::size_t>(got));
  }
  return out;
}

// A stand-in server on a Unix socket in a fresh temporary directory (no PostgreSQL), for
// plumbing no real server shows on demand; removed at the end.
class StandIn {
 public:
  StandIn() {
    char dir[] = "/tmp/fault-proxy-XXXXXX";
    REQUIRE(::mkdtemp(dir) != nullptr);
    dir_ = dir;
    path_ = dir_ + "/server.sock";
    listener_ = Fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    REQUIRE(listener_);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, path_.c_str(), path_.size() + 1);
    REQUIRE(::bind(listener_.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address) ==
            0);
    REQUIRE(::listen(listener_.get(), 4) == 0);
  }
  ~StandIn() {
    listener_.reset();
    ::unlink(path_.c_str());
    ::rmdir(dir_.c_str());
  }
  StandIn(const StandIn&) = delete;
  StandIn& operator=(const StandIn&) = delete;

  // The proxy target for it.
  std::string target() const { return "unix:" + path_; }
  // The next connection the proxy makes to it (kPatience at most).
  Fd accept() {
    REQUIRE((wait_fd(listener_.get(), POLLIN, kPatience) & POLLIN) != 0);
    Fd served(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    REQUIRE(served);
    return served;
  }

 private:
  std::string dir_;
  std::string path_;
  Fd listener_;
};

// A plain TCP connection to the proxy on `port`.
Fd connect_raw(std::uint16_t port) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  REQUIRE(fd);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd.get(), reinterpret_cast<const sockaddr*>(&to), sizeof to) == 0);
  return fd;
}

// Sends all of `bytes` on `fd` (a blocking socket).
void send_all(int fd, const std::string& bytes) {
  REQUIRE(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(bytes.size()));
}

// Bytes in the PostgreSQL protocol's order (big-endian).
std::string be32(std::uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>((v >> 16) & 0xff),
          static_cast<char>((v >> 8) & 0xff), static_cast<char>(v & 0xff)};
}
// A framed server message: type byte, length (counting itself), body.
std::string message(char type, const std::string& body) {
  return type + be32(static_cast<std::uint32_t>(body.size() + 4)) + body;
}
// A CommandComplete with `tag`.
std::string command_complete(const std::string& tag) {
  return message('C', tag + std::string(1, '\0'));
}
// An untyped client message: length (counting itself), code, body.
std::string untyped(std::uint32_t code, const std::string& body = "") {
  return be32(static_cast<std::uint32_t>(body.size() + 8)) + be32(code) + body;
}

// The CommandComplete tags a ServerStream reports for `server` (fed `piece` bytes at a time)
// after `client` (fed the same way), each with its stream offset.
std::vector<std::pair<std::uint64_t, std::string>> tags_of(const std::string& client,
                                                           const std::string& server,
                                                           std::size_t piece) {
  idem::test::fault_proxy_detail::ClientStartup startup;
  idem::test::fault_proxy_detail::ServerStream stream;
  for (std::size_t i = 0; i < client.size(); i += piece) {
    startup.feed(client.data() + i, std::min(piece, client.size() - i), stream);
  }
  std::vector<std::pair<std::uint64_t, std::string>> tags;
  for (std::size_t i = 0; i < server.size(); i += piece) {
    stream.feed(server.data() + i, std::min(piece, server.size() - i),
                [&](std::uint64_t start, const std::string& tag) {
                  tags.emplace_back(start, tag);
                  return true;
                });
  }
  CHECK(stream.offset() == server.size());
  return tags;
}

}  // namespace

TEST_CASE(
    "fault proxy: pg_socket_path reads the socket path from the host= and port= of a conninfo") {
  using idem::test::pg_socket_path;
  CHECK(pg_socket_path("host=/tmp/idem-pg-ab12 port=5432 user=postgres dbname=postgres") ==
        "/tmp/idem-pg-ab12/.s.PGSQL.5432");
  CHECK(pg_socket_path("user=postgres host = '/tmp/with space' port=6000") ==
        "/tmp/with space/.s.PGSQL.6000");
  CHECK(pg_socket_path("host=/a host=/b") == "/b/.s.PGSQL.5432");  // the last one wins
  CHECK(pg_socket_path("host='/it\\'s' port=1") == "/it's/.s.PGSQL.1");
  CHECK_THROWS_AS(pg_socket_path("port=5432"), std::invalid_argument);
  CHECK_THROWS_AS(pg_socket_path("host=localhost port=5432"), std::invalid_argument);
  CHECK_THROWS_AS(pg_socket_path("host=/a,/b"), std::invalid_argument);
  CHECK_THROWS_AS(pg_socket_path("host=/a port=x"), std::invalid_argument);
  CHECK_THROWS_AS(pg_socket_path("host='/a"), std::invalid_argument);
  CHECK_THROWS_AS(pg_socket_path("postgresql:///postgres"), std::invalid_argument);
}

TEST_CASE(
    "fault proxy: the reply parser finds every CommandComplete fed one byte at a time, after "
    "the one-byte answers to GSSENCRequest and SSLRequest") {
  const std::string startup =
      untyped(196608, std::string("user\0postgres\0\0", 15));  // StartupMessage, protocol 3.0
  const std::string greeting =
      message('R', be32(0)) + message('S', std::string("a\0b\0", 4)) + message('Z', "I");
  const std::string replies = message('T', std::string(30, '\x01')) +
                              message('D', std::string(70000, 'C')) + command_complete("SELECT 1") +
                              message('Z', "T") + command_complete("COMMIT") + message('Z', "I");
  const std::uint64_t select_at = greeting.size() + 5 + 30 + 5 + 70000;
  const std::uint64_t commit_at = select_at + 14 + 6;
  using Tags = std::vector<std::pair<std::uint64_t, std::string>>;

  SUBCASE("no negotiation") {
    for (std::size_t piece : {std::size_t{1}, std::size_t{3}, std::size_t{1} << 20}) {
      CAPTURE(piece);
      CHECK(tags_of(startup, greeting + replies, piece) ==
            Tags{{select_at, "SELECT 1"}, {commit_at, "COMMIT"}});
    }
  }
  SUBCASE("GSSENCRequest and SSLRequest, each refused with 'N'") {
    const std::string client = untyped(80877104) + untyped(80877103) + startup;
    for (std::size_t piece : {std::size_t{1}, std::size_t{5}, std::size_t{1} << 20}) {
      CAPTURE(piece);
      CHECK(tags_of(client, "NN" + greeting + replies, piece) ==
            Tags{{select_at + 2, "SELECT 1"}, {commit_at + 2, "COMMIT"}});
    }
  }
  SUBCASE("SSL accepted with 'S': the encrypted stream is not followed") {
    const std::string client = untyped(80877103) + "\x16\x03\x01";
    const Tags tags = tags_of(client, "S" + command_complete("COMMIT"), 1);
    CHECK(tags.empty());
  }
  SUBCASE("a CommandComplete is undecided from its type byte until its tag is complete") {
    idem::test::fault_proxy_detail::ServerStream stream;
    const std::string bytes = message('Z', "I") + command_complete("COMMIT") + message('Z', "I");
    std::vector<std::string> seen;
    for (std::size_t i = 0; i < bytes.size(); ++i) {
      CAPTURE(i);
      stream.feed(&bytes[i], 1, [&](std::uint64_t start, const std::string& tag) {
        CHECK(start == 6);
        seen.push_back(tag);
        return true;
      });
      const bool inside = i >= 6 && i < 6 + 5 + 6;  // type byte .. last letter of the tag
      CHECK(stream.undecided_command() ==
            (inside ? std::optional<std::uint64_t>(6) : std::nullopt));
    }
    CHECK(seen == std::vector<std::string>{"COMMIT"});
  }
}

TEST_CASE("fault proxy: a query through it returns its row, and the counters see the bytes") {
  FAULT_PROXY_SERVER_OR_SKIP(server);
  FaultProxy proxy(unix_target(server));
  CHECK(proxy.port() != 0);
  Conn c = connect(through(server, proxy.port()));
  CHECK(scalar(c.get(), "SELECT 40 + 2") == "42");
  CHECK(proxy.accepted() == 1);
  CHECK(proxy.open_connections() == 1);
  CHECK(proxy.bytes_to_server() > 0);
  CHECK(proxy.bytes_to_client() > 0);
  CHECK(proxy.replies_dropped() == 0);
}

TEST_CASE(
    "fault proxy: a stall holds every byte with the sockets open, and resume lets them through") {
  FAULT_PROXY_SERVER_OR_SKIP(server);
  Scratch scratch(server);
  FaultProxy proxy(unix_target(server));
  Conn c = connect(through(server, proxy.port()));
  CHECK(scalar(c.get(), "SELECT 1") == "1");

  proxy.stall();
  const std::uint64_t to_server = proxy.bytes_to_server();
  const std::uint64_t to_client = proxy.bytes_to_client();
  send_query(c.get(), "INSERT INTO " + scratch.table() + " VALUES (1)");
  const Answer held = collect(c.get(), kSilence);
  CHECK_FALSE(held.complete);
  CHECK(held.results.empty());
  CHECK(wait_socket(c.get(), POLLIN, 0ms) == 0);  // no byte, no hang-up: open and silent
  CHECK(PQstatus(c.get()) == CONNECTION_OK);
  CHECK(proxy.bytes_to_server() == to_server);
  CHECK(proxy.bytes_to_client() == to_client);
  CHECK(scratch.count(1) == "0");  // the INSERT never reached the server
  CHECK(proxy.open_connections() == 1);

  proxy.resume();
  const Answer answer = collect(c.get(), kPatience);
  REQUIRE(answer.complete);
  CHECK_FALSE(answer.connection_bad);
  REQUIRE(answer.results.size() == 1);
  CHECK(answer.results[0].tag == "INSERT 0 1");
  CHECK(scratch.count(1) == "1");
  CHECK(scalar(c.get(), "SELECT 2") == "2");
}

TEST_CASE(
    "fault proxy: a stall holds the server's bytes too (a NOTIFY), and resume delivers them") {
  FAULT_PROXY_SERVER_OR_SKIP(server);
  const std::string channel = "fault_proxy_" + std::to_string(::getpid());
  FaultProxy proxy(unix_target(server));
  Conn listener = connect(through(server, proxy.port()));
  run(listener.get(), "LISTEN " + channel);
  Conn direct = connect(server);

  proxy.stall();
  const std::uint64_t to_client = proxy.bytes_to_client();
  run(direct.get(), "NOTIFY " + channel + ", 'held'");  // the server sends it to `listener` now
  CHECK(wait_socket(listener.get(), POLLIN, kSilence) == 0);
  CHECK(PQconsumeInput(listener.get()) == 1);
  CHECK(PQnotifies(listener.get()) == nullptr);
  CHECK(PQstatus(listener.get()) == CONNECTION_OK);
  CHECK(proxy.bytes_to_client() == to_client);

  proxy.resume();
  const Clock::time_point deadline = Clock::now() + kPatience;
  PGnotify* notify = nullptr;
  while (notify == nullptr && remaining_ms(deadline) > 0) {
    if (wait_socket(listener.get(), POLLIN, Millis(remaining_ms(deadline))) == 0) continue;
    REQUIRE(PQconsumeInput(listener.get()) == 1);
    notify = PQnotifies(listener.get());
  }
  REQUIRE(notify != nullptr);
  CHECK(std::string(notify->relname) == channel);
  CHECK(std::string(notify->extra) == "held");
  PQfreemem(notify);
}

TEST_CASE(
    "fault proxy: a connection opened during a stall completes its startup only after resume") {
  FAULT_PROXY_SERVER_OR_SKIP(server);
  FaultProxy proxy(unix_target(server));
  proxy.stall();
  Conn c(PQconnectStart(through(server, proxy.port()).c_str()));
  REQUIRE(c != nullptr);
  REQUIRE(PQstatus(c.get()) != CONNECTION_BAD);
  PostgresPollingStatusType status = drive(c.get(), PGRES_POLLING_WRITING, kSilence);
  CHECK((status == PGRES_POLLING_READING || status == PGRES_POLLING_WRITING));
  CHECK(PQstatus(c.get()) != CONNECTION_OK);
  CHECK(PQstatus(c.get()) != CONNECTION_BAD);
  CHECK(proxy.bytes_to_server() == 0);
  CHECK(proxy.bytes_to_client() == 0);

  proxy.resume();
  status = drive(c.get(), status, kPatience);
  REQUIRE_MESSAGE(status == PGRES_POLLING_OK, PQerrorMessage(c.get()));
  CHECK(proxy.accepted() == 1);
  CHECK(scalar(c.get(), "SELECT 3") == "3");
}

TEST_CASE(
    "fault proxy: a cut ends every connection on both sides, and new connections work "
    "afterwards") {
  FAULT_PROXY_SERVER_OR_SKIP(server);
  Scratch scratch(server);
  FaultProxy proxy(unix_target(server));
  Conn a = connect(through(server, proxy.port()));
  Conn b = connect(through(server, proxy.port()));
  run(a.get(), "BEGIN; INSERT INTO " + scratch.table() + " VALUES (7)");  // holds a lock on t
  CHECK(scalar(b.get(), "SELECT 1") == "1");
  CHECK(proxy.open_connections() == 2);

  proxy.cut();
  CHECK(proxy.open_connections() == 0);
  // The client sees its connection end: EOF is there without sending anything.
  CHECK((wait_socket(a.get(), POLLIN, kPatience) & (POLLIN | POLLHUP)) != 0);
  for (PGconn* c : {a.get(), b.get()}) {
    if (PQsendQuery(c, "SELECT 1") == 1) {
      const Answer answer = collect(c, kPatience);
      CHECK(answer.complete);
      for (const Result& r : answer.results) CHECK(r.status != PGRES_TUPLES_OK);
    }
    CHECK(PQstatus(c) == CONNECTION_BAD);
  }
  // The server's side ended too: a's session is gone, its transaction rolled back and its lock
  // released (lock_timeout, below kPatience, bounds the wait).
  run(scratch.direct(), "BEGIN; SET LOCAL lock_timeout = '3s'; LOCK TABLE " + scratch.table() +
                            " IN ACCESS EXCLUSIVE MODE; COMMIT");
  CHECK(scratch.count(7) == "0");

  Conn c = connect(through(server, proxy.port()));
  CHECK(scalar(c.get(), "SELECT 4") == "4");
  CHECK(proxy.accepted() == 3);
  CHECK(proxy.open_connections() == 1);
}

TEST_CASE(
    "fault proxy: drop_reply_after(COMMIT) lets the COMMIT commit and the client see only its "
    "connection end, once") {
  FAULT_PROXY_SERVER_OR_SKIP(server);
  Scratch scratch(server);
  FaultProxy proxy(unix_target(server));
  std::string sslmode;
  SUBCASE("sslmode=disable") { sslmode = "disable"; }
  SUBCASE("sslmode=prefer: the server refuses the SSLRequest with one byte, N, framed right") {
    if (scalar(scratch.direct(), "SHOW ssl") != "off") {
      MESSAGE("the server has ssl = on: the case of an SSLRequest refused is skipped");
      return;
    }
    sslmode = "prefer";
  }
  const int v = 42;
  Conn c = connect(through(server, proxy.port(), sslmode));
  proxy.drop_reply_after("COMMIT");
  run(c.get(), "BEGIN");
  CHECK(run(c.get(), "INSERT INTO " + scratch.table() + " VALUES (" + std::to_string(v) + ")")
            .back()
            .tag == "INSERT 0 1");
  send_query(c.get(), "COMMIT");
  const Answer answer = collect(c.get(), kPatience);
  REQUIRE(answer.complete);
  CHECK(answer.connection_bad);
  for (const Result& r : answer.results) {
    CHECK(r.status == PGRES_FATAL_ERROR);
    CHECK(r.tag != "COMMIT");
  }
  CHECK(proxy.replies_dropped() == 1);
  CHECK(scratch.count(v) == "1");  // committed: the server sent the reply that was dropped

  // One-shot: the next COMMIT, on a new connection, passes.
  Conn again = connect(through(server, proxy.port(), sslmode));
  run(again.get(), "BEGIN; INSERT INTO " + scratch.table() + " VALUES (" + std::to_string(v) + ")");
  CHECK(run(again.get(), "COMMIT").back().tag == "COMMIT");
  CHECK(scratch.count(v) == "2");
  CHECK(proxy.replies_dropped() == 1);
}

TEST_CASE(
    "fault proxy: drop_reply_after delivers what the server sent before the matching "
    "CommandComplete and nothing from it on") {
  FAULT_PROXY_SERVER_OR_SKIP(server);
  FaultProxy proxy(unix_target(server));
  Conn c = connect(through(server, proxy.port()));
  proxy.drop_reply_after("SELECT 2");
  // Three statements, one reply stream: "SELECT 1", then "SELECT 2" (two rows), then "SELECT 1".
  send_query(c.get(), "SELECT 'first'; SELECT generate_series(1, 2); SELECT 'third'");
  const Answer answer = collect(c.get(), kPatience);
  REQUIRE(answer.complete);
  CHECK(answer.connection_bad);
  REQUIRE(answer.results.size() == 2);
  CHECK(answer.results[0].status == PGRES_TUPLES_OK);
  CHECK(answer.results[0].tag == "SELECT 1");
  CHECK(answer.results[0].value == "first");
  CHECK(answer.results[1].status == PGRES_FATAL_ERROR);
  CHECK(proxy.replies_dropped() == 1);
}

TEST_CASE(
    "fault proxy: drop_reply_after with a tag that never comes leaves traffic alone, and pass() "
    "disarms it") {
  FAULT_PROXY_SERVER_OR_SKIP(server);
  Scratch scratch(server);
  FaultProxy proxy(unix_target(server));
  Conn c = connect(through(server, proxy.port()));
  proxy.drop_reply_after("NO SUCH TAG");
  run(c.get(), "BEGIN; INSERT INTO " + scratch.table() + " VALUES (5)");
  CHECK(run(c.get(), "COMMIT").back().tag == "COMMIT");
  CHECK(scalar(c.get(), "SELECT count(*) FROM " + scratch.table()) == "1");
  CHECK(run(c.get(), "UPDATE " + scratch.table() + " SET v = 6").back().tag == "UPDATE 1");
  CHECK(proxy.replies_dropped() == 0);
  CHECK(proxy.open_connections() == 1);
  CHECK(PQstatus(c.get()) == CONNECTION_OK);

  proxy.drop_reply_after("COMMIT");
  proxy.pass();
  run(c.get(), "BEGIN; INSERT INTO " + scratch.table() + " VALUES (8)");
  CHECK(run(c.get(), "COMMIT").back().tag == "COMMIT");
  CHECK(proxy.replies_dropped() == 0);
  CHECK(scratch.count(8) == "1");
}

TEST_CASE(
    "fault proxy: stall_after lets the matching statement's answer through, then holds the next "
    "until resume") {
  FAULT_PROXY_SERVER_OR_SKIP(server);
  FaultProxy proxy(unix_target(server));
  Scratch scratch(server);
  Conn c = connect(through(server, proxy.port()));
  proxy.stall_after("INSERT");
  CHECK(run(c.get(), "SELECT 1").back().tag == "SELECT 1");  // another tag: passes
  CHECK(run(c.get(), "INSERT INTO " + scratch.table() + " VALUES (3)").back().tag == "INSERT 0 1");
  CHECK(proxy.stalls_started() == 1);
  send_query(c.get(), "INSERT INTO " + scratch.table() + " VALUES (4)");
  const Answer held = collect(c.get(), kSilence);
  CHECK_FALSE(held.complete);
  CHECK(held.results.empty());
  CHECK(scratch.count(4) == "0");  // it never reached the server
  proxy.resume();
  const Answer after = collect(c.get(), kPatience);
  REQUIRE(after.complete);
  CHECK(after.results.back().tag == "INSERT 0 1");
  CHECK(scratch.count(4) == "1");
  // One-shot: the next INSERT passes.
  CHECK(run(c.get(), "INSERT INTO " + scratch.table() + " VALUES (5)").back().tag == "INSERT 0 1");
  CHECK(proxy.stalls_started() == 1);
}

TEST_CASE(
    "fault proxy: 8 MiB each way go through intact past its 1 MiB buffers, with a drop armed") {
  FAULT_PROXY_SERVER_OR_SKIP(server);
  FaultProxy proxy(unix_target(server));
  Conn c = connect(through(server, proxy.port()));
  proxy.drop_reply_after("NO SUCH TAG");  // the parser follows every DataRow byte
  constexpr std::size_t kSize = std::size_t{8} << 20;
  const std::string down = scalar(c.get(), "SELECT repeat('x', " + std::to_string(kSize) + ")");
  CHECK(down.size() == kSize);
  CHECK(down.find_first_not_of('x') == std::string::npos);
  const std::string up =
      scalar(c.get(), "SELECT length(v) || ' ' || (ltrim(v, 'y') = '') FROM (SELECT '" +
                          std::string(kSize, 'y') + "'::text AS v) s");
  CHECK(up == std::to_string(kSize) + " true");
  CHECK(proxy.bytes_to_server() > kSize);
  CHECK(proxy.bytes_to_client() > kSize);
  CHECK(proxy.replies_dropped() == 0);
}

TEST_CASE(
    "fault proxy: a half-close goes through: the server sees EOF, and its answer still reaches "
    "the client") {
  StandIn stand_in;
  FaultProxy proxy(stand_in.target());
  Fd client = connect_raw(proxy.port());
  send_all(client.get(), "hello");
  REQUIRE(::shutdown(client.get(), SHUT_WR) == 0);
  Fd served = stand_in.accept();
  bool eof = false;
  CHECK(read_to_eof(served.get(), eof) == "hello");
  CHECK(eof);
  send_all(served.get(), "bye");
  served.reset();
  CHECK(read_to_eof(client.get(), eof) == "bye");
  CHECK(eof);
  CHECK(proxy.bytes_to_server() == 5);
  CHECK(proxy.bytes_to_client() == 3);
}

TEST_CASE(
    "fault proxy: with a drop armed, a CommandComplete split across reads is held until its tag "
    "decides, then passed or dropped whole") {
  StandIn stand_in;
  FaultProxy proxy(stand_in.target());
  proxy.drop_reply_after("COMMIT");
  Fd client = connect_raw(proxy.port());
  const std::string startup = untyped(196608, std::string("user\0x\0\0", 9));
  send_all(client.get(), startup);
  Fd served = stand_in.accept();
  CHECK(read_exactly(served.get(), startup.size(), kPatience) == startup);

  const std::string ready = message('Z', "I");
  const std::string select = command_complete("SELECT 1");
  send_all(served.get(), ready + select.substr(0, 8));  // type, length, "SEL"
  CHECK(read_exactly(client.get(), ready.size(), kPatience) == ready);
  CHECK(wait_fd(client.get(), POLLIN, kSilence) == 0);  // the undecided message is held
  send_all(served.get(), select.substr(8));
  CHECK(read_exactly(client.get(), select.size(), kPatience) == select);  // not COMMIT: passed

  const std::string commit = command_complete("COMMIT");
  send_all(served.get(), commit.substr(0, 3));
  CHECK(wait_fd(client.get(), POLLIN, kSilence) == 0);
  send_all(served.get(), commit.substr(3) + ready);
  bool eof = false;
  CHECK(read_to_eof(client.get(), eof).empty());  // nothing of it, then the end
  CHECK(eof);
  CHECK(read_to_eof(served.get(), eof).empty());  // the server side is closed too
  CHECK(eof);
  CHECK(proxy.replies_dropped() == 1);
  CHECK(proxy.bytes_to_client() == ready.size() + select.size());
}

TEST_CASE("fault proxy: with its target unreachable, the client's connection is closed") {
  for (const std::string& target : {std::string("unix:/nonexistent-fault-proxy-dir/.s.PGSQL.5432"),
                                    std::string("127.0.0.1:1")}) {
    CAPTURE(target);
    FaultProxy proxy(target);
    Conn c(PQconnectStart(through("user=postgres dbname=postgres", proxy.port()).c_str()));
    REQUIRE(c != nullptr);
    CHECK(drive(c.get(), PGRES_POLLING_WRITING, kPatience) == PGRES_POLLING_FAILED);
    CHECK(PQstatus(c.get()) == CONNECTION_BAD);
    CHECK(proxy.accepted() == 1);
    CHECK(proxy.bytes_to_server() == 0);
  }
  CHECK_THROWS_AS(FaultProxy("no-port"), std::invalid_argument);
  CHECK_THROWS_AS(FaultProxy("unix:"), std::invalid_argument);
}
