// A separate process for the cross-process race test: waits for the start signal (one byte
// on a file descriptor it inherited), makes one call through the coordinator with real time,
// and prints one JSON line: {"outcome": "executed"|"replayed"|"in_progress"|..., "charge_id": ...,
// "waited": true|false}.
//
//   idem_race_helper STORE LEDGER KEY START_FD LATENCY_MS
// STORE is a SQLite file, or postgresql:SCHEMA for a schema on the server IDEM_TEST_PG names.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "idem/coordinator.hpp"
#include "idem/pg_store.hpp"
#include "idem/sim/provider.hpp"
#include "idem/sqlite_store.hpp"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::cerr << "usage: idem_race_helper STORE LEDGER KEY START_FD LATENCY_MS\n";
    return 2;
  }
  auto clock = std::make_shared<idem::SystemClock>();
  // The provider does not deduplicate: every execution of the action is a charge.
  idem::sim::Provider provider(clock, {.latency = std::chrono::milliseconds(std::stoi(argv[5])),
                                       .dedup = false,
                                       .ledger_path = argv[2]});
  const std::string store = argv[1];
  std::shared_ptr<idem::Store> keys;
  if (store.starts_with("postgresql:")) {
    const char* conninfo = std::getenv("IDEM_TEST_PG");
    if (conninfo == nullptr) {
      std::cerr << "idem_race_helper: IDEM_TEST_PG is not set\n";
      return 2;
    }
    keys = std::make_shared<idem::PgStore>(
        conninfo, idem::PgOptions{.schema = store.substr(std::string("postgresql:").size())});
  } else {
    keys = std::make_shared<idem::SqliteStore>(store);
  }
  idem::Coordinator idem(
      std::move(keys),
      {.in_flight = idem::InFlight::wait, .max_wait = std::chrono::seconds(20), .clock = clock});
  idem::Request req;
  req.tenant = "alpha";
  req.operation = "payment.charge";
  req.key = argv[3];
  req.fingerprint = idem::Fingerprint::of(nlohmann::json{{"amount", 4990}});

  char go = 0;
  if (read(std::stoi(argv[4]), &go, 1) != 1) return 3;  // the start gate

  nlohmann::json line;
  try {
    const idem::Outcome out = idem.call(req, [&] {
      const auto r = provider.charge("A-1", 4990, "");
      return idem::Response{200, r.charge_id, {}};
    });
    line["outcome"] = out.replayed() ? "replayed" : "executed";
    line["charge_id"] = out.response.body;
  } catch (const idem::error& e) {
    line["outcome"] = std::string(idem::to_string(e.code()));
    line["error"] = e.what();
  }
  // Whether this process found the key held by another and waited: the proof that the
  // processes really overlapped.
  line["waited"] = idem.metrics().waited > 0;
  std::cout << line.dump() << std::endl;
  return 0;
}
