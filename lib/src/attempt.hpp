// How the drivers (coordinator.cpp, asio.cpp) start an Attempt and end a failed one.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>

#include "core.hpp"
#include "idem/steps.hpp"

namespace idem {

struct AttemptAccess {
  // Begins or resumes the progress of the record `token` holds (StepStore::begin_steps) and
  // counts a resume. Throws LeaseLostError if `token` is no longer current, or StoreError.
  static Attempt begin(detail::CoordinatorCore& core, const KeyId& id, std::int64_t token,
                       const std::string& payload);
  // begin() once begin_steps has answered `progress` (for a driver that made that call itself).
  static Attempt started(detail::CoordinatorCore& core, const KeyId& id, std::int64_t token,
                         std::optional<Progress> progress);
  static detail::CoordinatorCore& core(Attempt& attempt) noexcept { return attempt.core_; }
  // The action failed: an attempt that recorded a step (or left one pending) is counted and
  // logged as interrupted; its progress stays for the retry.
  static void failed(detail::CoordinatorCore& core, const Attempt& attempt);
  // Whether a step write of `attempt` failed in the store (whatever the action made of it: a
  // handler may answer a 503 of its own rather than throw).
  static bool store_failed(const Attempt& attempt) noexcept { return attempt.store_failed_; }

  // The completer's side, shared by Completer and Maintenance: the request that resumes an
  // abandoned operation (InFlight::raise: a holder is left alone), and the bookkeeping of
  // one resume (`failure`: what call_steps threw, or null).
  static Request resume_request(const AbandonedOperation& op);
  static void resumed(detail::CoordinatorCore& core, CompleterReport& report,
                      const AbandonedOperation& op, const std::exception_ptr& failure);
};

}  // namespace idem
