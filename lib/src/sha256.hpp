// SHA-256 through OpenSSL's EVP interface, for fingerprints and key hashes.
#pragma once

#include <array>
#include <initializer_list>
#include <string>
#include <string_view>

namespace idem::detail {

using Digest = std::array<unsigned char, 32>;

// The digest of the concatenation of `parts`. Throws idem::error if libcrypto fails.
Digest sha256(std::initializer_list<std::string_view> parts);

// The first `bytes` bytes of `d` as lowercase hex.
std::string hex(const Digest& d, std::size_t bytes = 32);

}  // namespace idem::detail
