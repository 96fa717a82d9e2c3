#include "idem/errors.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace idem {

std::string_view to_string(errc code) noexcept {
  switch (code) {
    case errc::invalid_key:
      return "invalid_key";
    case errc::invalid_argument:
      return "invalid_argument";
    case errc::key_reuse:
      return "key_reuse";
    case errc::in_progress:
      return "in_progress";
    case errc::lease_lost:
      return "lease_lost";
    case errc::store_unavailable:
      return "store_unavailable";
    case errc::outcome_unknown:
      return "outcome_unknown";
    case errc::corrupt_record:
      return "corrupt_record";
  }
  return "unknown";
}

InvalidKeyError::InvalidKeyError(std::string field, std::string rule)
    : error(errc::invalid_key, fmt::format("idempotency {} {}", field, rule)),
      field_(std::move(field)),
      rule_(std::move(rule)) {}

KeyReuseError::KeyReuseError(std::string stored_fingerprint, std::string request_fingerprint)
    : error(errc::key_reuse,
            fmt::format("idempotency key reused for a different request (stored fingerprint "
                        "{}, request fingerprint {})",
                        stored_fingerprint, request_fingerprint)),
      stored_(std::move(stored_fingerprint)),
      request_(std::move(request_fingerprint)) {}

InProgressError::InProgressError(std::chrono::milliseconds retry_after)
    : error(errc::in_progress,
            fmt::format("a request with this idempotency key is in progress; retry in {} ms",
                        std::max<std::int64_t>(retry_after.count(), 1000))),
      retry_after_(std::max(retry_after, std::chrono::milliseconds(1000))) {}

LeaseLostError::LeaseLostError(std::int64_t token)
    : error(errc::lease_lost,
            fmt::format("lease lost: fencing token {} was superseded; the result was not stored",
                        token)),
      token_(token) {}

LeaseLostError::LeaseLostError(std::int64_t token, std::string_view why)
    : error(errc::lease_lost, fmt::format("lease lost (fencing token {}): {}", token, why)),
      token_(token) {}

OutcomeUnknownError::OutcomeUnknownError(std::string step, std::optional<std::string> result)
    : error(errc::outcome_unknown,
            result ? fmt::format("the operation stopped in step '{}' after its call returned "
                                 "'{}' and before that was recorded: retry with the same key "
                                 "(it resumes), never with a new one",
                                 step, *result)
                   : fmt::format("the operation stopped in step '{}' after an effect may have "
                                 "happened: retry with the same key (it resumes), never with a "
                                 "new one",
                                 step)),
      step_(std::move(step)),
      result_(std::move(result)) {}

CorruptRecordError::CorruptRecordError(const std::string& what)
    : StoreError(errc::corrupt_record, what, 0) {}

}  // namespace idem
