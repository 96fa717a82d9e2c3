// The gRPC section of idem_bench: unary calls on loopback gRPC through idem::grpc::Guard, and
// the same service with the guard off, in the same run. Built only with gRPC (IDEM_GRPC).
#pragma once

#include <nlohmann/json.hpp>
#include <ostream>
#include <string>

namespace idem::bench {

// Runs the gRPC section: returns its JSON object ({"grpc": {"1": {...}, "64": {...}}} and the
// headline keys grpc_fresh_calls_per_s, grpc_replay_calls_per_s, grpc_guard_ratio, all at 64
// concurrent calls) and prints a human table to `*human` when human != nullptr. The guarded
// server's database goes under `dir`. Throws std::runtime_error on any status that is not OK,
// an answer that is not the one expected, or a count of the method's runs that does not add up.
nlohmann::json run_grpc(bool quick, const std::string& dir, std::ostream* human);

}  // namespace idem::bench
