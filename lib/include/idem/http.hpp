// idem — coordinator outcomes as HTTP responses, for any C++ HTTP server.
//
// Successes and stored business outcomes keep the status and body the action returned;
// replays carry "Idempotent-Replayed: true". idem's errors become RFC 9457 problem
// details (application/problem+json) with an extra member "error" holding a stable code.
// Free of any HTTP library: idem/beast.hpp (target idem::http) builds a whole layer for
// Boost.Beast handlers on these pieces.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "idem/coordinator.hpp"
#include "idem/errors.hpp"
#include "idem/response.hpp"

namespace idem {

// The header that marks a replayed response.
inline constexpr std::string_view kReplayedHeader = "Idempotent-Replayed";
// The header that says until when the key is remembered (an HTTP-date).
inline constexpr std::string_view kExpiresHeader = "Idempotency-Key-Expires";

// The key carried by one Idempotency-Key field value: an RFC 8941 sf-string ("..." with \"
// and \\ escapes, printable ASCII inside), with any well-formed RFC 8941 parameters after it
// (`"k";p=1`: accepted and ignored, as RFC 8941 lets a recipient do), or, as many clients send
// it, the bare key, whole (no DQUOTE, no comma: a comma-joined list of keys is not one key).
// nullopt when the value is neither. The key's own rules (1..255 bytes...) are
// validate_key_part's.
std::optional<std::string> parse_idempotency_key(std::string_view value);

// An IMF-fixdate (RFC 9110 §5.6.7), e.g. "Sun, 06 Nov 1994 08:49:37 GMT".
std::string http_date(TimePoint t);

// 400 invalid_key and invalid_argument, 422 key_reuse, 409 in_progress and lease_lost,
// 503 store_unavailable and outcome_unknown, 500 corrupt_record.
int http_status(errc code) noexcept;

// The stable "error" code of a problem body: idempotency_key_required (a missing key),
// idempotency_key_invalid, invalid_request, idempotency_key_reuse, idempotency_key_in_use,
// lease_lost, store_unavailable, outcome_unknown (an effect may have happened: retry with the
// same key, never a new one), idempotency_record_corrupt.
std::string_view http_error_code(const error& e) noexcept;

// The outcome as sent: its response, plus "Idempotent-Replayed: true" when replayed.
Response to_http(const Outcome& outcome);

// The error as sent: problem+json with type, title, status, detail and error; InProgressError
// adds Retry-After (whole seconds, at least 1).
Response to_http(const error& e);

// A problem+json response for errors that are not idem's (400 invalid_request, 401, 502...).
Response problem(int status, std::string_view error_code, std::string_view title,
                 std::string_view detail);

}  // namespace idem
