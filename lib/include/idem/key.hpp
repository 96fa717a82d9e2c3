// idem — the identity of a key.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace idem {

// A key is the triple (tenant, operation, key); the store's uniqueness is on all three.
//  - tenant isolates customers: equal keys of two tenants are unrelated records;
//  - operation is the scope ("payment.charge"): one client key under two operations
//    makes two records;
//  - key is the client's idempotency key.
struct KeyId {
  std::string tenant;
  std::string operation;
  std::string key;

  friend bool operator==(const KeyId&, const KeyId&) = default;
};

// The longest key, tenant or operation accepted, in bytes.
inline constexpr std::size_t kMaxKeyBytes = 255;

// Checks one part of a key: 1..255 bytes, each printable ASCII (0x20..0x7E).
// Throws InvalidKeyError naming `field` and the broken rule ("is empty", "is longer than
// 255 bytes", "contains a control byte (0x0a) at offset 3", "contains a non-ASCII byte
// (0xc3) at offset 0", "contains a NUL byte at offset 5"). Touches nothing else.
void validate_key_part(std::string_view field, std::string_view value);

// validate_key_part for tenant, operation and key, in that order.
void validate(const KeyId& id);

// A short, stable hash of the whole triple (12 lowercase hex digits of its SHA-256) for
// logs and metrics, which never print a client's key.
std::string short_hash(const KeyId& id);

// A key for a downstream system derived deterministically from the record:
// identical on every retry and after a restart, different for every (tenant, operation,
// key), and free of the client's raw key. `step` names the downstream call ("charge").
// Result: "idem_<32 hex digits>:<step>".
std::string derived_key(const KeyId& id, std::string_view step);

// The derived key of a multi-step operation's step (Attempt::derived_key): as above, and
// also different for every `origin` (Progress::origin), so a request made with the same key
// after its TTL is a new operation downstream too. "idem_<32 hex digits>:<step>".
std::string derived_key(const KeyId& id, std::int64_t origin, std::string_view step);

// The id of the `n`-th message (from 0) a step of a multi-step operation enqueued:
// "msg_<32 hex digits>", the same on every attempt of that operation, never holding the key.
std::string outbox_message_id(const KeyId& id, std::int64_t origin, std::string_view step,
                              std::size_t n);

struct KeyIdHash {
  std::size_t operator()(const KeyId& id) const noexcept;
};

}  // namespace idem
