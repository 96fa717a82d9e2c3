#include "flow.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "core.hpp"
#include "idem/test_control.hpp"

namespace idem::detail {
namespace {

bool corrupt(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const CorruptRecordError&) {
    return true;
  } catch (...) {
    return false;
  }
}

std::string describe(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

Loaded read_record(Store& store, const KeyId& id) noexcept {
  Loaded out;
  try {
    out.record = store.load(id);
  } catch (const StoreError&) {  // CorruptRecordError included
    out.error = std::current_exception();
  }
  return out;
}

Transferred transfer(PayloadStore& store, const PayloadOp& op) noexcept {
  Transferred out;
  try {
    out.data = op.put ? store.put(*op.id, *op.data) : store.get(*op.data);
  } catch (...) {
    out.error = std::current_exception();
  }
  return out;
}

Flow::Flow(CoordinatorCore& core, const Request& request, WaiterFactory make_waiter, bool steps)
    : core_(core),
      call_(core.prepare(request, steps)),
      make_waiter_(std::move(make_waiter)),
      give_up_(core.now() +
               std::min(core.options.max_wait, request.max_wait.value_or(core.options.max_wait))),
      poll_(core.options.poll_initial) {}

Flow::~Flow() {
  unsubscribe();
  done_holding();  // a driver that stopped mid-way (a destroyed coroutine) still wakes waiters
  Latency& latency = core_.latency;
  latency.call(ended_).observe_since(started_);
  if (waited_) latency.wait.observe_since(wait_started_);
}

Effect Flow::next() {
  switch (phase_) {
    case Phase::start:
      if (!call_.has_key) return on({Found::Kind::no_key}, nullptr, core_.now());
      // InFlight::run never reserves: it must read. Otherwise reserve at once unless
      // duplicates are common lately (read_first.hpp); both ways decide the same.
      if (call_.policy == InFlight::run || core_.read_first.now()) return read();
      return act(Decision::reserve, nullptr, core_.now());
    case Phase::read:
      return after_read();
    case Phase::reserve:
      return after_reserve();
    case Phase::ran:
      return after_ran();
    case Phase::failed:
      if (mode_ != Mode::reserved) std::rethrow_exception(failure_);
      if (core_.store->remote() && (store_failed_ || store_failure(failure_))) defer_release();
      {
        // A record with progress (a multi-step operation) is kept for its retry until the TTL.
        const TimePoint t = core_.now();
        op_ = StoreOp{.kind = StoreOp::Kind::release,
                      .id = &call_.id,
                      .now = t,
                      .expires_at = t + call_.ttl,
                      .token = token_};
      }
      return write(Phase::release);
    case Phase::complete:
      return after_complete();
    case Phase::store:
      return after_store();
    case Phase::release:
      return after_release();
    case Phase::free:
      return after_free();
    case Phase::late:
      return after_late();
    case Phase::put:
      return after_put();
    case Phase::fetch:
      return after_fetch();
    case Phase::sleep:
      unsubscribe();  // a wake may already have dropped us; subscribing again follows a read
      return read();
    case Phase::run:
      break;
  }
  throw std::logic_error("idem: Flow::next() while the action runs");
}

// --- what the store said -----------------------------------------------------------------

Effect Flow::after_read() {
  const TimePoint t = core_.now();
  const std::int64_t confirming = std::exchange(confirming_, 0);
  if (loaded_.error && corrupt(loaded_.error)) refuse_corrupt(loaded_.error);
  if (loaded_.error) {
    if (confirming != 0) {
      // Whether the reservation committed is unknown: it may hold the key for a whole lease
      // with nobody to run it. Whoever of this coordinator meets it next releases it.
      core_.lost.add(confirming, call_.id);
      log(LogLevel::warning, "reservation_unknown",
          fmt::format("the reservation failed and a look to see whether it committed failed too "
                      "({}); this coordinator releases it when it finds it",
                      describe(loaded_.error)));
      return on({Found::Kind::store_failed}, nullptr, t);  // store_error_: the write's
    }
    if (holder_ != 0) {
      // A look while waiting failed: keep waiting for the holder already seen.
      bump(core_.counters.store_errors);
      log(LogLevel::warning, "wait_poll_failed", describe(loaded_.error));
      if (t >= give_up_) return act(Decision::in_progress, nullptr, t);
      return sleep(t, /*after_failed_look=*/true);
    }
    store_error_ = loaded_.error;
    return on({Found::Kind::store_failed}, nullptr, t);
  }
  if (loaded_.record && loaded_.record->live_at(t)) {
    Record& r = *loaded_.record;
    if (confirming != 0 && r.state == State::in_progress && r.claim == confirming) {
      // The reservation committed; only its reply was lost. The call owns the key.
      log(LogLevel::warning, "reservation_confirmed",
          "the reservation's reply was lost; a look found it committed", r.token);
      op_.reservation = Reservation{Reservation::Kind::reserved, r.token, {}};
      return act(Decision::run_reserved, nullptr, t);
    }
    if (lost_here(r)) return free_lost(r, t);
    return on({Found::Kind::live, &r}, &r, t);
  }
  return on({Found::Kind::nothing_live}, nullptr, t);
}

bool Flow::lost_here(const Record& r) {
  return call_.policy != InFlight::run && r.state == State::in_progress && r.claim != 0 &&
         !core_.lost.empty() && core_.lost.take(r.claim);
}

Effect Flow::free_lost(const Record& r, TimePoint now) {
  log(LogLevel::warning, "released_lost",
      "the key is held by a reservation of this coordinator that nobody runs any more (its "
      "reply was lost, or its call ended when the store failed), so it is released",
      r.token);
  op_ = StoreOp{.kind = StoreOp::Kind::release,
                .id = &call_.id,
                .now = now,
                .expires_at = now + call_.ttl,
                .token = r.token};
  return write(Phase::free);
}

Effect Flow::after_free() {
  if (op_.error) {
    store_error_ = op_.error;
    return on({Found::Kind::store_failed}, nullptr, core_.now());
  }
  if (op_.applied) bump(core_.counters.released);
  // Released, or taken by another call meanwhile (the reservation finds out which).
  return act(Decision::reserve, nullptr, core_.now());
}

Effect Flow::after_reserve() {
  const TimePoint t = core_.now();
  if (op_.contended) core_.read_first.contended();
  reserved_until_ = op_.lease_until;  // counted from when the write went to the store
  Reservation& r = op_.reservation;
  Found found{Found::Kind::owned};
  Record* existing = nullptr;
  if (op_.error) {
    if (corrupt(op_.error)) refuse_corrupt(op_.error);
    store_error_ = op_.error;
    if (!std::exchange(confirmed_once_, true)) {
      // The write failed, and it may have committed all the same (a reply lost on its way
      // back): a look tells whether the record holds this call's claim.
      confirming_ = op_.claim;
      return read();
    }
    found = Found{Found::Kind::store_failed};
  } else if (r.kind == Reservation::Kind::existing) {
    existing = &*r.existing;
    if (lost_here(*existing)) return free_lost(*existing, t);
    found = Found{Found::Kind::live, existing};
  }
  return on(found, existing, t);
}

Effect Flow::on(const Found& found, Record* record, TimePoint now) {
  return act(decide(found, call_, core_.options.on_store_failure, now, give_up_), record, now);
}

// --- the decision, performed ---------------------------------------------------------------

Effect Flow::act(Decision d, Record* record, TimePoint now) {
  switch (d) {
    case Decision::reserve:
      op_ = StoreOp{.kind = StoreOp::Kind::reserve,
                    .id = &call_.id,
                    .fingerprint = &call_.fingerprint,
                    .now = now,
                    .lease_until = now + core_.options.lease,
                    .claim = core_.new_claim()};
      reserved_until_ = op_.lease_until;
      return write(Phase::reserve);

    case Decision::run_reserved: {
      const Reservation& r = op_.reservation;
      const bool takeover = r.kind == Reservation::Kind::taken_over;
      if (!std::exchange(looked_, true)) core_.read_first.fresh();
      token_ = r.token;
      claim_ = op_.claim;
      if (!call_.steps && now + call_.margin >= reserved_until_ &&
          !test_control::enabled(test_control::Mutation::skip_lease_check)) {
        // The reservation came back with less than the call margin of its lease left (a reply
        // that was slow, an owner that was paused): the store may let another call take the key
        // over while the action runs. The action is not run; the key is released.
        return refuse_late(now);
      }
      bump(takeover ? core_.counters.taken_over : core_.counters.reserved);
      bump(core_.counters.executed);
      log(takeover ? LogLevel::warning : LogLevel::debug, takeover ? "taken_over" : "reserved",
          takeover ? "took over a reservation whose lease had expired" : "");
      unsubscribe();
      holder_ = 0;
      core_.inflight.hold(call_.id, token_);
      holding_ = true;
      return run(Mode::reserved);
    }

    case Decision::run_unreserved:
      bump(core_.counters.executed);
      log(LogLevel::info, "cache_miss",
          "InFlight::run: no stored result, running without a reservation");
      return run(Mode::unreserved);

    case Decision::run_unprotected:
      bump(core_.counters.ran_unprotected);
      if (!call_.has_key) {
        log(LogLevel::warning, "ran_unprotected", "request without an idempotency key");
      } else {
        bump(core_.counters.store_errors);
        log(LogLevel::error, "store_unavailable",
            fmt::format("{}; fail_open: running the action unprotected", describe(store_error_)));
      }
      return run(Mode::unprotected);

    case Decision::replay: {
      if (!std::exchange(looked_, true)) core_.read_first.found();
      bump(core_.counters.replayed);
      log(LogLevel::debug, "replayed", "", record->token);
      return replay(std::move(*record), Outcome::Source::replayed);
    }

    case Decision::wait:
      if (!std::exchange(looked_, true)) core_.read_first.found();
      return wait_for(*record, now);

    case Decision::key_reuse:
      if (!std::exchange(looked_, true)) core_.read_first.found();
      bump(core_.counters.key_reuse);
      ended_ = CallEnd::reuse;
      log(LogLevel::info, "key_reuse", "same key, different fingerprint", record->token);
      throw KeyReuseError(record->fingerprint.hex(), call_.fingerprint.hex());

    case Decision::in_progress: {
      if (!std::exchange(looked_, true)) core_.read_first.found();
      const TimePoint lease_end = record != nullptr ? record->lease_until : holder_lease_;
      bump(core_.counters.in_progress_conflicts);
      ended_ = CallEnd::conflict;
      log(LogLevel::info, "in_progress",
          call_.policy == InFlight::raise ? "another request holds the key" : "gave up waiting",
          record != nullptr ? record->token : holder_);
      throw InProgressError(lease_end - now);
    }

    case Decision::store_unavailable: {
      bump(core_.counters.store_errors);
      log(LogLevel::error, "store_unavailable", describe(store_error_));
      std::rethrow_exception(store_error_);
    }
  }
  throw std::logic_error("idem: unknown decision");
}

Effect Flow::wait_for(const Record& holder, TimePoint now) {
  if (!std::exchange(waited_, true)) {
    bump(core_.counters.waited);
    wait_started_ = std::chrono::steady_clock::now();
    log(LogLevel::debug, "waiting", "another request holds the key; waiting for its outcome",
        holder.token);
  }
  holder_lease_ = holder.lease_until;  // a heartbeat may have moved it
  if (subscribed_ && holder_ == holder.token) return sleep(now);
  // Subscribe, then look once more: a completion between the read and the subscription
  // would otherwise go unseen until the next poll or the lease's end.
  unsubscribe();
  holder_ = holder.token;
  if (!waiter_) waiter_ = make_waiter_();
  holder_local_ = core_.inflight.subscribe(call_.id, holder_, waiter_);
  subscribed_ = true;
  return read();
}

Effect Flow::sleep(TimePoint now, bool after_failed_look) {
  // After a failed look the lease seen last says nothing (the holder may be renewing it, or
  // the store may be down for everyone): look again after a poll interval, never at once.
  TimePoint wake = after_failed_look ? give_up_ : std::min(give_up_, holder_lease_);
  if (!holder_local_ || after_failed_look) {  // poll with growing backoff
    wake = std::min(wake, now + poll_);
    poll_ = std::min(poll_ * 2, core_.options.poll_max);
  }
  if (wake <= now) {
    unsubscribe();
    return read();
  }
  if (!subscribed_) {  // after a failed look, a wake was lost with the subscription
    holder_local_ = core_.inflight.subscribe(call_.id, holder_, waiter_);
    subscribed_ = true;
  }
  phase_ = Phase::sleep;
  return Effect{Effect::Kind::sleep, wake};
}

// --- after the action ----------------------------------------------------------------------

void Flow::ran(Response response) {
  response_ = std::move(response);
  phase_ = Phase::ran;
}

void Flow::failed(std::exception_ptr error) {
  failure_ = std::move(error);
  phase_ = Phase::failed;
}

Effect Flow::after_ran() {
  if (mode_ == Mode::unprotected)
    return answer(std::move(response_), Outcome::Source::unprotected, {});
  const std::size_t limit = core_.options.inline_body_limit;
  if (limit != 0 && response_.body.size() > limit) {
    payload_ = PayloadOp{.put = true, .id = &call_.id, .data = &response_.body};
    phase_ = Phase::put;
    return Effect{Effect::Kind::payload};
  }
  stored_ = StoredResponse{response_, ""};
  return store_response();
}

Effect Flow::after_put() {
  if (transferred_.error) {
    done_holding();
    return unstored(fmt::format("payload store: {}", describe(transferred_.error)));
  }
  stored_ =
      StoredResponse{Response{.status = response_.status, .body = {}, .headers = response_.headers},
                     std::move(transferred_.data)};
  return store_response();
}

Effect Flow::store_response() {
  const TimePoint t = core_.now();
  op_ = StoreOp{.id = &call_.id,
                .fingerprint = &call_.fingerprint,
                .now = t,
                .expires_at = t + call_.ttl,
                .token = token_,
                .response = &stored_};
  if (mode_ == Mode::unreserved) {
    op_.kind = StoreOp::Kind::store_if_absent;
    return write(Phase::store);
  }
  op_.kind = StoreOp::Kind::complete;
  return write(Phase::complete);
}

Effect Flow::after_complete() {
  done_holding();
  if (op_.contended) core_.read_first.contended();
  if (op_.error) return unstored(describe(op_.error));
  if (!op_.applied) {
    bump(core_.counters.lease_lost);
    log(LogLevel::error, "lease_lost", "complete refused: the lease was taken over");
    throw LeaseLostError(token_);
  }
  bump(core_.counters.completed);
  log(LogLevel::debug, "completed", "");
  return answer(std::move(response_), Outcome::Source::executed, op_.expires_at);
}

Effect Flow::after_store() {
  // InFlight::run: stored if nobody had; else answer like the winner (the action ran twice).
  if (op_.error) return unstored(describe(op_.error));
  Reservation& r = op_.reservation;
  if (r.kind == Reservation::Kind::existing && r.existing->state == State::completed &&
      r.existing->fingerprint == call_.fingerprint) {
    log(LogLevel::warning, "store_race_lost",
        "InFlight::run: another request stored first; answering with its result");
    return replay(std::move(*r.existing), Outcome::Source::executed);
  }
  if (r.kind == Reservation::Kind::existing) {
    // Another request's record holds the key (in progress, or stored with another payload):
    // this response was not stored, and the Outcome must not say it was.
    log(LogLevel::warning, "store_race_lost",
        "InFlight::run: another record holds the key; this response is not stored");
    return answer(std::move(response_), Outcome::Source::executed, {});
  }
  bump(core_.counters.completed);
  log(LogLevel::debug, "completed", "");
  return answer(std::move(response_), Outcome::Source::executed, op_.expires_at);
}

Effect Flow::replay(Record&& record, Outcome::Source source) {
  if (record.body_ref.empty()) return answer(std::move(record.response), source, record.expires_at);
  response_ = std::move(record.response);
  body_ref_ = std::move(record.body_ref);
  fetched_for_ = source;
  fetched_expires_ = record.expires_at;
  payload_ = PayloadOp{.put = false, .data = &body_ref_};
  phase_ = Phase::fetch;
  return Effect{Effect::Kind::payload};
}

Effect Flow::after_fetch() {
  if (transferred_.error) std::rethrow_exception(transferred_.error);
  response_.body = std::move(transferred_.data);
  return answer(std::move(response_), fetched_for_, fetched_expires_);
}

Effect Flow::unstored(std::string_view why) {
  // The action ran; its result could not be stored. A reserved key stays reserved until the
  // lease ends (a derived key downstream keeps the retry single-charge).
  bump(core_.counters.store_errors);
  log(LogLevel::error, "complete_failed", why);
  return answer(std::move(response_), Outcome::Source::executed, {});
}

void Flow::refuse_corrupt(const std::exception_ptr& error) {
  bump(core_.counters.corrupt_records);
  log(LogLevel::error, "record_corrupt",
      fmt::format("{}: the call neither runs nor replays; the record is left for an operator",
                  describe(error)));
  std::rethrow_exception(error);
}

Effect Flow::refuse_late(TimePoint now) {
  bump(core_.counters.lease_lost);
  log(LogLevel::error, "lease_lost",
      fmt::format("the reservation came back with {} ms of its lease left, less than the call "
                  "margin ({} ms): the action is not run, and the key is released",
                  std::max<std::int64_t>(0, (reserved_until_ - now).count()),
                  call_.margin.count()));
  failure_ = std::make_exception_ptr(LeaseLostError(
      token_,
      "the reservation came back with too little of its lease left: the action was not "
      "run"));
  op_ = StoreOp{.kind = StoreOp::Kind::release,
                .id = &call_.id,
                .now = now,
                .expires_at = now + call_.ttl,
                .token = token_};
  return write(Phase::late);
}

Effect Flow::after_late() {
  if (op_.error) {
    // The key stays reserved until its lease ends; nothing ran.
    bump(core_.counters.store_errors);
    log(LogLevel::error, "release_failed", describe(op_.error));
  }
  std::rethrow_exception(failure_);
}

bool Flow::store_failure(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const StoreError&) {
    return true;
  } catch (const OutcomeUnknownError&) {
    return true;
  } catch (...) {
    return false;
  }
}

void Flow::defer_release() {
  // The store has just failed this call (on a remote store: a deadline, a lost connection).
  // Releasing now would most likely wait out a deadline of its own before the caller hears
  // anything, so the key is left to Coordinator::release_lost_reservations, which releases it
  // (progress kept) once the store answers, and to this coordinator's next call of the key;
  // at worst it ends with its lease.
  done_holding();
  core_.lost.add(claim_, call_.id);
  log(LogLevel::warning, "release_deferred",
      "the store failed: the key is released once it answers again (or when its lease ends)");
  std::rethrow_exception(failure_);
}

Effect Flow::after_release() {
  if (test_control::enabled(test_control::Mutation::release_without_wake)) {
    holding_ = false;
  } else {
    done_holding();
  }
  if (op_.error) {
    // The key stays reserved until its lease ends; the action's failure is the answer.
    bump(core_.counters.store_errors);
    log(LogLevel::error, "release_failed", describe(op_.error));
    std::rethrow_exception(failure_);
  }
  if (!op_.applied) {
    bump(core_.counters.lease_lost);
    log(LogLevel::error, "lease_lost", "release refused: the lease was taken over");
    // The action's own error rides along: std::rethrow_if_nested on the LeaseLostError.
    try {
      std::rethrow_exception(failure_);
    } catch (...) {
      std::throw_with_nested(LeaseLostError(token_));
    }
  }
  bump(core_.counters.released);
  ended_ = CallEnd::released;
  log(LogLevel::info, "released", "the action failed; the key is free for a retry");
  std::rethrow_exception(failure_);
}

// --- small steps -----------------------------------------------------------------------------

Effect Flow::read() {
  loaded_ = Loaded{};
  phase_ = Phase::read;
  return Effect{Effect::Kind::read};
}

Effect Flow::write(Phase phase) {
  phase_ = phase;
  return Effect{Effect::Kind::write};
}

Effect Flow::run(Mode mode) {
  mode_ = mode;
  phase_ = Phase::run;
  return Effect{.kind = Effect::Kind::run, .renew = mode == Mode::reserved};
}

Effect Flow::answer(Response response, Outcome::Source source, TimePoint expires_at) {
  switch (source) {
    case Outcome::Source::executed:
      ended_ = CallEnd::executed;
      break;
    case Outcome::Source::replayed:
      ended_ = CallEnd::replayed;
      break;
    case Outcome::Source::unprotected:
      ended_ = call_.has_key ? CallEnd::failed_open : CallEnd::no_key;
      break;
  }
  outcome_ = Outcome{std::move(response), source, expires_at};
  return Effect{Effect::Kind::answer};
}

void Flow::unsubscribe() {
  if (!subscribed_) return;
  core_.inflight.unsubscribe(call_.id, waiter_);
  subscribed_ = false;
}

void Flow::done_holding() {
  if (!std::exchange(holding_, false)) return;
  core_.inflight.finished(call_.id, token_);
}

void Flow::log(LogLevel level, std::string_view event, std::string_view message) const {
  log(level, event, message, token_ != 0 ? token_ : holder_);
}

void Flow::log(LogLevel level, std::string_view event, std::string_view message,
               std::int64_t token) const {
  core_.log(level, event, call_, token, message);
}

}  // namespace idem::detail
