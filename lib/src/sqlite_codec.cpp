#include "sqlite_codec.hpp"

#include <algorithm>
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
    p.origin = j.at("origin").get<std::int64_t>();
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
  const std::string_view fp = s.blob_view(0);
  Fingerprint::Bytes bytes{};
  std::copy_n(fp.begin(), std::min(fp.size(), bytes.size()), bytes.begin());
  r.fingerprint = Fingerprint(bytes);
  r.state = static_cast<State>(s.int64(1));
  r.token = s.int64(2);
  r.lease_until = at_ms(s.int64(3));
  r.created_at = at_ms(s.int64(4));
  r.expires_at = at_ms(s.int64(5));
  if (!s.is_null(6)) r.response.status = static_cast<int>(s.int64(6));
  if (!s.is_null(7)) r.response.headers = headers_from_json(s.text(7));
  r.response.body = s.blob(8);
  if (!s.is_null(9)) r.body_ref = s.text(9);
  if (!s.is_null(10)) r.recovery_point = s.text(10);
  return r;
}

}  // namespace idem::detail
