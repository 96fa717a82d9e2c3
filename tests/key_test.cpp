#include "idem/key.hpp"

#include <doctest/doctest.h>

#include <string>

#include "idem/errors.hpp"

namespace {

// The rule the validator names for `value`, or "" if it is accepted.
std::string rule_for(std::string_view value) {
  try {
    idem::validate_key_part("key", value);
    return "";
  } catch (const idem::InvalidKeyError& e) {
    CHECK(e.code() == idem::errc::invalid_key);
    CHECK(e.field() == "key");
    return e.rule();
  }
}

}  // namespace

TEST_CASE("key: 1 to 255 printable ASCII bytes are accepted") {
  CHECK(rule_for("7f3c1e8a-4b2d-4e91-a5f6-9c0d3b7e2a41") == "");
  CHECK(rule_for("a") == "");
  CHECK(rule_for(std::string(255, 'k')) == "");
  CHECK(rule_for(" ~!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}") == "");
}

TEST_CASE("key: each broken rule is named") {
  CHECK(rule_for("") == "is empty");
  CHECK(rule_for(std::string(256, 'k')) == "is longer than 255 bytes (256 bytes)");
  CHECK(rule_for("abc\ndef") == "contains a control byte (0x0a) at offset 3");
  CHECK(rule_for("\x7f") == "contains a control byte (0x7f) at offset 0");
  CHECK(rule_for(std::string("ab\0cd", 5)) == "contains a NUL byte at offset 2");
  CHECK(rule_for("ключ").starts_with("contains a non-ASCII byte (0xd0) at offset 0"));
}

TEST_CASE("key: the error message names the field and the rule") {
  try {
    idem::validate(idem::KeyId{"alpha", "", "k"});
    FAIL("no error");
  } catch (const idem::InvalidKeyError& e) {
    CHECK(e.field() == "operation");
    CHECK(std::string(e.what()) == "idempotency operation is empty");
  }
}

TEST_CASE("key: short_hash is stable, short, and does not contain the key") {
  const idem::KeyId id{"alpha", "payment.charge", "k1"};
  // SHA-256("alpha\0payment.charge\0k1\0"), first 6 bytes.
  CHECK(idem::short_hash(id) == "717c09315691");
  CHECK(idem::short_hash(idem::KeyId{"beta", "payment.charge", "k1"}) != idem::short_hash(id));
  CHECK(idem::short_hash(idem::KeyId{"alph", "apayment.charge", "k1"}) != idem::short_hash(id));
}

TEST_CASE("key: derived keys are deterministic and scoped to the whole triple") {
  const idem::KeyId id{"alpha", "payment.charge", "k1"};
  CHECK(idem::derived_key(id, "charge") == "idem_717c0931569171a973438da03819313e:charge");
  CHECK(idem::derived_key(id, "charge") == idem::derived_key(id, "charge"));
  CHECK(idem::derived_key(idem::KeyId{"beta", "payment.charge", "k1"}, "charge") !=
        idem::derived_key(id, "charge"));
  CHECK(idem::derived_key(id, "charge").find("k1") == std::string::npos);
}
