#include "idem/coordinator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <utility>

#include "coordinator_impl.hpp"

namespace idem {
namespace {

using Kind = Coordinator::Impl::Step::Kind;

void check(bool ok, std::string_view what) {
  if (!ok) throw error(errc::invalid_argument, fmt::format("idem options: {}", what));
}

void validate_options(const Options& o, const Store* store) {
  using std::chrono::minutes;
  check(store != nullptr, "a store is required");
  auto check_ttl = [&](std::chrono::milliseconds ttl, std::string_view name) {
    check(ttl >= minutes(1), fmt::format("{} is {} ms; a TTL is at least one minute (60000 ms)",
                                         name, ttl.count()));
    check(o.lease < ttl, fmt::format("lease ({} ms) must be shorter than {} ({} ms)",
                                     o.lease.count(), name, ttl.count()));
  };
  check(o.lease.count() > 0, "lease must be positive");
  check_ttl(o.ttl, "ttl");
  for (const auto& [op, ttl] : o.ttl_by_operation) check_ttl(ttl, fmt::format("ttl for '{}'", op));
  check(o.heartbeat.count() >= 0, "heartbeat must not be negative");
  check(o.heartbeat.count() == 0 || o.heartbeat < o.lease,
        fmt::format("heartbeat ({} ms) must be shorter than the lease ({} ms), or 0 for none",
                    o.heartbeat.count(), o.lease.count()));
  check(o.max_wait.count() >= 0, "max_wait must not be negative");
  check(o.poll_initial.count() > 0, "poll_initial must be positive");
  check(o.poll_max >= o.poll_initial, "poll_max must not be below poll_initial");
  check(o.reap_after.count() >= 0, "reap_after must not be negative");
  check(o.inline_body_limit == 0 || o.payload_store != nullptr,
        "inline_body_limit needs a payload_store to keep larger bodies");
}

// Waits on a condition variable for a completion in this process or a clock deadline.
class BlockingWaiter final : public detail::Waiter,
                             public std::enable_shared_from_this<BlockingWaiter> {
 public:
  void wake() override {
    std::lock_guard lock(mutex_);
    woken_ = true;
    cv_.notify_all();
  }

  void wait_until(Clock& clock, TimePoint at) {
    const Clock::TimerId timer = clock.call_at(at, [weak = weak_from_this()] {
      if (auto self = weak.lock()) self->wake();
    });
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [this] { return woken_; });
    }
    clock.cancel(timer);
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool woken_ = false;  // guarded by mutex_
};

}  // namespace

// --- Impl: the decisions ---------------------------------------------------------------

Coordinator::Impl::Impl(std::shared_ptr<Store> s, Options o)
    : store(std::move(s)), options(std::move(o)), clock(options.clock) {
  validate_options(options, store.get());
  if (!clock) clock = std::make_shared<SystemClock>();
}

Coordinator::Impl::Call Coordinator::Impl::prepare(const Request& r) const {
  validate_key_part("tenant", r.tenant);
  validate_key_part("operation", r.operation);
  Call c;
  c.policy = r.in_flight.value_or(options.in_flight);
  if (!r.key) {
    if (options.missing_key == MissingKey::reject) throw InvalidKeyError("key", "is missing");
    c.has_key = false;
    return c;
  }
  validate_key_part("key", *r.key);
  c.id = KeyId{r.tenant, r.operation, *r.key};
  c.fingerprint = r.fingerprint;
  auto it = options.ttl_by_operation.find(r.operation);
  c.ttl = it != options.ttl_by_operation.end() ? it->second : options.ttl;
  return c;
}

std::optional<Coordinator::Impl::Step> Coordinator::Impl::look(const Call& c, TimePoint t,
                                                              TimePoint give_up) {
  if (!c.has_key) {
    bump(counters.ran_unprotected);
    log(LogLevel::warning, "ran_unprotected", c, 0, "request without an idempotency key");
    return Step(Kind::unprotected);
  }
  // A read first: a replay or a conflict needs no write transaction.
  std::optional<Record> found;
  try {
    found = store->load(c.id);
  } catch (const StoreError& e) {
    return on_store_failure(c, e);
  }
  if (found && found->live_at(t)) return on_live(c, std::move(*found), t, give_up);
  if (c.policy == InFlight::run) {
    // The result cache: nothing stored, so run. No reservation.
    bump(counters.executed);
    log(LogLevel::info, "cache_miss", c, 0, "InFlight::run: no stored result, running without a reservation");
    return Step(Kind::execute);
  }
  return std::nullopt;  // absent or dead: reserve
}

StoreOp Coordinator::Impl::reserve_op(const Call& c, TimePoint t) const {
  StoreOp op;
  op.kind = StoreOp::Kind::reserve;
  op.id = &c.id;
  op.fingerprint = &c.fingerprint;
  op.now = t;
  op.lease_until = t + options.lease;
  return op;
}

Coordinator::Impl::Step Coordinator::Impl::reserved(const Call& c, StoreOp& op, TimePoint t,
                                                     TimePoint give_up) {
  if (op.error) {
    try {
      std::rethrow_exception(op.error);
    } catch (const StoreError& e) {
      return on_store_failure(c, e);
    }
  }
  Reservation& r = op.reservation;
  if (r.kind == Reservation::Kind::existing) return on_live(c, std::move(*r.existing), t, give_up);
  const bool takeover = r.kind == Reservation::Kind::taken_over;
  bump(takeover ? counters.taken_over : counters.reserved);
  bump(counters.executed);
  log(takeover ? LogLevel::warning : LogLevel::debug, takeover ? "taken_over" : "reserved", c, r.token,
      takeover ? "took over a reservation whose lease had expired" : "");
  inflight.hold(c.id, r.token);
  Step s(Kind::execute);
  s.token = r.token;
  return s;
}

Coordinator::Impl::Step Coordinator::Impl::on_live(const Call& c, Record&& found, TimePoint t,
                                                    TimePoint give_up) {
  // A live record holds the key. The fingerprint is checked before anything else.
  if (found.fingerprint != c.fingerprint) {
    bump(counters.key_reuse);
    log(LogLevel::info, "key_reuse", c, found.token, "same key, different fingerprint");
    throw KeyReuseError(found.fingerprint.hex(), c.fingerprint.hex());
  }
  if (found.state == State::completed) {
    bump(counters.replayed);
    log(LogLevel::debug, "replayed", c, found.token, "");
    Step s(Kind::replay);
    s.replay.source = Outcome::Source::replayed;
    s.replay.expires_at = found.expires_at;
    s.replay.response = response_of(std::move(found));
    return s;
  }
  if (c.policy == InFlight::run) {  // someone else reserved it; the cache runs anyway
    bump(counters.executed);
    return Step(Kind::execute);
  }
  if (c.policy == InFlight::raise || t >= give_up) {
    bump(counters.in_progress_conflicts);
    log(LogLevel::info, "in_progress", c, found.token,
        c.policy == InFlight::raise ? "another request holds the key" : "gave up waiting");
    throw InProgressError(found.lease_until - t);
  }
  Step s(Kind::wait);
  s.lease_until = found.lease_until;
  s.holder = found.token;
  return s;
}

Coordinator::Impl::Step Coordinator::Impl::begin(const Call& c, TimePoint give_up) {
  const TimePoint t = now();
  if (std::optional<Step> decided = look(c, t, give_up)) return std::move(*decided);
  StoreOp op = reserve_op(c, t);
  StoreOp* one = &op;
  store->apply(std::span<StoreOp* const>(&one, 1));
  return reserved(c, op, t, give_up);
}

Coordinator::Impl::Step Coordinator::Impl::on_store_failure(const Call& c, const StoreError& e) {
  bump(counters.store_errors);
  if (options.on_store_failure == FailureMode::fail_closed) {
    log(LogLevel::error, "store_unavailable", c, 0, e.what());
    throw e;
  }
  bump(counters.ran_unprotected);
  log(LogLevel::error, "store_unavailable", c, 0,
      fmt::format("{}; fail_open: running the action unprotected", e.what()));
  return Step(Kind::unprotected);
}

StoredResponse Coordinator::Impl::stored_form(const Call& c, const Response& response) const {
  StoredResponse stored{response, ""};
  if (options.inline_body_limit != 0 && response.body.size() > options.inline_body_limit) {
    stored.body_ref = options.payload_store->put(c.id, response.body);
    stored.response.body.clear();
  }
  return stored;
}

Response Coordinator::Impl::response_of(Record&& record) const {
  Response r = std::move(record.response);
  if (!record.body_ref.empty()) r.body = options.payload_store->get(record.body_ref);
  return r;
}

bool Coordinator::Impl::prepare_completion(const Call& c, std::int64_t token, const Response& response,
                                           Completion& out) {
  out.t = now();
  try {
    out.stored = stored_form(c, response);
  } catch (const std::exception& e) {
    bump(counters.store_errors);
    log(LogLevel::error, "complete_failed", c, token, fmt::format("payload store: {}", e.what()));
    inflight.finished(c.id, token);
    return false;
  }
  out.op.kind = StoreOp::Kind::complete;
  out.op.id = &c.id;
  out.op.token = token;
  out.op.response = &out.stored;
  out.op.expires_at = out.t + c.ttl;
  return true;
}

Outcome Coordinator::Impl::completed(const Call& c, std::int64_t token, Completion& done, Response response) {
  inflight.finished(c.id, token);
  if (done.op.error) {
    // The action ran; its result could not be stored. The key stays reserved until the
    // lease ends (a derived key downstream keeps the retry single-charge).
    bump(counters.store_errors);
    try {
      std::rethrow_exception(done.op.error);
    } catch (const std::exception& e) {
      log(LogLevel::error, "complete_failed", c, token, e.what());
    }
    return Outcome{std::move(response), Outcome::Source::executed};
  }
  if (!done.op.applied) {
    bump(counters.lease_lost);
    log(LogLevel::error, "lease_lost", c, token, "complete refused: the lease was taken over");
    throw LeaseLostError(token);
  }
  bump(counters.completed);
  log(LogLevel::debug, "completed", c, token, "");
  return Outcome{std::move(response), Outcome::Source::executed, done.op.expires_at};
}

Outcome Coordinator::Impl::finish(const Call& c, std::int64_t token, Response response) {
  if (token == 0) return finish_unreserved(c, std::move(response));
  Completion done;
  if (!prepare_completion(c, token, response, done)) return Outcome{std::move(response), Outcome::Source::executed};
  StoreOp* one = &done.op;
  store->apply(std::span<StoreOp* const>(&one, 1));
  return completed(c, token, done, std::move(response));
}

Outcome Coordinator::Impl::finish_unreserved(const Call& c, Response response) {
  // InFlight::run: store if nobody did, else answer with the winner's.
  const TimePoint t = now();
  std::optional<Record> winner;
  try {
    winner = store->store_if_absent(c.id, c.fingerprint, stored_form(c, response), t, t + c.ttl);
  } catch (const std::exception& e) {
    bump(counters.store_errors);
    log(LogLevel::error, "complete_failed", c, 0, e.what());
    return Outcome{std::move(response), Outcome::Source::executed};
  }
  if (winner && winner->state == State::completed && winner->fingerprint == c.fingerprint) {
    // Lost the race to store: answer like the winner (the action ran twice).
    log(LogLevel::warning, "store_race_lost", c, 0,
        "InFlight::run: another request stored first; answering with its result");
    const TimePoint expires_at = winner->expires_at;
    return Outcome{response_of(std::move(*winner)), Outcome::Source::executed, expires_at};
  }
  if (!winner) bump(counters.completed);
  log(LogLevel::debug, "completed", c, 0, "");
  return Outcome{std::move(response), Outcome::Source::executed, t + c.ttl};
}

void Coordinator::Impl::abandon(const Call& c, std::int64_t token) noexcept {
  if (token == 0) return;  // InFlight::run reserved nothing
  try {
    if (store->release(c.id, token, now())) {
      bump(counters.released);
      log(LogLevel::info, "released", c, token, "the action failed; the key is free for a retry");
    } else {
      bump(counters.lease_lost);
      log(LogLevel::error, "lease_lost", c, token, "release refused: the lease was taken over");
    }
  } catch (const std::exception& e) {
    bump(counters.store_errors);
    log(LogLevel::error, "release_failed", c, token, e.what());
  }
  inflight.finished(c.id, token);
}

std::optional<TimePoint> Coordinator::Impl::plan_wait(const Call& c, const Step& s,
                                                      TimePoint give_up,
                                                      std::chrono::milliseconds& poll,
                                                      const std::shared_ptr<detail::Waiter>& waiter) {
  const bool local = inflight.subscribe(c.id, s.holder, waiter);
  TimePoint lease_until = s.lease_until;
  // The holder may have finished between begin() and subscribe(): look once more, now that
  // a completion in this process is sure to wake us.
  try {
    const std::optional<Record> r = store->load(c.id);
    if (!r || r->token != s.holder || r->state != State::in_progress || !r->live_at(now())) {
      inflight.unsubscribe(c.id, waiter);
      return std::nullopt;
    }
    lease_until = r->lease_until;  // a heartbeat may have moved it
  } catch (const StoreError& e) {
    bump(counters.store_errors);
    log(LogLevel::warning, "wait_poll_failed", c, s.holder, e.what());
  }
  TimePoint wake = std::min(give_up, lease_until);
  if (!local) {  // the holder is in another process: poll with growing backoff
    wake = std::min(wake, now() + poll);
    poll = std::min(poll * 2, options.poll_max);
  }
  return wake;
}

void Coordinator::Impl::log(LogLevel level, std::string_view event, const Call& c,
                            std::int64_t token, std::string_view message) const {
  if (!options.log) return;
  const std::string hash = c.has_key ? short_hash(c.id) : std::string("-");
  log_event(level, event, hash, c.id.operation, token, message);
}

void Coordinator::Impl::log_event(LogLevel level, std::string_view event, std::string_view key_hash,
                                  std::string_view operation, std::int64_t token,
                                  std::string_view message) const {
  if (!options.log) return;
  LogEvent e;
  e.at = now();
  e.level = level;
  e.event = event;
  e.key_hash = key_hash;
  e.operation = operation;
  e.token = token;
  e.message = message;
  options.log(e);
}

bool Coordinator::Impl::queue_write(StoreOp& op, std::function<void()> done) {
  std::lock_guard lock(writes_mutex);
  writes.push_back(PendingWrite{&op, std::move(done)});
  return !std::exchange(flush_scheduled, true);
}

void Coordinator::Impl::flush_writes() {
  std::vector<PendingWrite> batch;
  {
    std::lock_guard lock(writes_mutex);
    batch.swap(writes);
    flush_scheduled = false;
  }
  std::vector<StoreOp*> ops;
  ops.reserve(batch.size());
  for (const PendingWrite& w : batch) ops.push_back(w.op);
  store->apply(ops);
  for (PendingWrite& w : batch) w.done();
}

// --- Heartbeat ---------------------------------------------------------------------------

struct Heartbeat::State : std::enable_shared_from_this<State> {
  Coordinator::Impl& impl;
  Coordinator::Impl::Call call;
  std::int64_t token;
  std::mutex mutex;
  bool stopped = false;      // guarded by mutex
  Clock::TimerId timer = 0;  // guarded by mutex

  State(Coordinator::Impl& i, const Coordinator::Impl::Call& c, std::int64_t t)
      : impl(i), call(c), token(t) {}

  void arm() {  // requires mutex
    timer = impl.clock->call_at(impl.now() + impl.options.heartbeat, [weak = weak_from_this()] {
      if (auto self = weak.lock()) self->tick();
    });
  }

  void tick() {
    std::lock_guard lock(mutex);
    if (stopped) return;
    try {
      if (!impl.store->renew(call.id, token, impl.now() + impl.options.lease)) {
        bump(impl.counters.lease_lost);
        impl.log(LogLevel::error, "lease_lost", call, token, "renewal refused: the lease was taken over");
        stopped = true;
        return;
      }
    } catch (const StoreError& e) {
      bump(impl.counters.store_errors);
      impl.log(LogLevel::warning, "renew_failed", call, token, e.what());
    }
    arm();
  }
};

Heartbeat::Heartbeat(Coordinator::Impl& impl, const Coordinator::Impl::Call& call, std::int64_t token) {
  if (token == 0 || impl.options.heartbeat.count() == 0) return;
  state_ = std::make_shared<State>(impl, call, token);
  std::lock_guard lock(state_->mutex);
  state_->arm();
}

Heartbeat::~Heartbeat() {
  if (!state_) return;
  std::lock_guard lock(state_->mutex);
  state_->stopped = true;
  state_->impl.clock->cancel(state_->timer);
}

// --- Coordinator: the blocking front end -------------------------------------------------

Coordinator::Coordinator(std::shared_ptr<Store> store, Options options)
    : impl_(std::make_unique<Impl>(std::move(store), std::move(options))) {}

Coordinator::~Coordinator() = default;

Outcome Coordinator::call(const Request& request, const std::function<Response()>& action) {
  Impl& d = *impl_;
  const Impl::Call c = d.prepare(request);
  const TimePoint give_up = d.now() + d.options.max_wait;
  std::chrono::milliseconds poll = d.options.poll_initial;
  bool waited = false;
  for (;;) {
    Impl::Step s = d.begin(c, give_up);
    switch (s.kind) {
      case Kind::replay:
        return std::move(s.replay);
      case Kind::unprotected:
        return Outcome{action(), Outcome::Source::unprotected};
      case Kind::execute: {
        Response response;
        {
          Heartbeat heartbeat(d, c, s.token);
          try {
            response = action();
          } catch (...) {
            d.abandon(c, s.token);
            throw;
          }
        }
        return d.finish(c, s.token, std::move(response));
      }
      case Kind::wait:
        break;
    }
    if (!std::exchange(waited, true)) {
      bump(d.counters.waited);
      d.log(LogLevel::debug, "waiting", c, s.holder, "another request holds the key; waiting for its outcome");
    }
    auto waiter = std::make_shared<BlockingWaiter>();
    const std::optional<TimePoint> wake = d.plan_wait(c, s, give_up, poll, waiter);
    if (!wake) continue;
    if (*wake > d.now()) waiter->wait_until(*d.clock, *wake);
    d.inflight.unsubscribe(c.id, waiter);
  }
}

std::size_t Coordinator::purge_expired(std::size_t batch) {
  Impl& d = *impl_;
  std::size_t total = 0;
  for (;;) {
    const std::size_t n = d.store->purge_expired(d.now(), batch);
    total += n;
    d.counters.purged.fetch_add(n, std::memory_order_relaxed);
    if (n < batch) return total;
  }
}

std::vector<ReapedRecord> Coordinator::reap(std::size_t batch) {
  Impl& d = *impl_;
  std::vector<ReapedRecord> all;
  for (;;) {
    std::vector<ReapedRecord> got = d.store->reap(d.now() - d.options.reap_after, batch);
    for (const ReapedRecord& r : got) {
      bump(d.counters.reaped);
      d.log_event(LogLevel::warning, "reaped", r.key_hash, r.operation, r.token,
                  "cleared a reservation whose lease ended long ago");
    }
    const std::size_t n = got.size();
    all.insert(all.end(), std::make_move_iterator(got.begin()), std::make_move_iterator(got.end()));
    if (n < batch) return all;
  }
}

std::chrono::milliseconds Coordinator::ttl_for(std::string_view operation) const {
  auto it = impl_->options.ttl_by_operation.find(operation);
  return it != impl_->options.ttl_by_operation.end() ? it->second : impl_->options.ttl;
}

MetricsSnapshot Coordinator::metrics() const {
  const Impl::Counters& c = impl_->counters;
  auto get = [](const std::atomic<std::uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  MetricsSnapshot m;
  m.reserved = get(c.reserved);
  m.taken_over = get(c.taken_over);
  m.executed = get(c.executed);
  m.completed = get(c.completed);
  m.replayed = get(c.replayed);
  m.waited = get(c.waited);
  m.in_progress_conflicts = get(c.in_progress_conflicts);
  m.key_reuse = get(c.key_reuse);
  m.released = get(c.released);
  m.lease_lost = get(c.lease_lost);
  m.store_errors = get(c.store_errors);
  m.ran_unprotected = get(c.ran_unprotected);
  m.purged = get(c.purged);
  m.reaped = get(c.reaped);
  return m;
}

const Options& Coordinator::options() const noexcept { return impl_->options; }
Clock& Coordinator::clock() const noexcept { return *impl_->clock; }
Store& Coordinator::store() const noexcept { return *impl_->store; }

std::string_view to_string(InFlight policy) noexcept {
  switch (policy) {
    case InFlight::run: return "run";
    case InFlight::wait: return "wait";
    case InFlight::raise: return "raise";
  }
  return "wait";
}

}  // namespace idem
