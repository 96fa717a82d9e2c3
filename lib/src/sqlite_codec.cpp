#include "sqlite_codec.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "idem/errors.hpp"

namespace idem::detail {
namespace {

// A column that holds an integer or NULL (the table is STRICT, so only a corrupt or foreign
// file holds anything else). Its type is asked once: a replay reads a dozen columns.
std::optional<std::int64_t> nullable_integer(const sqlite::Statement& s, int column,
                                             std::string_view name) {
  switch (s.type(column)) {
    case sqlite::Statement::Type::null:
      return std::nullopt;
    case sqlite::Statement::Type::integer:
      return s.int64(column);
    default:
      throw CorruptRecordError(fmt::format("sqlite: a stored {} is not an integer", name));
  }
}

// A column that must hold an integer.
std::int64_t integer(const sqlite::Statement& s, int column, std::string_view name) {
  if (const std::optional<std::int64_t> v = nullable_integer(s, column, name)) return *v;
  throw CorruptRecordError(fmt::format("sqlite: a stored {} is not an integer", name));
}

}  // namespace

void bind_id(sqlite::Statement& s, const KeyId& id, int first) {
  s.bind(first, id.tenant);
  s.bind(first + 1, id.operation);
  s.bind(first + 2, id.key);
}

void bind_fingerprint(sqlite::Statement& s, int index, const Fingerprint& fp) {
  s.bind_blob(index, fp.bytes().data(), fp.bytes().size());
}

void bind_response(sqlite::Statement& s, int first, const StoredResponse& r,
                   const std::string& headers_json) {
  s.bind(first, static_cast<std::int64_t>(r.response.status));
  if (headers_json.empty()) {
    s.bind_null(first + 1);
  } else {
    s.bind(first + 1, headers_json);
  }
  s.bind_blob(first + 2, r.response.body.data(), r.response.body.size());
  if (r.body_ref.empty()) {
    s.bind_null(first + 3);
  } else {
    s.bind(first + 3, r.body_ref);
  }
}

Record read_record(const sqlite::Statement& s) {
  Record r;
  Fingerprint::Bytes bytes{};
  const std::string_view fp =
      s.type(0) == sqlite::Statement::Type::blob ? s.blob_view(0) : std::string_view();
  if (fp.size() != bytes.size()) {
    throw CorruptRecordError("sqlite: a stored fingerprint is not a 32-byte blob");
  }
  std::copy_n(fp.begin(), bytes.size(), bytes.begin());
  r.fingerprint = Fingerprint(bytes);
  const std::int64_t state = integer(s, 1, "state");
  if (state < static_cast<int>(State::in_progress) || state > static_cast<int>(State::released)) {
    throw CorruptRecordError(fmt::format("sqlite: a stored state is {}, not 1, 2 or 3", state));
  }
  r.state = static_cast<State>(state);
  r.token = integer(s, 2, "token");
  r.lease_until = at_ms(integer(s, 3, "lease_until"));
  r.created_at = at_ms(integer(s, 4, "created_at"));
  r.expires_at = at_ms(integer(s, 5, "expires_at"));
  if (const auto status = nullable_integer(s, 6, "status")) {
    r.response.status = static_cast<int>(*status);
  }
  if (!s.is_null(7)) r.response.headers = headers_from_json(s.text_view(7));
  r.response.body = s.blob(8);
  if (!s.is_null(9)) r.body_ref = s.text(9);
  if (!s.is_null(10)) r.recovery_point = s.text(10);
  r.claim = nullable_integer(s, 11, "claim").value_or(0);
  return r;
}

}  // namespace idem::detail
