#include "idem/sim/async_provider.hpp"

#include "idem/asio.hpp"

namespace idem::sim {

boost::asio::awaitable<ChargeResult> async_charge(Provider& provider, std::string order_id,
                                                  std::int64_t amount,
                                                  std::string idempotency_key) {
  const PendingCharge pending =
      provider.start(std::move(order_id), amount, std::move(idempotency_key));
  co_await async_sleep_until(provider.clock(), pending.due);
  co_return provider.finish(pending);
}

}  // namespace idem::sim
