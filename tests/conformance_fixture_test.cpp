// The conformance fixture's controls (docs/conformance.md) over real loopback sockets: each
// X-Fixture-* field, the caller's tenant, the serve flags, a crash after the claim with a
// restart on the same files, and a record damaged on demand. Every test counts how many
// times the handler really ran (the fixture's counter, in this process or by GET /counter).
#include <doctest/doctest.h>

#include <fmt/format.h>
#include <utility>  // Boost 1.74's awaitable.hpp needs std::exchange declared first

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>
#include <csignal>
#include <nlohmann/json.hpp>

#include "http_client.hpp"
#include "prometheus_check.hpp"
#include "serve_support.hpp"

using namespace std::chrono_literals;
using idem::test::HttpClient;
using idem::test::HttpReply;
using idem::test::ServeProcess;
using nlohmann::json;

namespace {

using idem::test::Headers;

// The fixture in this process, as `idem-demo serve --app conformance` runs it.
struct Fixture : idem::test::Served {
  explicit Fixture(idem::demo::FixtureOptions fixture = {},
                   idem::InFlight policy = idem::InFlight::raise,
                   std::size_t replay_cache_bytes = 0)
      : Served([&] {
          idem::demo::ServerOptions o;
          o.app = idem::demo::AppKind::conformance;
          o.api.policy = policy;
          o.api.replay_cache_bytes = replay_cache_bytes;
          o.fixture = fixture;
          return o;
        }()) {}
  // How many times a counted route's handler ran.
  long long ran() { return server->conformance().count(); }
  idem::MetricsSnapshot metrics() { return server->conformance().coordinator().metrics(); }
};

Headers key(const std::string& k, Headers more = {}) {
  Headers h = {{"Idempotency-Key", k}, {"Content-Type", "application/json"}};
  h.insert(h.end(), more.begin(), more.end());
  return h;
}

std::string error_of(const HttpReply& r) { return json::parse(r.body).at("error"); }

// GET /counter of a server in another process.
long long counter(unsigned short port) {
  return json::parse(HttpClient(port).send("GET", "/counter").body).at("count");
}

// A response as its bytes came on the wire and as parsed.
struct Wire {
  std::string bytes;
  HttpReply reply;
  std::size_t fields(const std::string& name) const {
    std::size_t n = 0;
    for (std::size_t at = 0; (at = bytes.find("\r\n" + name + ":", at)) != std::string::npos; ++at)
      ++n;
    return n;
  }
};

// One request on a fresh connection, its fields written as given (a name may repeat), then
// the whole answer (the server closes: Connection: close). Bounded by raw_exchange's 5 s of
// silence.
Wire exchange(unsigned short port, const std::string& target, const Headers& headers,
              const std::string& body = "", const std::string& method = "POST") {
  std::string request = fmt::format("{} {} HTTP/1.1\r\nHost: x\r\n", method, target);
  for (const auto& [name, value] : headers) request += fmt::format("{}: {}\r\n", name, value);
  request += fmt::format("Content-Length: {}\r\nConnection: close\r\n\r\n", body.size()) + body;
  Wire w;
  w.bytes = idem::test::raw_exchange(port, request, false).bytes;
  boost::beast::http::response_parser<boost::beast::http::string_body> parser;
  parser.eager(true);
  parser.body_limit(boost::none);
  boost::beast::error_code ec;
  std::size_t used = 0;
  while (!ec && !parser.is_done() && used < w.bytes.size())
    used += parser.put(boost::asio::buffer(w.bytes.data() + used, w.bytes.size() - used), ec);
  REQUIRE_MESSAGE(parser.is_done(), w.bytes.substr(0, 300));
  const auto& res = parser.get();
  w.reply.status = static_cast<int>(res.result_int());
  for (const auto& f : res) {
    std::string name(f.name_string());
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    w.reply.headers[name] = std::string(f.value());
  }
  w.reply.body = res.body();
  return w;
}

// A record's column, read from the SQLite file.
std::string column(const std::string& db, const std::string& name, const std::string& k) {
  return idem::test::RawDb(db).text(
      fmt::format("SELECT {} FROM idem_keys WHERE key = '{}'", name, k));
}

}  // namespace

TEST_CASE(
    "conformance fixture: X-Fixture-Status answers that status, 201 and a JSON body by "
    "default") {
  Fixture f;
  HttpClient c(f.port());
  const HttpReply plain = c.send("POST", "/resources", key("s1"), R"({"name": "a"})");
  CHECK(plain.status == 201);
  CHECK(plain.headers.at("content-type") == "application/json");
  const json body = json::parse(plain.body);
  CHECK(body.at("tenant") == "default");
  CHECK(body.at("key") == "s1");
  CHECK(body.at("run") == 1);
  CHECK(body.at("body") == R"({"name": "a"})");
  for (int code : {200, 202, 404, 409, 422}) {
    CAPTURE(code);
    const std::string k = fmt::format("s-{}", code);
    const Headers h = key(k, {{"X-Fixture-Status", std::to_string(code)}});
    CHECK(c.send("POST", "/resources", h, "x").status == code);
    // The replay is the stored answer, whatever the retry's controls say.
    const HttpReply again =
        c.send("POST", "/resources", key(k, {{"X-Fixture-Status", "500"}}), "x");
    CHECK(again.status == code);
    CHECK(again.headers.at("idempotent-replayed") == "true");
  }
  // 204 has no body; a path under /resources/ and PATCH are routes too.
  const HttpReply empty =
      c.send("POST", "/resources/7", key("s-204", {{"X-Fixture-Status", "204"}}));
  CHECK(empty.status == 204);
  CHECK(empty.body.empty());
  CHECK(c.send("PATCH", "/resources/7", key("s-patch"), "p").status == 201);
  CHECK(c.send("PATCH", "/resources/7", key("s-patch"), "p").headers.at("idempotent-replayed") ==
        "true");
  CHECK(c.send("PUT", "/resources/7", key("s-put"), "p").status == 405);
  CHECK(f.ran() == 1 + 5 + 1 + 1);
  CHECK(json::parse(c.send("GET", "/counter").body).at("count") == f.ran());
}

TEST_CASE(
    "conformance fixture: a 500 releases the key, the 201 after it is stored, its "
    "Location and ETag replayed and its Set-Cookie neither replayed nor stored") {
  Fixture f;
  HttpClient c(f.port());
  const std::string body = R"({"amount": 5})";
  const HttpReply failed =
      c.send("POST", "/resources", key("k1", {{"X-Fixture-Status", "500"}}), body);
  CHECK(failed.status == 500);
  const Headers fields = {{"X-Fixture-Status", "201"},
                          {"X-Fixture-Header", "Location: /resources/41"},
                          {"X-Fixture-Header", "ETag: \"v1\""},
                          {"X-Fixture-Header", "Set-Cookie: session=first-callers; HttpOnly"}};
  // (the fields repeat: written as they are, not through HttpClient's one value per name)
  const Wire created = exchange(f.port(), "/resources", key("k1", fields), body);
  CHECK(created.reply.status == 201);
  CHECK_FALSE(created.reply.has("idempotent-replayed"));
  CHECK(created.reply.headers.at("location") == "/resources/41");
  CHECK(created.reply.headers.at("etag") == "\"v1\"");
  CHECK(created.reply.headers.at("set-cookie") == "session=first-callers; HttpOnly");
  const HttpReply replay = c.send("POST", "/resources", key("k1"), body);
  CHECK(replay.status == 201);
  CHECK(replay.headers.at("idempotent-replayed") == "true");
  CHECK(replay.headers.at("location") == "/resources/41");
  CHECK(replay.headers.at("etag") == "\"v1\"");
  CHECK_FALSE(replay.has("set-cookie"));
  CHECK(replay.body == created.reply.body);
  CHECK(json::parse(replay.body).at("run") == 2);
  CHECK(f.ran() == 2);  // the 500 and the 201; the replay ran nothing
  const std::string stored = column(f.db, "headers", "k1");
  CAPTURE(stored);
  CHECK(stored.find("/resources/41") != std::string::npos);
  CHECK(stored.find("\\\"v1\\\"") != std::string::npos);
  CHECK(stored.find("ookie") == std::string::npos);
  CHECK(stored.find("session=") == std::string::npos);
}

TEST_CASE(
    "conformance fixture: X-Fixture-Delay-Ms waits without blocking another request on "
    "another connection") {
  Fixture f;
  HttpClient waiting(f.port());
  waiting.write_only("POST", "/resources", key("d1", {{"X-Fixture-Delay-Ms", "6000"}}), "x");
  REQUIRE(idem::test::eventually([&] { return f.ran() == 1; }));
  // Answered within raw_exchange's 5 s bound, while the first waits 6 s.
  const Wire other = exchange(f.port(), "/resources", key("d2"), "y");
  CHECK(other.reply.status == 201);
  CHECK(column(f.db, "state", "d1") == "1");  // still in progress: its handler is waiting
  CHECK(column(f.db, "state", "d2") == "2");
  CHECK(exchange(f.port(), "/resources", key("d1"), "x").reply.status == 409);
  const HttpReply first = waiting.receive();
  CHECK(first.status == 201);
  CHECK(json::parse(first.body).at("run") == 1);
  CHECK(f.ran() == 2);
}

TEST_CASE(
    "conformance fixture: X-Fixture-Header sets response fields, repeatable, and a "
    "framing or malformed one is 400") {
  Fixture f;
  const Wire w = exchange(f.port(), "/resources",
                          key("h1", {{"X-Fixture-Header", "X-Trace: a b c"},
                                     {"X-Fixture-Header", "Link: </a>; rel=\"next\""},
                                     {"X-Fixture-Header", "Link: </b>; rel=\"prev\""},
                                     {"X-Fixture-Header", "Content-Type: text/csv"}}),
                          "x");
  CHECK(w.reply.status == 201);
  CHECK(w.reply.headers.at("x-trace") == "a b c");
  CHECK(w.fields("Link") == 2);
  CHECK(w.reply.headers.at("content-type") == "text/csv");
  const Wire replay = exchange(f.port(), "/resources", key("h1"), "x");
  CHECK(replay.reply.headers.at("idempotent-replayed") == "true");
  CHECK(replay.fields("Link") == 2);
  CHECK(replay.reply.headers.at("x-trace") == "a b c");
  for (const char* bad : {"Content-Length: 5", "Transfer-Encoding: chunked", "Connection: close",
                          "no colon", "Bad Name: x", ": empty name"}) {
    CAPTURE(bad);
    const Wire refused = exchange(f.port(), "/resources", key("h2", {{"X-Fixture-Header", bad}}));
    CHECK(refused.reply.status == 400);
    CHECK(error_of(refused.reply) == "invalid_request");
  }
  CHECK(f.ran() == 1);
  CHECK(idem::test::RawDb(f.db).rows() == 1);
}

TEST_CASE(
    "conformance fixture: X-Fixture-Body-Bytes answers that many bytes, replayed byte for "
    "byte") {
  Fixture f;
  HttpClient c(f.port());
  const HttpReply big = c.send("POST", "/resources", key("b1", {{"X-Fixture-Body-Bytes", "3000"}}));
  CHECK(big.status == 201);
  CHECK(big.body == std::string(3000, 'x'));
  CHECK(big.headers.at("content-type") == "application/octet-stream");
  CHECK(big.headers.at("content-length") == "3000");
  const HttpReply again = c.send("POST", "/resources", key("b1"));
  CHECK(again.body == big.body);
  CHECK(again.headers.at("idempotent-replayed") == "true");
  const HttpReply none = c.send("POST", "/resources", key("b0", {{"X-Fixture-Body-Bytes", "0"}}));
  CHECK(none.status == 201);
  CHECK(none.body.empty());
  CHECK(f.ran() == 2);
}

TEST_CASE(
    "conformance fixture: X-Fixture-Chunked sends the body chunked without "
    "Content-Length, and the replay is the same bytes") {
  Fixture f;
  const Wire w =
      exchange(f.port(), "/resources",
               key("c1", {{"X-Fixture-Chunked", "1"}, {"X-Fixture-Body-Bytes", "5000"}}));
  CHECK(w.reply.status == 201);
  CHECK(w.reply.headers.at("transfer-encoding") == "chunked");
  CHECK_FALSE(w.reply.has("content-length"));
  CHECK(w.reply.body == std::string(5000, 'x'));
  CHECK(w.bytes.find("\r\n\r\n1388\r\n") != std::string::npos);  // one chunk of 0x1388 bytes
  // The framing is per message: the replay carries the same bytes with a Content-Length.
  const Wire replay = exchange(f.port(), "/resources", key("c1"));
  CHECK(replay.reply.headers.at("idempotent-replayed") == "true");
  CHECK(replay.reply.body == w.reply.body);
  // The default JSON body chunked too, and X-Fixture-Chunked: 0 is the default framing.
  const Wire json_body =
      exchange(f.port(), "/resources", key("c2", {{"X-Fixture-Chunked", "1"}}), "j");
  CHECK(json_body.reply.headers.at("transfer-encoding") == "chunked");
  CHECK(json::parse(json_body.reply.body).at("body") == "j");
  const Wire framed = exchange(f.port(), "/resources", key("c3", {{"X-Fixture-Chunked", "0"}}));
  CHECK(framed.reply.has("content-length"));
  CHECK_FALSE(framed.reply.has("transfer-encoding"));
  CHECK(f.ran() == 3);
}

TEST_CASE(
    "conformance fixture: a bad control value is 400 before the layer: nothing runs, "
    "nothing is stored") {
  Fixture f;
  const std::vector<Headers> bad = {
      {{"X-Fixture-Status", "99"}},
      {{"X-Fixture-Status", "600"}},
      {{"X-Fixture-Status", "2O1"}},
      {{"X-Fixture-Status", "201"}, {"X-Fixture-Status", "500"}},
      {{"X-Fixture-Delay-Ms", "-1"}},
      {{"X-Fixture-Delay-Ms", "60001"}},
      {{"X-Fixture-Body-Bytes", "16777217"}},
      {{"X-Fixture-Chunked", "yes"}},
      {{"X-Fixture-Crash", "now"}},
      {{"X-Fixture-Colour", "blue"}},
      {{"X-Fixture-Status", "204"}, {"X-Fixture-Body-Bytes", "3"}},
  };
  for (const Headers& controls : bad) {
    CAPTURE(controls.front().first + ": " + controls.front().second);
    const Wire refused = exchange(f.port(), "/resources", key("bad", controls), "x");
    CHECK(refused.reply.status == 400);
    CHECK(error_of(refused.reply) == "invalid_request");
  }
  CHECK(f.ran() == 0);
  CHECK(idem::test::RawDb(f.db).rows() == 0);
  // The key is still free: the same key with good controls runs.
  CHECK(exchange(f.port(), "/resources", key("bad"), "x").reply.status == 201);
  CHECK(f.ran() == 1);
}

TEST_CASE(
    "conformance fixture: X-Fixture-Crash kills the process after the claim, a restart on "
    "the same files holds the key until its lease ends, then runs it once") {
  idem::test::TempDir dir;
  const std::string db = dir.file("crash.db");
  const std::vector<std::string> args = {"--app", "conformance", "--db", db, "--lease-ms", "3000"};
  {
    ServeProcess first("", args);
    HttpClient c(first.port);
    c.write_only("POST", "/resources", key("crash-1", {{"X-Fixture-Crash", "after-claim"}}), "x");
    CHECK(first.wait(30s) == 128 + SIGKILL);
    CHECK_THROWS(c.receive());  // no answer: the process died inside the handler
  }
  CHECK(column(db, "state", "crash-1") == "1");  // reserved, never completed nor released
  ServeProcess second("", args);
  HttpClient c(second.port);
  const HttpReply held = c.send("POST", "/resources", key("crash-1"), "x");
  CHECK(held.status == 409);
  CHECK(error_of(held) == "idempotency_key_in_use");
  // "... it holds the key for up to N ms more": the lease of --lease-ms, not the default 30 s.
  const std::string detail = json::parse(held.body).at("detail");
  const auto up_to = detail.find("up to ");
  REQUIRE(up_to != std::string::npos);
  CHECK(std::stoll(detail.substr(up_to + 6)) <= 3000);
  HttpReply after;
  REQUIRE(idem::test::eventually([&] {
    after = c.send("POST", "/resources", key("crash-1"), "x");
    return after.status != 409;
  }));
  CHECK(after.status == 201);
  CHECK_FALSE(after.has("idempotent-replayed"));
  CHECK(json::parse(after.body).at("run") == 1);
  CHECK(c.send("POST", "/resources", key("crash-1"), "x").headers.at("idempotent-replayed") ==
        "true");
  CHECK(counter(second.port) == 1);  // once here, after the run the first process died in
  ::kill(second.pid, SIGTERM);
  CHECK(second.wait(20s) == 0);
}

TEST_CASE(
    "conformance fixture: --tenant-header scopes keys by the caller's tenant: the same key "
    "from two tenants runs twice, neither a replay") {
  idem::test::TempDir dir;
  const std::string db = dir.file("tenants.db");
  ServeProcess s("", {"--app", "conformance", "--db", db, "--tenant-header", "X-Caller"});
  HttpClient c(s.port);
  const HttpReply a =
      c.send("POST", "/resources", key("same", {{"X-Caller", "tenant-A:user-1"}}), "x");
  const HttpReply b =
      c.send("POST", "/resources", key("same", {{"X-Caller", "tenant-B:user-1"}}), "x");
  CHECK(a.status == 201);
  CHECK(b.status == 201);
  CHECK_FALSE(a.has("idempotent-replayed"));
  CHECK_FALSE(b.has("idempotent-replayed"));
  CHECK(json::parse(a.body).at("tenant") == "tenant-A");
  CHECK(json::parse(b.body).at("tenant") == "tenant-B");
  CHECK(counter(s.port) == 2);
  // Another user of tenant-A is the same tenant: its replay.
  const HttpReply a2 =
      c.send("POST", "/resources", key("same", {{"X-Caller", "tenant-A:user-2"}}), "x");
  CHECK(a2.headers.at("idempotent-replayed") == "true");
  CHECK(json::parse(a2.body).at("tenant") == "tenant-A");
  // Without the field, or with no tenant in it: 400, nothing runs, nothing is stored.
  for (const Headers& h : {key("none"), key("none", {{"X-Caller", ":user-1"}})}) {
    const HttpReply refused = c.send("POST", "/resources", h, "x");
    CHECK(refused.status == 400);
    CHECK(error_of(refused) == "invalid_request");
  }
  CHECK(exchange(s.port, "/resources",
                 key("none", {{"X-Caller", "tenant-A:u"}, {"X-Caller", "tenant-B:u"}}), "x")
            .reply.status == 400);
  CHECK(json::parse(c.send("GET", "/idempotency").body).at("scope") ==
        "tenant (from the request's credentials), operation, key");
  CHECK(counter(s.port) == 2);
  CHECK(idem::test::RawDb(db).rows() == 2);
  // A record damaged on demand is the caller's tenant's only.
  const std::string target = R"({"method": "POST", "path": "/resources", "key": "same"})";
  CHECK(c.send("POST", "/_fixture/corrupt", {{"X-Caller", "tenant-B:ops"}}, target).status == 204);
  CHECK(c.send("POST", "/_fixture/corrupt", {}, target).status == 400);
  CHECK(c.send("POST", "/resources", key("same", {{"X-Caller", "tenant-B:user-1"}}), "x").status ==
        500);
  CHECK(c.send("POST", "/resources", key("same", {{"X-Caller", "tenant-A:user-1"}}), "x")
            .headers.at("idempotent-replayed") == "true");
  CHECK(counter(s.port) == 2);
  ::kill(s.pid, SIGTERM);
  CHECK(s.wait(20s) == 0);
}

TEST_CASE(
    "conformance fixture: --replayed-header names the replay marker, --ttl and --lease-ms "
    "reach the fixture's coordinator") {
  idem::test::TempDir dir;
  ServeProcess s("", {"--app", "conformance", "--db", dir.file("r.db"), "--replayed-header",
                      "Idempotency-Replayed", "--ttl", "120", "--lease-ms", "4000"});
  HttpClient c(s.port);
  CHECK(c.send("POST", "/resources", key("r1"), "x").status == 201);
  const HttpReply replay = c.send("POST", "/resources", key("r1"), "x");
  CHECK(replay.headers.at("idempotency-replayed") == "true");
  CHECK_FALSE(replay.has("idempotent-replayed"));
  const json policy = json::parse(c.send("GET", "/idempotency").body);
  CHECK(policy.at("replayed_header") == "Idempotency-Replayed");
  CHECK(policy.at("expires_after_seconds") == 120);
  // The lease: a key in flight is held for at most --lease-ms.
  HttpClient holder(s.port);
  holder.write_only("POST", "/resources", key("r2", {{"X-Fixture-Delay-Ms", "1500"}}), "x");
  REQUIRE(idem::test::eventually([&] { return counter(s.port) == 2; }));
  const HttpReply busy = c.send("POST", "/resources", key("r2"), "x");
  CHECK(busy.status == 409);
  const std::string detail = json::parse(busy.body).at("detail");
  CHECK(std::stoll(detail.substr(detail.find("up to ") + 6)) <= 4000);
  CHECK(holder.receive().status == 201);
  CHECK(counter(s.port) == 2);
  ::kill(s.pid, SIGTERM);
  CHECK(s.wait(20s) == 0);
}

TEST_CASE(
    "conformance fixture: with --replay-cache-mb a replay is answered from memory, the handler "
    "ran once and /metrics counts the cache") {
  using idem::test::prometheus_parsed;
  Fixture f({}, idem::InFlight::raise, std::size_t{1} << 20);
  HttpClient c(f.port());
  const HttpReply first = c.send("POST", "/resources", key("rc1"), "x");
  REQUIRE(first.status == 201);
  const json before = prometheus_parsed(c.send("GET", "/metrics").body);
  for (int i = 0; i < 3; ++i) {
    CAPTURE(i);
    const HttpReply again = c.send("POST", "/resources", key("rc1"), "x");
    CHECK(again.status == 201);
    CHECK(again.headers.at("idempotent-replayed") == "true");
    CHECK(again.body == first.body);
  }
  CHECK(c.send("POST", "/resources", key("rc1"), "other").status == 422);
  CHECK(f.ran() == 1);
  const json after = prometheus_parsed(c.send("GET", "/metrics").body);
  // The first replay reads the record from the file and keeps it; the other two and the reuse
  // check are answered from memory.
  CHECK(before.at("counters").at("idem_replay_cache_hits_total") == 0);
  CHECK(after.at("counters").at("idem_replay_cache_hits_total") == 3);
  CHECK(after.at("gauges").at("idem_replay_cache_entries") == 1);
  CHECK(f.metrics().replayed == 3);
  // Without the option, no cache and no cache lines.
  Fixture plain;
  CHECK_FALSE(prometheus_parsed(HttpClient(plain.port()).send("GET", "/metrics").body)
                  .at("counters")
                  .contains("idem_replay_cache_hits_total"));
}

TEST_CASE(
    "conformance fixture: GET /metrics holds a latency histogram per outcome, read by "
    "Prometheus's text parser with buckets, sum and count that agree") {
  using idem::test::histogram_count;
  // Under wait: executed, replayed, a reuse, a 500 that releases its key, and a duplicate that
  // waits for its first and replays it.
  Fixture f({.max_wait = 30s}, idem::InFlight::wait);
  HttpClient c(f.port());
  for (const char* k : {"m1", "m2", "m3"})
    CHECK(c.send("POST", "/resources", key(k), "x").status == 201);
  for (int i = 0; i < 2; ++i)
    CHECK(c.send("POST", "/resources", key("m1"), "x").headers.at("idempotent-replayed") == "true");
  CHECK(c.send("POST", "/resources", key("m1"), "other").status == 422);
  CHECK(c.send("POST", "/resources", key("m5", {{"X-Fixture-Status", "500"}}), "x").status == 500);
  HttpClient holder(f.port());
  holder.write_only("POST", "/resources", key("mw", {{"X-Fixture-Delay-Ms", "1500"}}), "x");
  REQUIRE(idem::test::eventually([&] { return f.ran() == 5; }));
  const HttpReply waited = c.send("POST", "/resources", key("mw"), "x");  // waits, then replays
  CHECK(waited.headers.at("idempotent-replayed") == "true");
  CHECK(holder.receive().status == 201);
  CHECK(f.ran() == 5);  // m1, m2, m3, m5, mw: once each
  const nlohmann::json parsed = idem::test::prometheus_parsed(c.send("GET", "/metrics").body);
  const std::map<std::string, double> expected = {
      {"executed", 4}, {"replayed", 3},    {"conflict", 0}, {"reuse", 1},
      {"released", 1}, {"failed_open", 0}, {"no_key", 0},   {"error", 0}};
  for (const auto& entry : expected) {
    const std::string& outcome = entry.first;  // (not a structured binding: clang 14 cannot
    const auto n = entry.second;               // capture one in CAPTURE's lambda)
    CAPTURE(outcome);
    CHECK(histogram_count(parsed, "idem_call_duration_seconds", "outcome=" + outcome) == n);
  }
  CHECK(histogram_count(parsed, "idem_wait_duration_seconds") == 1);
  CHECK(histogram_count(parsed, "idem_store_duration_seconds", "operation=apply") ==
        histogram_count(parsed, "idem_commit_batch_size"));
  CHECK(histogram_count(parsed, "idem_store_duration_seconds", "operation=apply") > 0);

  // Under raise: a duplicate while its first runs is a conflict.
  Fixture raising;
  HttpClient first(raising.port());
  first.write_only("POST", "/resources", key("c1", {{"X-Fixture-Delay-Ms", "1000"}}), "x");
  REQUIRE(idem::test::eventually([&] { return raising.ran() == 1; }));
  HttpClient dup(raising.port());
  CHECK(dup.send("POST", "/resources", key("c1"), "x").status == 409);
  CHECK(first.receive().status == 201);
  CHECK(raising.ran() == 1);
  const nlohmann::json busy = idem::test::prometheus_parsed(dup.send("GET", "/metrics").body);
  CHECK(histogram_count(busy, "idem_call_duration_seconds", "outcome=conflict") == 1);
  CHECK(histogram_count(busy, "idem_call_duration_seconds", "outcome=executed") == 1);
  CHECK(histogram_count(busy, "idem_wait_duration_seconds") == 0);
}

TEST_CASE("conformance fixture: --max-wait-ms bounds a duplicate's wait under --policy wait") {
  idem::test::TempDir dir;
  ServeProcess s("", {"--app", "conformance", "--db", dir.file("w.db"), "--policy", "wait",
                      "--max-wait-ms", "200"});
  HttpClient holder(s.port);
  holder.write_only("POST", "/resources", key("w1", {{"X-Fixture-Delay-Ms", "3000"}}), "x");
  REQUIRE(idem::test::eventually([&] { return counter(s.port) == 1; }));
  // The duplicate waited 200 ms, not the default 10 s, and gave up while the first still ran.
  HttpClient c(s.port);
  const HttpReply gave_up = c.send("POST", "/resources", key("w1"), "x");
  CHECK(gave_up.status == 409);
  CHECK(error_of(gave_up) == "idempotency_key_in_use");
  CHECK(column(dir.file("w.db"), "state", "w1") == "1");
  const HttpReply first = holder.receive();
  CHECK(first.status == 201);
  const HttpReply replay = c.send("POST", "/resources", key("w1"), "x");
  CHECK(replay.headers.at("idempotent-replayed") == "true");
  CHECK(replay.body == first.body);
  CHECK(counter(s.port) == 1);
  ::kill(s.pid, SIGTERM);
  CHECK(s.wait(20s) == 0);
}

TEST_CASE(
    "conformance fixture: a chunked response over --max-stored-body-bytes is delivered "
    "whole, marked as not kept, and the retry runs again") {
  idem::test::TempDir dir;
  const std::string db = dir.file("m.db");
  ServeProcess s("", {"--app", "conformance", "--db", db, "--max-stored-body-bytes", "1000"});
  const Headers big = key("m1", {{"X-Fixture-Body-Bytes", "5000"}, {"X-Fixture-Chunked", "1"}});
  const Wire first = exchange(s.port, "/resources", big);
  CHECK(first.reply.status == 201);
  CHECK(first.reply.body == std::string(5000, 'x'));
  CHECK(first.reply.headers.at("transfer-encoding") == "chunked");
  CHECK(first.reply.headers.at("idempotent-not-stored") == "body-too-large");
  CHECK(column(db, "state", "m1") == "3");  // released
  const Wire retry = exchange(s.port, "/resources", big);
  CHECK(retry.reply.status == 201);
  CHECK(retry.reply.body.size() == 5000);
  CHECK_FALSE(retry.reply.has("idempotent-replayed"));
  CHECK(retry.reply.headers.at("idempotent-not-stored") == "body-too-large");
  CHECK(counter(s.port) == 2);
  // At the limit: stored and replayed as always.
  const Headers small = key("m2", {{"X-Fixture-Body-Bytes", "1000"}, {"X-Fixture-Chunked", "1"}});
  CHECK_FALSE(exchange(s.port, "/resources", small).reply.has("idempotent-not-stored"));
  const Wire replay = exchange(s.port, "/resources", small);
  CHECK(replay.reply.headers.at("idempotent-replayed") == "true");
  CHECK(replay.reply.body.size() == 1000);
  CHECK(counter(s.port) == 3);
  HttpClient c(s.port);
  CHECK(json::parse(c.send("GET", "/idempotency").body).at("max_stored_body_bytes") == 1000);
  ::kill(s.pid, SIGTERM);
  CHECK(s.wait(20s) == 0);
}

TEST_CASE(
    "conformance fixture: a record damaged by POST /_fixture/corrupt is refused with 500 "
    "idempotency_record_corrupt, never run again, and counted") {
  Fixture f;
  HttpClient c(f.port());
  const std::string body = R"({"n": 1})";
  CHECK(c.send("POST", "/resources", key("bad-1"), body).status == 201);
  const std::string target =
      json{{"method", "POST"}, {"path", "/resources"}, {"key", "bad-1"}, {"body", body}}.dump();
  const HttpReply damaged = c.send("POST", "/_fixture/corrupt", {}, target);
  CHECK(damaged.status == 204);
  CHECK(column(f.db, "headers", "bad-1") == "not json");
  for (int i = 0; i < 2; ++i) {
    const HttpReply refused = c.send("POST", "/resources", key("bad-1"), body);
    CHECK(refused.status == 500);
    CHECK(refused.headers.at("content-type") == "application/problem+json");
    CHECK(error_of(refused) == "idempotency_record_corrupt");
    CHECK_FALSE(refused.has("idempotent-replayed"));
  }
  CHECK(f.ran() == 1);
  CHECK(f.metrics().corrupt_records == 2);
  CHECK(c.send("GET", "/metrics").body.find("idem_corrupt_records_total 2") != std::string::npos);
  // A key quoted as its field carried it is the same record; no record is 404, bad input 400.
  CHECK(c.send("POST", "/_fixture/corrupt", {},
               json{{"path", "/resources"}, {"key", "\"bad-1\""}}.dump())
            .status == 204);
  CHECK(c.send("POST", "/_fixture/corrupt", {},
               json{{"path", "/resources"}, {"key", "never-used"}}.dump())
            .status == 404);
  CHECK(c.send("POST", "/_fixture/corrupt", {},
               json{{"method", "PATCH"}, {"path", "/resources"}, {"key", "bad-1"}}.dump())
            .status == 404);
  CHECK(c.send("POST", "/_fixture/corrupt", {}, "not json").status == 400);
  CHECK(c.send("POST", "/_fixture/corrupt", {}, json{{"path", "/resources"}}.dump()).status == 400);
  CHECK(f.ran() == 1);
}

TEST_CASE("conformance fixture: POST /_fixture/corrupt is for loopback peers only") {
  idem::test::TempDir dir;
  idem::demo::ConformanceApp plain({.db = dir.file("peers.db")});
  idem::demo::ConformanceApp tenants(
      {.db = dir.file("tenants.db"), .fixture = {.tenant_header = "X-Caller"}});
  const auto ask = [&](const std::string& address, idem::demo::ConformanceApp& app) {
    idem::demo::Request req{boost::beast::http::verb::post, "/_fixture/corrupt", 11};
    req.body() = R"({"path": "/resources", "key": "k"})";
    req.prepare_payload();
    boost::asio::io_context io;
    auto answer =
        boost::asio::co_spawn(io, app.handle(std::move(req), {address}), boost::asio::use_future);
    io.run();
    return static_cast<int>(answer.get().result_int());
  };
  CHECK(ask("192.0.2.7", plain) == 403);
  CHECK(ask("10.0.0.1", plain) == 403);
  CHECK(ask("2001:db8::1", plain) == 403);
  CHECK(ask("127.0.0.1", plain) == 404);  // allowed; there is no such record
  CHECK(ask("127.1.2.3", plain) == 404);
  CHECK(ask("::1", plain) == 404);
  CHECK(ask("::ffff:127.0.0.1", plain) == 404);
  // The peer is checked first: another host learns nothing about the tenant field.
  CHECK(ask("192.0.2.7", tenants) == 403);
  CHECK(ask("127.0.0.1", tenants) == 400);  // no X-Caller
}
