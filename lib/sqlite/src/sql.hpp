// The SQL the wrappers themselves run.
#pragma once

#include <string_view>

namespace idem::sqlite::sql {

inline constexpr std::string_view kBeginImmediate = "BEGIN IMMEDIATE";
inline constexpr std::string_view kBegin = "BEGIN";
inline constexpr std::string_view kCommit = "COMMIT";
inline constexpr std::string_view kRollback = "ROLLBACK";
inline constexpr std::string_view kJournalModeWal = "PRAGMA journal_mode=WAL";

}  // namespace idem::sqlite::sql
