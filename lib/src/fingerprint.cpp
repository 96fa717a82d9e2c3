#include "idem/fingerprint.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "idem/errors.hpp"
#include "sha256.hpp"

namespace idem {
namespace {

constexpr std::string_view kPrefix = "idem.fp.v1\n";

}  // namespace

Fingerprint Fingerprint::of_bytes(std::string_view canonical) {
  return Fingerprint(detail::sha256({kPrefix, canonical}));
}

Fingerprint Fingerprint::of(const nlohmann::json& fields) {
  if (!fields.is_object()) {
    throw error(errc::invalid_argument, "fingerprint: significant fields must be a JSON object");
  }
  std::string canonical;
  try {
    // nlohmann::json objects are std::map: keys come out sorted bytewise; indent -1 is
    // the compact form; strict error handling rejects invalid UTF-8.
    canonical = fields.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
  } catch (const nlohmann::json::exception& e) {
    throw error(errc::invalid_argument, fmt::format("fingerprint: {}", e.what()));
  }
  return of_bytes(canonical);
}

namespace {

template <class Names>
nlohmann::json pick(const nlohmann::json& request, const Names& significant) {
  if (!request.is_object()) {
    throw error(errc::invalid_argument, "fingerprint: the request must be a JSON object");
  }
  nlohmann::json picked = nlohmann::json::object();
  for (std::string_view name : significant) {
    auto it = request.find(name);
    if (it != request.end()) picked[std::string(name)] = *it;
  }
  return picked;
}

}  // namespace

Fingerprint Fingerprint::of(const nlohmann::json& request,
                            std::initializer_list<std::string_view> significant) {
  return of(pick(request, significant));
}

Fingerprint Fingerprint::of(const nlohmann::json& request,
                            const std::vector<std::string>& significant) {
  return of(pick(request, significant));
}

std::string Fingerprint::hex() const { return detail::hex(bytes_); }

}  // namespace idem
