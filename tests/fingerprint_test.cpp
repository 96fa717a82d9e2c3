#include "idem/fingerprint.hpp"

#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "idem/errors.hpp"

using nlohmann::json;

// Vectors computed independently: sha256("idem.fp.v1\n" + compact sorted JSON). They pin the
// encoding: if one changes, every stored fingerprint in every deployed database breaks.
TEST_CASE("fingerprint: pinned test vectors") {
  CHECK(idem::Fingerprint::of(json{{"amount", 4990}, {"currency", "RUB"}, {"order_id", "A-10023"}})
            .hex() == "ba5c201ee9cd1b034e32890011fa5536584e59ffcba5d2b330f92cdc0ec946ee");
  CHECK(idem::Fingerprint::of(json::object()).hex() ==
        "b50f66183ce23a78582bb044451c9c18478dd728ea8a3dfa9c370ffbc25a1fdd");
  CHECK(idem::Fingerprint::of(json{{"recipient", "Ёж \"q\""}, {"amount", 5}}).hex() ==
        "edf48487a16b33bca15d4ba6033a6eae49a667de705cf3fa94ea6cd78b469a95");
}

TEST_CASE("fingerprint: field order and whitespace do not matter") {
  const auto a = idem::Fingerprint::of(json::parse(R"({"amount":4990,"currency":"RUB"})"));
  const auto b =
      idem::Fingerprint::of(json::parse("{ \"currency\" : \"RUB\",\n\t\"amount\" : 4990 }"));
  CHECK(a == b);
}

TEST_CASE("fingerprint: only the named significant fields count") {
  const json first = json::parse(
      R"({"amount":4990,"currency":"RUB","order_id":"A-1","comment":"first try","trace_id":"t1"})");
  const json retry = json::parse(
      R"({"trace_id":"t2","comment":"retry","order_id":"A-1","currency":"RUB","amount":4990})");
  const json other = json::parse(R"({"amount":5,"currency":"RUB","order_id":"A-1"})");
  auto fp = [](const json& j) {
    return idem::Fingerprint::of(j, {"amount", "currency", "order_id"});
  };
  CHECK(fp(first) == fp(retry));
  CHECK(fp(first) != fp(other));
  CHECK(fp(first).hex() == "15b962f88cc8b64b9454746eeecd18c4a939996a67420574c67d8099a660fe13");
}

TEST_CASE("fingerprint: types are significant, a missing field differs from null") {
  auto of = [](const char* text) { return idem::Fingerprint::of(json::parse(text)); };
  CHECK(of(R"({"amount":5})") != of(R"({"amount":5.0})"));
  CHECK(of(R"({"amount":5})") != of(R"({"amount":"5"})"));
  CHECK(of(R"({})") != of(R"({"amount":null})"));
}

TEST_CASE("fingerprint: bad input is rejected with invalid_argument") {
  auto code_of = [](const json& j) {
    try {
      (void)idem::Fingerprint::of(j);
      return std::string("none");
    } catch (const idem::error& e) {
      return std::string(idem::to_string(e.code()));
    }
  };
  CHECK(code_of(json::array({1, 2})) == "invalid_argument");
  CHECK(code_of(json{{"name", std::string("\xff\xfe")}}) == "invalid_argument");
}
