#include "conformance_app.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core/string.hpp>
#include <cctype>
#include <charconv>
#include <csignal>
#include <nlohmann/json.hpp>
#include <utility>
#include <variant>
#include <vector>

#include "conformance_sql.hpp"
#include "idem/file_payload_store.hpp"
#include "idem/fingerprint.hpp"
#include "idem/internal/sqlite.hpp"  // idem's RAII wrappers over sqlite3, for /_fixture/corrupt
#include "idem/key.hpp"
#include "idem/replay_cache.hpp"
#include "idem/sqlite_store.hpp"

namespace idem::demo {
namespace {

namespace net = boost::asio;
namespace bh = boost::beast::http;

// The number after `prefix` in `text` (all of the rest), if it is one within [low, high].
std::optional<long long> number_after(std::string_view text, std::string_view prefix, long long low,
                                      long long high) {
  if (!text.starts_with(prefix)) return std::nullopt;
  text.remove_prefix(prefix.size());
  long long n = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || end != text.data() + text.size() || n < low || n > high)
    return std::nullopt;
  return n;
}

bool iequals(std::string_view a, std::string_view b) {
  return boost::beast::iequals({a.data(), a.size()}, {b.data(), b.size()});
}

Reply bad_request(std::string_view detail) {
  return problem_reply(400, "invalid_request", "Invalid request", detail);
}

// An RFC 9110 token (a field name).
bool is_token(std::string_view s) {
  constexpr std::string_view extra = "!#$%&'*+-.^_`|~";
  return !s.empty() && std::all_of(s.begin(), s.end(), [&](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) != 0 ||
           extra.find(c) != std::string_view::npos;
  });
}

std::string_view trimmed(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Fields the transport writes for each message: a handler that set them would break the
// framing (or be overwritten), so X-Fixture-Header refuses them.
bool transport_field(std::string_view name) {
  for (std::string_view f : {"Connection", "Keep-Alive", "Transfer-Encoding", "Content-Length",
                             "TE", "Trailer", "Upgrade", "Proxy-Connection", "Date", "Server"}) {
    if (iequals(name, f)) return true;
  }
  return false;
}

// 127.0.0.0/8, ::1, and IPv4-mapped loopback.
bool loopback(const std::string& address) {
  boost::system::error_code ec;
  net::ip::address a = net::ip::make_address(address, ec);
  if (ec) return false;
  if (a.is_v6() && a.to_v6().is_v4_mapped())
    a = net::ip::make_address_v4(net::ip::v4_mapped, a.to_v6());
  return a.is_loopback();
}

constexpr std::string_view kControlPrefix = "X-Fixture-";

// How a /resources request asks its handler to answer (its X-Fixture-* fields).
struct Controls {
  int status = 201;
  long long delay_ms = 0;
  std::vector<std::pair<std::string, std::string>> headers;
  std::optional<std::size_t> body_bytes;
  bool chunked = false;
  bool crash = false;
};

// The controls of `req`, or the 400 that refuses them. Every X-Fixture-* field is read
// (a name the fixture does not know is refused, so a typo never passes unnoticed); each but
// X-Fixture-Header at most once.
std::variant<Controls, Reply> controls_of(const Request& req) {
  Controls c;
  std::vector<std::string> seen;
  for (const auto& f : req) {
    const std::string_view name = sv(f.name_string());
    if (name.size() < kControlPrefix.size() ||
        !iequals(name.substr(0, kControlPrefix.size()), kControlPrefix))
      continue;
    const std::string_view value = trimmed(sv(f.value()));
    const std::string_view control = name.substr(kControlPrefix.size());
    if (iequals(control, "Header")) {
      const auto colon = value.find(':');
      const std::string_view field = colon == std::string_view::npos ? "" : value.substr(0, colon);
      if (!is_token(field))
        return bad_request("X-Fixture-Header takes \"Name: value\" with Name a field name");
      if (transport_field(field)) {
        return bad_request(
            fmt::format("X-Fixture-Header cannot set {}: the transport writes it", field));
      }
      c.headers.emplace_back(std::string(field), std::string(trimmed(value.substr(colon + 1))));
      continue;
    }
    for (const std::string& s : seen) {
      if (iequals(s, control))
        return bad_request(fmt::format("{} was sent twice", name.substr(0, 100)));
    }
    seen.emplace_back(control);
    if (iequals(control, "Status")) {
      const auto n = number_after(value, "", 200, 599);
      if (!n) return bad_request("X-Fixture-Status must be a number from 200 to 599");
      c.status = static_cast<int>(*n);
    } else if (iequals(control, "Delay-Ms")) {
      const auto n = number_after(value, "", 0, 60000);
      if (!n) return bad_request("X-Fixture-Delay-Ms must be a number from 0 to 60000");
      c.delay_ms = *n;
    } else if (iequals(control, "Body-Bytes")) {
      const auto n = number_after(value, "", 0, 16 << 20);
      if (!n) return bad_request("X-Fixture-Body-Bytes must be a number from 0 to 16777216");
      c.body_bytes = static_cast<std::size_t>(*n);
    } else if (iequals(control, "Chunked")) {
      if (value != "0" && value != "1") return bad_request("X-Fixture-Chunked must be 0 or 1");
      c.chunked = value == "1";
    } else if (iequals(control, "Crash")) {
      if (value != "after-claim") return bad_request("X-Fixture-Crash must be after-claim");
      c.crash = true;
    } else {
      return bad_request(
          fmt::format("{} is not a control of the fixture (X-Fixture-Status, -Delay-Ms, -Header, "
                      "-Body-Bytes, -Chunked, -Crash)",
                      name.substr(0, 100)));
    }
  }
  // RFC 9110: a 204 or 304 never has content.
  if ((c.status == 204 || c.status == 304) && (c.body_bytes.value_or(0) > 0 || c.chunked))
    return bad_request("a 204 or 304 has no body: no X-Fixture-Body-Bytes or X-Fixture-Chunked");
  return c;
}

}  // namespace

struct ConformanceApp::Impl {
  ConformanceOptions options;
  std::shared_ptr<ReplayCache> replay_cache;  // ConformanceOptions::replay_cache_bytes; else null
  std::unique_ptr<Coordinator> idem;
  std::unique_ptr<http::Layer> layer;
  std::atomic<long long> counter{0};  // written on the io thread, read by any

  // ConformanceOptions::handwritten: its connection and statements.
  struct Hand {
    sqlite::BusyPolicy busy{std::chrono::seconds(5), {}};
    sqlite::Connection db;
    std::optional<sqlite::Statement> reserve, load, complete, release;
    explicit Hand(const std::string& path) : db(sqlite::open_connection(path, &busy)) {
      sqlite::enable_wal(db.get(), busy);
      sqlite::exec(db.get(), sql::kHandSynchronous);
      sqlite::exec(db.get(), sql::kHandSchema);
      reserve.emplace(db.get(), sql::kHandReserve);
      load.emplace(db.get(), sql::kHandLoad);
      complete.emplace(db.get(), sql::kHandComplete);
      release.emplace(db.get(), sql::kHandRelease);
    }
    void bind_id(sqlite::Statement& s, const std::string& tenant, const std::string& operation,
                 const std::string& key) {
      s.bind(1, tenant);
      s.bind(2, operation);
      s.bind(3, key);
    }
  };
  std::unique_ptr<Hand> hand;

  explicit Impl(ConformanceOptions o) : options(std::move(o)) {
    if (!options.layer && options.handwritten) hand = std::make_unique<Hand>(options.db);
    Options idem_options;
    idem_options.in_flight = options.policy;
    idem_options.on_store_failure =
        options.fail_closed ? FailureMode::fail_closed : FailureMode::fail_open;
    idem_options.ttl = options.ttl;
    idem_options.lease = options.lease;
    idem_options.heartbeat = options.lease / 3;
    idem_options.max_wait = options.fixture.max_wait;
    idem_options.inline_body_limit = std::size_t{1} << 20;
    idem_options.payload_store = std::make_shared<FilePayloadStore>(options.db + ".payloads");
    std::shared_ptr<Store> store = std::make_shared<SqliteStore>(options.db);
    if (options.replay_cache_bytes > 0) {
      replay_cache = std::make_shared<ReplayCache>(
          store, ReplayCacheOptions{.max_bytes = options.replay_cache_bytes});
      store = replay_cache;
    }
    idem = std::make_unique<Coordinator>(std::move(store), std::move(idem_options));
    http::LayerOptions layer_options;
    layer_options.in_flight = options.policy;
    layer_options.replayed_header = options.fixture.replayed_header;
    layer_options.max_stored_body = options.fixture.max_stored_body;
    if (!options.fixture.tenant_header.empty()) {
      // Checked before the layer (caller()): here the field is there, once, with a tenant.
      layer_options.tenant = [name = options.fixture.tenant_header](const Request& r) {
        const std::string_view value = sv(r[name]);
        return std::string(value.substr(0, value.find(':')));
      };
    }
    layer = std::make_unique<http::Layer>(*idem, std::move(layer_options));
  }

  // The caller's tenant (FixtureOptions::tenant_header), or the 400 that refuses a request
  // without one.
  std::variant<std::string, Reply> caller(const Request& req) const {
    const std::string& name = options.fixture.tenant_header;
    if (name.empty()) return std::string("default");
    const auto [first, last] = req.equal_range(name);
    const auto fields = std::distance(first, last);
    if (fields != 1) {
      return bad_request(
          fields == 0 ? fmt::format("{} is required: it names the caller (tenant:user)", name)
                      : fmt::format("{} was sent {} times", name, fields));
    }
    const std::string_view value = sv(first->value());
    const std::string_view tenant = value.substr(0, value.find(':'));
    if (tenant.empty()) return bad_request(fmt::format("{} names no tenant before its ':'", name));
    return std::string(tenant);
  }

  // ConformanceOptions::handwritten: what a handler without idem does around `handler`.
  net::awaitable<Reply> by_hand(const Request& req, const std::string& tenant,
                                const http::AsyncHandler& handler) {
    const auto field = req.find("Idempotency-Key");
    if (field == req.end() || field->value().empty())
      co_return problem_reply(400, "idempotency_key_required", "Idempotency-Key required", "");
    const std::string key(sv(field->value()));
    const std::string operation = fmt::format("{} {}", sv(req.method_string()), sv(req.target()));
    const Fingerprint fingerprint = Fingerprint::of_bytes(req.body());
    Hand& h = *hand;
    bool fresh = false;
    {
      sqlite::ResetGuard reset(*h.reserve);
      h.bind_id(*h.reserve, tenant, operation, key);
      h.reserve->bind_blob(4, fingerprint.bytes().data(), fingerprint.bytes().size());
      fresh = h.reserve->step();
    }
    if (!fresh) {
      sqlite::ResetGuard reset(*h.load);
      h.bind_id(*h.load, tenant, operation, key);
      if (!h.load->step()) co_return problem_reply(409, "idempotency_key_in_use", "In use", "");
      if (h.load->blob_view(1) !=
          std::string_view(reinterpret_cast<const char*>(fingerprint.bytes().data()),
                           fingerprint.bytes().size()))
        co_return problem_reply(422, "idempotency_key_reuse", "Key reused", "");
      if (h.load->int64(0) != 2) {
        Reply busy = problem_reply(409, "idempotency_key_in_use", "In use", "");
        busy.set(bh::field::retry_after, "1");
        co_return busy;
      }
      Reply r = body_reply(static_cast<int>(h.load->int64(2)), h.load->blob(3),
                           "application/octet-stream");
      r.set(options.fixture.replayed_header, "true");
      co_return r;
    }
    const http::Context unprotected{};
    std::optional<Reply> reply;
    try {
      reply = co_await handler(req, unprotected);
    } catch (...) {
    }
    if (!reply || reply->result_int() >= 500) {
      sqlite::ResetGuard reset(*h.release);
      h.bind_id(*h.release, tenant, operation, key);
      h.release->step();
      if (!reply) co_return problem_reply(500, "internal", "Handler failed", "");
      co_return std::move(*reply);
    }
    sqlite::ResetGuard reset(*h.complete);
    h.bind_id(*h.complete, tenant, operation, key);
    h.complete->bind(4, static_cast<std::int64_t>(reply->result_int()));
    h.complete->bind_blob(5, reply->body().data(), reply->body().size());
    h.complete->step();
    co_return std::move(*reply);
  }

  // A counted route, or nullopt when the request names none. Validation happens here,
  // before the layer: a malformed route parameter or control stores nothing.
  struct Route {
    enum Kind { echo, status, slow, large, resources } kind;
    long long n = 0;
    Controls controls{};
  };

  static std::variant<Route, Reply> route(const Request& req, std::string_view path,
                                          std::string_view query) {
    if (path == "/echo") return Route{Route::echo};
    if (path.starts_with("/status/")) {
      const auto code = number_after(path, "/status/", 200, 599);
      if (!code) return bad_request("the status must be a number from 200 to 599");
      return Route{Route::status, *code};
    }
    if (path == "/slow") {
      const auto ms = number_after(query, "ms=", 0, 60000);
      if (!ms) return bad_request("slow needs ?ms=N with N from 0 to 60000");
      return Route{Route::slow, *ms};
    }
    if (path == "/large") {
      const auto bytes = number_after(query, "bytes=", 0, 16 << 20);
      if (!bytes) return bad_request("large needs ?bytes=N with N from 0 to 16777216");
      return Route{Route::large, *bytes};
    }
    if (path == "/resources" || path.starts_with("/resources/")) {
      auto controls = controls_of(req);
      if (auto* refused = std::get_if<Reply>(&controls)) return std::move(*refused);
      return Route{Route::resources, 0, std::get<Controls>(std::move(controls))};
    }
    return problem_reply(404, "not_found", "Not found",
                         fmt::format("no route for {}", path.substr(0, 100)));
  }

  net::awaitable<Reply> run(const Route& r, const Request& req, const std::string& tenant,
                            const http::Context& call) {
    const long long runs = ++counter;
    // (if, not switch: g++ 12 does not see co_return as the end of a case)
    if (r.kind == Route::echo) {
      const auto type = req.find(bh::field::content_type);
      co_return body_reply(
          201, req.body(),
          type == req.end() ? std::string_view("application/octet-stream") : sv(type->value()));
    }
    if (r.kind == Route::status)
      co_return body_reply(static_cast<int>(r.n), fmt::format("status:{}", r.n), "text/plain");
    if (r.kind == Route::slow) {
      net::steady_timer timer(co_await net::this_coro::executor);
      timer.expires_after(std::chrono::milliseconds(r.n));
      co_await timer.async_wait(net::use_awaitable);
      co_return body_reply(200, fmt::format("slept:{}", r.n), "text/plain");
    }
    if (r.kind == Route::resources)
      co_return co_await resource(r.controls, req, tenant, call, runs);
    co_return body_reply(200, std::string(static_cast<std::size_t>(r.n), 'x'),
                         "application/octet-stream");
  }

  // The /resources handler: waits, dies or answers as its controls say.
  static net::awaitable<Reply> resource(const Controls& c, const Request& req,
                                        const std::string& tenant, const http::Context& call,
                                        long long runs) {
    if (c.delay_ms > 0) {
      net::steady_timer timer(co_await net::this_coro::executor);
      timer.expires_after(std::chrono::milliseconds(c.delay_ms));
      co_await timer.async_wait(net::use_awaitable);
    }
    // As kill -9 would: no reply, no release, no cleanup; the key stays reserved until its
    // lease ends.
    if (c.crash) std::raise(SIGKILL);
    Reply r;
    r.version(11);
    r.result(static_cast<unsigned>(c.status));
    if (c.status != 204 && c.status != 304) {
      if (c.body_bytes) {
        r.body() = std::string(*c.body_bytes, 'x');
        r.set(bh::field::content_type, "application/octet-stream");
      } else {
        const nlohmann::json body = {
            {"tenant", tenant},
            {"key", call.protected_call ? nlohmann::json(call.id.key) : nlohmann::json(nullptr)},
            {"run", runs},
            {"body", req.body()}};
        r.body() = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
        r.set(bh::field::content_type, "application/json");
      }
    }
    for (const auto& [name, value] : c.headers) {
      if (iequals(name, "Content-Type")) {
        r.set(bh::field::content_type, value);
      } else {
        r.insert(name, value);
      }
    }
    if (c.chunked) {
      r.chunked(true);  // no Content-Length: the transport sends the body as chunks
    } else {
      r.prepare_payload();
    }
    co_return r;
  }

  // POST /_fixture/corrupt: the record of (tenant, "<method> <path>", key) damaged outside
  // the layer, so that it no longer decodes.
  // (a loopback peer's: handle() refused the others)
  Reply corrupt(const Request& req, const std::string& tenant) const {
    const nlohmann::json j = nlohmann::json::parse(req.body(), nullptr, false);
    if (!j.is_object()) return bad_request("the body must be a JSON object");
    const auto text = [&](const char* member) -> const nlohmann::json* {
      const auto it = j.find(member);
      return it != j.end() && it->is_string() ? &*it : nullptr;
    };
    if (j.contains("method") && !text("method")) return bad_request("method must be a string");
    if (!text("path") || !text("key")) return bad_request("path and key are required strings");
    if (j.contains("body") && !text("body")) return bad_request("body must be a string");
    const std::string method = j.value("method", "POST");
    const std::string target = j.at("path");
    if (!target.starts_with('/')) return bad_request("path must start with '/'");
    // The key as the request carried it in its field: a bare key or an sf-string.
    const std::optional<std::string> key = parse_idempotency_key(j.at("key").get<std::string>());
    if (!key || key->empty()) return bad_request("key is not an Idempotency-Key value");
    const std::string operation = fmt::format("{} {}", method, target.substr(0, target.find('?')));
    if (operation.size() > kMaxKeyBytes) return bad_request("method and path are too long");
    try {
      sqlite::BusyPolicy busy{std::chrono::seconds(5), {}};
      sqlite::Connection c = sqlite::open_connection(options.db, &busy);
      sqlite::Statement s(c.get(), sql::kCorruptHeaders);
      s.bind(1, tenant);
      s.bind(2, operation);
      s.bind(3, *key);
      s.step();
      if (s.changes() == 0) {
        return problem_reply(404, "not_found", "No such record",
                             "no record of this tenant, method, path and key");
      }
    } catch (const StoreError& e) {
      return problem_reply(503, "store_unavailable", "Store unavailable", e.what());
    }
    Reply r;
    r.result(bh::status::no_content);
    return r;
  }
};

ConformanceApp::ConformanceApp(ConformanceOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
ConformanceApp::~ConformanceApp() = default;
Coordinator& ConformanceApp::coordinator() noexcept { return *impl_->idem; }
long long ConformanceApp::count() const noexcept { return impl_->counter; }

net::awaitable<Reply> ConformanceApp::handle(Request req, Peer peer) {
  Impl& d = *impl_;
  const std::string_view target = sv(req.target());
  const std::string_view path = target.substr(0, target.find('?'));
  const std::string_view query =
      target.find('?') == std::string_view::npos ? "" : target.substr(target.find('?') + 1);
  if (path == "/healthz" && req.method() == bh::verb::get)
    co_return body_reply(200, R"({"status":"ok"})", "application/json");
  if (path == "/idempotency" && req.method() == bh::verb::get)
    co_return body_reply(200, d.layer->policy(), "application/json");
  if (path == "/metrics" && req.method() == bh::verb::get) {
    std::string text = d.idem->metrics().to_prometheus();
    if (d.replay_cache) text += d.replay_cache->to_prometheus();
    co_return body_reply(200, std::move(text), "text/plain; version=0.0.4");
  }
  if (path == "/reset") {
    if (req.method() != bh::verb::post) co_return method_not_allowed("POST");
    d.counter = 0;
    Reply r;
    r.result(bh::status::no_content);
    co_return r;
  }
  if (path == "/counter") {
    // Behind the layer like any route; the layer passes a GET through even with a key.
    const http::AsyncHandler counter = [&d](const Request& r,
                                            const http::Context&) -> net::awaitable<Reply> {
      if (r.method() != bh::verb::get) co_return method_not_allowed("GET");
      co_return body_reply(200, nlohmann::json{{"count", d.counter.load()}}.dump(),
                           "application/json");
    };
    co_return co_await d.layer->async_handle(req, counter);
  }
  if (path == "/_fixture/corrupt") {
    if (req.method() != bh::verb::post) co_return method_not_allowed("POST");
    if (!loopback(peer.address)) {
      co_return problem_reply(403, "forbidden", "Forbidden",
                              "only a loopback peer may damage a stored record");
    }
    auto tenant = d.caller(req);
    if (auto* refused = std::get_if<Reply>(&tenant)) co_return std::move(*refused);
    co_return d.corrupt(req, std::get<std::string>(tenant));
  }
  auto found = Impl::route(req, path, query);
  if (auto* refused = std::get_if<Reply>(&found)) co_return std::move(*refused);
  const Impl::Route route = std::get<Impl::Route>(std::move(found));
  if (route.kind == Impl::Route::resources) {
    if (req.method() != bh::verb::post && req.method() != bh::verb::patch)
      co_return method_not_allowed("POST, PATCH");
  } else if (req.method() != bh::verb::post) {
    co_return method_not_allowed("POST");
  }
  auto caller = d.caller(req);
  if (auto* refused = std::get_if<Reply>(&caller)) co_return std::move(*refused);
  const std::string tenant = std::get<std::string>(std::move(caller));
  const http::AsyncHandler handler = [&d, &route, &tenant](const Request& r,
                                                           const http::Context& call) {
    return d.run(route, r, tenant, call);
  };
  // (named, not a temporary: g++ 12 destroys temporaries in a co_await expression twice)
  const http::Context unprotected{};
  if (d.hand) co_return co_await d.by_hand(req, tenant, handler);
  if (!d.options.layer) co_return co_await handler(req, unprotected);
  co_return co_await d.layer->async_handle(req, handler);
}

}  // namespace idem::demo
