// A separate process for the cross-process race test: waits for the start signal (one byte
// on a file descriptor it inherited), makes one call through the coordinator with real time,
// and prints one JSON line: {"outcome": "executed"|"replayed"|"in_progress"|..., "charge_id": ...,
// "waited": true|false}.
//
//   idem_race_helper DB LEDGER KEY START_FD LATENCY_MS
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "idem/coordinator.hpp"
#include "idem/sim/provider.hpp"
#include "idem/sqlite_store.hpp"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::cerr << "usage: idem_race_helper DB LEDGER KEY START_FD LATENCY_MS\n";
    return 2;
  }
  auto clock = std::make_shared<idem::SystemClock>();
  // The provider does not deduplicate: every execution of the action is a charge.
  idem::sim::Provider provider(clock, {.latency = std::chrono::milliseconds(std::stoi(argv[5])),
                                       .dedup = false,
                                       .ledger_path = argv[2]});
  idem::Coordinator idem(
      std::make_shared<idem::SqliteStore>(argv[1]),
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
