// idem's HTTP layer (idem/beast.hpp) over real loopback sockets, through the conformance
// fixture of `idem-demo serve --app conformance`: the Idempotency-Key draft's rules, each
// counted by how many times the handler really ran (the fixture's counter).
#include <doctest/doctest.h>

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <thread>

#include "http_client.hpp"
#include "serve_support.hpp"

using namespace std::chrono_literals;
using idem::test::HttpClient;
using idem::test::HttpReply;
using nlohmann::json;

namespace {

using idem::test::Headers;

// The conformance fixture, as `idem-demo serve --app conformance` runs it.
struct Fixture : idem::test::Served {
  explicit Fixture(idem::InFlight policy = idem::InFlight::raise)
      : Served([policy] {
          idem::demo::ServerOptions o;
          o.app = idem::demo::AppKind::conformance;
          o.api.policy = policy;
          return o;
        }()) {}
  // How many times a counted route's handler ran.
  long long ran() { return server->conformance().count(); }
  // Until `n` requests hold their keys.
  void until_reserved(std::uint64_t n) {
    REQUIRE(idem::test::eventually(
        [&] { return server->conformance().coordinator().metrics().reserved >= n; }));
  }
};

Headers key(const std::string& k, const std::string& type = "application/json") {
  return {{"Idempotency-Key", k}, {"Content-Type", type}};
}

std::string error_of(const HttpReply& r) { return json::parse(r.body).at("error"); }

}  // namespace

TEST_CASE("http layer: a POST runs once per key, the duplicate replays status, headers, bytes") {
  Fixture f;
  HttpClient c(f.port());
  const std::string body = R"({"amount": 100, "note": "first"})";
  const HttpReply first = c.send("POST", "/echo", key("k1"), body);
  CHECK(first.status == 201);
  CHECK(first.body == body);
  CHECK(first.headers.at("content-type") == "application/json");
  CHECK_FALSE(first.has("idempotent-replayed"));
  CHECK(first.has("idempotency-key-expires"));
  for (int i = 0; i < 3; ++i) {
    const HttpReply again = c.send("POST", "/echo", key("k1"), body);
    CHECK(again.status == 201);
    CHECK(again.body == body);
    CHECK(again.headers.at("content-type") == "application/json");
    CHECK(again.headers.at("idempotent-replayed") == "true");
    CHECK(again.headers.at("idempotency-key-expires") ==
          first.headers.at("idempotency-key-expires"));
  }
  CHECK(f.ran() == 1);
  // Bytes that are not JSON, and no Content-Type: echoed as application/octet-stream.
  const std::string bytes("\x00\xff\x01 raw", 7);
  const HttpReply raw = c.send("POST", "/echo", {{"Idempotency-Key", "k2"}}, bytes);
  CHECK(raw.body == bytes);
  CHECK(raw.headers.at("content-type") == "application/octet-stream");
  CHECK(c.send("POST", "/echo", {{"Idempotency-Key", "k2"}}, bytes).body == bytes);
  CHECK(f.ran() == 2);
}

TEST_CASE("http layer: a GET (and PUT, DELETE) with a key passes through, never replayed") {
  Fixture f;
  HttpClient c(f.port());
  CHECK(c.send("GET", "/counter", key("g1")).body == R"({"count":0})");
  c.send("POST", "/echo", key("p1"), "{}");
  const HttpReply second = c.send("GET", "/counter", key("g1"));
  CHECK(second.body == R"({"count":1})");  // a replay would say 0
  CHECK_FALSE(second.has("idempotent-replayed"));
  CHECK_FALSE(second.has("idempotency-key-expires"));
  // PUT is not protected: it reaches the route (which takes only POST) without a key check.
  CHECK(c.send("PUT", "/echo", {}, "{}").status == 405);
  CHECK(c.send("DELETE", "/echo", {}).status == 405);
  CHECK(f.ran() == 1);
  idem::test::RawDb raw(f.db);
  CHECK(raw.rows() == 1);  // only the POST's key
}

TEST_CASE("http layer: the header name's case does not matter") {
  Fixture f;
  HttpClient c(f.port());
  const HttpReply a = c.send("POST", "/echo", {{"idempotency-key", "case-1"}}, "x");
  const HttpReply b = c.send("POST", "/echo", {{"IDEMPOTENCY-KEY", "case-1"}}, "x");
  const HttpReply d = c.send("POST", "/echo", {{"IdEmPoTeNcY-kEy", "case-1"}}, "x");
  CHECK(a.status == 201);
  CHECK_FALSE(a.has("idempotent-replayed"));
  CHECK(b.headers.at("idempotent-replayed") == "true");
  CHECK(d.headers.at("idempotent-replayed") == "true");
  CHECK(f.ran() == 1);
}

TEST_CASE("http layer: a quoted (RFC 8941 sf-string) key and the same bare key are one key") {
  Fixture f;
  HttpClient c(f.port());
  c.send("POST", "/echo", key("\"order-7\""), "x");
  const HttpReply bare = c.send("POST", "/echo", key("order-7"), "x");
  CHECK(bare.headers.at("idempotent-replayed") == "true");
  // Escapes decode: "a\"b" is the key a"b... which a bare value cannot carry.
  c.send("POST", "/echo", key(R"("a\\b")"), "y");
  CHECK(c.send("POST", "/echo", key(R"(a\b)"), "y").headers.at("idempotent-replayed") == "true");
  // A comma inside quotes is part of one key, not a list.
  CHECK(c.send("POST", "/echo", key("\"a,b\""), "z").status == 201);
  CHECK(f.ran() == 2 + 1);
}

TEST_CASE("http layer: a missing key is 400 and runs nothing, malformed keys are 400") {
  Fixture f;
  HttpClient c(f.port());
  const HttpReply none = c.send("POST", "/echo", {{"Content-Type", "text/plain"}}, "x");
  CHECK(none.status == 400);
  CHECK(none.headers.at("content-type") == "application/problem+json");
  CHECK(error_of(none) == "idempotency_key_required");
  CHECK(json::parse(none.body).at("status") == 400);
  for (const std::string& bad :
       {std::string("a,b"), std::string("\"a\", \"b\""), std::string("\"unterminated"),
        std::string("\"bad\\escape\""), std::string(256, 'k'), std::string("x\"y")}) {
    CAPTURE(bad);
    const HttpReply r = c.send("POST", "/echo", key(bad), "x");
    CHECK(r.status == 400);
    CHECK(error_of(r) == "idempotency_key_invalid");
  }
  // Two key fields: which one would a proxy keep? Neither: 400.
  const idem::test::RawReply two = idem::test::raw_exchange(
      f.port(),
      "POST /echo HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k1\r\nIdempotency-Key: k2\r\n"
      "Content-Length: 1\r\nConnection: close\r\n\r\nx",
      false);
  CHECK(two.bytes.starts_with("HTTP/1.1 400"));
  CHECK(two.bytes.find("idempotency_key_invalid") != std::string::npos);
  CHECK(f.ran() == 0);
  idem::test::RawDb raw(f.db);
  CHECK(raw.rows() == 0);
}

TEST_CASE("http layer: a changed payload is 422, the original record stays and still replays") {
  Fixture f;
  HttpClient c(f.port());
  const HttpReply original = c.send("POST", "/echo", key("k1"), R"({"amount": 100})");
  const HttpReply changed = c.send("POST", "/echo", key("k1"), R"({"amount": 999})");
  CHECK(changed.status == 422);
  CHECK(error_of(changed) == "idempotency_key_reuse");
  // The Content-Type is part of the request too.
  CHECK(c.send("POST", "/echo", key("k1", "text/plain"), R"({"amount": 100})").status == 422);
  const HttpReply retry = c.send("POST", "/echo", key("k1"), R"({"amount": 100})");
  CHECK(retry.status == 201);
  CHECK(retry.body == original.body);
  CHECK(retry.headers.at("idempotent-replayed") == "true");
  CHECK(f.ran() == 1);
}

TEST_CASE("http layer: a 4xx is an outcome, stored and replayed, a 5xx is not stored") {
  Fixture f;
  HttpClient c(f.port());
  for (int code : {404, 402, 409, 303}) {
    CAPTURE(code);
    const std::string k = fmt::format("k-{}", code);
    const std::string target = fmt::format("/status/{}", code);
    CHECK(c.send("POST", target, key(k), "x").status == code);
    const HttpReply again = c.send("POST", target, key(k), "x");
    CHECK(again.status == code);
    CHECK(again.body == fmt::format("status:{}", code));
    CHECK(again.headers.at("idempotent-replayed") == "true");
  }
  CHECK(f.ran() == 4);
  for (int code : {500, 503}) {
    CAPTURE(code);
    const std::string k = fmt::format("k-{}", code);
    const std::string target = fmt::format("/status/{}", code);
    CHECK(c.send("POST", target, key(k), "x").status == code);
    const HttpReply again = c.send("POST", target, key(k), "x");
    CHECK(again.status == code);
    CHECK_FALSE(again.has("idempotent-replayed"));
  }
  CHECK(f.ran() == 4 + 2 * 2);  // each 5xx ran again: the key was released
}

TEST_CASE("http layer: a duplicate in flight is 409 with a whole-seconds Retry-After >= 1") {
  Fixture f;
  HttpClient holder(f.port());
  holder.write_only("POST", "/slow?ms=3000", key("busy"), "x");
  f.until_reserved(1);
  HttpClient c(f.port());
  const HttpReply busy = c.send("POST", "/slow?ms=3000", key("busy"), "x");
  CHECK(busy.status == 409);
  CHECK(error_of(busy) == "idempotency_key_in_use");
  const std::string& after = busy.headers.at("retry-after");
  CHECK(after.find_first_not_of("0123456789") == std::string::npos);
  CHECK(std::stoll(after) >= 1);
  // A different payload while the first is in flight is 422, not 409.
  CHECK(c.send("POST", "/slow?ms=3000", key("busy"), "other").status == 422);
  const HttpReply done = holder.receive();
  CHECK(done.status == 200);
  CHECK(done.body == "slept:3000");
  CHECK(c.send("POST", "/slow?ms=3000", key("busy"), "x").headers.at("idempotent-replayed") ==
        "true");
  CHECK(f.ran() == 1);
}

TEST_CASE("http layer: 20 parallel duplicates: one runs, the others get 409 or its replay (x5)") {
  Fixture f;
  int conflicts = 0;
  for (int round = 0; round < 5; ++round) {
    const std::string k = fmt::format("race-{}", round);
    std::vector<std::unique_ptr<HttpClient>> clients;
    for (int i = 0; i < 20; ++i) clients.push_back(std::make_unique<HttpClient>(f.port()));
    for (auto& c : clients) c->write_only("POST", "/slow?ms=1000", key(k), "x");
    int ran = 0, replayed = 0;
    for (auto& c : clients) {
      const HttpReply r = c->receive();
      if (r.status == 409) {
        ++conflicts;
      } else {
        CHECK(r.status == 200);
        (r.has("idempotent-replayed") ? replayed : ran) += 1;
      }
    }
    CHECK(ran == 1);  // one answer from a run; a duplicate that came late got the replay
    CHECK(f.ran() == round + 1);
  }
  CHECK(conflicts > 0);  // duplicates overlapped the run in flight
}

TEST_CASE("http layer: under wait, parallel duplicates all get the one result") {
  Fixture f(idem::InFlight::wait);
  std::vector<std::unique_ptr<HttpClient>> clients;
  for (int i = 0; i < 10; ++i) clients.push_back(std::make_unique<HttpClient>(f.port()));
  for (auto& c : clients) c->write_only("POST", "/slow?ms=200", key("w"), "x");
  int replayed = 0;
  for (auto& c : clients) {
    const HttpReply r = c->receive();
    CHECK(r.status == 200);
    CHECK(r.body == "slept:200");
    replayed += r.has("idempotent-replayed");
  }
  CHECK(replayed == 9);
  CHECK(f.ran() == 1);
}

TEST_CASE("http layer: a large body (over 1 MiB) is kept by reference and replays byte for byte") {
  Fixture f;
  HttpClient c(f.port());
  const HttpReply first = c.send("POST", "/large?bytes=2097152", key("big"), "");
  CHECK(first.status == 200);
  CHECK(first.body.size() == 2097152);
  const HttpReply again = c.send("POST", "/large?bytes=2097152", key("big"), "");
  CHECK(again.body == first.body);
  CHECK(again.headers.at("idempotent-replayed") == "true");
  CHECK(f.ran() == 1);
  idem::test::RawDb raw(f.db);
  CHECK(raw.scalar("SELECT count(*) FROM idem_keys WHERE body_ref <> '' AND length(body) = 0 OR "
                   "(body_ref <> '' AND body IS NULL)") == 1);
  // A small one stays inline.
  c.send("POST", "/large?bytes=10", key("small"), "");
  CHECK(raw.scalar("SELECT count(*) FROM idem_keys WHERE body_ref IS NULL OR body_ref = ''") == 1);
}

TEST_CASE("http layer: POST /reset is outside the layer, a bad route parameter stores nothing") {
  Fixture f;
  HttpClient c(f.port());
  c.send("POST", "/echo", key("k1"), "x");
  CHECK(f.ran() == 1);
  const HttpReply reset = c.send("POST", "/reset");
  CHECK(reset.status == 204);
  CHECK(reset.body.empty());
  CHECK(f.ran() == 0);
  CHECK(c.send("POST", "/status/99", key("k2"), "x").status == 400);
  CHECK(c.send("POST", "/slow?ms=-1", key("k2"), "x").status == 400);
  CHECK(c.send("POST", "/large?bytes=99999999999", key("k2"), "x").status == 400);
  CHECK(c.send("POST", "/nope", key("k2"), "x").status == 404);
  CHECK(f.ran() == 0);
  idem::test::RawDb raw(f.db);
  CHECK(raw.rows() == 1);  // k1's only
}

TEST_CASE("http layer: the policy is published, expiry included") {
  Fixture f;
  HttpClient c(f.port());
  const json policy = json::parse(c.send("GET", "/idempotency").body);
  CHECK(policy.at("header") == "Idempotency-Key");
  CHECK(policy.at("methods") == json::array({"POST", "PATCH"}));
  CHECK(policy.at("key_required") == true);
  CHECK(policy.at("expires_after_seconds") == 24 * 3600);
  CHECK(policy.at("in_flight") == "409 with Retry-After");
}

TEST_CASE("http layer: the same key on two routes is two operations") {
  Fixture f;
  HttpClient c(f.port());
  CHECK(c.send("POST", "/status/201", key("shared"), "x").status == 201);
  CHECK(c.send("POST", "/status/202", key("shared"), "x").status == 202);
  CHECK(c.send("POST", "/echo", key("shared"), "x").status == 201);
  CHECK(f.ran() == 3);
}

namespace {

// The blocking form of the layer, driven directly: options a route may set.
idem::http::Request post(const std::string& k, std::string body) {
  idem::http::Request req{idem::http::Verb::post, "/report", 11};
  req.set("Idempotency-Key", k);
  req.body() = std::move(body);
  req.prepare_payload();
  return req;
}

}  // namespace

TEST_CASE("http layer (blocking): replay_large_bodies = false keeps status and headers only") {
  idem::test::World w;
  idem::http::LayerOptions o;
  o.large_body = 1000;
  o.replay_large_bodies = false;
  idem::http::Layer layer(*w.idem, o);
  int ran = 0;
  const idem::http::Handler report = [&](const idem::http::Request&, const idem::http::Context&) {
    ++ran;
    idem::http::Reply r{boost::beast::http::status::ok, 11};
    r.set("Content-Type", "text/csv");
    r.set("X-Report", "7");
    r.body() = std::string(5000, 'r');
    r.prepare_payload();
    return r;
  };
  const idem::http::Reply first = layer.handle(post("r1", "q"), report);
  CHECK(first.body().size() == 5000);
  CHECK(first.count("Idempotent-Body-Omitted") == 0);
  const idem::http::Reply again = layer.handle(post("r1", "q"), report);
  CHECK(again.result_int() == 200);
  CHECK(again.body().empty());
  CHECK(again["Idempotent-Body-Omitted"] == "5000");
  CHECK(again["X-Report"] == "7");
  CHECK(again["Content-Type"] == "text/csv");
  CHECK(again["Idempotent-Replayed"] == "true");
  CHECK(ran == 1);
}

TEST_CASE(
    "http layer (blocking): a body over max_stored_body is delivered whole, kept not at all, "
    "marked, and the retry runs again") {
  idem::test::World w;
  idem::http::LayerOptions o;
  o.max_stored_body = 1000;
  o.large_body = 10;  // both apply: max_stored_body wins, nothing is kept
  o.replay_large_bodies = false;
  idem::http::Layer layer(*w.idem, o);
  const std::string not_stored(idem::http::kNotStoredHeader);
  int ran = 0;
  std::size_t size = 5000;
  const idem::http::Handler report = [&](const idem::http::Request&, const idem::http::Context&) {
    ++ran;
    idem::http::Reply r{boost::beast::http::status::ok, 11};
    r.set("X-Report", "7");
    r.body() = std::string(size, 'r');
    r.prepare_payload();
    return r;
  };
  const idem::http::Reply first = layer.handle(post("m1", "q"), report);
  CHECK(first.body().size() == 5000);
  CHECK(first[not_stored] == "body-too-large");
  CHECK(first["X-Report"] == "7");
  const auto record = w.store->load({"default", "POST /report", "m1"});
  REQUIRE(record);  // released: no status, no headers, no body
  CHECK(record->state == idem::State::released);
  CHECK(record->response.headers.empty());
  CHECK(record->response.body.empty());
  const idem::http::Reply retry = layer.handle(post("m1", "q"), report);
  CHECK(retry.body().size() == 5000);
  CHECK(retry.count("Idempotent-Replayed") == 0);
  CHECK(ran == 2);
  // At the limit it is an outcome like any other (here over large_body: its body omitted).
  size = 1000;
  layer.handle(post("m2", "q"), report);
  const idem::http::Reply replay = layer.handle(post("m2", "q"), report);
  CHECK(replay["Idempotent-Replayed"] == "true");
  CHECK(replay["Idempotent-Body-Omitted"] == "1000");
  CHECK(replay.count(not_stored) == 0);
  CHECK(ran == 3);
  // A 5xx is not stored either, but not for its size: no marker.
  const idem::http::Handler failing = [&](const idem::http::Request&, const idem::http::Context&) {
    ++ran;
    idem::http::Reply r{boost::beast::http::status::service_unavailable, 11};
    r.body() = std::string(5000, 'e');
    return r;
  };
  CHECK(layer.handle(post("m3", "q"), failing).count(not_stored) == 0);
  CHECK(ran == 4);
}

TEST_CASE("http layer (blocking): a handler's exception releases the key, the retry runs") {
  idem::test::World w;
  idem::http::Layer layer(*w.idem);
  int ran = 0;
  const idem::http::Handler flaky = [&](const idem::http::Request&, const idem::http::Context& c) {
    if (++ran == 1) throw std::runtime_error("downstream timed out");
    idem::http::Reply r{boost::beast::http::status::created, 11};
    r.body() = c.id.tenant + "|" + c.id.operation;
    return r;
  };
  CHECK_THROWS_WITH(layer.handle(post("e1", "q"), flaky), "downstream timed out");
  const idem::http::Reply retry = layer.handle(post("e1", "q"), flaky);
  CHECK(retry.result_int() == 201);
  CHECK(retry.body() == "default|POST /report");
  CHECK(layer.handle(post("e1", "q"), flaky)["Idempotent-Replayed"] == "true");
  CHECK(ran == 2);
}

TEST_CASE("http layer (blocking): options a route sets: tenant, key_required, bad options") {
  idem::test::World w;
  idem::http::LayerOptions o;
  o.key_required = false;
  o.tenant = [](const idem::http::Request& r) { return std::string(r["X-Tenant"]); };
  idem::http::Layer layer(*w.idem, o);
  int ran = 0;
  const idem::http::Handler h = [&](const idem::http::Request&, const idem::http::Context& c) {
    ++ran;
    idem::http::Reply r{boost::beast::http::status::ok, 11};
    r.body() = c.protected_call ? c.id.tenant : "unprotected";
    return r;
  };
  idem::http::Request no_key{idem::http::Verb::post, "/x", 11};
  CHECK(layer.handle(no_key, h).body() == "unprotected");
  CHECK(layer.handle(no_key, h).body() == "unprotected");  // runs each time, as asked
  idem::http::Request a = post("t1", "q");
  a.set("X-Tenant", "acme");
  idem::http::Request b = post("t1", "q");
  b.set("X-Tenant", "globex");
  CHECK(layer.handle(a, h).body() == "acme");
  CHECK(layer.handle(b, h).body() == "globex");  // another tenant's key: its own record
  CHECK(layer.handle(a, h)["Idempotent-Replayed"] == "true");
  CHECK(ran == 4);
  idem::http::LayerOptions bad;
  bad.key_header = "";
  CHECK_THROWS_AS(idem::http::Layer(*w.idem, bad), idem::error);
  idem::http::LayerOptions renamed;
  renamed.replayed_header = "Idempotency-Replayed";
  idem::http::Layer other(*w.idem, renamed);
  other.handle(post("n1", "q"), h);
  CHECK(other.handle(post("n1", "q"), h)["Idempotency-Replayed"] == "true");
}

TEST_CASE("http layer: the query is part of the request, 408/425/429 are not stored") {
  Fixture f;
  HttpClient c(f.port());
  CHECK(c.send("POST", "/slow?ms=1", key("q1"), "x").status == 200);
  const HttpReply other = c.send("POST", "/slow?ms=2", key("q1"), "x");
  CHECK(other.status == 422);  // not the first's answer replayed
  CHECK(error_of(other) == "idempotency_key_reuse");
  for (int code : {408, 425, 429}) {
    CAPTURE(code);
    const std::string k = fmt::format("later-{}", code);
    const std::string target = fmt::format("/status/{}", code);
    c.send("POST", target, key(k), "x");
    CHECK_FALSE(c.send("POST", target, key(k), "x").has("idempotent-replayed"));
  }
  CHECK(f.ran() == 1 + 3 * 2);
}

TEST_CASE("http layer (blocking): the handler's own idem::error propagates, the key is released") {
  idem::test::World w;
  idem::http::Layer layer(*w.idem);
  int ran = 0;
  const idem::http::Handler h = [&](const idem::http::Request&, const idem::http::Context&) {
    if (++ran == 1) throw idem::StoreError("the handler's own database is locked", 5);
    return idem::http::Reply{boost::beast::http::status::created, 11};
  };
  // Not a 503 store_unavailable answer: that would blame idem's store for the handler's.
  CHECK_THROWS_AS(layer.handle(post("h1", "q"), h), idem::StoreError);
  CHECK(layer.handle(post("h1", "q"), h).result_int() == 201);
  CHECK(ran == 2);
}

TEST_CASE("http layer (blocking): a documentation link on 400 and 422, InFlight::run refused") {
  idem::test::World w;
  idem::http::LayerOptions o;
  o.documentation = "https://api.example.com/docs/idempotency";
  idem::http::Layer layer(*w.idem, o);
  const idem::http::Handler h = [](const idem::http::Request&, const idem::http::Context&) {
    return idem::http::Reply{boost::beast::http::status::ok, 11};
  };
  idem::http::Request no_key{idem::http::Verb::post, "/x", 11};
  const idem::http::Reply missing = layer.handle(no_key, h);
  CHECK(missing.result_int() == 400);
  CHECK(missing["Link"] == "<https://api.example.com/docs/idempotency>; rel=\"describedby\"");
  layer.handle(post("d1", "a"), h);
  const idem::http::Reply reuse = layer.handle(post("d1", "b"), h);
  CHECK(reuse.result_int() == 422);
  CHECK(reuse["Link"] == "<https://api.example.com/docs/idempotency>; rel=\"describedby\"");
  idem::http::LayerOptions run;
  run.in_flight = idem::InFlight::run;
  CHECK_THROWS_AS(idem::http::Layer(*w.idem, run), idem::error);
}

TEST_CASE("http layer: HTTP-dates are IMF-fixdates whatever the locale") {
  using namespace std::chrono;
  CHECK(idem::http_date(idem::TimePoint(seconds(784111777))) == "Sun, 06 Nov 1994 08:49:37 GMT");
  CHECK(idem::http_date(idem::TimePoint(milliseconds(951782400999))) ==
        "Tue, 29 Feb 2000 00:00:00 GMT");
  // A key's expiry ten years on, and the far ends of what a TimePoint holds, stay whole.
  CHECK(idem::http_date(idem::TimePoint(seconds(2110000000))) == "Tue, 11 Nov 2036 07:06:40 GMT");
  CHECK(idem::http_date(idem::TimePoint(seconds(253402300799))) == "Fri, 31 Dec 9999 23:59:59 GMT");
  CHECK(idem::http_date(idem::TimePoint(hours(24) * 4000000)).ends_with(":00:00 GMT"));
}

TEST_CASE("http layer: an sf-string key's RFC 8941 parameters are accepted and ignored") {
  CHECK(idem::parse_idempotency_key(R"("k";p=1)") == std::optional<std::string>("k"));
  CHECK(idem::parse_idempotency_key(R"("k"; a=1;b=?0;c=:aGk=:;d=tok/en;e="s\"";f=-1.25;g)") ==
        std::optional<std::string>("k"));
  // Parameters must be well formed, and only follow a string: a bare value is taken whole.
  for (const char* bad : {R"("k";)", R"("k";P=1)", R"("k";p=)", R"("k" ;p=1)", R"("k"x)",
                          R"("k";p="open)", R"("k";p=?2)", R"("k";p=:a b:)"}) {
    CAPTURE(bad);
    CHECK_FALSE(idem::parse_idempotency_key(bad));
  }
  CHECK(idem::parse_idempotency_key("k;p=1") == std::optional<std::string>("k;p=1"));
  // Over HTTP: the parameters do not make another key.
  Fixture f;
  HttpClient c(f.port());
  CHECK(c.send("POST", "/echo", key(R"("order-8";v=2)"), "x").status == 201);
  CHECK(c.send("POST", "/echo", key("order-8"), "x").headers.at("idempotent-replayed") == "true");
  CHECK(f.ran() == 1);
}

TEST_CASE(
    "http layer (blocking): session and credential fields go to the caller whose request ran, "
    "never stored or replayed") {
  idem::test::World w;
  idem::http::LayerOptions o;
  // The service's own field, set as a list: the session fields stay unstored all the same.
  o.unstored_headers = {"X-Session-Token"};
  idem::http::Layer layer(*w.idem, o);
  int ran = 0;
  const idem::http::Handler login = [&](const idem::http::Request&, const idem::http::Context&) {
    ++ran;
    idem::http::Reply r{boost::beast::http::status::created, 11};
    r.set("Location", "/orders/7");
    r.set("ETag", "\"v1\"");
    r.insert("Set-Cookie", "session=first-callers; HttpOnly");
    r.insert("Set-Cookie", "csrf=abc");
    r.set("Authentication-Info", "nextnonce=\"x\"");
    r.set("x-session-token", "tok-1");  // the service's own, matched whatever its case
    r.body() = "created";
    r.prepare_payload();
    return r;
  };
  const idem::http::Reply first = layer.handle(post("s1", "q"), login);
  CHECK(first.count("Set-Cookie") == 2);
  CHECK(first["Authentication-Info"] == "nextnonce=\"x\"");
  CHECK(first["X-Session-Token"] == "tok-1");
  const idem::http::Reply again = layer.handle(post("s1", "q"), login);
  CHECK(again["Idempotent-Replayed"] == "true");
  CHECK(again["Location"] == "/orders/7");
  CHECK(again["ETag"] == "\"v1\"");
  CHECK(again.count("Set-Cookie") == 0);
  CHECK(again.count("Authentication-Info") == 0);
  CHECK(again.count("X-Session-Token") == 0);
  CHECK(ran == 1);
  // Not in the store either.
  const auto record = w.store->load({"default", "POST /report", "s1"});
  REQUIRE(record);
  for (const idem::Header& h : record->response.headers) {
    CAPTURE(h.name);
    CHECK(h.name != "Set-Cookie");
    CHECK(h.name != "Authentication-Info");
    CHECK(h.name != "x-session-token");
  }
  CHECK(record->response.headers.size() == 2);  // Location and ETag
  SUBCASE("an allow-list keeps only the fields it names") {
    idem::http::LayerOptions only;
    only.stored_headers = {"location"};
    idem::http::Layer strict(*w.idem, only);
    strict.handle(post("s2", "q"), login);
    const idem::http::Reply replay = strict.handle(post("s2", "q"), login);
    CHECK(replay["Location"] == "/orders/7");
    CHECK(replay.count("ETag") == 0);
    CHECK(replay.count("Set-Cookie") == 0);
  }
}
