// Built against an installed idem (find_package(idem CONFIG), idem::idem): every blocking
// public header compiles without Boost, and a retried charge runs once.
#include <idem/clock.hpp>
#include <idem/coordinator.hpp>
#include <idem/errors.hpp>
#include <idem/file_payload_store.hpp>
#include <idem/fingerprint.hpp>
#include <idem/http.hpp>
#include <idem/key.hpp>
#include <idem/maintenance.hpp>
#include <idem/metrics.hpp>
#include <idem/options.hpp>
#include <idem/response.hpp>
#include <idem/sqlite_store.hpp>
#include <idem/steps.hpp>
#include <idem/store.hpp>
#include <idem/store_wrapper.hpp>
#include <idem/typed.hpp>
#include <iostream>
#include <nlohmann/json.hpp>

#ifdef BOOST_ASIO_VERSION
#error "a blocking idem header pulled in Boost.Asio"
#endif

int main() {
  idem::Coordinator idem(std::make_shared<idem::SqliteStore>(":memory:"), idem::Options{});
  const idem::Request request{.tenant = "alpha",
                              .operation = "payment.charge",
                              .key = "consumer-1",
                              .fingerprint = idem::Fingerprint::of(nlohmann::json{{"amount", 10}})};
  int charges = 0;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const idem::Outcome out = idem.call(request, [&] {
      ++charges;
      return idem::Response{200, R"({"charge":"ch_1"})", {}};
    });
    if (out.response.body != R"({"charge":"ch_1"})") return 2;
  }
  std::cout << "blocking consumer: charges made: " << charges << '\n';
  idem::MaintenanceThread maintenance(idem);  // the schedule, without Boost
  if (maintenance.run_once().rounds != 1) return 3;
  return charges == 1 && idem.metrics().replayed == 2 ? 0 : 1;
}
