// idem — the fingerprint of a request.
#pragma once

#include <array>
#include <initializer_list>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace idem {

// SHA-256 (OpenSSL libcrypto) over a canonical encoding of the significant fields of a
// request. Two requests with the same fingerprint are "the same operation"; a key
// presented with another fingerprint is a KeyReuseError.
//
// Canonical encoding (version 1, pinned by test vectors; it never changes within v1):
//   "idem.fp.v1\n" + the JSON text of an object holding exactly the named fields, keys
//   sorted bytewise, no whitespace, strings as UTF-8 with JSON's minimal escapes, numbers
//   as nlohmann-json prints them (integers without a fraction, floats shortest
//   round-trip). So field order and whitespace in the client's JSON do not matter, while
//   5 and 5.0 and "5" are different requests. A named field that the request lacks is
//   left out of the object (which differs from a present null).
class Fingerprint {
 public:
  using Bytes = std::array<unsigned char, 32>;

  Fingerprint() = default;  // all zero: "no fingerprint"
  explicit Fingerprint(const Bytes& bytes) : bytes_(bytes) {}

  // From an object that holds only the significant fields.
  // Throws idem::error(errc::invalid_argument) if `fields` is not an object or holds a
  // string that is not valid UTF-8.
  static Fingerprint of(const nlohmann::json& fields);

  // From a whole request: picks `significant` fields out of `request` (an object).
  // Throws idem::error(errc::invalid_argument) if `request` is not an object or a picked
  // field holds a string that is not valid UTF-8. Fields not named are never looked at.
  static Fingerprint of(const nlohmann::json& request,
                        std::initializer_list<std::string_view> significant);
  static Fingerprint of(const nlohmann::json& request, const std::vector<std::string>& significant);

  // From already canonical bytes (a caller with its own encoding). Prefixed like v1. Any
  // bytes are accepted; throws only what allocation throws.
  static Fingerprint of_bytes(std::string_view canonical);

  const Bytes& bytes() const noexcept { return bytes_; }
  std::string hex() const;  // 64 lowercase hex digits

  friend bool operator==(const Fingerprint&, const Fingerprint&) = default;

 private:
  Bytes bytes_{};
};

}  // namespace idem
