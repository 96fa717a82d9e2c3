// PostgreSQL under faults that are not crashes, through the fault proxy (fault_proxy.hpp)
// between a node and the server: a connection that stalls with its sockets open (a stuck
// pooler, a frozen backend), a COMMIT that reaches the server while its reply is lost. Every
// test counts the provider's charges (a provider that does not deduplicate) and the answers.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>

#include "fault_proxy.hpp"
#include "http_client.hpp"
#include "idem/coordinator.hpp"
#include "idem/errors.hpp"
#include "idem/internal/store_stats.hpp"
#include "idem/pg_store.hpp"
#include "idem/sim/provider.hpp"
#include "serve_support.hpp"
#include "store_engines.hpp"

using namespace std::chrono_literals;
using idem::test::FaultProxy;
using nlohmann::json;

namespace {

// The test server's conninfo, as a FaultProxy target and as a conninfo through a proxy.
struct Server {
  std::string conninfo = idem::test::test_pg_conninfo();
  std::string target() const { return "unix:" + idem::test::pg_socket_path(conninfo); }
  static std::string via(const FaultProxy& proxy) {
    return fmt::format(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable gssencmode=disable",
        proxy.port());
  }
  // A URI of `database` (a fresh_pg_database() URI's database) through `proxy`.
  static std::string via(const FaultProxy& proxy, const std::string& database_uri) {
    const std::string name = database_uri.substr(
        database_uri.find(":///") + 4, database_uri.find('?') - database_uri.find(":///") - 4);
    return fmt::format("postgresql://postgres@127.0.0.1:{}/{}?sslmode=disable&gssencmode=disable",
                       proxy.port(), name);
  }
};

#define PG_FAULTS_SERVER_OR_SKIP()                   \
  do {                                               \
    ::idem::test::PgEngine engine;                   \
    if (!::idem::test::engine_ready(engine)) return; \
  } while (false)

// One HTTP exchange on a fresh connection ("Connection: close"); the answer's status, or 0
// when none came within 5 s (raw_exchange's bound).
struct Exchange {
  int status = 0;
  std::string bytes;
  bool has(const std::string& header) const {
    return bytes.find("\r\n" + header + ":") != std::string::npos;
  }
  std::string body() const { return bytes.substr(bytes.find("\r\n\r\n") + 4); }
};

Exchange exchange(unsigned short port, const std::string& method, const std::string& target,
                  const std::string& extra = "", const std::string& body = "") {
  const std::string request = fmt::format(
      "{} {} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{}Content-Length: {}\r\n\r\n{}", method,
      target, extra, body.size(), body);
  Exchange out;
  out.bytes = idem::test::raw_exchange(port, request, false).bytes;
  if (out.bytes.starts_with("HTTP/1.1 ")) out.status = std::stoi(out.bytes.substr(9, 3));
  return out;
}

Exchange pay(unsigned short port, const std::string& key, const std::string& order = "A-1") {
  const std::string body = json{{"amount", 4990}, {"currency", "RUB"}, {"order_id", order}}.dump();
  return exchange(port, "POST", "/v1/payments",
                  "Authorization: Bearer sk_test_alpha\r\nContent-Type: application/json\r\n"
                  "Idempotency-Key: " +
                      key + "\r\n",
                  body);
}

// Two payments nodes on one database: `a` reaches it through `proxy`, `b` directly. The
// provider does not deduplicate; its ledger is one file both share (the bank statement).
struct Nodes {
  idem::test::TempDir dir;
  std::string database = idem::test::fresh_pg_database();
  std::string ledger = dir.file("ledger.db");
  FaultProxy proxy{Server{}.target()};
  std::optional<idem::test::Served> a, b;

  explicit Nodes(std::chrono::milliseconds lease = 30s,
                 std::chrono::milliseconds statement_timeout = 5s) {
    const auto options = [&](const std::string& db) {
      idem::demo::ServerOptions o;
      o.api.db = db;
      o.api.ledger = ledger;
      o.api.provider_dedup = false;
      o.api.lease = lease;
      o.api.store_busy_timeout = statement_timeout;
      o.api.maintenance_loop = false;
      return o;
    };
    a.emplace(options(Server::via(proxy, database)));
    b.emplace(options(database));
  }
  std::size_t debits() { return b->server->api().provider().charge_count(); }
  idem::Coordinator& idem_a() { return a->server->api().coordinator(); }
};

bool eventually_answers(idem::Store& store, const idem::KeyId& id) {
  return idem::test::eventually(
      [&] {
        try {
          store.load(id);
          return true;
        } catch (const idem::StoreError&) {
          return false;
        }
      },
      10s);
}

}  // namespace

TEST_CASE(
    "pg faults: a stalled connection costs a call its reply deadline, then a StoreError that says "
    "so, and the store serves again once the server answers") {
  PG_FAULTS_SERVER_OR_SKIP();
  FaultProxy proxy(Server{}.target());
  idem::PgStore store(Server::via(proxy), idem::PgOptions{.schema = idem::test::fresh_pg_schema(),
                                                          .statement_timeout = 300ms,
                                                          .reply_margin = 200ms,
                                                          .batch_connections = 0});
  const idem::KeyId id{"alpha", "pay", "k"};
  CHECK_FALSE(store.load(id));
  proxy.stall();
  try {
    store.load(id);
    FAIL("a stalled server answered");
  } catch (const idem::StoreError& e) {
    CHECK(std::string(e.what()).find("no reply within 500 ms") != std::string::npos);
    CHECK(e.code() == idem::errc::store_unavailable);
  }
  proxy.resume();
  CHECK(eventually_answers(store, id));
}

TEST_CASE(
    "pg faults: a LISTEN connection that stalls silent is asked an empty statement, dropped when "
    "that gets no answer, and opened again, and wake-ups reach the node afterwards") {
  PG_FAULTS_SERVER_OR_SKIP();
  FaultProxy proxy(Server{}.target());
  const std::string schema = idem::test::fresh_pg_schema();
  // The listening node reaches the server through the proxy; the node that completes keys,
  // directly. Silence is noticed after 300 + 200 ms, a question unanswered after as long.
  idem::PgStore listening(Server::via(proxy), idem::PgOptions{.schema = schema,
                                                              .clock = idem::PgClock::caller,
                                                              .statement_timeout = 300ms,
                                                              .reply_margin = 200ms,
                                                              .connect_timeout = 1s,
                                                              .batch_connections = 0,
                                                              .notify = true});
  idem::Coordinator completing(
      std::make_shared<idem::PgStore>(Server{}.conninfo,
                                      idem::PgOptions{.schema = schema, .notify = true}),
      idem::Options{});
  std::atomic<int> woken{0};
  const std::uint64_t subscription =
      listening.add_change_listener([&](const idem::KeyId& id) { woken += id.key == "after"; });
  const auto listens = [&] { return idem::detail::StoreStats::of(listening).listens; };
  REQUIRE(idem::test::eventually([&] { return listens() == 1; }, 10s));
  const std::uint64_t accepted = proxy.accepted();
  proxy.stall();  // every socket stays open; nothing moves: TCP keepalives see nothing wrong
  // The listener gives its silent connection up and tries another (the proxy accepts it and
  // holds it). A failure bound: a listener that waits for the socket alone never does.
  CHECK(idem::test::eventually([&] { return proxy.accepted() > accepted; }, 10s));
  proxy.resume();
  CHECK(idem::test::eventually([&] { return listens() >= 2; }, 10s));
  const idem::Outcome done = completing.call(
      idem::Request{.tenant = "alpha", .operation = "pay", .key = "after", .fingerprint = {}}, [] {
        return idem::Response{200, "{}", {}};
      });
  CHECK_FALSE(done.replayed());
  CHECK(idem::test::eventually([&] { return woken.load() >= 1; }, 10s));
  listening.remove_change_listener(subscription);
}

TEST_CASE(
    "pg faults: a store whose LISTEN connection is reconnecting to a server that does not answer "
    "is destroyed at once, not after its connect deadline") {
  PG_FAULTS_SERVER_OR_SKIP();
  FaultProxy proxy(Server{}.target());
  const std::string schema = idem::test::fresh_pg_schema();
  // Deadlines far past the test's bounds: only a stop that ends the wait passes.
  auto listening =
      std::make_unique<idem::PgStore>(Server::via(proxy), idem::PgOptions{.schema = schema,
                                                                          .statement_timeout = 60s,
                                                                          .connect_timeout = 60s,
                                                                          .batch_connections = 0,
                                                                          .notify = true});
  const std::uint64_t subscription = listening->add_change_listener([](const idem::KeyId&) {});
  REQUIRE(idem::test::eventually(
      [&] { return idem::detail::StoreStats::of(*listening).listens == 1; }, 10s));
  const std::uint64_t accepted = proxy.accepted();
  proxy.stall();  // connections accepted from now on reach no server and hear nothing
  proxy.cut();    // the LISTEN connection ends: the listener connects again, and waits
  REQUIRE(idem::test::eventually([&] { return proxy.accepted() > accepted; }, 10s));
  std::atomic<bool> destroyed{false};
  std::thread destroying([&] {
    listening->remove_change_listener(subscription);
    listening.reset();
    destroyed = true;
  });
  // A failure bound: a listener that waits out its connect deadline takes 60 s.
  CHECK(idem::test::eventually([&] { return destroyed.load(); }, 10s));
  destroying.join();
  proxy.resume();
}

TEST_CASE(
    "pg faults: during a stall of one node's connection its /healthz answers, its requests end "
    "with 503, /readyz says not ready, the other node serves, and afterwards it serves again") {
  PG_FAULTS_SERVER_OR_SKIP();
  Nodes n(30s, 500ms);
  const unsigned short a = n.a->port(), b = n.b->port();
  REQUIRE(pay(a, "before").status == 200);
  n.proxy.stall();
  CHECK(exchange(a, "GET", "/healthz").status == 200);
  const Exchange during = pay(a, "during");
  CHECK(during.status == 503);  // within its reply deadlines (raw_exchange gives up at 5 s)
  CHECK(during.body().find("store_unavailable") != std::string::npos);
  CHECK(exchange(a, "GET", "/healthz").status == 200);
  CHECK(exchange(a, "GET", "/readyz").status == 503);
  CHECK(pay(b, "other-node").status == 200);  // the other node does not notice
  CHECK(exchange(a, "GET", "/healthz").status == 200);
  n.proxy.resume();
  CHECK(idem::test::eventually([&] { return exchange(a, "GET", "/readyz").status == 200; }, 10s));
  CHECK(pay(a, "during").status == 200);  // no restart: the same process serves the same key
  CHECK(n.debits() == 3);
}

TEST_CASE(
    "pg faults: a node whose connection stalls past twice the lease with a checkout in flight "
    "never charges after its lease, and a retry on a second node right after charges once "
    "(x3, IDEM_PAUSE_TRIALS)") {
  PG_FAULTS_SERVER_OR_SKIP();
  constexpr auto kLease = 1s;
  Nodes n(kLease);
  const unsigned short a = n.a->port(), b = n.b->port();
  const int trials = idem::test::pause_trials();
  for (int trial = 0; trial < trials; ++trial) {
    CAPTURE(trial);
    const std::string key = fmt::format("stall-{}", trial);
    const std::string order = fmt::format("O-{}", trial);
    const std::size_t before = n.debits();
    // The stall begins as node A's reservation has committed and its answer has arrived: the
    // checkout's next writes (its start, the debit's pending mark) wait in the proxy.
    n.proxy.stall_after("COMMIT");
    std::optional<Exchange> answer_a;
    std::thread first([&] { answer_a = pay(a, key, order); });
    REQUIRE(idem::test::eventually(
        [&] { return n.proxy.stalls_started() == static_cast<std::uint64_t>(trial) + 1; }, 10s));
    // Twice the lease, on the database's clock.
    const std::string sql = fmt::format(
        "SELECT count(*) FROM idem.idem_keys WHERE key = '{}' AND lease_until + {} < "
        "(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
        key, std::chrono::milliseconds(kLease).count());
    REQUIRE(
        idem::test::eventually([&] { return idem::test::pg_text(n.database, sql) == "1"; }, 10s));
    n.proxy.resume();
    const Exchange retry = pay(b, key, order);  // a retry on the second node, right after
    first.join();
    REQUIRE(answer_a);
    CAPTURE(retry.bytes);
    CAPTURE(answer_a->bytes);
    CHECK(retry.status == 200);
    // Node A's checkout was refused before its call: it answers that it lost its lease (or,
    // if the retry had not taken over yet, that the key is held), never a second charge.
    CHECK((answer_a->status == 409 || answer_a->status == 503));
    CHECK(n.debits() == before + 1);
    CHECK(pay(b, key, order).bytes.find("Idempotent-Replayed: true") != std::string::npos);
  }
  CHECK(n.idem_a().metrics().lease_lost >= static_cast<std::uint64_t>(trials));
}

TEST_CASE(
    "pg faults: the debit's COMMIT whose reply is lost answers outcome unknown with the charge id, "
    "never 'nothing happened', and a retry with the same key ends with one debit") {
  PG_FAULTS_SERVER_OR_SKIP();
  Nodes n;
  const unsigned short a = n.a->port();
  // The next COMMIT after the provider charged is the one that records the debit.
  n.a->server->api().provider().on_event([&](idem::TimePoint, const std::string& line) {
    if (line.starts_with("provider: charged")) n.proxy.drop_reply_after("COMMIT");
  });
  const Exchange first = pay(a, "lost-commit");
  n.a->server->api().provider().on_event(nullptr);
  CHECK(n.proxy.replies_dropped() == 1);
  CHECK(first.status == 503);
  CHECK(first.body().find("outcome_unknown") != std::string::npos);
  CHECK(first.body().find("ch_1") != std::string::npos);
  CHECK(first.body().find("never with a new key") != std::string::npos);
  CHECK(first.body().find("before any charge") == std::string::npos);
  CHECK(first.has("Payment-Charge-Id"));
  CHECK(n.debits() == 1);
  const Exchange retry = pay(a, "lost-commit");
  CHECK(retry.status == 200);
  CHECK(retry.body().find("ch_1") != std::string::npos);
  CHECK(n.debits() == 1);
}

TEST_CASE(
    "pg faults: a reservation whose reply is lost does not hold its key for the lease: the "
    "request looks its claim up on the new connection and is answered") {
  PG_FAULTS_SERVER_OR_SKIP();
  Nodes n(30s);
  const unsigned short a = n.a->port();
  n.proxy.drop_reply_after("COMMIT");  // the reservation's pipeline commits; its reply is lost
  const Exchange first = pay(a, "lost-reservation");
  CHECK(n.proxy.replies_dropped() == 1);
  if (first.status != 200) {
    // The look after the lost reply may itself have failed: the next request of this node
    // releases the reservation it recognises as its own, not after the 30 s lease.
    CHECK(first.status == 503);
    CHECK(pay(a, "lost-reservation").status == 200);
  }
  CHECK(n.debits() == 1);
  CHECK(pay(a, "lost-reservation").bytes.find("Idempotent-Replayed: true") != std::string::npos);
}
