// Fuzz target: the Idempotency-Key field value, from raw bytes to the key the store sees.
//
// The input is one field value. Properties:
//  - parse_idempotency_key accepts a bare value (no DQUOTE, no comma) unchanged, and an
//    RFC 8941 sf-string exactly when re-serialising its key gives back the start of the
//    input, and only RFC 8941 parameters follow (`"k";p=1`, ignored);
//  - validate_key_part accepts exactly 1..255 printable ASCII bytes and otherwise throws
//    InvalidKeyError, nothing else;
//  - the HTTP layer (idem/beast.hpp) in front of a handler answers 400 exactly when the
//    value is not a valid key; otherwise the handler runs once, and an identical retry
//    replays its reply without running it again.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "fuzz_support.hpp"
#include "idem/beast.hpp"
#include "idem/errors.hpp"
#include "idem/http.hpp"
#include "idem/key.hpp"
#include "idem/sqlite_store.hpp"

namespace {

using idem::fuzz::require;

// The key as an RFC 8941 sf-string.
std::string sf_string(const std::string& key) {
  std::string out = "\"";
  for (char c : key) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + '"';
}

bool printable_ascii(const std::string& s) {
  for (char c : s) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

// One coordinator and layer for many inputs, renewed now and then so the in-memory
// database stays small.
struct World {
  std::unique_ptr<idem::Coordinator> coordinator;
  std::unique_ptr<idem::http::Layer> layer;
  std::size_t inputs = 0;

  void renew() {
    layer.reset();
    coordinator = std::make_unique<idem::Coordinator>(
        std::make_shared<idem::SqliteStore>(":memory:"), idem::Options{});
    layer = std::make_unique<idem::http::Layer>(*coordinator);
  }
  idem::http::Layer& next() {
    if (inputs++ % 4096 == 0) renew();
    return *layer;
  }
};

// Checks the syntax and key properties of one field value; returns the key if it is valid.
std::optional<std::string> check_value(const std::string& value) {
  // 1. The field value's syntax.
  const std::optional<std::string> key = idem::parse_idempotency_key(value);
  const bool quoted = !value.empty() && value.front() == '"';
  if (!quoted) {
    const bool bare = value.find_first_of(",\"") == std::string::npos;
    require(key.has_value() == bare, "a bare value is a key exactly when it has no comma or quote");
    if (key) require(*key == value, "a bare key is the value unchanged");
  } else if (key) {
    require(printable_ascii(*key), "an sf-string's key is printable ASCII");
    // The sf-string is the key's one serialisation; RFC 8941 parameters may follow it.
    const std::string item = sf_string(*key);
    require(value.starts_with(item), "an sf-string is the key's one serialisation");
    require(value.size() == item.size() || value[item.size()] == ';',
            "after the sf-string come only parameters");
  }
  if (key && printable_ascii(*key)) {
    const std::optional<std::string> again = idem::parse_idempotency_key(sf_string(*key));
    require(again == key, "a printable key's sf-string parses back to the key");
  }

  // 2. The key's own rules.
  bool valid = false;
  if (key) {
    try {
      idem::validate_key_part("key", *key);
      valid = true;
    } catch (const idem::InvalidKeyError&) {
    }
    require(valid == (!key->empty() && key->size() <= idem::kMaxKeyBytes && printable_ascii(*key)),
            "validate_key_part accepts exactly 1..255 printable ASCII bytes");
    if (valid) {
      const idem::KeyId id{"tenant", "op", *key};
      require(idem::short_hash(id).size() == 12, "short_hash is 12 hex digits");
      require(idem::derived_key(id, "charge").size() == 5 + 32 + 7,
              "a derived key is idem_<32 hex>:<step>");
    }
  }
  return valid ? key : std::nullopt;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string value(idem::fuzz::as_text(data, size));
  (void)check_value(value);

  // 3. The HTTP layer with this value in its key field. Beast keeps a field value without
  // its surrounding whitespace (as its parser does): the layer sees that value.
  static World world;
  idem::http::Layer& layer = world.next();
  int runs = 0;
  const idem::http::Handler handler = [&](const idem::http::Request&,
                                          const idem::http::Context& call) {
    ++runs;
    idem::http::Reply r{boost::beast::http::status::created, 11};
    r.body() = call.id.key;
    r.prepare_payload();
    return r;
  };
  idem::http::Request req{idem::http::Verb::post, "/orders", 11};
  req.set("Idempotency-Key", value);
  req.body() = "{}";
  req.prepare_payload();
  const std::optional<std::string> key = check_value(std::string(req["Idempotency-Key"]));
  const idem::http::Reply first = layer.handle(req, handler);
  if (!key) {
    require(first.result_int() == 400 && runs == 0, "an invalid key is 400 and nothing runs");
    return 0;
  }
  // The key may have been used by an earlier input of this run: then it replays.
  require(first.result_int() == 201 && runs <= 1, "a valid key runs the handler at most once");
  require(first.body() == *key, "the reply is the handler's, for this key");
  const idem::http::Reply retry = layer.handle(req, handler);
  require(retry.result_int() == 201 && retry.body() == first.body(),
          "a retry gets the first reply");
  require(retry["Idempotent-Replayed"] == "true", "a retry is marked as a replay");
  require(runs <= 1, "a retry never runs the handler again");
  return 0;
}
