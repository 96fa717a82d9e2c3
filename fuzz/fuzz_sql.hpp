// The fuzz targets' SQL, as named constants (scripts/check-walls keeps SQL in *_sql.hpp).
#pragma once

#include <string_view>

namespace idem::fuzz::sql {

// A row with the columns of lib/src/sql.hpp's kLoad, each a bound value (?1..?11), so a
// target can hand read_record any column values, of any type, with no table's constraints.
inline constexpr std::string_view kRowOfParameters =
    "SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11";

}  // namespace idem::fuzz::sql
