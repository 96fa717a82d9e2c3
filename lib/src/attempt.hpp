// How the effect loop (drive.hpp) starts an Attempt and ends a failed one, the completer's
// bookkeeping, and the one body of an external step.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "core.hpp"
#include "idem/steps.hpp"

namespace idem {

struct AttemptAccess {
  // The Attempt of the record `token` holds, once StepStore::begin_steps has answered
  // `progress`; counts a resume. Throws LeaseLostError if `progress` is null (`token` is no
  // longer current).
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

namespace detail {

// The one body of Attempt::external (P: drive.hpp's BlockingEffects) and async_external
// (asio.cpp's AsyncEffects): the plan, the look-up after an unknown outcome, the call with the
// derived key, each store step through perform.store and each application call through P::run.
template <class P, class Call, class Lookup>
typename P::template Task<std::string> external_step(Attempt& attempt, std::string_view step,
                                                     const Call& call, const Lookup& lookup,
                                                     P perform) {
  Attempt::Plan plan = co_await perform.store([&] { return attempt.begin_external(step); });
  if (plan.kind == Attempt::Plan::Kind::done) co_return plan.result;
  if (plan.kind == Attempt::Plan::Kind::look_up) {
    if (lookup) {
      std::optional<std::string> found = co_await P::run(lookup, plan.key);
      if (found) {
        std::string recorded = co_await perform.store(
            [&] { return attempt.finish_external(step, std::move(*found), true); });
        co_return recorded;
      }
    }
    // Never happened downstream (or no way to ask): call, as a first call.
    co_await perform.store([&] {
      attempt.begin_call(step);
      return true;
    });
  }
  // On the thread that calls: the way back from the store (another thread's turn, an event
  // loop's queue) may have taken part of the lease.
  attempt.check_call(step);
  std::string result = co_await P::run(call, plan.key);
  std::string recorded = co_await perform.store(
      [&] { return attempt.finish_external(step, std::move(result), false); });
  co_return recorded;
}

}  // namespace detail
}  // namespace idem
