// The HTTP section of idem_bench: the demo server's conformance app end to end over keep-alive
// connections, with idem's layer, with idempotency written by hand, and bare, in the same run.
#pragma once

#include <nlohmann/json.hpp>
#include <ostream>
#include <string>

namespace idem::bench {

// Runs the HTTP section: returns its JSON object ({"http": {...}} and the headline keys
// http_fresh_requests_per_s, http_replay_requests_per_s, http_layer_vs_handwritten_ratio(_1conn),
// http_layer_vs_noop_ratio, http_replay_vs_noop_ratio, http_layer_added_p50/p99_us_1conn) and
// prints a human
// table to `*human` when human != nullptr. The servers' databases go under `dir`.
// Throws std::runtime_error on any unexpected answer or a counter that does not add up.
nlohmann::json run_http(bool quick, const std::string& dir, std::ostream* human);

}  // namespace idem::bench
