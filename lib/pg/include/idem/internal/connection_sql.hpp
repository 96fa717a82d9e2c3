// The SQL a pg::Connection (pg_connection.hpp) runs by itself; the store's own statements are
// in lib/src/pg_sql.hpp.
#pragma once

namespace idem::pg::sql {

inline constexpr const char* kBegin = "BEGIN";
inline constexpr const char* kCommit = "COMMIT";
inline constexpr const char* kRollback = "ROLLBACK";

}  // namespace idem::pg::sql
