#include "record_codec.hpp"

#include <limits>
#include <nlohmann/json.hpp>

#include "idem/errors.hpp"

namespace idem::detail {

namespace {

// The last headers this thread encoded or decoded, with their text. The records of one service
// carry a few header sets over and over ([["Content-Type","application/json"]]): a completion
// encodes the set and a replay decodes it, and nlohmann takes about 5,400 instructions each way
// for that one header (callgrind, 2026-12-07; its lexer builds each string a character at a
// time), where comparing with the kept set and copying it takes a few hundred. Only what
// encoded or decoded without error is kept, and only a text of at most kMaxText bytes.
struct KeptHeaders {
  static constexpr std::size_t kMaxText = 1024;
  std::string text;  // empty: nothing kept
  std::vector<Header> headers;

  void keep(std::string_view t, const std::vector<Header>& h) {
    if (t.size() > kMaxText) return;
    text.clear();  // the two change together, or the text stays empty
    headers = h;
    text.assign(t);
  }
};
thread_local KeptHeaders kept;

}  // namespace

std::string headers_to_json(const std::vector<Header>& headers) {
  if (headers.empty()) return {};
  if (!kept.text.empty() && headers == kept.headers) return kept.text;
  nlohmann::json arr = nlohmann::json::array();
  for (const Header& h : headers) arr.push_back({h.name, h.value});
  std::string text;
  try {
    text = arr.dump();
  } catch (const nlohmann::json::exception&) {
    throw StoreError("idem: a response header is not valid UTF-8 and cannot be stored", 0);
  }
  kept.keep(text, headers);
  return text;
}

namespace {

// Reads [["name", "value"], ...] straight into headers with nlohmann's SAX parser: a replay
// decodes its headers on every call, and building the JSON document first cost it a tenth of
// its time (perf, 2026-12-02). Anything of another shape is refused with `why`.
class HeadersReader final : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit HeadersReader(std::vector<Header>& out) : out_(out) {}
  std::string why;

  bool null() override { return refuse("a value that is not a string"); }
  bool boolean(bool) override { return refuse("a value that is not a string"); }
  bool number_integer(number_integer_t) override { return refuse("a number"); }
  bool number_unsigned(number_unsigned_t) override { return refuse("a number"); }
  bool number_float(number_float_t, const string_t&) override { return refuse("a number"); }
  bool binary(binary_t&) override { return refuse("binary data"); }
  bool start_object(std::size_t) override { return refuse("an object"); }
  bool key(string_t&) override { return refuse("an object"); }
  bool end_object() override { return refuse("an object"); }
  bool string(string_t& s) override {
    if (depth_ != 2 || fields_ >= 2) return refuse("a string outside a [name, value] pair");
    if (fields_++ == 0) {
      out_.push_back({std::move(s), {}});
    } else {
      out_.back().value = std::move(s);
    }
    return true;
  }
  bool start_array(std::size_t) override {
    if (++depth_ > 2) return refuse("nested arrays");
    fields_ = 0;
    return true;
  }
  bool end_array() override {
    if (depth_-- == 2 && fields_ != 2) return refuse("a pair that is not [name, value]");
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    return refuse(e.what());
  }
  bool complete() const { return depth_ == 0 && why.empty(); }

 private:
  bool refuse(std::string_view what) {
    if (why.empty()) why = what;
    return false;
  }
  std::vector<Header>& out_;
  int depth_ = 0;
  int fields_ = 0;
};

}  // namespace

std::vector<Header> headers_from_json(std::string_view text) {
  std::vector<Header> out;
  if (text.empty()) return out;
  if (text == kept.text) return kept.headers;
  HeadersReader reader(out);
  const bool ok = nlohmann::json::sax_parse(text, &reader);
  if (!ok || !reader.complete()) {
    throw CorruptRecordError(
        "idem: a stored headers column does not decode: " +
        (reader.why.empty() ? std::string("not an array of pairs") : reader.why));
  }
  kept.keep(text, out);
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
