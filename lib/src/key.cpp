#include "idem/key.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "idem/errors.hpp"
#include "sha256.hpp"

namespace idem {
namespace {

// Tenant, operation and key, each followed by a NUL (which no part may hold), so
// ("a", "bc") and ("ab", "c") never collide.
detail::Digest digest_of(const KeyId& id) {
  using namespace std::string_view_literals;
  return detail::sha256({id.tenant, "\0"sv, id.operation, "\0"sv, id.key, "\0"sv});
}

}  // namespace

void validate_key_part(std::string_view field, std::string_view value) {
  if (value.empty()) throw InvalidKeyError(std::string(field), "is empty");
  if (value.size() > kMaxKeyBytes) {
    throw InvalidKeyError(std::string(field), fmt::format("is longer than {} bytes ({} bytes)",
                                                          kMaxKeyBytes, value.size()));
  }
  // Every call checks its three parts: the common case, all printable, in one pass.
  if (std::all_of(value.begin(), value.end(), [](char c) {
        const auto byte = static_cast<unsigned char>(c);
        return byte >= 0x20 && byte < 0x7f;
      })) {
    return;
  }
  for (std::size_t i = 0; i < value.size(); ++i) {
    const auto byte = static_cast<unsigned char>(value[i]);
    if (byte == 0) {
      throw InvalidKeyError(std::string(field), fmt::format("contains a NUL byte at offset {}", i));
    }
    if (byte < 0x20 || byte == 0x7f) {
      throw InvalidKeyError(
          std::string(field),
          fmt::format("contains a control byte (0x{:02x}) at offset {}", byte, i));
    }
    if (byte > 0x7f) {
      throw InvalidKeyError(std::string(field),
                            fmt::format("contains a non-ASCII byte (0x{:02x}) at offset {}; only "
                                        "printable ASCII 0x20..0x7e is allowed",
                                        byte, i));
    }
  }
}

void validate(const KeyId& id) {
  validate_key_part("tenant", id.tenant);
  validate_key_part("operation", id.operation);
  validate_key_part("key", id.key);
}

std::string short_hash(const KeyId& id) { return detail::hex(digest_of(id), 6); }

std::string derived_key(const KeyId& id, std::string_view step) {
  return fmt::format("idem_{}:{}", detail::hex(digest_of(id), 16), step);
}

namespace {

// The key's digest, the origin and a label, NUL-separated like digest_of.
detail::Digest digest_of(const KeyId& id, std::int64_t origin, std::string_view kind,
                         std::string_view label) {
  using namespace std::string_view_literals;
  const std::string key_hex = detail::hex(digest_of(id), 32);
  const std::string origin_text = std::to_string(origin);
  return detail::sha256({key_hex, "\0"sv, origin_text, "\0"sv, kind, "\0"sv, label, "\0"sv});
}

}  // namespace

std::string derived_key(const KeyId& id, std::int64_t origin, std::string_view step) {
  return fmt::format("idem_{}:{}", detail::hex(digest_of(id, origin, "step", step), 16), step);
}

std::string outbox_message_id(const KeyId& id, std::int64_t origin, std::string_view step,
                              std::size_t n) {
  std::string label(step);
  label += '\0';
  label += std::to_string(n);
  return fmt::format("msg_{}", detail::hex(digest_of(id, origin, "message", label), 16));
}

std::size_t KeyIdHash::operator()(const KeyId& id) const noexcept {
  std::size_t h = std::hash<std::string>{}(id.tenant);
  h = h * 31 + std::hash<std::string>{}(id.operation);
  return h * 31 + std::hash<std::string>{}(id.key);
}

}  // namespace idem
