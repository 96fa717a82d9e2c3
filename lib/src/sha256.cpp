#include "sha256.hpp"

#include <openssl/evp.h>

#include <memory>

#include "idem/errors.hpp"

namespace idem::detail {

Digest sha256(std::initializer_list<std::string_view> parts) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  bool ok = ctx != nullptr && EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) == 1;
  for (std::string_view part : parts) {
    ok = ok && EVP_DigestUpdate(ctx.get(), part.data(), part.size()) == 1;
  }
  Digest out{};
  unsigned int len = 0;
  ok = ok && EVP_DigestFinal_ex(ctx.get(), out.data(), &len) == 1 && len == out.size();
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
