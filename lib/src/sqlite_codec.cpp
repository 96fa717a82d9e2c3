#include "sqlite_codec.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "idem/errors.hpp"

namespace idem::detail {
namespace {

std::vector<Header> headers_from_json(const std::string& text) {
  std::vector<Header> out;
  if (text.empty()) return out;
  try {
    for (const auto& pair : nlohmann::json::parse(text)) {
      out.push_back({pair.at(0).get<std::string>(), pair.at(1).get<std::string>()});
    }
  } catch (const nlohmann::json::exception& e) {
    throw StoreError(std::string("sqlite: a stored headers column does not decode: ") + e.what(),
                     0);
  }
  return out;
}

// A column that must hold an integer (the table is STRICT, so only a corrupt or foreign
// file holds anything else).
std::int64_t integer(const sqlite::Statement& s, int column, std::string_view name) {
  if (s.type(column) != sqlite::Statement::Type::integer) {
    throw StoreError(fmt::format("sqlite: a stored {} is not an integer", name), 0);
  }
  return s.int64(column);
}

}  // namespace

std::string progress_to_json(const Progress& p) {
  nlohmann::json steps = nlohmann::json::array();
  for (const StepResult& s : p.steps) steps.push_back({s.step, s.result, s.reconciled});
  nlohmann::json j = {{"origin", p.origin}, {"steps", std::move(steps)}, {"pending", nullptr}};
  if (p.pending) j["pending"] = *p.pending;
  try {
    return j.dump();
  } catch (const nlohmann::json::exception&) {
    throw error(errc::invalid_argument,
                "idem: a step's name or result is not valid UTF-8 text; keep results small text "
                "(an id), and larger or binary data in the application's own tables");
  }
}

Progress progress_from_json(std::string_view text) {
  Progress p;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    // An integer that fits: nlohmann converts a float (1e300) with a cast that is undefined
    // behaviour when out of range.
    const nlohmann::json& origin = j.at("origin");
    if (!origin.is_number_integer() ||
        (origin.is_number_unsigned() &&
         origin.get<std::uint64_t>() > std::uint64_t{std::numeric_limits<std::int64_t>::max()})) {
      throw StoreError("sqlite: a stored progress column's origin is not a 64-bit integer", 0);
    }
    p.origin = origin.get<std::int64_t>();
    for (const auto& s : j.at("steps")) {
      p.steps.push_back(
          {s.at(0).get<std::string>(), s.at(1).get<std::string>(), s.at(2).get<bool>()});
    }
    if (const auto& pending = j.at("pending"); !pending.is_null())
      p.pending = pending.get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    throw StoreError(std::string("sqlite: a stored progress column does not decode: ") + e.what(),
                     0);
  }
  return p;
}

void bind_id(sqlite::Statement& s, const KeyId& id) {
  s.bind(1, id.tenant);
  s.bind(2, id.operation);
  s.bind(3, id.key);
}

void bind_fingerprint(sqlite::Statement& s, int index, const Fingerprint& fp) {
  s.bind_blob(index, fp.bytes().data(), fp.bytes().size());
}

std::string headers_to_json(const std::vector<Header>& headers) {
  if (headers.empty()) return {};
  nlohmann::json arr = nlohmann::json::array();
  for (const Header& h : headers) arr.push_back({h.name, h.value});
  try {
    return arr.dump();
  } catch (const nlohmann::json::exception&) {
    throw StoreError("sqlite: a response header is not valid UTF-8 and cannot be stored", 0);
  }
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
  if (s.type(0) != sqlite::Statement::Type::blob || s.blob_view(0).size() != bytes.size()) {
    throw StoreError("sqlite: a stored fingerprint is not a 32-byte blob", 0);
  }
  const std::string_view fp = s.blob_view(0);
  std::copy_n(fp.begin(), bytes.size(), bytes.begin());
  r.fingerprint = Fingerprint(bytes);
  const std::int64_t state = integer(s, 1, "state");
  if (state < static_cast<int>(State::in_progress) || state > static_cast<int>(State::released)) {
    throw StoreError(fmt::format("sqlite: a stored state is {}, not 1, 2 or 3", state), 0);
  }
  r.state = static_cast<State>(state);
  r.token = integer(s, 2, "token");
  r.lease_until = at_ms(integer(s, 3, "lease_until"));
  r.created_at = at_ms(integer(s, 4, "created_at"));
  r.expires_at = at_ms(integer(s, 5, "expires_at"));
  if (!s.is_null(6)) r.response.status = static_cast<int>(integer(s, 6, "status"));
  if (!s.is_null(7)) r.response.headers = headers_from_json(s.text(7));
  r.response.body = s.blob(8);
  if (!s.is_null(9)) r.body_ref = s.text(9);
  if (!s.is_null(10)) r.recovery_point = s.text(10);
  return r;
}

}  // namespace idem::detail
