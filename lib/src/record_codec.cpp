#include "record_codec.hpp"

#include <limits>
#include <nlohmann/json.hpp>

#include "idem/errors.hpp"

namespace idem::detail {

std::string headers_to_json(const std::vector<Header>& headers) {
  if (headers.empty()) return {};
  nlohmann::json arr = nlohmann::json::array();
  for (const Header& h : headers) arr.push_back({h.name, h.value});
  try {
    return arr.dump();
  } catch (const nlohmann::json::exception&) {
    throw StoreError("idem: a response header is not valid UTF-8 and cannot be stored", 0);
  }
}

std::vector<Header> headers_from_json(std::string_view text) {
  std::vector<Header> out;
  if (text.empty()) return out;
  try {
    for (const auto& pair : nlohmann::json::parse(text)) {
      out.push_back({pair.at(0).get<std::string>(), pair.at(1).get<std::string>()});
    }
  } catch (const nlohmann::json::exception& e) {
    throw CorruptRecordError(std::string("idem: a stored headers column does not decode: ") +
                             e.what());
  }
  return out;
}

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
      throw CorruptRecordError("idem: a stored progress column's origin is not a 64-bit integer");
    }
    p.origin = origin.get<std::int64_t>();
    for (const auto& s : j.at("steps")) {
      p.steps.push_back(
          {s.at(0).get<std::string>(), s.at(1).get<std::string>(), s.at(2).get<bool>()});
    }
    if (const auto& pending = j.at("pending"); !pending.is_null())
      p.pending = pending.get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    throw CorruptRecordError(std::string("idem: a stored progress column does not decode: ") +
                             e.what());
  }
  return p;
}

namespace {

// The recorded progress, or a fresh one starting at `origin`.
Progress started(std::optional<Progress> recorded, std::int64_t origin) {
  if (recorded) return std::move(*recorded);
  Progress fresh;
  fresh.origin = origin;
  return fresh;
}

}  // namespace

Progress with_pending(std::optional<Progress> recorded, std::int64_t origin,
                      const std::string& step) {
  Progress p = started(std::move(recorded), origin);
  p.pending = step;
  return p;
}

Progress with_step(std::optional<Progress> recorded, std::int64_t origin, const StepResult& step) {
  Progress p = started(std::move(recorded), origin);
  p.steps.push_back(step);
  if (p.pending == step.step) p.pending.reset();
  return p;
}

void add_outbox_count(OutboxCounts& counts, std::int64_t state, std::size_t n) {
  switch (state) {
    case 0:
      counts.pending = n;
      break;
    case 1:
      counts.delivered = n;
      break;
    default:
      counts.parked = n;
      break;
  }
}

}  // namespace idem::detail
