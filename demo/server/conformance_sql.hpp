// Every SQL statement of the conformance fixture (conformance_app.cpp): what it does to idem's
// own table from outside the layer, in SQLite's dialect.
#pragma once

#include <string_view>

namespace idem::demo::sql {

// POST /_fixture/corrupt: the record's headers column made something that is not a JSON
// array, so the record no longer decodes (idem::CorruptRecordError). ?1 tenant ?2 operation
// ?3 key. One row changed: a record was damaged; none: there was no record.
inline constexpr std::string_view kCorruptHeaders =
    "UPDATE idem_keys SET headers = 'not json' WHERE tenant = ?1 AND operation = ?2 AND key = ?3";

}  // namespace idem::demo::sql
