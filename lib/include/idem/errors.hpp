// idem — errors.
//
// Every failure idem reports is an idem::error (a std::runtime_error) carrying one
// idem::errc. The comment on each value says when it happens, whether the caller
// should retry, and the HTTP status a server would map it to.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace idem {

enum class errc {
  // The idempotency key, tenant or operation breaks a rule of idem/key.hpp (empty, longer
  // than 255 bytes, a byte outside printable ASCII 0x20..0x7E), or the key is missing
  // and Options::missing_key is MissingKey::reject. Nothing was stored and nothing ran.
  // Never retry unchanged: fix the request. HTTP 400.
  invalid_key,

  // An option or argument is out of range (TTL under one minute, a lease not shorter
  // than the TTL, a negative wait...). Raised when the Coordinator is built or when a
  // call names a bad per-call value; nothing was stored. Fix the configuration.
  invalid_argument,

  // The key is held, live, by a request with a different fingerprint: the client reused
  // a key for another operation. Checked before anything else about the stored record;
  // nothing ran, nothing changed. Never retry with this key (abseil kFailedPrecondition).
  // HTTP 422. The error carries both fingerprints (KeyReuseError).
  key_reuse,

  // Another request holds the key and has not finished: raised at once under
  // InFlight::raise, or under InFlight::wait when the bounded wait ran out. Nothing ran.
  // Retry the same call later (abseil kUnavailable); InProgressError::retry_after()
  // suggests when. HTTP 409 with Retry-After.
  in_progress,

  // This caller's lease was taken over (its fencing token is no longer current): its
  // action ran, but its result was not stored and the new owner's record stands. Or, before
  // an external call, the lease had ended or had less than Options::call_margin left (a reply
  // that came late, an owner that was paused): then nothing was called, and the key was
  // released if this caller still held it. The event is logged and counted. Do not run the
  // action outside idem: ask the key again, which replays the new owner's result or runs it
  // afresh. HTTP 409 (or 500 for an internal caller).
  lease_lost,

  // The store could not be used: SQLITE_BUSY after busy_timeout, an I/O error, a full
  // disk, a database that cannot be opened. Under FailureMode::fail_closed the action did
  // not run in this call; an earlier call with the same key may have had its effect (its
  // stored outcome, or a multi-step operation's recorded steps, stand, and a retry with the
  // same key replays or resumes them). Retry with backoff and the same key (abseil
  // kUnavailable). HTTP 503.
  store_unavailable,

  // A multi-step operation stopped after an effect may have happened: an external step was
  // called and its result could not be recorded, or the store failed after a step had been
  // recorded or begun (by this attempt, or by an earlier one whose progress this attempt had
  // read). Nothing is lost: the progress stays on the key and a retry with the same key
  // resumes it, looking an unrecorded call up by its derived key before calling again. Retry
  // with the same key (abseil kUnavailable), never with a new one: a new key would do it all
  // again. HTTP 503. OutcomeUnknownError says which step and, when known, what it returned.
  outcome_unknown,

  // The key's stored record does not decode (a damaged row, or one written by something else).
  // idem neither runs the request (the record may say it ran already, or is running: running it
  // again could do twice what must happen once, so not even FailureMode::fail_open runs it) nor
  // replays it, and leaves the record as it is. Counted (MetricsSnapshot::corrupt_records) and
  // logged ("record_corrupt"). Do not retry: an operator repairs or deletes the record.
  // HTTP 500. CorruptRecordError is a StoreError, so code written for store failures stops too.
  corrupt_record,
};

// A short, stable name for an errc ("key_reuse"), for logs and error bodies.
std::string_view to_string(errc code) noexcept;

// The one exception type idem throws (subclasses below add detail).
class error : public std::runtime_error {
 public:
  error(errc code, const std::string& what) : std::runtime_error(what), code_(code) {}
  errc code() const noexcept { return code_; }

 private:
  errc code_;
};

// errc::invalid_key. rule() names the broken rule in a few words ("longer than 255
// bytes"); field() is "key", "tenant" or "operation".
class InvalidKeyError : public error {
 public:
  InvalidKeyError(std::string field, std::string rule);
  const std::string& field() const noexcept { return field_; }
  const std::string& rule() const noexcept { return rule_; }

 private:
  std::string field_;
  std::string rule_;
};

// errc::key_reuse, with the stored and the presented fingerprint (lowercase hex).
class KeyReuseError : public error {
 public:
  KeyReuseError(std::string stored_fingerprint, std::string request_fingerprint);
  const std::string& stored_fingerprint() const noexcept { return stored_; }
  const std::string& request_fingerprint() const noexcept { return request_; }

 private:
  std::string stored_;
  std::string request_;
};

// errc::in_progress. retry_after() is how long until the holder's lease ends (at least
// one second), a fair Retry-After for the client.
class InProgressError : public error {
 public:
  explicit InProgressError(std::chrono::milliseconds retry_after);
  std::chrono::milliseconds retry_after() const noexcept { return retry_after_; }

 private:
  std::chrono::milliseconds retry_after_;
};

// errc::lease_lost. token() is the fencing token this caller held.
class LeaseLostError : public error {
 public:
  explicit LeaseLostError(std::int64_t token);
  // With what happened in `why` ("the reservation came back too late: nothing was called").
  LeaseLostError(std::int64_t token, std::string_view why);
  std::int64_t token() const noexcept { return token_; }

 private:
  std::int64_t token_;
};

// errc::outcome_unknown. step() is the step the operation stopped in; result() is what that
// step's external call returned when the call came back and its recording failed (a charge id),
// else nullopt. The store's error that stopped it is nested (std::rethrow_if_nested).
class OutcomeUnknownError : public error {
 public:
  OutcomeUnknownError(std::string step, std::optional<std::string> result);
  const std::string& step() const noexcept { return step_; }
  const std::optional<std::string>& result() const noexcept { return result_; }

 private:
  std::string step_;
  std::optional<std::string> result_;
};

// errc::store_unavailable. sqlite_code() is SQLite's extended result code (0 when the
// failure did not come from SQLite), in the manner of SQLiteCpp's Exception.
//
// Defined here, in the header, because the internal SQLite and libpq wrappers (lib/sqlite,
// lib/pg) throw it too and link nothing of libidem: the library depends on them, never back.
class StoreError : public error {
 public:
  StoreError(const std::string& what, int sqlite_code)
      : StoreError(errc::store_unavailable, what, sqlite_code) {}
  int sqlite_code() const noexcept { return sqlite_code_; }

 protected:
  StoreError(errc code, const std::string& what, int sqlite_code)
      : error(code, what), sqlite_code_(sqlite_code) {}

 private:
  int sqlite_code_;
};

// errc::corrupt_record: what() names the column that does not decode.
class CorruptRecordError : public StoreError {
 public:
  explicit CorruptRecordError(const std::string& what);
};

}  // namespace idem
