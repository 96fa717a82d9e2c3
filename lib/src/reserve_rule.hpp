// The reservation rule in one function: what a reservation of a key does to the record
// already there. No I/O: an engine reads the record, asks, and writes what it is told.
// SqliteStore calls it; PgStore's idem_reserve (pg_sql.hpp) carries the same rule in PL/pgSQL
// so that a reservation is one round trip, and tests/reserve_rule_test.cpp holds the function
// and both engines to one table of cases.
#pragma once

#include <algorithm>
#include <cstdint>

#include "idem/store.hpp"

namespace idem::detail {

struct ReserveAnswer {
  // reserved: the key is the caller's (write a fresh reservation: INSERT when there was no
  // record, else replace the dead one); taken_over: the caller replaces an in_progress record
  // whose lease ended; existing: the record stands and is returned untouched.
  Reservation::Kind kind = Reservation::Kind::reserved;
  std::int64_t token = 0;  // reserved and taken_over: the caller's new token
  bool resume = false;     // the replacement keeps the record's progress and request
};

// `existing`: the key's record, or null when there is none; `progress`: whether it has
// progress (a multi-step operation recorded a step); `now_ms`: `now` in milliseconds since
// the epoch, the floor of a new token.
inline ReserveAnswer reserve_rule(const Record* existing, bool progress,
                                  const Fingerprint& fingerprint, TimePoint now,
                                  std::int64_t now_ms) {
  if (existing == nullptr) return {Reservation::Kind::reserved, now_ms, false};
  // A record that counts holds the key.
  if (existing->live_at(now)) return {Reservation::Kind::existing, 0, false};
  // A multi-step operation that made progress keeps its key for its own retry: after a crash
  // (in_progress, its lease over) and, once it failed and released, until its record's
  // expiry. Another request with this key is a reuse: money may have moved under the first,
  // and taking the key would orphan it.
  const bool same = existing->fingerprint == fingerprint;
  const bool in_progress = existing->state == State::in_progress;
  const bool kept_for_retry =
      progress &&
      (in_progress || (existing->state == State::released && now < existing->expires_at));
  if (kept_for_retry && !same) return {Reservation::Kind::existing, 0, false};
  // The record no longer counts: the caller replaces it. The token grows past every earlier
  // token of this key, and past the clock, so a token stays unique even after a purge deleted
  // the row. The same request resumes an in_progress record (a takeover) or a released one
  // kept for its retry.
  return {in_progress ? Reservation::Kind::taken_over : Reservation::Kind::reserved,
          std::max(existing->token + 1, now_ms), same && (in_progress || kept_for_retry)};
}

}  // namespace idem::detail
