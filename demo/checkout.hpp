// Seed 000's checkout as a multi-step operation (idem/steps.hpp), shared by `idem-demo
// serve` (POST /v1/payments), `idem-demo checkout` (one process, for crash tests) and the
// table's crash scenario:
//   debited        - the provider charges with the step's derived key (external; after an
//                    unknown outcome the charge is looked up by that key first);
//   order_created  - the order row, unique per tenant and order_id, inserted ignoring the
//                    conflict in the step's own transaction (local);
//   notified       - the receipt mail queued in the outbox in the step's transaction (local);
//                    a Dispatcher delivers it to the mail sender, which deduplicates only on
//                    the message id.
#pragma once

#include <utility>  // Boost 1.74's awaitable.hpp needs std::exchange declared first

#include <boost/asio/awaitable.hpp>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "idem/response.hpp"
#include "idem/steps.hpp"

namespace idem::sim {
class MailSender;
class Provider;
}  // namespace idem::sim

namespace idem::demo {

struct CheckoutRequest {
  std::string tenant;
  std::string order_id;
  std::int64_t amount = 0;
  std::string currency;
  std::string email = "buyer@example.com";
};

// As stored on the record (Request::payload) and back. checkout_from_payload throws
// std::runtime_error for a payload that is not one.
std::string to_payload(const CheckoutRequest& r);
CheckoutRequest checkout_from_payload(const std::string& payload);

// Creates the orders table in `db` (the keys' SQLite file) if it is missing. Throws
// StoreError. (database.hpp opens either engine with its orders table.)
void create_orders_table(const std::string& db);

// The points of the flow where the table's scenario and the tests make a process die:
// "before debited", "debited: charged, not recorded", "after debited",
// "order_created: inside its transaction", "after order_created",
// "notified: inside its transaction", "after notified" (queued, not delivered).
using CrashHook = std::function<void(std::string_view point)>;

// The whole flow, blocking (the provider's latency blocks the thread). `crash` is called at
// each point above. Returns 200 with the payment, or 402 when the provider declines.
Response checkout(Attempt& attempt, sim::Provider& provider, const CheckoutRequest& request,
                  const CrashHook& crash = {});
// The same flow for coroutines (the provider's latency suspends).
boost::asio::awaitable<Response> async_checkout(Attempt& attempt, sim::Provider& provider,
                                                CheckoutRequest request);

// The outbox's delivery to the simulated mail sender ("mail" topic).
Delivery mail_delivery(sim::MailSender& mail);

// How many orders the SQLite file `db` holds (for tables and tests).
std::size_t count_orders(const std::string& db);

}  // namespace idem::demo
