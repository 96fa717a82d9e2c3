// The payments API of `idem-demo serve`: seed 000's design (POST /v1/payments with an
// Idempotency-Key, tenants from API keys, 400/401/402/409/422/502/503/504) on idem's
// coordinator. Independent of the HTTP server: it takes a parsed request and returns an
// idem::Response, so any server can carry it (demo/server/server.cpp uses Boost.Beast).
#pragma once

#include <utility>  // Boost 1.74's awaitable.hpp needs std::exchange declared first

#include <boost/asio/awaitable.hpp>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/coordinator.hpp"
#include "idem/response.hpp"

namespace idem::sim {
class Provider;
}

namespace idem::demo {

struct HttpRequest {
  std::string method;  // "POST"
  std::string target;  // "/v1/payments"
  std::vector<Header> headers;
  std::string body;

  // The first header named `name` (case-insensitive), or nullptr.
  const std::string* header(std::string_view name) const;
};

struct ApiOptions {
  std::string db;                     // idempotency keys and payments (SQLite file)
  std::string ledger;                 // provider ledger; empty: in memory
  InFlight policy = InFlight::raise;  // a public API should not hold connections
  std::chrono::milliseconds provider_latency{300};
  bool fail_closed = false;
  // API key -> tenant. Empty: the two demo keys sk_test_alpha -> alpha, sk_test_beta -> beta.
  std::map<std::string, std::string> api_keys{};
  std::chrono::milliseconds ttl{std::chrono::hours(24)};
  std::chrono::milliseconds store_busy_timeout{std::chrono::seconds(5)};
};

// Reads "api_key tenant" lines ('#' starts a comment). Throws std::runtime_error naming the
// line that is not of that form.
std::map<std::string, std::string> load_api_keys(const std::string& path);

// An Idempotency-Key header value: a bare key, or an RFC 8941 sf-string ("..." with \" and
// \\ escapes). nullopt if the quoting is malformed.
std::optional<std::string> parse_idempotency_key(std::string_view value);

// Thread-safety: one PaymentsApi serves the coroutines of one io_context thread.
class PaymentsApi {
 public:
  explicit PaymentsApi(ApiOptions options);
  ~PaymentsApi();
  PaymentsApi(const PaymentsApi&) = delete;
  PaymentsApi& operator=(const PaymentsApi&) = delete;

  // Routes one request. Never throws for bad input: every failure is a problem+json answer.
  boost::asio::awaitable<Response> handle(HttpRequest request);

  Coordinator& coordinator() noexcept;
  sim::Provider& provider() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem::demo
