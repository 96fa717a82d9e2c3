#include "idem/steps.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "attempt.hpp"
#include "core.hpp"
#include "drive.hpp"
#include "idem/test_control.hpp"
#include "maintenance_jobs.hpp"

namespace idem {

// --- Attempt -------------------------------------------------------------------------------

Attempt::Attempt(detail::CoordinatorCore& core, KeyId id, std::int64_t token, Progress progress)
    : core_(core),
      id_(std::move(id)),
      token_(token),
      progress_(std::move(progress)),
      resumed_(!progress_.steps.empty() || progress_.pending.has_value()) {}

std::optional<std::string> Attempt::recovery_point() const {
  if (progress_.steps.empty()) return std::nullopt;
  return progress_.steps.back().step;
}

const std::string* Attempt::result(std::string_view step) const noexcept {
  for (const StepResult& s : progress_.steps) {
    if (s.step == step) return &s.result;
  }
  return nullptr;
}

const std::string* Attempt::known_result(std::string_view step) const noexcept {
  if (const std::string* r = result(step)) return r;
  const auto it = unrecorded_.find(step);
  return it != unrecorded_.end() ? &it->second : nullptr;
}

bool Attempt::may_have_effects() const noexcept {
  return called_ || !progress_.steps.empty() || progress_.pending.has_value();
}

void Attempt::store_failed(std::string_view step) const {
  store_failed_ = true;
  if (!may_have_effects()) throw;
  const auto it = unrecorded_.find(step);
  std::throw_with_nested(OutcomeUnknownError(
      std::string(step),
      it != unrecorded_.end() ? std::optional<std::string>(it->second) : std::nullopt));
}

void Attempt::lease_lost(std::string_view step, std::string_view why) const {
  detail::bump(core_.counters.lease_lost);
  const std::string what = fmt::format("step '{}': {}", step, why);
  core_.log(LogLevel::error, "lease_lost", short_hash(id_), id_.operation, token_, what);
  throw LeaseLostError(token_, what);
}

std::string Attempt::derived_key(std::string_view step) const {
  return idem::derived_key(id_, progress_.origin, step);
}

void Attempt::check_step(std::string_view step) const {
  detail::check(!step.empty(), "a step needs a name");
}

std::string Attempt::record(StepCommit& commit) {
  const std::string_view step = commit.result.step;
  const bool reconciled = commit.result.reconciled;
  bool committed = false;
  try {
    committed = steps_of(*core_.store).commit_step(id_, token_, progress_.origin, commit);
  } catch (const StoreError&) {
    store_failed(step);
  }
  if (!committed) lease_lost(step, "not recorded: the lease was taken over");
  unrecorded_.erase(commit.result.step);
  detail::bump(core_.counters.steps_recorded);
  if (reconciled) detail::bump(core_.counters.reconciled);
  core_.log(
      reconciled ? LogLevel::warning : LogLevel::debug,
      reconciled ? "step_reconciled" : "step_recorded", short_hash(id_), id_.operation, token_,
      reconciled ? fmt::format("step '{}': the unknown outcome was looked up and recorded", step)
                 : fmt::format("step '{}'", step));
  progress_.steps.push_back(std::move(commit.result));
  progress_.pending.reset();
  return progress_.steps.back().result;
}

std::string Attempt::local(std::string_view step, const LocalWork& work) {
  check_step(step);
  if (const std::string* done = result(step)) return *done;
  // The store reads commit.result after the work ran in its transaction.
  StepCommit commit{StepResult{std::string(step), {}, false}, core_.now(), {}};
  commit.local = [&commit, &work](LocalTransaction& tx) { commit.result.result = work(tx); };
  return record(commit);
}

Attempt::Plan Attempt::begin_external(std::string_view step) {
  check_step(step);
  if (const std::string* done = result(step)) return Plan{Plan::Kind::done, *done, {}};
  if (progress_.pending == step) return Plan{Plan::Kind::look_up, {}, derived_key(step)};
  begin_call(step);
  return Plan{Plan::Kind::call, {}, derived_key(step)};
}

void Attempt::begin_call(std::string_view step) {
  check_step(step);
  const std::string name(step);
  // The lease must still have the call margin left when the call starts. The store checks it
  // on its clock as it marks the step (and renews the lease); the attempt checks it again on
  // its own, counting the renewed lease from before the mark was sent: a mark that comes back
  // late (or an owner paused after it) does not call out either.
  const std::chrono::milliseconds margin = core_.call_margin_for(id_.operation);
  const TimePoint sent = core_.now();
  LeaseCheck lease{sent, sent + margin, sent + core_.options.lease};
  const bool unchecked = test_control::enabled(test_control::Mutation::skip_lease_check);
  if (unchecked) lease = LeaseCheck{sent, TimePoint{}, TimePoint{}};  // no check, no renewal
  bool marked = false;
  try {
    marked = steps_of(*core_.store).mark_pending(id_, token_, progress_.origin, name, lease);
  } catch (const StoreError&) {
    store_failed(step);
  }
  if (!marked) {
    lease_lost(step, fmt::format("not called: the lease was taken over, or had less than the "
                                 "call margin ({} ms) left",
                                 margin.count()));
  }
  progress_.pending = name;
  mark_sent_ = sent;
  confirmed_until_ = unchecked ? TimePoint::max() : lease.renew_to;
  check_call(step);
  called_ = true;
}

void Attempt::check_call(std::string_view step) const {
  const std::chrono::milliseconds margin = core_.call_margin_for(id_.operation);
  const TimePoint now = core_.now();
  if (now + margin >= confirmed_until_) {
    lease_lost(step, fmt::format("not called: {} ms after the pending mark was sent, less than "
                                 "the call margin ({} ms) of the lease was left",
                                 (now - mark_sent_).count(), margin.count()));
  }
}

std::string Attempt::finish_external(std::string_view step, std::string result, bool reconciled) {
  check_step(step);
  if (!reconciled) unrecorded_[std::string(step)] = result;
  StepCommit commit{StepResult{std::string(step), std::move(result), reconciled}, core_.now(), {}};
  return record(commit);
}

std::string Attempt::external(std::string_view step, const ExternalCall& call,
                              const Lookup& lookup) {
  return detail::external_step(*this, step, call, lookup, detail::BlockingEffects{{}, core_}).get();
}

Attempt AttemptAccess::started(detail::CoordinatorCore& core, const KeyId& id, std::int64_t token,
                               std::optional<Progress> progress) {
  if (!progress) {
    detail::bump(core.counters.lease_lost);
    core.log(LogLevel::error, "lease_lost", short_hash(id), id.operation, token,
             "begin_steps refused: the lease was taken over");
    throw LeaseLostError(token, "the operation could not begin: the lease was taken over");
  }
  if (!progress->steps.empty() || progress->pending) {
    detail::bump(core.counters.resumed);
    core.log(
        LogLevel::info, "resumed", short_hash(id), id.operation, token,
        fmt::format("resuming after '{}'{}",
                    progress->steps.empty() ? "(no step)" : progress->steps.back().step,
                    progress->pending ? fmt::format("; step '{}' was in flight", *progress->pending)
                                      : std::string()));
  }
  return Attempt(core, id, token, std::move(*progress));
}

void AttemptAccess::failed(detail::CoordinatorCore& core, const Attempt& attempt) {
  if (attempt.progress_.steps.empty() && !attempt.progress_.pending) return;
  detail::bump(core.counters.interrupted);
  core.log(LogLevel::warning, "interrupted", short_hash(attempt.id_), attempt.id_.operation,
           attempt.token_,
           fmt::format("failed after '{}'; the progress is kept and a retry resumes",
                       attempt.recovery_point().value_or("(a step in flight)")));
}

// --- Completer -----------------------------------------------------------------------------

Completer::Completer(Coordinator& coordinator, CompleterOptions options)
    : coordinator_(coordinator), options_(options) {
  detail::check(options_.batch > 0, "completer: batch must be at least 1");
  detail::check(options_.abandoned_after.count() >= 0,
                "completer: abandoned_after must not be negative");
}

void Completer::on(std::string operation, Resume resume) {
  validate_key_part("operation", operation);
  detail::check(static_cast<bool>(resume), "completer: a handler is required");
  handlers_[std::move(operation)] = std::move(resume);
}

Request AttemptAccess::resume_request(const AbandonedOperation& op) {
  return Request{.tenant = op.id.tenant,
                 .operation = op.id.operation,
                 .key = op.id.key,
                 .fingerprint = op.fingerprint,
                 .in_flight = InFlight::raise,
                 .payload = op.request};
}

void AttemptAccess::resumed(detail::CoordinatorCore& core, CompleterReport& report,
                            const AbandonedOperation& op, const std::exception_ptr& failure) {
  if (!failure) {
    ++report.finished;
    detail::bump(core.counters.completer_finished);
    core.log(LogLevel::warning, "completed_abandoned", short_hash(op.id), op.id.operation, 0,
             "finished an abandoned operation from its recovery point");
    return;
  }
  try {
    std::rethrow_exception(failure);
  } catch (const InProgressError&) {
    ++report.skipped;  // a client's retry (or another completer) holds it now
  } catch (const KeyReuseError&) {
    ++report.skipped;
  } catch (const std::exception& e) {
    ++report.failed;
    detail::bump(core.counters.completer_failed);
    core.log(LogLevel::error, "complete_abandoned_failed", short_hash(op.id), op.id.operation, 0,
             e.what());
  } catch (...) {
    ++report.failed;
    detail::bump(core.counters.completer_failed);
    core.log(LogLevel::error, "complete_abandoned_failed", short_hash(op.id), op.id.operation, 0,
             "unknown error");
  }
}

CompleterReport Completer::run_once() {
  std::vector<std::string> operations;
  for (const auto& [operation, handler] : handlers_) operations.push_back(operation);
  const std::vector<AbandonedOperation> found =
      coordinator_.abandoned(options_.abandoned_after, options_.batch, operations);
  CompleterReport report;
  const std::atomic<bool> never_stops{false};
  detail::resume_abandoned<detail::Blocking>(coordinator_, found, handlers_, never_stops, report)
      .get();
  return report;
}

// --- Dispatcher ----------------------------------------------------------------------------

Dispatcher::Dispatcher(Coordinator& coordinator, Delivery delivery, OutboxOptions options)
    : coordinator_(coordinator), delivery_(std::move(delivery)), options_(options) {
  detail::check(static_cast<bool>(delivery_), "dispatcher: a delivery function is required");
  detail::check(options_.max_attempts >= 1, "dispatcher: max_attempts must be at least 1");
  detail::check(options_.first_retry.count() > 0, "dispatcher: first_retry must be positive");
  detail::check(options_.max_retry >= options_.first_retry,
                "dispatcher: max_retry must not be below first_retry");
  detail::check(options_.claim_for.count() > 0, "dispatcher: claim_for must be positive");
  detail::check(!options_.deliver_margin || (options_.deliver_margin->count() >= 0 &&
                                             *options_.deliver_margin < options_.claim_for),
                "dispatcher: deliver_margin must not be negative and must be shorter than "
                "claim_for");
  detail::check(options_.batch > 0, "dispatcher: batch must be at least 1");
  detail::check(!options_.keep_delivered || options_.keep_delivered->count() >= 0,
                "dispatcher: keep_delivered must not be negative");
}

DispatchReport Dispatcher::run_once() {
  detail::CoordinatorCore& core = detail::CoordinatorAccess::core(coordinator_);
  StepStore& store = steps_of(*core.store);
  DispatchReport report;
  // Only messages due when the run began: those enqueued (or failed) meanwhile wait for the
  // next run, so a steady inflow cannot keep this one (and a stop() waiting for it) going.
  const TimePoint began = core.now();
  const std::chrono::milliseconds margin = options_.deliver_margin.value_or(
      std::min<std::chrono::milliseconds>(std::chrono::seconds(1), options_.claim_for / 4));
  // What a batch delivered is marked in one transaction: when the batch ends, and before a
  // failure is recorded or the rest given back (so no mark waits behind a store error). A
  // dispatcher that dies before then leaves those messages claimed, and they are delivered
  // again once the claim ends, as one that died mid-delivery would. How many of them were
  // still pending (the count outbox_delivered returns) does not matter here: a message another
  // dispatcher delivered and marked after our claim ended was delivered by us too.
  std::vector<std::string> delivered;
  const auto mark_delivered = [&] {
    if (delivered.empty()) return;
    store.outbox_delivered(delivered, core.now());
    report.delivered += delivered.size();
    detail::bump(core.counters.outbox_delivered, delivered.size());
    delivered.clear();
  };
  for (;;) {
    const TimePoint claimed_until = core.now() + options_.claim_for;
    const std::vector<OutboxMessage> batch =
        store.claim_outbox(began, claimed_until, options_.batch);
    for (std::size_t next = 0; next < batch.size(); ++next) {
      const OutboxMessage& m = batch[next];
      // The claim is what keeps other dispatchers off these messages: past its margin, the
      // rest goes back (due again at claimed_until) and nothing more is delivered in this run.
      if (core.now() + margin >= claimed_until) {
        mark_delivered();
        report.given_back = batch.size() - next;
        detail::bump(core.counters.outbox_given_back, report.given_back);
        core.log(LogLevel::warning, "outbox_claim_lapsed", "-", m.topic, 0,
                 fmt::format("{} claimed message(s) given back undelivered, from {}: the claim "
                             "had less than {} ms left",
                             report.given_back, m.id, margin.count()));
        return report;
      }
      std::string failure;
      try {
        delivery_(m);
      } catch (const std::exception& e) {
        failure = e.what();
      } catch (...) {
        failure = "unknown error";
      }
      if (failure.empty()) {
        delivered.push_back(m.id);
        continue;
      }
      mark_delivered();
      const int attempts = m.attempts + 1;
      const bool park = attempts >= options_.max_attempts;
      auto backoff = options_.first_retry;
      for (int i = 1; i < attempts && backoff < options_.max_retry; ++i) backoff *= 2;
      backoff = std::min(backoff, options_.max_retry);
      store.outbox_failed(m.id, core.now() + (park ? std::chrono::milliseconds(0) : backoff), park,
                          failure);
      if (park) {
        ++report.parked;
        detail::bump(core.counters.outbox_parked);
        core.log(LogLevel::error, "outbox_parked", "-", m.topic, 0,
                 fmt::format("message {} parked after {} attempts: {}", m.id, attempts, failure));
      } else {
        ++report.retried;
        detail::bump(core.counters.outbox_retried);
        core.log(LogLevel::warning, "outbox_retry", "-", m.topic, 0,
                 fmt::format("message {} not delivered (attempt {}), retry in {} ms: {}", m.id,
                             attempts, backoff.count(), failure));
      }
    }
    mark_delivered();
    if (batch.size() < options_.batch) return report;
  }
}

std::size_t Dispatcher::purge() {
  detail::CoordinatorCore& core = detail::CoordinatorAccess::core(coordinator_);
  const std::chrono::milliseconds keep =
      std::min(options_.keep_delivered.value_or(core.options.ttl), core.options.ttl);
  std::size_t total = 0;
  for (;;) {
    const std::size_t n = steps_of(*core.store).purge_outbox(core.now() - keep, options_.batch);
    total += n;
    if (n < options_.batch) return total;
  }
}

}  // namespace idem
