#include "checkout.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <stdexcept>

#include "checkout_sql.hpp"
#include "idem/asio.hpp"
#include "idem/http.hpp"
#include "idem/internal/sqlite.hpp"  // idem's RAII wrappers over sqlite3, for the orders table
#include "idem/sim/async_provider.hpp"
#include "idem/sim/mail.hpp"
#include "idem/sim/provider.hpp"

namespace idem::demo {
namespace {

using nlohmann::json;

// A charge as the debited step records it: the charge id, or "declined:<reason>".
std::string charge_result(const sim::ChargeResult& r) {
  return r.declined ? "declined:" + r.reason : r.charge_id;
}

// The provider's answer to "did a charge with this key happen?".
std::optional<std::string> look_up_charge(sim::Provider& provider, const std::string& key) {
  std::optional<sim::Charge> c = provider.find(key);
  if (!c) return std::nullopt;
  return c->id;
}

std::int64_t epoch_ms(const sim::Provider& provider) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             provider.clock().now().time_since_epoch())
      .count();
}

// order_created: the order row, inserted ignoring a conflict on (tenant, order_id); its id.
std::string create_order(LocalTransaction& tx, const CheckoutRequest& r,
                         const std::string& charge_id, std::int64_t now_ms) {
  const std::string body = json{
      {"charge_id", charge_id},
      {"amount", r.amount},
      {"currency", r.currency},
      {"order_id", r.order_id},
      {"status", "succeeded"}}.dump();
  const bool pg = tx.dialect() == LocalTransaction::Dialect::postgresql;
  tx.execute(pg ? sql::pg::kInsertOrder : sql::kInsertOrder,
             {r.tenant, r.order_id, charge_id, body, now_ms});
  const std::vector<LocalTransaction::Row> rows =
      tx.execute(pg ? sql::pg::kOrderId : sql::kOrderId, {r.tenant, r.order_id});
  return std::get<std::string>(rows.at(0).at(0));
}

// notified: the receipt, queued in the outbox; the message id.
std::string queue_receipt(LocalTransaction& tx, const CheckoutRequest& r,
                          const std::string& charge_id, const std::string& order) {
  const std::string text = fmt::format("Receipt: order {} ({}) paid, {} {} minor units, charge {}",
                                       r.order_id, order, r.amount, r.currency, charge_id);
  return tx.enqueue("mail", json{{"to", r.email}, {"text", text}}.dump());
}

Response declined(std::string_view reason) {
  return problem(402, "payment_declined", "Payment declined",
                 fmt::format("the provider declined the charge: {}", reason));
}

// The answer once the order and the receipt are recorded.
Response paid(const CheckoutRequest& r, const std::string& charge, const std::string& order) {
  Response out;
  out.status = 200;
  out.headers = {{"Content-Type", "application/json"}};
  out.body = json{{"id", order},
                  {"charge_id", charge},
                  {"amount", r.amount},
                  {"currency", r.currency},
                  {"order_id", r.order_id},
                  {"status", "succeeded"}}
                 .dump();  // keys sorted: the bytes of GET /v1/payments/{id}
  return out;
}

// The local steps and the answer, after the debit, blocking.
Response after_debit(Attempt& a, sim::Provider& provider, const CheckoutRequest& r,
                     const std::string& charge, const CrashHook& crash) {
  auto at = [&crash](std::string_view point) {
    if (crash) crash(point);
  };
  at("after debited");
  if (charge.starts_with("declined:")) return declined(charge.substr(9));
  const std::string order = a.local("order_created", [&](LocalTransaction& tx) {
    std::string id = create_order(tx, r, charge, epoch_ms(provider));
    at("order_created: inside its transaction");
    return id;
  });
  at("after order_created");
  a.local("notified", [&](LocalTransaction& tx) {
    std::string id = queue_receipt(tx, r, charge, order);
    at("notified: inside its transaction");
    return id;
  });
  at("after notified");
  return paid(r, charge, order);
}

}  // namespace

std::string to_payload(const CheckoutRequest& r) {
  return json{{"tenant", r.tenant},
              {"order_id", r.order_id},
              {"amount", r.amount},
              {"currency", r.currency},
              {"email", r.email}}
      .dump();
}

CheckoutRequest checkout_from_payload(const std::string& payload) {
  try {
    const json j = json::parse(payload);
    return CheckoutRequest{j.at("tenant"), j.at("order_id"), j.at("amount"), j.at("currency"),
                           j.at("email")};
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("not a stored checkout request: {}", e.what()));
  }
}

void create_orders_table(const std::string& db) {
  sqlite::BusyPolicy busy{std::chrono::seconds(5), {}};
  sqlite::Connection c = sqlite::open_connection(db, &busy);
  sqlite::enable_wal(c.get(), busy);
  sqlite::exec(c.get(), sql::kOrdersSchema);
}

std::size_t count_orders(const std::string& db) {
  sqlite::BusyPolicy busy{std::chrono::seconds(5), {}};
  sqlite::Connection c = sqlite::open_connection(db, &busy);
  sqlite::Statement s(c.get(), sql::kCountOrders);
  s.step();
  return static_cast<std::size_t>(s.int64(0));
}

Response checkout(Attempt& attempt, sim::Provider& provider, const CheckoutRequest& r,
                  const CrashHook& crash) {
  if (crash) crash("before debited");
  const std::string charge = attempt.external(
      "debited",
      [&](const std::string& key) {
        std::string id = charge_result(provider.charge(r.order_id, r.amount, key));
        if (crash) crash("debited: charged, not recorded");
        return id;
      },
      [&](const std::string& key) { return look_up_charge(provider, key); });
  return after_debit(attempt, provider, r, charge, crash);
}

boost::asio::awaitable<Response> async_checkout(Attempt& attempt, sim::Provider& provider,
                                                CheckoutRequest r) {
  const AsyncExternalCall call =
      [&](const std::string& key) -> boost::asio::awaitable<std::string> {
    sim::ChargeResult charged = co_await sim::async_charge(provider, r.order_id, r.amount, key);
    co_return charge_result(charged);
  };
  const AsyncLookup lookup =
      [&](const std::string& key) -> boost::asio::awaitable<std::optional<std::string>> {
    co_return look_up_charge(provider, key);
  };
  const std::string charge = co_await async_external(attempt, "debited", call, lookup);
  if (charge.starts_with("declined:")) co_return declined(charge.substr(9));
  const std::string order = co_await async_local(
      attempt, "order_created",
      [&](LocalTransaction& tx) { return create_order(tx, r, charge, epoch_ms(provider)); });
  co_await async_local(attempt, "notified",
                       [&](LocalTransaction& tx) { return queue_receipt(tx, r, charge, order); });
  co_return paid(r, charge, order);
}

Delivery mail_delivery(sim::MailSender& mail) {
  return [&mail](const OutboxMessage& m) {
    if (m.topic != "mail")
      throw std::runtime_error(fmt::format("no receiver for topic {}", m.topic));
    const json j = json::parse(m.payload);
    mail.send(m.id, j.at("to"), j.at("text"));
  };
}

}  // namespace idem::demo
