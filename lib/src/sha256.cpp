#include "sha256.hpp"

#include <openssl/evp.h>

#include "idem/errors.hpp"

namespace idem::detail {

namespace {

// OpenSSL 3 looks an algorithm up in its providers on every EVP_DigestInit_ex(EVP_sha256()),
// under a lock; fetching it once and keeping one context per thread leaves only the hashing.
struct Hasher {
  EVP_MD* md = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  Hasher() = default;
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  ~Hasher() {
    EVP_MD_CTX_free(ctx);
    EVP_MD_free(md);
  }
};

}  // namespace

Digest sha256(std::initializer_list<std::string_view> parts) {
  thread_local Hasher h;
  bool ok = h.md != nullptr && h.ctx != nullptr && EVP_DigestInit_ex(h.ctx, h.md, nullptr) == 1;
  for (std::string_view part : parts) {
    ok = ok && EVP_DigestUpdate(h.ctx, part.data(), part.size()) == 1;
  }
  Digest out{};
  unsigned int len = 0;
  ok = ok && EVP_DigestFinal_ex(h.ctx, out.data(), &len) == 1 && len == out.size();
  if (!ok) throw error(errc::invalid_argument, "libcrypto SHA-256 failed");
  return out;
}

std::string hex(const Digest& d, std::size_t bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(bytes * 2, '0');
  for (std::size_t i = 0; i < bytes && i < d.size(); ++i) {
    out[2 * i] = kDigits[d[i] >> 4];
    out[2 * i + 1] = kDigits[d[i] & 0x0f];
  }
  return out;
}

}  // namespace idem::detail
