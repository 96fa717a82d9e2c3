#include "payments_api.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "idem/asio.hpp"
#include "idem/http.hpp"
#include "idem/internal/sqlite.hpp"  // idem's RAII wrappers over sqlite3, for the payments table
#include "idem/sim/async_provider.hpp"
#include "idem/sqlite_store.hpp"
#include "payments_sql.hpp"

namespace idem::demo {
namespace {

namespace net = boost::asio;
using nlohmann::json;

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

Response json_response(int status, const json& body) {
  return Response{status, body.dump(), {{"Content-Type", "application/json"}}};
}

Response method_not_allowed(std::string_view allow) {
  Response r = problem(405, "method_not_allowed", "Method not allowed",
                       fmt::format("this resource accepts {}", allow));
  r.headers.push_back({"Allow", std::string(allow)});
  return r;
}

Response invalid_request(std::string_view detail) {
  return problem(400, "invalid_request", "Invalid request", detail);
}

// An HTTP-date (RFC 9110) for the Idempotency-Key-Expires header.
std::string http_date(TimePoint t) {
  const std::time_t secs =
      std::chrono::system_clock::to_time_t(std::chrono::system_clock::time_point(t));
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%a, %d %b %Y %H:%M:%S GMT", &tm);
  return buf;
}

// The payment fields, checked. Returns a problem to send, or nullopt if the body is valid.
std::optional<Response> check_payment(const json& body) {
  if (!body.is_object()) return invalid_request("the body must be a JSON object");
  const auto amount = body.find("amount");
  if (amount == body.end() || !amount->is_number_integer() || amount->get<long long>() <= 0 ||
      (amount->is_number_unsigned() && amount->get<unsigned long long>() > 1'000'000'000'000ULL)) {
    return invalid_request("amount must be an integer from 1 to 10^12 (minor units)");
  }
  const auto currency = body.find("currency");
  if (currency == body.end() || !currency->is_string() ||
      currency->get_ref<const std::string&>().size() != 3 ||
      !std::all_of(currency->get_ref<const std::string&>().begin(),
                   currency->get_ref<const std::string&>().end(),
                   [](char c) { return c >= 'A' && c <= 'Z'; })) {
    return invalid_request("currency must be a three-letter ISO 4217 code such as \"RUB\"");
  }
  const auto order = body.find("order_id");
  if (order == body.end() || !order->is_string() || order->get_ref<const std::string&>().empty() ||
      order->get_ref<const std::string&>().size() > 64 ||
      !std::all_of(order->get_ref<const std::string&>().begin(),
                   order->get_ref<const std::string&>().end(),
                   [](char c) { return c >= 0x21 && c <= 0x7e; })) {
    return invalid_request("order_id must be 1 to 64 printable ASCII characters without spaces");
  }
  if (const auto c = body.find("comment"); c != body.end() && !c->is_string()) {
    return invalid_request("comment, when present, must be a string");
  }
  if (const auto m = body.find("metadata"); m != body.end() && !m->is_object()) {
    return invalid_request("metadata, when present, must be an object");
  }
  return std::nullopt;
}

}  // namespace

const std::string* HttpRequest::header(std::string_view name) const {
  for (const Header& h : headers) {
    if (iequals(h.name, name)) return &h.value;
  }
  return nullptr;
}

std::map<std::string, std::string> load_api_keys(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(fmt::format("cannot read API keys file {}", path));
  std::map<std::string, std::string> keys;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (const auto hash = line.find('#'); hash != std::string::npos) line.erase(hash);
    std::istringstream words(line);
    std::string key, tenant, extra;
    if (!(words >> key)) continue;
    if (!(words >> tenant) || (words >> extra)) {
      throw std::runtime_error(fmt::format("{}:{}: expected \"api_key tenant\"", path, n));
    }
    validate_key_part("tenant", tenant);
    keys[key] = tenant;
  }
  return keys;
}

std::optional<std::string> parse_idempotency_key(std::string_view v) {
  if (v.empty() || v.front() != '"') return std::string(v);
  // RFC 8941 sf-string: DQUOTE *( unescaped / "\" ( DQUOTE / "\" ) ) DQUOTE
  std::string out;
  for (std::size_t i = 1; i < v.size(); ++i) {
    const char c = v[i];
    if (c == '"') return i + 1 == v.size() ? std::optional<std::string>(out) : std::nullopt;
    if (c == '\\') {
      if (++i == v.size() || (v[i] != '"' && v[i] != '\\')) return std::nullopt;
      out += v[i];
    } else if (c < 0x20 || c > 0x7e) {
      return std::nullopt;
    } else {
      out += c;
    }
  }
  return std::nullopt;  // no closing quote
}

struct PaymentsApi::Impl {
  ApiOptions options;
  std::shared_ptr<SystemClock> clock = std::make_shared<SystemClock>();
  std::shared_ptr<sim::Provider> provider;
  std::unique_ptr<Coordinator> idem;
  // The payments table (the application's own data, beside idem's keys).
  sqlite::BusyPolicy busy{std::chrono::seconds(5), {}};
  sqlite::Connection db;
  std::unique_ptr<sqlite::TransactionStatements> tx;
  std::unique_ptr<sqlite::Statement> insert_payment, name_payment, find_payment;

  explicit Impl(ApiOptions o) : options(std::move(o)) {
    if (options.api_keys.empty())
      options.api_keys = {{"sk_test_alpha", "alpha"}, {"sk_test_beta", "beta"}};
    provider = std::make_shared<sim::Provider>(
        clock,
        sim::ProviderOptions{.latency = options.provider_latency, .ledger_path = options.ledger});
    Options idem_options;
    idem_options.in_flight = options.policy;
    idem_options.ttl = options.ttl;
    idem_options.on_store_failure =
        options.fail_closed ? FailureMode::fail_closed : FailureMode::fail_open;
    idem_options.clock = clock;
    idem = std::make_unique<Coordinator>(
        std::make_shared<SqliteStore>(options.db,
                                      SqliteOptions{.busy_timeout = options.store_busy_timeout}),
        std::move(idem_options));
    db = sqlite::open_connection(options.db, &busy);
    sqlite::enable_wal(db.get(), busy);
    sqlite::exec(db.get(), sql::kPaymentsSchema);
    tx = std::make_unique<sqlite::TransactionStatements>(db.get());
    name_payment = std::make_unique<sqlite::Statement>(db.get(), sql::kNamePayment);
    insert_payment = std::make_unique<sqlite::Statement>(db.get(), sql::kInsertPayment);
    find_payment = std::make_unique<sqlite::Statement>(db.get(), sql::kFindPayment);
  }

  // The tenant of the request's bearer token, or nullopt.
  std::optional<std::string> tenant_of(const HttpRequest& r) const {
    const std::string* auth = r.header("Authorization");
    if (auth == nullptr || auth->size() <= 7 ||
        !iequals(std::string_view(*auth).substr(0, 7), "Bearer ")) {
      return std::nullopt;
    }
    const auto it = options.api_keys.find(auth->substr(7));
    if (it == options.api_keys.end()) return std::nullopt;
    return it->second;
  }

  // The action: charge with a key derived from the record, then record the payment.
  net::awaitable<Response> charge(std::string tenant, KeyId id, json body) {
    const std::string order_id = body.at("order_id");
    const long long amount = body.at("amount");
    const sim::ChargeResult r =
        co_await sim::async_charge(*provider, order_id, amount, derived_key(id, "charge"));
    if (r.declined) {
      co_return problem(402, "payment_declined", "Payment declined",
                        fmt::format("the provider declined the charge: {}", r.reason));
    }
    const json payment = {{"charge_id", r.charge_id},
                          {"amount", amount},
                          {"currency", body.at("currency")},
                          {"order_id", order_id},
                          {"status", "succeeded"}};
    // One transaction: the row, then its id ("pay_<seq>") written into its body.
    sqlite::Transaction payment_tx(*tx);
    std::int64_t seq = 0;
    {
      sqlite::ResetGuard reset(*insert_payment);
      const std::string text = payment.dump();
      insert_payment->bind(1, tenant);
      insert_payment->bind(2, text);
      insert_payment->bind(3, static_cast<std::int64_t>(clock->now().time_since_epoch().count()));
      insert_payment->step();
      seq = insert_payment->int64(0);
      insert_payment->step();
    }
    sqlite::ResetGuard reset(*name_payment);
    name_payment->bind(1, seq);
    name_payment->step();
    const std::string text = name_payment->text(0);
    name_payment->step();
    payment_tx.commit();
    co_return Response{200, text, {{"Content-Type", "application/json"}}};
  }

  net::awaitable<Response> create(const HttpRequest& req, std::string tenant) {
    const std::string* raw_key = req.header("Idempotency-Key");
    if (raw_key == nullptr) {
      co_return problem(400, "idempotency_key_required", "Idempotency-Key required",
                        "POST /v1/payments needs an Idempotency-Key header: a client-generated "
                        "key (a UUID) reused unchanged on every retry");
    }
    const std::optional<std::string> key = parse_idempotency_key(*raw_key);
    if (!key) {
      co_return problem(400, "idempotency_key_invalid", "Invalid idempotency key",
                        "Idempotency-Key is neither a bare key nor a valid RFC 8941 string");
    }
    try {
      validate_key_part("key", *key);
    } catch (const InvalidKeyError& e) {
      co_return to_http(e);
    }
    json body = json::parse(req.body, nullptr, false);
    if (body.is_discarded()) co_return invalid_request("the body is not valid JSON");
    if (std::optional<Response> bad = check_payment(body)) co_return std::move(*bad);

    Request request;
    request.tenant = tenant;
    request.operation = "payment.create";
    request.key = *key;
    request.fingerprint = Fingerprint::of(body, {"amount", "currency", "order_id"});
    KeyId id{tenant, request.operation, *key};
    AsyncAction action = [this, tenant, id, body]() { return charge(tenant, id, body); };
    try {
      const Outcome out = co_await async_call(*idem, std::move(request), std::move(action));
      Response r = to_http(out);
      if (out.expires_at != TimePoint{})
        r.headers.push_back({"Idempotency-Key-Expires", http_date(out.expires_at)});
      co_return r;
    } catch (const error& e) {
      co_return to_http(e);
    } catch (const sim::ProviderTimeout& e) {
      co_return problem(504, "provider_unavailable", "Payment provider unavailable",
                        fmt::format("{}; nothing was stored, retry with the same key", e.what()));
    } catch (const std::exception& e) {
      co_return problem(502, "provider_unavailable", "Payment failed", e.what());
    }
  }

  Response find(std::string_view id, const std::string& tenant) {
    std::int64_t seq = 0;
    const bool well_formed =
        id.starts_with("pay_") && id.size() > 4 && id.size() < 24 &&
        std::all_of(id.begin() + 4, id.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (well_formed) seq = std::stoll(std::string(id.substr(4)));
    sqlite::ResetGuard reset(*find_payment);
    find_payment->bind(1, seq);
    find_payment->bind(2, tenant);
    if (!well_formed || !find_payment->step()) {
      return problem(404, "not_found", "No such payment",
                     "no payment with this id for this API key");
    }
    return Response{200, find_payment->text(0), {{"Content-Type", "application/json"}}};
  }

  Response charges() const {
    json list = json::array();
    for (const sim::Charge& c : provider->charges()) {
      list.push_back({{"id", c.id}, {"order_id", c.order_id}, {"amount", c.amount}});
    }
    return json_response(200, {{"count", list.size()}, {"charges", list}});
  }
};

PaymentsApi::PaymentsApi(ApiOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
PaymentsApi::~PaymentsApi() = default;
Coordinator& PaymentsApi::coordinator() noexcept { return *impl_->idem; }
sim::Provider& PaymentsApi::provider() noexcept { return *impl_->provider; }

net::awaitable<Response> PaymentsApi::handle(HttpRequest req) {
  Impl& d = *impl_;
  const std::string path = req.target.substr(0, req.target.find('?'));
  try {
    if (path == "/healthz") {
      if (req.method != "GET") co_return method_not_allowed("GET");
      co_return json_response(200, {{"status", "ok"}});
    }
    if (path == "/metrics") {
      if (req.method != "GET") co_return method_not_allowed("GET");
      co_return Response{
          200, d.idem->metrics().to_prometheus(), {{"Content-Type", "text/plain; version=0.0.4"}}};
    }
    if (path == "/v1/provider/charges") {
      if (req.method != "GET") co_return method_not_allowed("GET");
      co_return d.charges();
    }
    const bool collection = path == "/v1/payments";
    const bool item = path.starts_with("/v1/payments/") && path.size() > 13 &&
                      path.find('/', 13) == std::string::npos;
    if (!collection && !item) {
      co_return problem(404, "not_found", "Not found",
                        fmt::format("no route for {}", path.substr(0, 100)));
    }
    // Authentication comes before anything else about the request.
    const std::optional<std::string> tenant = d.tenant_of(req);
    if (!tenant) {
      Response r =
          problem(401, "unauthorized", "Unauthorized",
                  "send Authorization: Bearer <API key> (demo keys: sk_test_alpha, sk_test_beta)");
      r.headers.push_back({"WWW-Authenticate", "Bearer"});
      co_return r;
    }
    if (collection) {
      if (req.method != "POST") co_return method_not_allowed("POST");
      Response r = co_await d.create(req, *tenant);
      co_return r;
    }
    if (req.method != "GET") co_return method_not_allowed("GET");
    co_return d.find(std::string_view(path).substr(13), *tenant);
  } catch (const std::exception& e) {
    co_return problem(500, "internal_error", "Internal error", e.what());
  }
}

}  // namespace idem::demo
