// idem::sim — the simulated provider for coroutines (pulls in Boost.Asio).
#pragma once

#include <utility>  // Boost 1.74's awaitable.hpp needs std::exchange declared first

#include <boost/asio/awaitable.hpp>
#include <cstdint>
#include <string>

#include "idem/sim/provider.hpp"

namespace idem::sim {

// Provider::charge for coroutines: suspends for the latency on the provider's clock (it
// does not block the thread), then settles. Same results and errors.
boost::asio::awaitable<ChargeResult> async_charge(Provider& provider, std::string order_id,
                                                  std::int64_t amount, std::string idempotency_key);

}  // namespace idem::sim
