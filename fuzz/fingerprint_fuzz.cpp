// Fuzz target: the fingerprint's canonical encoding (idem/fingerprint.hpp).
//
// The input is parsed as JSON. Properties, for every document that parses:
//  - Fingerprint::of never throws for an object (parsed strings are valid UTF-8) and
//    throws idem::error(invalid_argument) for anything else;
//  - it is stable: the same document twice, the document re-serialised with other
//    whitespace and its object members in reverse order, and its canonical text parsed
//    again all give the same fingerprint;
//  - picking significant fields equals fingerprinting the object of those fields alone,
//    and a field not named never changes the fingerprint.
// Input that does not parse still goes through Fingerprint::of_bytes.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"

namespace {

using idem::fuzz::require;
using nlohmann::json;

// `j` as JSON text with object members in reverse order and whitespace chosen by `salt`.
void reserialise(const json& j, unsigned& salt, std::string& out) {
  static constexpr const char* kSpace[] = {"", " ", "\n", "\t ", "\r\n  "};
  const auto space = [&] { out += kSpace[salt++ % 5]; };
  space();
  if (j.is_object()) {
    out += '{';
    bool first = true;
    for (auto it = j.crbegin(); it != j.crend(); ++it) {
      if (!first) out += ',';
      first = false;
      space();
      out += json(it.key()).dump();
      space();
      out += ':';
      reserialise(it.value(), salt, out);
    }
    space();
    out += '}';
  } else if (j.is_array()) {
    out += '[';
    for (std::size_t i = 0; i < j.size(); ++i) {
      if (i > 0) out += ',';
      reserialise(j[i], salt, out);
    }
    space();
    out += ']';
  } else {
    out += j.dump();
  }
  space();
}

idem::Fingerprint of_object(const json& j) {
  try {
    return idem::Fingerprint::of(j);
  } catch (const idem::error&) {
    require(false, "Fingerprint::of never throws for a parsed object");
  }
  return {};
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(idem::fuzz::as_text(data, size));
  const json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) {
    require(idem::Fingerprint::of_bytes(text) == idem::Fingerprint::of_bytes(text),
            "of_bytes is a function of its bytes");
    return 0;
  }
  if (!j.is_object()) {
    bool refused = false;
    try {
      (void)idem::Fingerprint::of(j);
    } catch (const idem::error& e) {
      refused = e.code() == idem::errc::invalid_argument;
    }
    require(refused, "a value that is not an object is invalid_argument");
    return 0;
  }

  const idem::Fingerprint fp = of_object(j);
  require(of_object(j) == fp, "the same object twice gives the same fingerprint");

  unsigned salt = static_cast<unsigned>(size);
  std::string other;
  reserialise(j, salt, other);
  const json reordered = json::parse(other, nullptr, false);
  require(!reordered.is_discarded(), "the re-serialised document parses");
  require(of_object(reordered) == fp, "whitespace and member order do not change the fingerprint");

  const json canonical = json::parse(j.dump(), nullptr, false);
  require(!canonical.is_discarded() && of_object(canonical) == fp,
          "the canonical text parses back to the same fingerprint");

  // Significant fields: every other member, then the same with a field not named added.
  std::vector<std::string> names;
  json picked = json::object();
  bool take = true;
  for (const auto& [name, value] : j.items()) {
    if (take) {
      names.push_back(name);
      picked[name] = value;
    }
    take = !take;
  }
  const idem::Fingerprint of_picked = idem::Fingerprint::of(j, names);
  require(of_picked == of_object(picked), "picking fields is fingerprinting them alone");
  json extended = j;
  std::string extra = "~fuzz-extra";
  while (extended.contains(extra)) extra += '~';
  extended[extra] = json::array({1, "x"});
  require(idem::Fingerprint::of(extended, names) == of_picked,
          "a field not named does not change the fingerprint");
  if (!names.empty() && names.size() < j.size()) {
    require(of_picked != fp, "dropping a field changes the fingerprint");
  }
  return 0;
}
