// How a record maps to the columns of idem_keys: times as epoch milliseconds, the
// fingerprint as a 32-byte blob, headers as a JSON array of [name, value] pairs, the body
// as a blob (byte-exact). The statements' parameter numbers are in sql.hpp.
#pragma once

#include <cstdint>
#include <string>

#include "idem/internal/sqlite.hpp"
#include "idem/store.hpp"

namespace idem::detail {

inline std::int64_t ms(TimePoint t) { return t.time_since_epoch().count(); }
inline TimePoint at_ms(std::int64_t v) { return TimePoint(std::chrono::milliseconds(v)); }

// Binds tenant ?1, operation ?2, key ?3.
void bind_id(sqlite::Statement& s, const KeyId& id);
void bind_fingerprint(sqlite::Statement& s, int index, const Fingerprint& fp);

// The headers column's text (empty when there are no headers: stored as NULL). Throws
// StoreError if a name or value is not valid UTF-8 (the column is JSON).
std::string headers_to_json(const std::vector<Header>& headers);

// Binds status ?first, headers ?first+1, body ?first+2, body_ref ?first+3. The strings
// bound are owned by `headers_json` and `r`, which must outlive the statement's step.
void bind_response(sqlite::Statement& s, int first, const StoredResponse& r,
                   const std::string& headers_json);

// Progress as the progress column keeps it: {"origin": N, "steps": [[step, result,
// reconciled], ...], "pending": step or null} (the request has its own column). Throws
// idem::error(errc::invalid_argument) if a step name or result is not valid UTF-8.
std::string progress_to_json(const Progress& p);
// Throws StoreError if `text` does not decode. `request` is left empty.
Progress progress_from_json(std::string_view text);

// The record on the current row of sql::kLoad (which must have stepped onto a row).
// Throws StoreError if a column does not decode (a corrupt or foreign row): a fingerprint
// that is not a 32-byte blob, a state other than 1, 2 or 3, a non-integer token, time or
// status, a headers column that is not a JSON array of [name, value] string pairs.
Record read_record(const sqlite::Statement& load);

}  // namespace idem::detail
