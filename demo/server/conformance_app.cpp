#include "conformance_app.hpp"

#include <fmt/format.h>

#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <charconv>
#include <nlohmann/json.hpp>
#include <variant>

#include "idem/file_payload_store.hpp"
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

}  // namespace

struct ConformanceApp::Impl {
  ConformanceOptions options;
  std::unique_ptr<Coordinator> idem;
  std::unique_ptr<http::Layer> layer;
  long long counter = 0;  // io thread only

  explicit Impl(ConformanceOptions o) : options(std::move(o)) {
    Options idem_options;
    idem_options.in_flight = options.policy;
    idem_options.on_store_failure =
        options.fail_closed ? FailureMode::fail_closed : FailureMode::fail_open;
    idem_options.inline_body_limit = std::size_t{1} << 20;
    idem_options.payload_store = std::make_shared<FilePayloadStore>(options.db + ".payloads");
    idem = std::make_unique<Coordinator>(std::make_shared<SqliteStore>(options.db),
                                         std::move(idem_options));
    http::LayerOptions layer_options;
    layer_options.in_flight = options.policy;
    layer = std::make_unique<http::Layer>(*idem, std::move(layer_options));
  }

  // A counted route, or nullopt when the request names none. Validation happens here,
  // before the layer: a malformed route parameter stores nothing.
  struct Route {
    enum Kind { echo, status, slow, large } kind;
    long long n = 0;
  };

  static std::variant<Route, Reply> route(const Request& req, std::string_view path,
                                          std::string_view query) {
    const auto bad = [](std::string_view detail) {
      return problem_reply(400, "invalid_request", "Invalid request", detail);
    };
    if (path == "/echo") return Route{Route::echo};
    if (path.starts_with("/status/")) {
      const auto code = number_after(path, "/status/", 200, 599);
      if (!code) return bad("the status must be a number from 200 to 599");
      return Route{Route::status, *code};
    }
    if (path == "/slow") {
      const auto ms = number_after(query, "ms=", 0, 60000);
      if (!ms) return bad("slow needs ?ms=N with N from 0 to 60000");
      return Route{Route::slow, *ms};
    }
    if (path == "/large") {
      const auto bytes = number_after(query, "bytes=", 0, 16 << 20);
      if (!bytes) return bad("large needs ?bytes=N with N from 0 to 16777216");
      return Route{Route::large, *bytes};
    }
    (void)req;
    return problem_reply(404, "not_found", "Not found",
                         fmt::format("no route for {}", path.substr(0, 100)));
  }

  net::awaitable<Reply> run(const Route& r, const Request& req) {
    ++counter;
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
    co_return body_reply(200, std::string(static_cast<std::size_t>(r.n), 'x'),
                         "application/octet-stream");
  }
};

ConformanceApp::ConformanceApp(ConformanceOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
ConformanceApp::~ConformanceApp() = default;
Coordinator& ConformanceApp::coordinator() noexcept { return *impl_->idem; }
long long ConformanceApp::count() const noexcept { return impl_->counter; }

net::awaitable<Reply> ConformanceApp::handle(Request req, Peer) {
  Impl& d = *impl_;
  const std::string_view target = sv(req.target());
  const std::string_view path = target.substr(0, target.find('?'));
  const std::string_view query =
      target.find('?') == std::string_view::npos ? "" : target.substr(target.find('?') + 1);
  if (path == "/healthz" && req.method() == bh::verb::get)
    co_return body_reply(200, R"({"status":"ok"})", "application/json");
  if (path == "/idempotency" && req.method() == bh::verb::get)
    co_return body_reply(200, d.layer->policy(), "application/json");
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
      co_return body_reply(200, nlohmann::json{{"count", d.counter}}.dump(), "application/json");
    };
    co_return co_await d.layer->async_handle(req, counter);
  }
  auto found = Impl::route(req, path, query);
  if (auto* refused = std::get_if<Reply>(&found)) co_return std::move(*refused);
  const Impl::Route route = std::get<Impl::Route>(found);
  if (req.method() != bh::verb::post) co_return method_not_allowed("POST");
  const http::AsyncHandler handler = [&d, route](const Request& r, const http::Context&) {
    return d.run(route, r);
  };
  // (named, not a temporary: g++ 12 destroys temporaries in a co_await expression twice)
  const http::Context unprotected{};
  if (!d.options.layer) co_return co_await handler(req, unprotected);
  co_return co_await d.layer->async_handle(req, handler);
}

}  // namespace idem::demo
