#include "idem/http.hpp"

#include <nlohmann/json.hpp>
#include <string>

namespace idem {

int http_status(errc code) noexcept {
  switch (code) {
    case errc::invalid_key:
    case errc::invalid_argument:
      return 400;
    case errc::key_reuse:
      return 422;
    case errc::in_progress:
    case errc::lease_lost:
      return 409;
    case errc::store_unavailable:
      return 503;
  }
  return 500;
}

std::string_view http_error_code(const error& e) noexcept {
  switch (e.code()) {
    case errc::invalid_key: {
      const auto* k = dynamic_cast<const InvalidKeyError*>(&e);
      if (k != nullptr && k->field() == "key" && k->rule() == "is missing") {
        return "idempotency_key_required";
      }
      return "idempotency_key_invalid";
    }
    case errc::invalid_argument:
      return "invalid_request";
    case errc::key_reuse:
      return "idempotency_key_reuse";
    case errc::in_progress:
      return "idempotency_key_in_use";
    case errc::lease_lost:
      return "lease_lost";
    case errc::store_unavailable:
      return "store_unavailable";
  }
  return "internal_error";
}

Response to_http(const Outcome& outcome) {
  Response r = outcome.response;
  if (outcome.replayed()) r.headers.push_back({std::string(kReplayedHeader), "true"});
  return r;
}

Response problem(int status, std::string_view error_code, std::string_view title,
                 std::string_view detail) {
  nlohmann::json body = {{"type", "about:blank"},
                         {"title", title},
                         {"status", status},
                         {"detail", detail},
                         {"error", error_code}};
  return Response{status, body.dump(), {{"Content-Type", "application/problem+json"}}};
}

Response to_http(const error& e) {
  static constexpr auto title_of = [](errc code) -> std::string_view {
    switch (code) {
      case errc::invalid_key:
        return "Invalid idempotency key";
      case errc::invalid_argument:
        return "Invalid request";
      case errc::key_reuse:
        return "Idempotency key reused for a different request";
      case errc::in_progress:
        return "A request with this idempotency key is in progress";
      case errc::lease_lost:
        return "The request lost its reservation";
      case errc::store_unavailable:
        return "Idempotency store unavailable";
    }
    return "Error";
  };
  Response r = problem(http_status(e.code()), http_error_code(e), title_of(e.code()), e.what());
  if (const auto* busy = dynamic_cast<const InProgressError*>(&e)) {
    const auto seconds = (busy->retry_after().count() + 999) / 1000;
    r.headers.push_back({"Retry-After", std::to_string(seconds < 1 ? 1 : seconds)});
  }
  return r;
}

}  // namespace idem
