// The pg section of idem_bench: idem over PostgreSQL (PgStore) against floors written with
// plain libpq, on the same durable server in the same run.
#pragma once

#include <nlohmann/json.hpp>
#include <ostream>
#include <string>

namespace idem::bench {

struct PgBenchConfig {
  bool quick = false;
  // The server (a libpq conninfo). The section drops and makes again the schemas bench_* in
  // its database.
  std::string conninfo;
  // This program, started again as the other node of the cross-node hand-off.
  std::string self;
  // Where that node writes its answer.
  std::string dir;
};

// How a duplicate waiting in another node learns that the holder finished: it polls the
// store (Options::poll_initial, poll_max: 1 ms doubling to 8 ms; PgOptions::notify off on
// both nodes), or it is woken by the holder's NOTIFY (PgOptions::notify on) and polls
// only every 50 ms doubling to 1 s as the safety net. Passed to the waiting node on its
// command line.
enum class PgWake { poll, notify };

// Runs the pg section: returns its JSON object ({"pg": {...}} and the headline keys pg_*) and
// prints a human table to `*human` when human != nullptr. Throws StoreError when the server
// cannot be used, std::runtime_error when a floor's statement fails or the other node does
// not answer as expected.
nlohmann::json run_pg(const PgBenchConfig& config, std::ostream* human);

// The other node of the cross-node hand-off: `idem_bench --pg-waiter ARGS...` (the arguments
// after --pg-waiter, as run_pg passes them). Returns the process's exit code.
int run_pg_waiter(int argc, char** argv);

}  // namespace idem::bench
