// How a record's parts are kept in any engine's columns: times as epoch milliseconds,
// headers as a JSON array of [name, value] pairs, a multi-step operation's progress as JSON;
// and how a step changes that progress. Shared by SqliteStore and PgStore, so both keep
// records alike (and a record moves between them unchanged).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/store.hpp"

namespace idem::detail {

inline std::int64_t ms(TimePoint t) { return t.time_since_epoch().count(); }
inline TimePoint at_ms(std::int64_t v) { return TimePoint(std::chrono::milliseconds(v)); }

// The headers column's text (empty when there are no headers: stored as NULL). Throws
// StoreError if a name or value is not valid UTF-8 (the column is JSON).
std::string headers_to_json(const std::vector<Header>& headers);
// Throws StoreError if `text` is not a JSON array of [name, value] string pairs.
std::vector<Header> headers_from_json(std::string_view text);

// Progress as the progress column keeps it: {"origin": N, "steps": [[step, result,
// reconciled], ...], "pending": step or null} (the request has its own column). Throws
// idem::error(errc::invalid_argument) if a step name or result is not valid UTF-8.
std::string progress_to_json(const Progress& p);
// Throws StoreError if `text` does not decode. `request` is left empty.
Progress progress_from_json(std::string_view text);

// The progress after `step` is marked pending (StepStore::mark_pending); it starts at `origin`
// when nothing was recorded yet.
Progress with_pending(std::optional<Progress> recorded, std::int64_t origin,
                      const std::string& step);
// The progress after `step` finished (StepStore::commit_step): appended, and no longer pending if
// it was; it starts at `origin` when nothing was recorded yet.
Progress with_step(std::optional<Progress> recorded, std::int64_t origin, const StepResult& step);

// Adds `n` messages of the outbox's state column `state` (0 pending, 1 delivered, 2 parked).
void add_outbox_count(OutboxCounts& counts, std::int64_t state, std::size_t n);

}  // namespace idem::detail
