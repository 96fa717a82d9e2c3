#include "commands.hpp"

#include <fmt/format.h>

#include <iostream>
#include <nlohmann/json.hpp>

#include "checkout.hpp"
#include "database.hpp"
#include "idem/coordinator.hpp"
#include "idem/http.hpp"
#include "idem/sim/mail.hpp"
#include "idem/sim/provider.hpp"
#include "idem/steps.hpp"
#include "idem/store_wrapper.hpp"

#include <signal.h>

namespace idem::demo {
namespace {

InFlight policy_of(const std::string& name) {
  if (name == "run") return InFlight::run;
  if (name == "raise") return InFlight::raise;
  return InFlight::wait;
}

// The options of a one-shot process: its lease, a heartbeat at a third of it, and a wait
// long enough for a duplicate to outlast a crashed holder's lease.
Options process_options(long long lease_ms, InFlight policy, std::shared_ptr<Clock> clock) {
  const auto lease = std::chrono::milliseconds(lease_ms);
  Options options;
  options.in_flight = policy;
  options.lease = lease;
  options.heartbeat = lease / 3;
  options.max_wait = std::max<std::chrono::milliseconds>(std::chrono::seconds(10),
                                                         lease + std::chrono::seconds(1));
  options.clock = std::move(clock);
  return options;
}

// A store that stops this process (SIGSTOP) after the first reservation it commits, before
// the coordinator has the reply: a pause inside the round trip, as a frozen owner sees it.
class StopAfterReserve : public StoreWrapper {
 public:
  using StoreWrapper::StoreWrapper;
  void apply(std::span<StoreOp* const> ops) override {
    StoreWrapper::apply(ops);
    for (const StoreOp* op : ops) {
      if (!stopped_ && op->kind == StoreOp::Kind::reserve && !op->error &&
          op->reservation.kind != Reservation::Kind::existing) {
        stopped_ = true;
        raise(SIGSTOP);
      }
    }
  }

 private:
  bool stopped_ = false;
};

}  // namespace

int run_charge(const ChargeArgs& a) {
  nlohmann::json line;
  try {
    auto clock = std::make_shared<SystemClock>();
    sim::Provider provider(clock, {.latency = std::chrono::milliseconds(a.provider_latency_ms),
                                   .dedup = a.provider_dedup,
                                   .ledger_path = a.ledger});
    if (a.crash_after_charge) provider.inject(sim::Fault::crash);

    Options options = process_options(a.lease_ms, policy_of(a.policy), clock);
    options.on_store_failure = a.fail_closed ? FailureMode::fail_closed : FailureMode::fail_open;
    Database db(a.db, {.clock = clock});
    std::shared_ptr<Store> store = db.store();
    if (a.stop_at == "reserved") store = std::make_shared<StopAfterReserve>(store);
    Coordinator idem(store, options);

    const nlohmann::json body = {
        {"amount", a.amount}, {"currency", a.currency}, {"order_id", a.order_id}};
    Request req;
    req.tenant = a.tenant;
    req.operation = a.operation;
    req.key = a.key;
    req.fingerprint = Fingerprint::of(body);
    line["key_hash"] = short_hash({a.tenant, a.operation, a.key});

    // The provider gets a key derived from the record: the same on every retry, in every
    // process, after a crash.
    const std::string downstream = derived_key({a.tenant, a.operation, a.key}, "charge");
    const Outcome out = idem.call(req, [&] {
      const sim::ChargeResult r = provider.charge(a.order_id, a.amount, downstream);
      if (r.declined) {
        return Response{
            402, nlohmann::json{{"status", "declined"}, {"reason", r.reason}}.dump(), {}};
      }
      return Response{200,
                      nlohmann::json{{"charge_id", r.charge_id},
                                     {"amount", a.amount},
                                     {"currency", a.currency},
                                     {"order_id", a.order_id}}
                          .dump(),
                      {}};
    });
    const Response http = to_http(out);
    line["waited"] = idem.metrics().waited > 0;  // another request held the key meanwhile
    line["outcome"] = out.source == Outcome::Source::replayed      ? "replayed"
                      : out.source == Outcome::Source::unprotected ? "unprotected"
                                                                   : "executed";
    line["status"] = http.status;
    const auto stored = nlohmann::json::parse(out.response.body);
    if (stored.contains("charge_id")) line["charge_id"] = stored["charge_id"];
  } catch (const error& e) {
    line["outcome"] = std::string(to_string(e.code()));
    line["status"] = http_status(e.code());
    line["error"] = e.what();
  } catch (const std::exception& e) {
    line["outcome"] = "error";
    line["error"] = e.what();
  }
  std::cout << line.dump() << std::endl;
  return line.contains("charge_id") ? 0 : 1;
}

int run_ledger(const std::string& ledger) {
  auto clock = std::make_shared<SystemClock>();
  sim::Provider provider(clock, {.ledger_path = ledger});
  nlohmann::json charges = nlohmann::json::array();
  for (const sim::Charge& c : provider.charges()) {
    charges.push_back({{"id", c.id},
                       {"order_id", c.order_id},
                       {"amount", c.amount},
                       {"idempotency_key", c.idempotency_key},
                       {"at_ms", c.at.time_since_epoch().count()}});
  }
  std::cout << nlohmann::json{{"count", charges.size()}, {"charges", charges}}.dump() << std::endl;
  return 0;
}

int run_checkout(const CheckoutArgs& a) {
  nlohmann::json line;
  try {
    auto clock = std::make_shared<SystemClock>();
    sim::Provider provider(clock, {.latency = std::chrono::milliseconds(a.provider_latency_ms),
                                   .dedup = a.provider_dedup,
                                   .ledger_path = a.ledger});
    Options options = process_options(a.lease_ms, InFlight::wait, clock);
    if (a.heartbeat_ms >= 0) options.heartbeat = std::chrono::milliseconds(a.heartbeat_ms);
    Database db(a.db, {.clock = clock});
    Coordinator idem(db.store(), options);

    const CheckoutRequest order{a.tenant, a.order_id, a.amount, a.currency, "buyer@example.com"};
    Request req;
    req.tenant = a.tenant;
    req.operation = "payment.create";
    req.key = a.key;
    req.fingerprint = Fingerprint::of(
        nlohmann::json{{"amount", a.amount}, {"currency", a.currency}, {"order_id", a.order_id}});
    req.payload = to_payload(order);
    const Outcome out = idem.call_steps(req, [&](Attempt& attempt) {
      return checkout(attempt, provider, checkout_from_payload(attempt.request()),
                      [&a](std::string_view point) {
                        if (point == a.stop_at) raise(SIGSTOP);
                      });
    });
    line["status"] = out.response.status;
    line["outcome"] = out.replayed() ? "replayed" : "executed";
    line["body"] = nlohmann::json::parse(out.response.body, nullptr, false);
    line["resumed"] = idem.metrics().resumed;
    line["reconciled"] = idem.metrics().reconciled;
    line["debits"] = provider.charge_count();
    line["orders"] = db.count_orders();
    std::cout << line.dump() << std::endl;
    return out.response.status == 200 ? 0 : 1;
  } catch (const std::exception& e) {
    const auto* idem_error = dynamic_cast<const error*>(&e);
    line["outcome"] = idem_error ? std::string(to_string(idem_error->code())) : "error";
    line["error"] = e.what();
    std::cout << line.dump() << std::endl;
    return 1;
  }
}

int run_dispatch(const std::string& db, const std::string& ledger) {
  try {
    auto clock = std::make_shared<SystemClock>();
    sim::MailSender mail(clock, {.journal_path = ledger});
    Options options;
    options.clock = clock;
    Database database(db, {.clock = clock});
    Coordinator idem(database.store(), options);
    Dispatcher dispatcher(idem, mail_delivery(mail));
    const DispatchReport r = dispatcher.run_once();
    std::cout << nlohmann::json{{"delivered", r.delivered},
                                {"retried", r.retried},
                                {"parked", r.parked},
                                {"given_back", r.given_back},
                                {"pending", steps_of(idem.store()).outbox_counts().pending},
                                {"mails", mail.count()}}
                     .dump()
              << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cout << nlohmann::json{{"error", e.what()}}.dump() << std::endl;
    return 1;
  }
}

}  // namespace idem::demo
