// Fuzz target: decoding a stored record (lib/src/sqlite_codec.hpp), as from a corrupt or
// foreign database file.
//
// The input's first byte chooses what is decoded:
//   'p' the rest is a progress column: progress_from_json;
//   'r' the rest is a row of kLoad's 11 columns (fingerprint, state, token, lease_until,
//       created_at, expires_at, status, headers, body, body_ref, recovery_point), separated
//       by 0x1f; each column is a type letter and its value: n (NULL), i<decimal> (integer),
//       f<decimal> (real), t<bytes> (text), b<bytes> (blob); missing columns are NULL;
//       read_record on that row (a SELECT of bound parameters: any type in any column).
// Properties: a column that does not decode is a StoreError, never another exception, a
// crash or undefined behaviour; what decodes is a record the library can use (state one of
// the three, the times usable by live_at and http_date).
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_sql.hpp"
#include "fuzz_support.hpp"
#include "idem/errors.hpp"
#include "idem/http.hpp"
#include "idem/internal/sqlite.hpp"
#include "sqlite_codec.hpp"

namespace {

using idem::fuzz::require;

constexpr std::size_t kColumns = 11;

void decode_progress(std::string_view text) {
  try {
    const idem::Progress p = idem::detail::progress_from_json(text);
    // What decodes encodes again (the store rewrites progress with every step).
    const std::string again = idem::detail::progress_to_json(p);
    const idem::Progress back = idem::detail::progress_from_json(again);
    require(
        back.origin == p.origin && back.steps.size() == p.steps.size() && back.pending == p.pending,
        "decoded progress survives its own encoding");
  } catch (const idem::StoreError&) {
  }
}

// The statement every row goes through, on a private in-memory database.
idem::sqlite::Statement& row_statement() {
  static idem::sqlite::BusyPolicy busy{std::chrono::milliseconds(0), {}};
  static idem::sqlite::Connection db = idem::sqlite::open_connection(":memory:", &busy);
  static idem::sqlite::Statement select(db.get(), idem::fuzz::sql::kRowOfParameters);
  return select;
}

void decode_row(std::string_view text) {
  std::vector<std::string_view> columns;
  while (columns.size() < kColumns && !text.empty()) {
    const std::size_t end = text.find('\x1f');
    columns.push_back(text.substr(0, end));
    text = end == std::string_view::npos ? std::string_view() : text.substr(end + 1);
  }
  idem::sqlite::Statement& s = row_statement();
  idem::sqlite::ResetGuard reset(s);
  for (std::size_t i = 0; i < kColumns; ++i) {
    const int index = static_cast<int>(i) + 1;
    const std::string_view c = i < columns.size() ? columns[i] : std::string_view("n");
    const std::string_view value = c.empty() ? c : c.substr(1);
    switch (c.empty() ? 'n' : c.front()) {
      case 'i': {
        std::int64_t n = 0;
        std::from_chars(value.data(), value.data() + value.size(), n);
        s.bind(index, n);
        break;
      }
      case 'f': {
        double d = 0;
        std::from_chars(value.data(), value.data() + value.size(), d);
        s.bind(index, d);
        break;
      }
      case 't':
        s.bind(index, value);
        break;
      case 'b':
        s.bind_blob(index, value.data(), value.size());
        break;
      default:
        s.bind_null(index);
        break;
    }
  }
  require(s.step(), "the row of parameters is a row");
  const bool fingerprint_ok =
      !columns.empty() && columns[0].size() == 1 + 32 && columns[0].front() == 'b';
  idem::Record r;
  try {
    r = idem::detail::read_record(s);
  } catch (const idem::StoreError&) {
    return;
  }
  require(fingerprint_ok, "a decoded record's fingerprint was 32 bytes");
  require(r.state == idem::State::in_progress || r.state == idem::State::completed ||
              r.state == idem::State::released,
          "a decoded record's state is one of the three");
  // What the library does with a record's times: whether it counts now, and on a replay
  // the key's expiry as an HTTP date.
  const idem::TimePoint now{std::chrono::milliseconds(1767225600000)};
  (void)r.live_at(now);
  if (r.state == idem::State::completed) {
    const std::string date = idem::http_date(r.expires_at);
    require(date.size() >= 29 && date.ends_with(" GMT"), "an HTTP date is an IMF-fixdate");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view input = idem::fuzz::as_text(data, size);
  if (input.empty()) return 0;
  if (input.front() == 'p') {
    decode_progress(input.substr(1));
  } else if (input.front() == 'r') {
    decode_row(input.substr(1));
  }
  return 0;
}
