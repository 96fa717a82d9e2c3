// The calls every benchmark section makes: one tenant and operation, one fingerprint, keys
// numbered from a prefix, a small response.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "idem/coordinator.hpp"

namespace idem::bench {

inline const Fingerprint kFp =
    Fingerprint::of(nlohmann::json{{"amount", 4990}, {"currency", "RUB"}});
inline const std::string kTenant = "alpha", kOperation = "payment.charge";

inline std::string key_of(std::size_t i, std::string_view prefix = "k") {
  return fmt::format("{}{:08}", prefix, i);
}

inline Request request_for(const std::string& key) {
  Request r;
  r.tenant = kTenant;
  r.operation = kOperation;
  r.key = key;
  r.fingerprint = kFp;
  return r;
}

inline Response small_response() { return Response{200, R"({"charge_id":"ch_1"})", {}}; }

}  // namespace idem::bench
