// What the fuzz targets share: a check that aborts (libFuzzer and the replay main both
// report an abort as a finding, with the input that caused it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace idem::fuzz {

// Aborts naming the broken property when `ok` is false.
inline void require(bool ok, std::string_view property) {
  if (ok) return;
  std::fprintf(stderr, "fuzz: property broken: %.*s\n", static_cast<int>(property.size()),
               property.data());
  std::abort();
}

inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace idem::fuzz
