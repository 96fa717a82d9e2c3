#include "payments_api.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core/string.hpp>
#include <cctype>
#include <charconv>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkout.hpp"
#include "database.hpp"
#include "idem/asio.hpp"
#include "idem/replay_cache.hpp"
#include "idem/sim/mail.hpp"
#include "idem/sim/provider.hpp"

namespace idem::demo {
namespace {

namespace net = boost::asio;
namespace bh = boost::beast::http;
using nlohmann::json;

Reply json_reply(int status, const json& body) {
  return body_reply(status, body.dump(), "application/json");
}

Reply invalid_request(std::string_view detail) {
  return problem_reply(400, "invalid_request", "Invalid request", detail);
}

// The value of the query parameter `name` in `target`, or "" (no decoding: the demo's
// parameters are digits and charge ids).
std::string_view query_param(std::string_view target, std::string_view name) {
  const auto q = target.find('?');
  if (q == std::string_view::npos) return {};
  std::string_view rest = target.substr(q + 1);
  while (!rest.empty()) {
    const auto amp = rest.find('&');
    const std::string_view pair = rest.substr(0, amp);
    if (pair.size() > name.size() && pair.starts_with(name) && pair[name.size()] == '=')
      return pair.substr(name.size() + 1);
    if (amp == std::string_view::npos) break;
    rest.remove_prefix(amp + 1);
  }
  return {};
}

// Digits as a positive int64, or nullopt (empty, a non-digit, or out of range).
std::optional<std::int64_t> positive_number(std::string_view digits) {
  std::int64_t n = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), n);
  if (ec != std::errc() || end != digits.data() + digits.size() || n <= 0) return std::nullopt;
  return n;
}

// The payment fields, checked. Returns a problem to send, or nullopt if the body is valid.
std::optional<Reply> check_payment(const json& body) {
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

std::map<std::string, std::string> load_api_keys(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(fmt::format("cannot read API keys file {}", path));
  std::map<std::string, std::string> keys;
  std::map<std::string, int> line_of;
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
    if (const auto [it, fresh] = line_of.try_emplace(key, n); !fresh) {
      throw std::runtime_error(
          fmt::format("{}:{}: API key repeated (first on line {}); one key names one tenant", path,
                      n, it->second));
    }
    keys[key] = tenant;
  }
  if (keys.empty()) {
    throw std::runtime_error(fmt::format(
        "{}: no API keys (every line is empty or a comment); refusing to start, since the "
        "public demo keys would then open the API",
        path));
  }
  return keys;
}

struct PaymentsApi::Impl {
  ApiOptions options;
  std::shared_ptr<Clock> clock;
  std::shared_ptr<sim::Provider> provider;
  std::unique_ptr<sim::MailSender> mail;
  std::shared_ptr<ReplayCache> replay_cache;  // ApiOptions::replay_cache_bytes; else null
  std::unique_ptr<Coordinator> idem;
  std::unique_ptr<http::Layer> layer;
  http::AsyncHandler create_handler;
  // idem's store and the orders table (the application's own data, beside idem's keys; its
  // writes are the checkout's local steps, in the key's own transactions).
  std::unique_ptr<Database> db;
  // Operator reads (the whole ledger, page by page) run here, off the io thread.
  net::thread_pool operator_work{1};
  // Reads of a database server (GET /v1/payments/{id}, /readyz) run here, off the io thread.
  net::thread_pool reads{1};
  // Purge, reap, the completer and the outbox, on their own thread.
  std::unique_ptr<Maintenance> maintenance;
  net::thread_pool maintenance_work{1};

  explicit Impl(ApiOptions o)
      : options(std::move(o)),
        clock(options.clock ? options.clock : std::make_shared<SystemClock>()) {
    if (options.api_keys.empty())
      options.api_keys = {{"sk_test_alpha", "alpha"}, {"sk_test_beta", "beta"}};
    provider = std::make_shared<sim::Provider>(
        clock, sim::ProviderOptions{.latency = options.provider_latency,
                                    .dedup = options.provider_dedup,
                                    .ledger_path = options.ledger});
    mail =
        std::make_unique<sim::MailSender>(clock, sim::MailOptions{.journal_path = options.ledger});
    Options idem_options;
    idem_options.in_flight = options.policy;
    idem_options.ttl = options.ttl;
    idem_options.lease = options.lease;
    idem_options.heartbeat = options.lease / 3;
    idem_options.on_store_failure =
        options.fail_closed ? FailureMode::fail_closed : FailureMode::fail_open;
    idem_options.clock = clock;
    db = std::make_unique<Database>(
        options.db, DatabaseOptions{.clock = clock, .busy_timeout = options.store_busy_timeout});
    std::shared_ptr<Store> store = db->store();
    if (options.replay_cache_bytes > 0) {
      replay_cache = std::make_shared<ReplayCache>(
          store, ReplayCacheOptions{.max_bytes = options.replay_cache_bytes, .clock = clock});
      store = replay_cache;
    }
    idem = std::make_unique<Coordinator>(std::move(store), std::move(idem_options));
    http::LayerOptions layer_options;
    layer_options.methods = {bh::verb::post};
    layer_options.in_flight = options.policy;
    layer_options.tenant = [this](const Request& r) { return tenant_of(r).value_or(""); };
    layer_options.operation = [](const Request&) { return std::string("payment.create"); };
    layer_options.fingerprint = http::json_fields({"amount", "currency", "order_id"});
    layer_options.check = [](const Request& r) -> std::optional<Reply> {
      const json body = json::parse(r.body(), nullptr, false);
      if (body.is_discarded()) return invalid_request("the body is not valid JSON");
      return check_payment(body);
    };
    layer_options.steps = true;
    layer = std::make_unique<http::Layer>(*idem, std::move(layer_options));
    create_handler = [this](const Request& r, const http::Context& call) {
      return create(r, call);
    };
    maintenance = std::make_unique<Maintenance>(*idem, options.maintenance);
    maintenance->deliver(mail_delivery(*mail));
    maintenance->resume("payment.create", [this](Attempt& attempt) {
      return layer->resume(attempt, create_handler);
    });
    if (options.maintenance_loop) maintenance->start(maintenance_work.get_executor());
  }

  ~Impl() { join(); }

  void join() {
    maintenance->stop();
    maintenance_work.join();
    operator_work.join();
    reads.join();
  }

  // The one Authorization field's value; nullopt when absent or sent more than once.
  static std::optional<std::string_view> authorization(const Request& r) {
    const auto [first, last] = r.equal_range(bh::field::authorization);
    if (first == last || std::next(first) != last) return std::nullopt;
    return sv(first->value());
  }

  // The tenant of the request's bearer token, or nullopt.
  std::optional<std::string> tenant_of(const Request& r) const {
    const std::optional<std::string_view> auth = authorization(r);
    if (!auth || auth->size() <= 7 || !boost::beast::iequals({auth->data(), 7}, "Bearer "))
      return std::nullopt;
    const auto it = options.api_keys.find(std::string(auth->substr(7)));
    if (it == options.api_keys.end()) return std::nullopt;
    return it->second;
  }

  // The operator routes: every tenant's data. With an operator key, only its bearer; without
  // one, clients from operator_addresses that do not present a tenant's key.
  bool operator_may_read(const Request& r, const Peer& peer) const {
    if (!options.operator_key.empty()) {
      const std::optional<std::string_view> auth = authorization(r);
      return auth && *auth == "Bearer " + options.operator_key;
    }
    const auto& from = options.operator_addresses;
    return std::find(from.begin(), from.end(), peer.address) != from.end() && !tenant_of(r);
  }

  // The handler behind the layer: seed 000's checkout (debit, order, mail) as steps of the
  // key's attempt. Failures are 5xx replies, which the layer does not store: the key is
  // released with its progress, and the retry resumes. An answer after a failure never says
  // "nothing happened" when a charge may have been made: once the debit was begun (marked
  // pending) or recorded, it says the outcome is unknown (error "outcome_unknown"), with the
  // charge id when it is known, and tells the client to retry with the same key, never a new one.
  net::awaitable<Reply> create(const Request& req, const http::Context& call) {
    const json body = json::parse(req.body());  // the layer's check() parsed it already
    CheckoutRequest order{call.id.tenant, body.at("order_id"), body.at("amount"),
                          body.at("currency")};
    Attempt& attempt = *call.attempt;
    int status = 503;
    std::string cause;
    try {
      Response r = co_await async_checkout(attempt, *provider, std::move(order));
      co_return http::to_reply(r);
    } catch (const sim::ProviderTimeout& e) {
      status = 504;
      cause = e.what();
    } catch (const OutcomeUnknownError& e) {
      cause = e.what();
    } catch (const StoreError& e) {
      cause = e.what();
    }
    // (A LeaseLostError goes on to the layer, which answers 409 lease_lost: this request no
    // longer holds the key, and its answer must never become the key's stored outcome.)
    const std::string* charge = attempt.known_result("debited");
    if (!attempt.may_have_effects()) {
      co_return problem_reply(
          503, "store_unavailable", "Payment not made",
          fmt::format("the store failed before this payment took effect ({}); nothing was "
                      "charged: retry with the same key",
                      cause));
    }
    const std::string detail =
        charge != nullptr
            ? fmt::format(
                  "the charge {} was made, and recording the payment failed ({}): retry "
                  "with the same key to finish it, never with a new key",
                  *charge, cause)
            : fmt::format(
                  "a charge may have been made, and whether it was is not known yet ({}): "
                  "retry with the same key (the charge is looked up before any new "
                  "attempt), never with a new key",
                  cause);
    Reply r = problem_reply(status, "outcome_unknown", "Payment outcome unknown", detail);
    if (charge != nullptr) r.set("Payment-Charge-Id", *charge);
    co_return r;
  }

  // Runs `read` (a call into the database) off the io thread when the database is a server
  // (PostgreSQL: a read may wait up to its deadline), on the reads thread; inline on SQLite.
  template <class T, class F>
  net::awaitable<T> database_read(F read) {
    if (!db->store()->remote()) co_return read();
    // (named, not a temporary: g++ 12 destroys temporaries in a co_await expression twice)
    auto on_reads = [read]() -> net::awaitable<T> { co_return read(); };
    co_return co_await net::co_spawn(reads, std::move(on_reads), net::use_awaitable);
  }

  net::awaitable<Reply> find(std::string_view id, const std::string& tenant) {
    const std::optional<std::int64_t> seq =
        id.starts_with("pay_") ? positive_number(id.substr(4)) : std::nullopt;
    struct Found {
      std::optional<std::string> order;
      std::string failure;
    };
    // (named, not a temporary: g++ 12 destroys temporaries in a co_await expression twice)
    const auto read = [this, seq, tenant] {
      Found f;
      try {
        if (seq) f.order = db->find_order(*seq, tenant);
      } catch (const StoreError& e) {
        f.failure = e.what();
      }
      return f;
    };
    Found found = co_await database_read<Found>(read);
    if (!found.failure.empty()) {
      co_return problem_reply(503, "store_unavailable", "Payments unavailable",
                              fmt::format("{}; retry", found.failure));
    }
    if (!found.order) {
      co_return problem_reply(404, "not_found", "No such payment",
                              "no payment with this id for this API key");
    }
    // Re-serialised with sorted keys: the bytes the checkout answered with.
    co_return json_reply(200, json::parse(*found.order));
  }

  // Readiness: whether the store answers a read now (within its own deadline), asked off the io
  // thread. Liveness (/healthz) asks nothing of the store.
  net::awaitable<Reply> ready() {
    const auto probe = [this]() -> std::string {
      try {
        idem->store().load(KeyId{"-", "readiness", "probe"});
        return {};
      } catch (const std::exception& e) {
        return e.what();
      }
    };
    std::string failure = co_await database_read<std::string>(probe);
    if (!failure.empty()) co_return problem_reply(503, "store_unavailable", "Not ready", failure);
    co_return json_reply(200, {{"status", "ready"}});
  }

  // The mail journal (every tenant's mail): GET /v1/mail, an operator route.
  Reply mails() {
    json list = json::array();
    for (const sim::Mail& m : mail->journal()) {
      list.push_back(
          {{"seq", m.seq}, {"message_id", m.message_id}, {"to", m.to}, {"text", m.text}});
    }
    return json_reply(200, {{"count", list.size()}, {"mails", list}});
  }

  // One page of the provider's statement: ?after=ch_N&limit=1..1000 (default 100). Read on
  // the operator thread, so a large ledger never stalls the requests on the io thread.
  net::awaitable<Reply> charges(std::string_view target) {
    std::int64_t after = 0;
    if (const std::string_view a = query_param(target, "after"); !a.empty()) {
      const auto n = a.starts_with("ch_") ? positive_number(a.substr(3)) : std::nullopt;
      if (!n) co_return invalid_request("after must be a charge id such as ch_100");
      after = *n;
    }
    std::size_t limit = 100;
    if (const std::string_view l = query_param(target, "limit"); !l.empty()) {
      const auto n = positive_number(l);
      if (!n || *n > 1000) co_return invalid_request("limit must be from 1 to 1000");
      limit = static_cast<std::size_t>(*n);
    }
    struct Page {
      json list = json::array();
      std::size_t count = 0;
      std::string failure;
    };
    // A coroutine of the operator thread's own; this one resumes on the io thread when it
    // is done. (A bare post to the pool would only hop through it: the completion runs on
    // the awaiting coroutine's executor.)
    Page read = co_await net::co_spawn(
        operator_work,
        [this, after, limit]() -> net::awaitable<Page> {
          Page p;
          try {
            for (const sim::Charge& c : provider->charges_after(after, limit)) {
              p.list.push_back({{"id", c.id}, {"order_id", c.order_id}, {"amount", c.amount}});
            }
            p.count = provider->charge_count();
          } catch (const std::exception& e) {
            p.failure = e.what();
          }
          co_return p;
        },
        net::use_awaitable);
    json& list = read.list;
    const std::size_t count = read.count;
    const std::string& failure = read.failure;
    if (!failure.empty())
      co_return problem_reply(503, "ledger_unavailable", "Ledger unavailable", failure);
    json page = {{"count", count}, {"charges", list}, {"next", nullptr}};
    if (list.size() == limit) page["next"] = list.back().at("id");
    co_return json_reply(200, page);
  }
};

PaymentsApi::PaymentsApi(ApiOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
PaymentsApi::~PaymentsApi() = default;
Coordinator& PaymentsApi::coordinator() noexcept { return *impl_->idem; }
sim::Provider& PaymentsApi::provider() noexcept { return *impl_->provider; }
void PaymentsApi::join_background() { impl_->join(); }
sim::MailSender& PaymentsApi::mail() noexcept { return *impl_->mail; }
Maintenance& PaymentsApi::maintenance() noexcept { return *impl_->maintenance; }

net::awaitable<Reply> PaymentsApi::handle(Request req, Peer peer) {
  Impl& d = *impl_;
  const std::string target(req.target());
  const std::string path = target.substr(0, target.find('?'));
  const bool get = req.method() == bh::verb::get;
  try {
    if (path == "/healthz") {  // liveness: this process answers; the store is not asked
      if (!get) co_return method_not_allowed("GET");
      co_return json_reply(200, {{"status", "ok"}});
    }
    if (path == "/readyz") {  // readiness: the store answers a read
      if (!get) co_return method_not_allowed("GET");
      co_return co_await d.ready();
    }
    if (path == "/v1/idempotency") {
      if (!get) co_return method_not_allowed("GET");
      co_return body_reply(200, d.layer->policy(), "application/json");
    }
    if (path == "/metrics" || path == "/v1/provider/charges" || path == "/v1/mail") {
      if (!get) co_return method_not_allowed("GET");
      if (!d.operator_may_read(req, peer)) {
        co_return problem_reply(403, "forbidden", "Operator route",
                                d.options.operator_key.empty()
                                    ? "served only to loopback clients without a tenant's API key"
                                    : "served only to requests bearing the operator key");
      }
      if (path == "/metrics") {
        std::string text = d.idem->metrics().to_prometheus();
        if (d.replay_cache) text += d.replay_cache->to_prometheus();
        co_return body_reply(200, std::move(text), "text/plain; version=0.0.4");
      }
      if (path == "/v1/mail") co_return d.mails();
      co_return co_await d.charges(target);
    }
    const bool collection = path == "/v1/payments";
    const bool item = path.starts_with("/v1/payments/") && path.size() > 13 &&
                      path.find('/', 13) == std::string::npos;
    if (!collection && !item) {
      co_return problem_reply(404, "not_found", "Not found",
                              fmt::format("no route for {}", path.substr(0, 100)));
    }
    // Authentication comes before anything else about the request.
    if (req.count(bh::field::authorization) > 1) {
      co_return invalid_request("Authorization was sent more than once; send exactly one");
    }
    const std::optional<std::string> tenant = d.tenant_of(req);
    if (!tenant) {
      Reply r = problem_reply(
          401, "unauthorized", "Unauthorized",
          "send Authorization: Bearer <API key> (demo keys: sk_test_alpha, sk_test_beta)");
      r.set(bh::field::www_authenticate, "Bearer");
      co_return r;
    }
    if (collection) {
      if (req.method() != bh::verb::post) co_return method_not_allowed("POST");
      co_return co_await d.layer->async_handle(req, d.create_handler);
    }
    if (!get) co_return method_not_allowed("GET");
    co_return co_await d.find(std::string_view(path).substr(13), *tenant);
  } catch (const std::exception& e) {
    co_return problem_reply(500, "internal_error", "Internal error", e.what());
  }
}

}  // namespace idem::demo
