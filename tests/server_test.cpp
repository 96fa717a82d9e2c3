// idem-demo serve over real HTTP on a loopback port: seed 000's contract end to end. Every
// test about duplicates counts the provider's charges.
#include <doctest/doctest.h>

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "http_client.hpp"
#include "idem/sim/provider.hpp"
#include "serve_support.hpp"

using namespace std::chrono_literals;
using idem::InFlight;
using idem::test::HttpClient;
using idem::test::HttpReply;
using nlohmann::json;

namespace {

using Headers = std::vector<std::pair<std::string, std::string>>;

struct TestServer {
  idem::test::TempDir dir;
  std::string db = idem::test::server_database(dir);
  std::unique_ptr<idem::demo::Server> server;
  std::thread thread;

  explicit TestServer(idem::demo::ServerOptions options = {}) {
    options.port = 0;
    options.api.db = db;
    server = std::make_unique<idem::demo::Server>(std::move(options));
    thread = std::thread([this] { server->run(); });
  }
  ~TestServer() {
    server->stop();
    thread.join();
  }
  unsigned short port() const { return server->port(); }
  std::size_t charges() { return server->api().provider().charge_count(); }
};

idem::demo::ServerOptions with(InFlight policy, std::chrono::milliseconds latency = 300ms) {
  idem::demo::ServerOptions o;
  o.api.policy = policy;
  o.api.provider_latency = latency;
  return o;
}

Headers post_headers(const std::string& key, const std::string& api_key = "sk_test_alpha") {
  return {{"Authorization", "Bearer " + api_key},
          {"Idempotency-Key", key},
          {"Content-Type", "application/json"}};
}

std::string payment(long long amount = 4990, const std::string& extra = "") {
  return fmt::format(R"({{"amount": {}, "currency": "RUB", "order_id": "A-10023"{}}})", amount,
                     extra);
}

std::string error_of(const HttpReply& r) { return json::parse(r.body).at("error"); }

}  // namespace

// Each duplicate read while the first request runs is refused with 409; one read after it
// finished (a loaded machine, a sanitizer build) is a replay of its reply. Which of the two a
// duplicate gets is timing; one execution, one charge and no third answer is the contract.
TEST_CASE(
    "server: 20 parallel requests with one key under raise: one executes, the others 409 while "
    "it runs or its replay after, one charge (x20)") {
  TestServer s(with(InFlight::raise));
  int conflicts = 0;
  for (int round = 0; round < 20; ++round) {
    const std::string key = fmt::format("round-{}", round);
    std::vector<std::unique_ptr<HttpClient>> clients;
    for (int i = 0; i < 20; ++i) clients.push_back(std::make_unique<HttpClient>(s.port()));
    for (auto& c : clients) c->write_only("POST", "/v1/payments", post_headers(key), payment(4990));
    std::vector<HttpReply> replays;
    std::optional<HttpReply> executed;
    int conflict = 0;
    for (auto& c : clients) {
      HttpReply r = c->receive();
      if (r.status == 200 && r.has("idempotent-replayed")) {
        replays.push_back(std::move(r));
      } else if (r.status == 200) {
        REQUIRE_FALSE(executed.has_value());  // a second execution
        executed = std::move(r);
      } else {
        REQUIRE(r.status == 409);
        ++conflict;
        CHECK(error_of(r) == "idempotency_key_in_use");
        CHECK(r.has("retry-after"));
      }
    }
    REQUIRE(executed.has_value());
    for (const HttpReply& r : replays) CHECK(r.body == executed->body);
    REQUIRE(conflict + static_cast<int>(replays.size()) == 19);
    REQUIRE(s.charges() == static_cast<std::size_t>(round + 1));
    conflicts += conflict;
  }
  // The requests overlapped: duplicates met the first one running (19 of 19 in a round on an
  // idle machine).
  INFO("409s over 20 rounds: " << conflicts);
  CHECK(conflicts >= 20);
}

TEST_CASE(
    "server: 20 parallel requests with one key under wait: twenty 200, byte-identical, one charge "
    "(x20)") {
  TestServer s(with(InFlight::wait));
  for (int round = 0; round < 20; ++round) {
    const std::string key = fmt::format("round-{}", round);
    std::vector<std::unique_ptr<HttpClient>> clients;
    for (int i = 0; i < 20; ++i) clients.push_back(std::make_unique<HttpClient>(s.port()));
    for (auto& c : clients) c->write_only("POST", "/v1/payments", post_headers(key), payment(4990));
    std::vector<std::string> bodies;
    for (auto& c : clients) {
      const HttpReply r = c->receive();
      REQUIRE(r.status == 200);
      bodies.push_back(r.body);
    }
    for (const auto& b : bodies) REQUIRE(b == bodies.front());
    REQUIRE(s.charges() == static_cast<std::size_t>(round + 1));
  }
}

TEST_CASE("server: a replay is byte-identical even when non-significant fields changed") {
  TestServer s(with(InFlight::raise, 10ms));
  HttpClient c(s.port());
  const HttpReply first =
      c.send("POST", "/v1/payments", post_headers("k1"), payment(4990, R"(, "comment": "first")"));
  REQUIRE(first.status == 200);
  CHECK_FALSE(first.has("idempotent-replayed"));
  CHECK(first.has("idempotency-key-expires"));
  const HttpReply again =
      c.send("POST", "/v1/payments", post_headers("k1"),
             payment(4990, R"(, "comment": "retry", "metadata": {"trace": "t2"})"));
  CHECK(again.status == 200);
  CHECK(again.headers.at("idempotent-replayed") == "true");
  CHECK(again.body == first.body);
  CHECK(again.headers.at("idempotency-key-expires") == first.headers.at("idempotency-key-expires"));
  CHECK(s.charges() == 1);
  // The payment is readable by its id.
  const std::string id = json::parse(first.body).at("id");
  const HttpReply got =
      c.send("GET", "/v1/payments/" + id, {{"Authorization", "Bearer sk_test_alpha"}});
  CHECK(got.status == 200);
  CHECK(got.body == first.body);
}

TEST_CASE("server: a quoted (RFC 8941) key is the same key as the bare one") {
  TestServer s(with(InFlight::raise, 10ms));
  HttpClient c(s.port());
  CHECK(c.send("POST", "/v1/payments", post_headers("abc-123"), payment()).status == 200);
  const HttpReply quoted = c.send("POST", "/v1/payments", post_headers("\"abc-123\""), payment());
  CHECK(quoted.status == 200);
  CHECK(quoted.headers.at("idempotent-replayed") == "true");
  CHECK(s.charges() == 1);
}

TEST_CASE("server: the same key under two tenants makes two payments, neither sees the other's") {
  TestServer s(with(InFlight::raise, 10ms));
  HttpClient c(s.port());
  const HttpReply a =
      c.send("POST", "/v1/payments", post_headers("shared", "sk_test_alpha"), payment(4990));
  const HttpReply b =
      c.send("POST", "/v1/payments", post_headers("shared", "sk_test_beta"), payment(5));
  REQUIRE(a.status == 200);
  REQUIRE(b.status == 200);  // another tenant's amount is not a key reuse
  CHECK(s.charges() == 2);
  const std::string id_a = json::parse(a.body).at("id"), id_b = json::parse(b.body).at("id");
  CHECK(id_a != id_b);
  CHECK(c.send("GET", "/v1/payments/" + id_a, {{"Authorization", "Bearer sk_test_beta"}}).status ==
        404);
  CHECK(c.send("GET", "/v1/payments/" + id_b, {{"Authorization", "Bearer sk_test_alpha"}}).status ==
        404);
  CHECK(
      c.send("POST", "/v1/payments", post_headers("shared", "sk_test_alpha"), payment(4990)).body ==
      a.body);
  CHECK(c.send("POST", "/v1/payments", post_headers("shared", "sk_test_beta"), payment(5)).body ==
        b.body);
  CHECK(s.charges() == 2);
}

TEST_CASE("server: a changed amount under the same key is 422 and charges nothing") {
  TestServer s(with(InFlight::raise, 10ms));
  HttpClient c(s.port());
  REQUIRE(c.send("POST", "/v1/payments", post_headers("k1"), payment(4990)).status == 200);
  const HttpReply reuse = c.send("POST", "/v1/payments", post_headers("k1"), payment(5));
  CHECK(reuse.status == 422);
  CHECK(error_of(reuse) == "idempotency_key_reuse");
  CHECK(reuse.headers.at("content-type") == "application/problem+json");
  CHECK(s.charges() == 1);
}

TEST_CASE("server: a decline (402) is an outcome: stored and replayed, nothing charged") {
  TestServer s(with(InFlight::raise, 10ms));
  s.server->api().provider().inject(idem::sim::Fault::decline);
  HttpClient c(s.port());
  const HttpReply first = c.send("POST", "/v1/payments", post_headers("k1"), payment());
  CHECK(first.status == 402);
  CHECK(error_of(first) == "payment_declined");
  const HttpReply again = c.send("POST", "/v1/payments", post_headers("k1"), payment());
  CHECK(again.status == 402);
  CHECK(again.body == first.body);
  CHECK(again.headers.at("idempotent-replayed") == "true");
  CHECK(s.charges() == 0);  // a re-run would have charged: no fault is left
}

TEST_CASE(
    "server: a provider timeout is 504 outcome unknown, nothing stored, the retry charges exactly "
    "once") {
  TestServer s(with(InFlight::raise, 10ms));
  s.server->api().provider().inject(idem::sim::Fault::timeout);
  HttpClient c(s.port());
  const HttpReply first = c.send("POST", "/v1/payments", post_headers("k1"), payment());
  CHECK(first.status == 504);
  // The charge was begun: the server cannot tell whether the provider made it.
  CHECK(error_of(first) == "outcome_unknown");
  CHECK(first.body.find("never with a new key") != std::string::npos);
  CHECK_FALSE(first.has("payment-charge-id"));
  CHECK(s.charges() == 0);
  const HttpReply retry = c.send("POST", "/v1/payments", post_headers("k1"), payment());
  CHECK(retry.status == 200);
  CHECK_FALSE(retry.has("idempotent-replayed"));
  CHECK(s.charges() == 1);
}

TEST_CASE("server (sqlite): fail-closed with the store locked answers 503 and charges nothing") {
  idem::demo::ServerOptions o = with(InFlight::raise, 10ms);
  o.api.fail_closed = true;
  o.api.store_busy_timeout = 50ms;
  TestServer s(o);
  idem::test::RawDb locker(s.db);
  REQUIRE(locker.exec("BEGIN IMMEDIATE") == SQLITE_OK);
  HttpClient c(s.port());
  const HttpReply r = c.send("POST", "/v1/payments", post_headers("k1"), payment());
  CHECK(r.status == 503);
  CHECK(error_of(r) == "store_unavailable");
  CHECK(s.charges() == 0);
  locker.exec("ROLLBACK");
  CHECK(c.send("POST", "/v1/payments", post_headers("k1"), payment()).status == 200);
  CHECK(s.charges() == 1);
}

TEST_CASE("server: 400s name the broken rule and store nothing") {
  TestServer s(with(InFlight::raise, 10ms));
  HttpClient c(s.port());
  const Headers no_key = {{"Authorization", "Bearer sk_test_alpha"}};
  CHECK(error_of(c.send("POST", "/v1/payments", no_key, payment())) == "idempotency_key_required");
  for (const std::string& bad :
       {std::string(256, 'k'), std::string("\"unterminated"), std::string("\"bad\\escape\"")}) {
    const HttpReply r = c.send("POST", "/v1/payments", post_headers(bad), payment());
    CHECK(r.status == 400);
    CHECK(error_of(r) == "idempotency_key_invalid");
  }
  const std::vector<std::pair<std::string, std::string>> bodies = {
      {"{not json", "the body is not valid JSON"},
      {"[1,2]", "the body must be a JSON object"},
      {R"({"currency": "RUB", "order_id": "A-1"})", "amount must be an integer"},
      {R"({"amount": 0, "currency": "RUB", "order_id": "A-1"})", "amount must be an integer"},
      {R"({"amount": 10.5, "currency": "RUB", "order_id": "A-1"})", "amount must be an integer"},
      {R"({"amount": "10", "currency": "RUB", "order_id": "A-1"})", "amount must be an integer"},
      {R"({"amount": 10, "currency": "rub", "order_id": "A-1"})", "currency must be"},
      {R"({"amount": 10, "currency": "RUB"})", "order_id must be"},
      {R"({"amount": 10, "currency": "RUB", "order_id": "A-1", "comment": 5})",
       "comment, when present"},
  };
  for (const auto& entry : bodies) {
    // Not a structured binding: clang 14 cannot capture one in CHECK_MESSAGE's lambda.
    const auto& body = entry.first;
    const auto& words = entry.second;
    const HttpReply r = c.send("POST", "/v1/payments", post_headers("k-bad-body"), body);
    CHECK(r.status == 400);
    CHECK(error_of(r) == "invalid_request");
    CHECK_MESSAGE(
        json::parse(r.body).at("detail").get<std::string>().find(words) != std::string::npos, body);
  }
  CHECK(idem::test::key_rows(s.db) == 0);
  CHECK(s.charges() == 0);
  // The key that only ever saw bad bodies is free for a good one.
  CHECK(c.send("POST", "/v1/payments", post_headers("k-bad-body"), payment()).status == 200);
}

TEST_CASE("server: a missing or unknown API key is 401 before anything else") {
  TestServer s(with(InFlight::raise, 10ms));
  HttpClient c(s.port());
  const HttpReply none = c.send("POST", "/v1/payments", {}, "{not json");
  CHECK(none.status == 401);
  CHECK(error_of(none) == "unauthorized");
  CHECK(none.headers.at("www-authenticate") == "Bearer");
  CHECK(c.send("POST", "/v1/payments", post_headers("k1", "sk_live_nope"), payment()).status ==
        401);
  CHECK(c.send("GET", "/v1/payments/pay_1", {{"Authorization", "Basic abc"}}).status == 401);
  CHECK(s.charges() == 0);
}

TEST_CASE("server: API keys come from a file when given") {
  idem::test::TempDir dir;
  const std::string path = dir.file("keys.txt");
  {
    std::ofstream out(path);
    out << "# api_key tenant\nsk_acme acme\n\nsk_globex globex  # second tenant\n";
  }
  idem::demo::ServerOptions o = with(InFlight::raise, 10ms);
  o.api.api_keys = idem::demo::load_api_keys(path);
  TestServer s(o);
  HttpClient c(s.port());
  CHECK(c.send("POST", "/v1/payments", post_headers("k1", "sk_acme"), payment()).status == 200);
  CHECK(c.send("POST", "/v1/payments", post_headers("k1", "sk_test_alpha"), payment()).status ==
        401);
  std::ofstream(dir.file("bad.txt")) << "only_one_word\n";
  CHECK_THROWS_WITH(idem::demo::load_api_keys(dir.file("bad.txt")),
                    doctest::Contains("bad.txt:1: expected \"api_key tenant\""));
}

TEST_CASE("server: routes, methods, health, metrics and the provider's statement") {
  TestServer s(with(InFlight::raise, 10ms));
  HttpClient c(s.port());
  CHECK(c.send("GET", "/healthz").status == 200);
  CHECK(c.send("GET", "/nope").status == 404);
  const HttpReply wrong =
      c.send("GET", "/v1/payments", {{"Authorization", "Bearer sk_test_alpha"}});
  CHECK(wrong.status == 405);
  CHECK(wrong.headers.at("allow") == "POST");
  CHECK(
      c.send("DELETE", "/v1/payments/pay_1", {{"Authorization", "Bearer sk_test_alpha"}}).status ==
      405);
  CHECK(
      c.send("GET", "/v1/payments/not-an-id", {{"Authorization", "Bearer sk_test_alpha"}}).status ==
      404);
  c.send("POST", "/v1/payments", post_headers("k1"), payment());
  c.send("POST", "/v1/payments", post_headers("k1"), payment());
  const HttpReply statement = c.send("GET", "/v1/provider/charges");
  CHECK(json::parse(statement.body).at("count") == 1);
  const HttpReply metrics = c.send("GET", "/metrics");
  CHECK(metrics.body.find("idem_replayed_total 1\n") != std::string::npos);
  CHECK(metrics.body.find("idem_completed_total 1\n") != std::string::npos);
}

TEST_CASE("server: with a replay cache, replays are answered from memory and counted in /metrics") {
  idem::demo::ServerOptions options = with(InFlight::raise, 10ms);
  options.api.replay_cache_bytes = 1 << 20;
  TestServer s(std::move(options));
  HttpClient c(s.port());
  for (int i = 0; i < 5; ++i) {
    CHECK(c.send("POST", "/v1/payments", post_headers("k1"), payment()).status == 200);
  }
  // Another amount under the key: 422, from the held record too.
  CHECK(c.send("POST", "/v1/payments", post_headers("k1"), payment(100)).status == 422);
  CHECK(json::parse(c.send("GET", "/v1/provider/charges").body).at("count") == 1);
  const HttpReply metrics = c.send("GET", "/metrics");
  CHECK(metrics.body.find("idem_replayed_total 4\n") != std::string::npos);
  CHECK(metrics.body.find("idem_key_reuse_total 1\n") != std::string::npos);
  // The first replay read the record and kept it; the other three and the 422 were hits.
  CHECK(metrics.body.find("idem_replay_cache_hits_total 4\n") != std::string::npos);
  CHECK(metrics.body.find("idem_replay_cache_entries 1\n") != std::string::npos);
}

TEST_CASE("server: stop() lets the request in flight finish and be answered") {
  auto s = std::make_unique<TestServer>(with(InFlight::raise, 300ms));
  HttpClient c(s->port());
  c.write_only("POST", "/v1/payments", post_headers("k1"), payment());
  // Wait until the request is inside the coordinator (reserved), then stop.
  while (s->server->api().coordinator().metrics().reserved == 0) std::this_thread::yield();
  s->server->stop();
  const HttpReply r = c.receive();
  CHECK(r.status == 200);
  CHECK(r.headers.at("connection") == "close");
  CHECK(s->charges() == 1);
  s.reset();  // joins run(), which returned after the last request
}

TEST_CASE(
    "server: hostile input gets 400/413/431 or a closed connection, and the server keeps serving") {
  idem::demo::ServerOptions o = with(InFlight::raise, 10ms);
  o.read_timeout = 300ms;
  o.idle_timeout = 300ms;
  o.body_limit = 16 * 1024;
  o.header_limit = 4 * 1024;
  TestServer s(o);
  const std::string auth = "Authorization: Bearer sk_test_alpha\r\n";
  const std::string good = "{\"amount\": 10, \"currency\": \"RUB\", \"order_id\": \"A-1\"}";
  auto post = [&](const std::string& key_line, const std::string& body) {
    return "POST /v1/payments HTTP/1.1\r\nHost: x\r\n" + auth + key_line +
           "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
           "\r\n\r\n" + body;
  };
  struct Case {
    std::string name, bytes;
    bool half_close;
    std::string expect;  // status line prefix, or "": the server closes without a byte
  };
  const std::vector<Case> cases = {
      {"garbage", "\x01\x02\x03 not http at all\r\n\r\n", false, "HTTP/1.1 400"},
      {"bad method token", "P(ST /v1/payments HTTP/1.1\r\nHost: x\r\n\r\n", false, "HTTP/1.1 400"},
      {"bad version", "GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n", false, "HTTP/1.1 400"},
      {"no version", "GET /healthz\r\n\r\n", false, "HTTP/1.1 400"},
      {"space in target", "GET /he althz HTTP/1.1\r\n\r\n", false, "HTTP/1.1 400"},
      {"bad header line", "GET /healthz HTTP/1.1\r\nNoColonHere\r\n\r\n", false, "HTTP/1.1 400"},
      {"bad content-length", "POST /v1/payments HTTP/1.1\r\nContent-Length: abc\r\n\r\n", false,
       "HTTP/1.1 400"},
      {"two content-lengths",
       "POST /v1/payments HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", false,
       "HTTP/1.1 400"},
      {"bad chunk size", "POST /v1/payments HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
       false, "HTTP/1.1 400"},
      {"huge body", post("Idempotency-Key: big\r\n", std::string(64 * 1024, 'x')), false,
       "HTTP/1.1 413"},
      {"huge declared body", "POST /v1/payments HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n",
       false, "HTTP/1.1 413"},
      {"huge header", "GET /healthz HTTP/1.1\r\nX-Big: " + std::string(8 * 1024, 'a') + "\r\n\r\n",
       false, "HTTP/1.1 431"},
      {"many headers",
       "GET /healthz HTTP/1.1\r\n" +
           [] {
             std::string h;
             for (int i = 0; i < 1000; ++i) h += "X-" + std::to_string(i) + ": v\r\n";
             return h;
           }() +
           "\r\n",
       false, "HTTP/1.1 431"},
      {"huge target", "GET /" + std::string(8 * 1024, 'a') + " HTTP/1.1\r\n\r\n", false,
       "HTTP/1.1 431"},
      {"truncated headers", "GET /healthz HTTP/1.1\r\nHost: x\r\n", true, ""},
      {"truncated body",
       "POST /v1/payments HTTP/1.1\r\n" + auth + "Content-Length: 100\r\n\r\n{\"amount\"", true,
       ""},
      {"never finished headers", "GET /healthz HTTP/1.1\r\nHost:", false, ""},
      {"never finished body", "POST /v1/payments HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc", false,
       ""},
      {"connect and say nothing", "", false, ""},
      {"bad json", post("Idempotency-Key: j1\r\n", "{\"amount\": "), false, "HTTP/1.1 400"},
      {"json with NUL", post("Idempotency-Key: j2\r\n", std::string("{\"amount\":\0}", 12)), false,
       "HTTP/1.1 400"},
      {"deep json",
       post("Idempotency-Key: j3\r\n", std::string(5000, '[') + std::string(5000, ']')), false,
       "HTTP/1.1 400"},
      {"non-UTF-8 json", post("Idempotency-Key: j4\r\n", "{\"order_id\": \"\xff\xfe\"}"), false,
       "HTTP/1.1 400"},
      {"empty key", post("Idempotency-Key: \r\n", good), false, "HTTP/1.1 400"},
      {"over-long key", post("Idempotency-Key: " + std::string(300, 'k') + "\r\n", good), false,
       "HTTP/1.1 400"},
      {"control byte in key",
       post("Idempotency-Key: a\x01"
            "b\r\n",
            good),
       false, "HTTP/1.1 400"},
      {"non-ASCII key", post("Idempotency-Key: \xd0\xba\xd0\xbb\r\n", good), false, "HTTP/1.1 400"},
      {"half-quoted key", post("Idempotency-Key: \"abc\r\n", good), false, "HTTP/1.1 400"},
      {"wrong method on payments",
       "PUT /v1/payments HTTP/1.1\r\n" + auth + "Content-Length: 0\r\n\r\n", false, "HTTP/1.1 405"},
      {"unknown path", "GET /etc/passwd HTTP/1.1\r\n\r\n", false, "HTTP/1.1 404"},
      {"dot-dot path", "GET /v1/payments/../../healthz HTTP/1.1\r\n" + auth + "\r\n", false,
       "HTTP/1.1 404"},
      {"HTTP/1.0 without keep-alive", "GET /healthz HTTP/1.0\r\n\r\n", false, "HTTP/1.1 200"},
  };
  REQUIRE(cases.size() >= 30);
  for (const Case& c : cases) {
    CAPTURE(c.name);
    const idem::test::RawReply answer = idem::test::raw_exchange(s.port(), c.bytes, c.half_close);
    CAPTURE(answer.bytes.substr(0, 40));
    // Every connection ends at the server's hand: nothing holds a connection open for long.
    CHECK(answer.closed_by_server);
    if (c.expect.empty()) {
      CHECK(answer.bytes.empty());
    } else {
      CHECK(answer.bytes.starts_with(c.expect));
    }
  }
  // Still serving, still correct.
  HttpClient client(s.port());
  CHECK(client.send("GET", "/healthz").status == 200);
  const HttpReply ok = client.send("POST", "/v1/payments", post_headers("after-the-storm"), good);
  CHECK(ok.status == 200);
  CHECK(client.send("POST", "/v1/payments", post_headers("after-the-storm"), good).body == ok.body);
  CHECK(s.charges() == 1);
}
