#include "idem/coordinator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <random>
#include <utility>

#include "attempt.hpp"
#include "core.hpp"
#include "drive.hpp"
#include "idem/test_control.hpp"

namespace idem {
namespace detail {

void check(bool ok, std::string_view what) {
  if (!ok) throw error(errc::invalid_argument, fmt::format("idem: {}", what));
}

namespace {

// Throws invalid_argument "idem: options: <what>" unless `ok`. The message is formatted only
// when it is thrown: a service makes a coordinator per process and per restart, and a
// simulator many thousands of them.
template <typename... Args>
void check_option(bool ok, fmt::format_string<Args...> what, Args&&... args) {
  if (!ok) check(false, fmt::format("options: {}", fmt::format(what, std::forward<Args>(args)...)));
}

std::shared_ptr<Store> checked(std::shared_ptr<Store> store, const Options& o) {
  using std::chrono::minutes;
  check_option(store != nullptr, "a store is required");
  auto check_ttl = [&](std::chrono::milliseconds ttl, std::string_view name, std::string_view op) {
    check_option(ttl >= minutes(1), "{}{} is {} ms; a TTL is at least one minute (60000 ms)", name,
                 op, ttl.count());
    check_option(o.lease < ttl, "lease ({} ms) must be shorter than {}{} ({} ms)", o.lease.count(),
                 name, op, ttl.count());
  };
  check_option(o.lease.count() > 0, "lease must be positive");
  check_ttl(o.ttl, "ttl", "");
  for (const auto& [op, ttl] : o.ttl_by_operation)
    check_ttl(ttl, "ttl for ", fmt::format("'{}'", op));
  check_option(o.heartbeat.count() >= 0, "heartbeat must not be negative");
  check_option(o.heartbeat.count() == 0 || o.heartbeat < o.lease,
               "heartbeat ({} ms) must be shorter than the lease ({} ms), or 0 for none",
               o.heartbeat.count(), o.lease.count());
  auto check_margin = [&](std::chrono::milliseconds m, std::string_view name, std::string_view op) {
    check_option(m.count() >= 0 && m < o.lease,
                 "{}{} ({} ms) must be at least 0 and shorter than the lease ({} ms)", name, op,
                 m.count(), o.lease.count());
  };
  if (o.call_margin) check_margin(*o.call_margin, "call_margin", "");
  for (const auto& [op, m] : o.call_margin_by_operation)
    check_margin(m, "call_margin for ", fmt::format("'{}'", op));
  check_option(o.max_wait.count() >= 0, "max_wait must not be negative");
  check_option(o.poll_initial.count() > 0, "poll_initial must be positive");
  check_option(o.poll_max >= o.poll_initial, "poll_max must not be below poll_initial");
  check_option(o.reap_after.count() >= 0, "reap_after must not be negative");
  check_option(o.inline_body_limit == 0 || o.payload_store != nullptr,
               "inline_body_limit needs a payload_store to keep larger bodies");
  return store;
}

}  // namespace

// --- CoordinatorCore ---------------------------------------------------------------------

CoordinatorCore::CoordinatorCore(std::shared_ptr<Store> s, Options o)
    : store(checked(std::move(s), o)),
      options(std::move(o)),
      clock(options.clock ? options.clock : std::make_shared<SystemClock>()),
      changes(*store, inflight),
      commits(*store, clock.get(), &latency),
      claims_(std::random_device{}() * 0x100000001ULL + std::random_device{}()) {}

std::int64_t CoordinatorCore::new_claim() {
  for (;;) {
    const auto claim = static_cast<std::int64_t>(claims_.fetch_add(1, std::memory_order_relaxed));
    if (claim != 0) return claim;
  }
}

void LostReservations::add(std::int64_t claim, const KeyId& id) {
  std::lock_guard lock(mutex_);
  if (lost_.size() == kMax) lost_.pop_front();
  lost_.emplace_back(claim, id);
}

bool LostReservations::take(std::int64_t claim) {
  std::lock_guard lock(mutex_);
  const auto it = std::find_if(lost_.begin(), lost_.end(),
                               [claim](const auto& entry) { return entry.first == claim; });
  if (it == lost_.end()) return false;
  lost_.erase(it);
  return true;
}

std::vector<std::pair<std::int64_t, KeyId>> LostReservations::all() const {
  std::lock_guard lock(mutex_);
  return {lost_.begin(), lost_.end()};
}

bool LostReservations::empty() const {
  std::lock_guard lock(mutex_);
  return lost_.empty();
}

CoordinatorCore::ChangeSubscription::ChangeSubscription(Store& store, InflightRegistry& inflight)
    : store_(store), id_(store.add_change_listener([&inflight](const KeyId& id) {
        inflight.changed_elsewhere(id);
      })) {}

CoordinatorCore::ChangeSubscription::~ChangeSubscription() {
  if (id_ != 0) store_.remove_change_listener(id_);
}

std::size_t CoordinatorCore::purge_batch(std::size_t batch) {
  const std::size_t n =
      latency.time(StoreCall::purge, [&] { return store->purge_expired(now(), batch); });
  bump(counters.purged, n);
  return n;
}

Call CoordinatorCore::prepare(const Request& r, bool steps) const {
  validate_key_part("tenant", r.tenant);
  validate_key_part("operation", r.operation);
  check(!r.max_wait || r.max_wait->count() >= 0, "request: max_wait must not be negative");
  Call c;
  c.policy = r.in_flight.value_or(options.in_flight);
  if (!steps && c.policy == InFlight::wait &&
      test_control::enabled(test_control::Mutation::wait_runs_unprotected))
    c.policy = InFlight::run;
  c.steps = steps;
  if (steps) {
    check(c.policy != InFlight::run,
          "call_steps: InFlight::run cannot run a multi-step operation (it would run its steps "
          "without a reservation); use wait or raise");
    if (!r.key) throw InvalidKeyError("key", "is missing; a multi-step operation needs one");
  }
  if (!r.key) {
    if (options.missing_key == MissingKey::reject) throw InvalidKeyError("key", "is missing");
    c.has_key = false;
    c.id.tenant = r.tenant;
    c.id.operation = r.operation;
    return c;
  }
  validate_key_part("key", *r.key);
  c.id = KeyId{r.tenant, r.operation, *r.key};
  c.fingerprint = r.fingerprint;
  c.ttl = ttl_for(r.operation);
  c.margin = call_margin_for(r.operation);
  return c;
}

std::chrono::milliseconds CoordinatorCore::ttl_for(std::string_view operation) const {
  auto it = options.ttl_by_operation.find(operation);
  return it != options.ttl_by_operation.end() ? it->second : options.ttl;
}

std::chrono::milliseconds CoordinatorCore::call_margin_for(std::string_view operation) const {
  auto it = options.call_margin_by_operation.find(operation);
  if (it != options.call_margin_by_operation.end()) return it->second;
  if (options.call_margin) return *options.call_margin;
  return std::min<std::chrono::milliseconds>(std::chrono::seconds(1), options.lease / 4);
}

void CoordinatorCore::log(LogLevel level, std::string_view event, const Call& c, std::int64_t token,
                          std::string_view message) const {
  if (!options.log) return;
  const std::string hash = c.has_key ? short_hash(c.id) : std::string("-");
  log(level, event, hash, c.id.operation, token, message);
}

void CoordinatorCore::log(LogLevel level, std::string_view event, std::string_view key_hash,
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

}  // namespace detail

// --- Coordinator: the blocking driver ------------------------------------------------------

Coordinator::Coordinator(std::shared_ptr<Store> store, Options options)
    : core_(std::make_unique<detail::CoordinatorCore>(std::move(store), std::move(options))) {}

Coordinator::~Coordinator() = default;

Outcome Coordinator::call(const Request& request, const std::function<Response()>& action) {
  return detail::drive(*core_, request, action, detail::BlockingEffects{{}, *core_}).get();
}

Outcome Coordinator::call_steps(const Request& request,
                                const std::function<Response(Attempt&)>& action) {
  return detail::drive(*core_, request, action, detail::BlockingEffects{{}, *core_}).get();
}

std::vector<AbandonedOperation> Coordinator::abandoned(std::chrono::milliseconds idle_for,
                                                       std::size_t limit,
                                                       const std::vector<std::string>& operations) {
  detail::check(limit > 0, "abandoned: limit must be at least 1");
  if (operations.empty()) return {};
  const TimePoint now = core_->now();
  return steps_of(*core_->store).abandoned(now - idle_for, now, limit, operations);
}

// --- Maintenance and introspection ---------------------------------------------------------

std::size_t Coordinator::purge_expired(std::size_t batch) {
  detail::check(batch > 0, "purge_expired: batch must be at least 1");
  std::size_t total = 0;
  for (;;) {
    const std::size_t n = core_->purge_batch(batch);
    total += n;
    if (n < batch) return total;
  }
}

std::vector<ReapedRecord> Coordinator::reap(std::size_t batch) {
  detail::check(batch > 0, "reap: batch must be at least 1");
  detail::CoordinatorCore& core = *core_;
  std::vector<ReapedRecord> all;
  for (;;) {
    std::vector<ReapedRecord> got = core.latency.time(detail::StoreCall::reap, [&] {
      return core.store->reap(core.now() - core.options.reap_after, batch);
    });
    for (const ReapedRecord& r : got) {
      detail::bump(core.counters.reaped);
      core.log(LogLevel::warning, "reaped", r.key_hash, r.operation, r.token,
               "cleared a reservation whose lease ended long ago");
    }
    const std::size_t n = got.size();
    all.insert(all.end(), std::make_move_iterator(got.begin()), std::make_move_iterator(got.end()));
    if (n < batch) return all;
  }
}

std::size_t Coordinator::release_lost_reservations() {
  detail::CoordinatorCore& core = *core_;
  if (core.lost.empty()) return 0;
  std::size_t released = 0;
  for (const auto& [claim, id] : core.lost.all()) {
    const detail::Loaded found = detail::read_record(*core.store, id);
    if (found.error) {
      detail::bump(core.counters.store_errors);
      continue;  // the store still fails: next time
    }
    const Record* r = found.record ? &*found.record : nullptr;
    if (r == nullptr || r->state != State::in_progress || r->claim != claim) {
      core.lost.take(claim);  // it never committed, or has ended or passed to another since
      continue;
    }
    const TimePoint now = core.now();
    StoreOp op{.kind = StoreOp::Kind::release,
               .id = &id,
               .now = now,
               .expires_at = now + core.ttl_for(id.operation),
               .token = r->token};
    core.commits.commit(op);
    if (op.error) {
      detail::bump(core.counters.store_errors);
      continue;
    }
    core.lost.take(claim);
    if (!op.applied) continue;
    ++released;
    detail::bump(core.counters.released);
    core.log(LogLevel::warning, "released_lost", short_hash(id), id.operation, r->token,
             "released a reservation of this coordinator that nobody runs any more (its reply "
             "was lost, or its call ended when the store failed)");
  }
  return released;
}

std::chrono::milliseconds Coordinator::ttl_for(std::string_view operation) const {
  return core_->ttl_for(operation);
}

MetricsSnapshot Coordinator::metrics() const {
  const detail::Counters& c = core_->counters;
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
  m.corrupt_records = get(c.corrupt_records);
  m.steps_recorded = get(c.steps_recorded);
  m.resumed = get(c.resumed);
  m.reconciled = get(c.reconciled);
  m.interrupted = get(c.interrupted);
  m.completer_finished = get(c.completer_finished);
  m.completer_failed = get(c.completer_failed);
  m.outbox_delivered = get(c.outbox_delivered);
  m.outbox_retried = get(c.outbox_retried);
  m.outbox_parked = get(c.outbox_parked);
  m.outbox_given_back = get(c.outbox_given_back);
  core_->latency.snapshot(m);
  return m;
}

const Options& Coordinator::options() const noexcept { return core_->options; }
Clock& Coordinator::clock() const noexcept { return *core_->clock; }
Store& Coordinator::store() const noexcept { return *core_->store; }

std::string_view to_string(InFlight policy) noexcept {
  switch (policy) {
    case InFlight::run:
      return "run";
    case InFlight::wait:
      return "wait";
    case InFlight::raise:
      return "raise";
  }
  return "wait";
}

}  // namespace idem
