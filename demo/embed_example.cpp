// The README's embedding example: a charge handler protected by idem. Built with the project
// and run by ctest (it fails unless the retries charged once).
#include <idem/coordinator.hpp>
#include <idem/sqlite_store.hpp>

#include <iostream>
#include <nlohmann/json.hpp>

int main() {
  idem::Options options;
  options.in_flight = idem::InFlight::wait;  // or raise for a public API (409)
  options.lease = std::chrono::seconds(30);  // longer than the slowest honest attempt
  idem::Coordinator idem(std::make_shared<idem::SqliteStore>(":memory:"), options);

  int charges = 0;  // the side effect that must not repeat
  const nlohmann::json body = {{"amount", 4990},
                               {"currency", "RUB"},
                               {"order_id", "A-10023"},
                               {"comment", "not significant"}};
  const idem::Request request{
      .tenant = "alpha",
      .operation = "payment.charge",
      .key = "7f3c1e8a-4b2d-4e91-a5f6-9c0d3b7e2a41",
      .fingerprint = idem::Fingerprint::of(body, {"amount", "currency", "order_id"})};

  for (int attempt = 1; attempt <= 3; ++attempt) {  // the client retries
    const idem::Outcome out = idem.call(request, [&] {
      // Downstream gets a key derived from the record: the same on every retry.
      const std::string provider_key =
          idem::derived_key({request.tenant, request.operation, *request.key}, "charge");
      ++charges;  // gateway.charge(body, provider_key) in a real service
      return idem::Response{
          200, nlohmann::json{{"charge", "ch_1"}, {"key", provider_key}}.dump(), {}};
    });
    std::cout << "attempt " << attempt << ": " << out.response.status
              << (out.replayed() ? " (replayed)" : "") << '\n';
  }
  std::cout << "charges made: " << charges << '\n';
  return charges == 1 ? 0 : 1;
}
