// How a record maps to SQLite's columns of idem_keys: the fingerprint as a 32-byte blob, the
// body as a blob (byte-exact), times, headers and progress as record_codec.hpp keeps them.
// The statements' parameter numbers are in sql.hpp.
#pragma once

#include <cstdint>
#include <string>

#include "idem/internal/sqlite.hpp"
#include "idem/store.hpp"
#include "record_codec.hpp"

namespace idem::detail {

// Binds tenant, operation and key to ?first, ?first+1 and ?first+2 (default ?1..?3).
void bind_id(sqlite::Statement& s, const KeyId& id, int first = 1);
void bind_fingerprint(sqlite::Statement& s, int index, const Fingerprint& fp);

// Binds status ?first, headers ?first+1, body ?first+2, body_ref ?first+3. The strings
// bound are owned by `headers_json` and `r`, which must outlive the statement's step.
void bind_response(sqlite::Statement& s, int first, const StoredResponse& r,
                   const std::string& headers_json);

// The record on the current row of sql::kLoad (which must have stepped onto a row).
// Throws StoreError if a column does not decode (a corrupt or foreign row): a fingerprint
// that is not a 32-byte blob, a state other than 1, 2 or 3, a non-integer token, time or
// status, a headers column that is not a JSON array of [name, value] string pairs.
Record read_record(const sqlite::Statement& load);

}  // namespace idem::detail
