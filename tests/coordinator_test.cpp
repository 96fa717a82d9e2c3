// The blocking front end on simulated time: every rule of the key, the fingerprint, the lease, the
// stored response, store failures and the reaper that one thread can show. Each test counts the
// provider's charges, not only the responses.
#include "idem/coordinator.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <latch>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <thread>
#include <utility>

#include "idem/http.hpp"
#include "idem/store_wrapper.hpp"
#include "idem/typed.hpp"
#include "prometheus_check.hpp"
#include "test_support.hpp"

using namespace std::chrono_literals;
using idem::InFlight;
using idem::Outcome;
using idem::Response;
using idem::test::request;
using idem::test::World;
using nlohmann::json;

namespace {

// Blocking tests advance the clock inside the action, so the provider itself is instant.
const idem::sim::ProviderOptions kInstant{.latency = 0ms};

World blocking_world(idem::Options options = {}) { return World(std::move(options), kInstant); }

// A store whose next reservation's reply comes back late: the write commits, then the clock
// moves on (a stalled connection, a paused owner) and `meanwhile` runs (what the rest of the
// world does in that time) before the caller hears back.
class LateReply final : public idem::StoreWrapper {
 public:
  LateReply(std::shared_ptr<idem::Store> target, idem::sim::SimulatedClock& clock)
      : StoreWrapper(std::move(target)), clock_(clock) {}

  void delay_next_reservation(std::chrono::milliseconds delay,
                              std::function<void()> meanwhile = {}) {
    delay_ = delay;
    meanwhile_ = std::move(meanwhile);
  }

  void apply(std::span<idem::StoreOp* const> ops) override {
    StoreWrapper::apply(ops);
    const bool reserved = std::any_of(ops.begin(), ops.end(), [](const idem::StoreOp* op) {
      return op->kind == idem::StoreOp::Kind::reserve;
    });
    if (!reserved || delay_.count() == 0) return;
    clock_.advance(std::exchange(delay_, 0ms));
    if (auto meanwhile = std::exchange(meanwhile_, {})) meanwhile();
  }

 private:
  idem::sim::SimulatedClock& clock_;
  std::chrono::milliseconds delay_{0};
  std::function<void()> meanwhile_;
};

std::string charge_id(const Outcome& out) { return json::parse(out.response.body).at("charge_id"); }

}  // namespace

TEST_CASE("coordinator: a retry after completion replays the stored response byte for byte") {
  World w = blocking_world();
  const Outcome first = w.idem->call(request("k1"), w.charge_action());
  const Outcome second = w.idem->call(request("k1"), w.charge_action());
  CHECK(first.source == Outcome::Source::executed);
  CHECK(second.source == Outcome::Source::replayed);
  CHECK(second.response == first.response);
  CHECK(charge_id(second) == "ch_1");
  CHECK(w.charges() == 1);
  CHECK(w.idem->metrics().replayed == 1);
}

TEST_CASE("coordinator: a business rejection (402) is an outcome, stored and replayed") {
  World w = blocking_world();
  w.provider->inject(idem::sim::Fault::decline);
  const Outcome first = w.idem->call(request("k1"), w.charge_action());
  CHECK(first.response.status == 402);
  const Outcome again = w.idem->call(request("k1"), w.charge_action());
  CHECK(again.replayed());
  CHECK(again.response.status == 402);
  CHECK(again.response.body == first.response.body);
  // Had the retry run, the provider (no fault left) would have charged.
  CHECK(w.charges() == 0);
}

TEST_CASE("coordinator: an exception from the action releases the key, the retry really runs") {
  World w = blocking_world();
  w.provider->inject(idem::sim::Fault::timeout);
  CHECK_THROWS_AS(w.idem->call(request("k1"), w.charge_action()), idem::sim::ProviderTimeout);
  CHECK(w.charges() == 0);
  CHECK(w.store->load({"alpha", "payment.charge", "k1"})->state == idem::State::released);
  const Outcome retry = w.idem->call(request("k1"), w.charge_action());
  CHECK(retry.source == Outcome::Source::executed);
  CHECK(charge_id(retry) == "ch_1");
  CHECK(w.charges() == 1);
  CHECK(w.idem->metrics().released == 1);
}

TEST_CASE(
    "coordinator: the same key with another fingerprint is KeyReuse, with both fingerprints") {
  World w = blocking_world();
  const Outcome first = w.idem->call(request("k1", 4990), w.charge_action());
  try {
    w.idem->call(request("k1", 5), w.charge_action());
    FAIL("no KeyReuse");
  } catch (const idem::KeyReuseError& e) {
    CHECK(e.code() == idem::errc::key_reuse);
    CHECK(e.stored_fingerprint() == request("k1", 4990).fingerprint.hex());
    CHECK(e.request_fingerprint() == request("k1", 5).fingerprint.hex());
  }
  CHECK(w.charges() == 1);
  CHECK(w.store->load({"alpha", "payment.charge", "k1"})->response == first.response);
  CHECK(w.idem->metrics().key_reuse == 1);
}

TEST_CASE("coordinator: KeyReuse is checked before in-progress (raise and wait alike)") {
  for (InFlight policy : {InFlight::raise, InFlight::wait}) {
    World w = blocking_world({.in_flight = policy});
    bool reuse_seen = false;
    w.idem->call(request("k1", 4990), [&] {
      CHECK_THROWS_AS(w.idem->call(request("k1", 5), w.charge_action()), idem::KeyReuseError);
      reuse_seen = true;
      return w.charge_action()();
    });
    CHECK(reuse_seen);
    CHECK(w.charges() == 1);
  }
}

TEST_CASE("coordinator: tenants are isolated even when their keys are equal") {
  World w = blocking_world();
  const Outcome a = w.idem->call(request("k1", 4990, "alpha"), w.charge_action());
  const Outcome b = w.idem->call(request("k1", 5, "beta"), w.charge_action());  // no KeyReuse
  CHECK(charge_id(a) == "ch_1");
  CHECK(charge_id(b) == "ch_2");
  CHECK(charge_id(w.idem->call(request("k1", 4990, "alpha"), w.charge_action())) == "ch_1");
  CHECK(charge_id(w.idem->call(request("k1", 5, "beta"), w.charge_action())) == "ch_2");
  CHECK(w.charges() == 2);
}

TEST_CASE("coordinator: one key under two operations makes two independent records") {
  World w = blocking_world();
  w.idem->call(request("k1", 4990, "alpha", "order.create"), w.charge_action());
  w.idem->call(request("k1", 4990, "alpha", "order.cancel"), w.charge_action());
  w.idem->call(request("k1", 4990, "alpha", "order.cancel"), w.charge_action());
  CHECK(w.charges() == 2);
  CHECK(w.rows() == 2);
}

TEST_CASE("coordinator: bad keys are rejected before the store is touched") {
  World w = blocking_world();
  const std::vector<std::string> bad = {
      "",       std::string(256, 'k'), "tab\there", "nul" + std::string(1, '\0'), "caf\xc3\xa9",
      "del\x7f"};
  int ran = 0;
  for (const std::string& key : bad) {
    CHECK_THROWS_AS(w.idem->call(request(key),
                                 [&] {
                                   ++ran;
                                   return Response{};
                                 }),
                    idem::InvalidKeyError);
  }
  CHECK_THROWS_WITH_AS(w.idem->call(request("k1", 1, ""),
                                    [&] {
                                      ++ran;
                                      return Response{};
                                    }),
                       "idempotency tenant is empty", idem::InvalidKeyError);
  CHECK(ran == 0);
  CHECK(w.rows() == 0);
}

TEST_CASE("coordinator: a missing key is rejected, or run unprotected and counted") {
  idem::Request no_key = request("unused");
  no_key.key.reset();
  {
    World w = blocking_world();
    CHECK_THROWS_WITH_AS(w.idem->call(no_key, w.charge_action()), "idempotency key is missing",
                         idem::InvalidKeyError);
    CHECK(w.charges() == 0);
  }
  {
    World w = blocking_world({.missing_key = idem::MissingKey::run_unprotected});
    CHECK(w.idem->call(no_key, w.charge_action()).source == Outcome::Source::unprotected);
    CHECK(w.idem->call(no_key, w.charge_action()).source == Outcome::Source::unprotected);
    CHECK(w.charges() == 2);  // unprotected really means unprotected
    CHECK(w.idem->metrics().ran_unprotected == 2);
    CHECK(w.rows() == 0);
  }
}

TEST_CASE("coordinator: options that break a rule are refused with the rule named") {
  auto store = std::make_shared<idem::SqliteStore>(":memory:");
  auto refuse = [&](idem::Options o, const std::string& words) {
    try {
      idem::Coordinator c(store, std::move(o));
      FAIL("accepted");
    } catch (const idem::error& e) {
      CHECK(e.code() == idem::errc::invalid_argument);
      CHECK_MESSAGE(std::string(e.what()).find(words) != std::string::npos, e.what());
    }
  };
  refuse({.ttl = 59s}, "a TTL is at least one minute");
  refuse({.ttl_by_operation = {{"payment.charge", 30s}}}, "ttl for 'payment.charge' is 30000 ms");
  refuse({.lease = 2min, .ttl = 2min}, "lease (120000 ms) must be shorter than ttl");
  refuse({.lease = 0ms}, "lease must be positive");
  refuse({.lease = 1s, .heartbeat = 1s}, "heartbeat (1000 ms) must be shorter than the lease");
  refuse({.inline_body_limit = 10}, "needs a payload_store");
  CHECK_NOTHROW(idem::Coordinator(store, {.lease = 1s, .heartbeat = 0ms, .ttl = 1min}));
}

TEST_CASE("coordinator: a completed record lives for its TTL, then the key is new") {
  World w = blocking_world({.ttl = 1h, .ttl_by_operation = {{"order.cancel", 2min}}});
  w.idem->call(request("k1"), w.charge_action());
  w.idem->call(request("k1", 4990, "alpha", "order.cancel"), w.charge_action());
  w.clock->advance(2min);  // the cancel's TTL is over; the charge's is not
  CHECK(w.idem->call(request("k1"), w.charge_action()).replayed());
  CHECK_FALSE(
      w.idem->call(request("k1", 4990, "alpha", "order.cancel"), w.charge_action()).replayed());
  CHECK(w.charges() == 3);
  w.clock->advance(1h);
  // After the TTL, even another fingerprint is simply a new request.
  CHECK(w.idem->call(request("k1", 5), w.charge_action()).source == Outcome::Source::executed);
  CHECK(w.charges() == 4);
  CHECK(w.idem->ttl_for("order.cancel") == 2min);
}

namespace {

// Records what purge_expired() and reap() asked of the store and got.
struct RecordingStore final : idem::StoreWrapper {
  using StoreWrapper::StoreWrapper;
  std::vector<std::pair<std::size_t, std::size_t>> purges;  // (limit, deleted)
  std::size_t purge_expired(idem::TimePoint now, std::size_t limit) override {
    const std::size_t n = StoreWrapper::purge_expired(now, limit);
    purges.emplace_back(limit, n);
    return n;
  }
};

}  // namespace

TEST_CASE("coordinator: purge deletes expired records in bounded batches and counts them") {
  World w = blocking_world();
  auto recording = std::make_shared<RecordingStore>(w.store);
  idem::Coordinator idem(recording, {.ttl = 1min, .clock = w.clock});
  for (int i = 0; i < 7; ++i) idem.call(request("k" + std::to_string(i)), w.charge_action(0ms));
  CHECK(idem.purge_expired(3) == 0);
  CHECK(recording->purges == std::vector<std::pair<std::size_t, std::size_t>>{{3, 0}});
  recording->purges.clear();
  w.clock->advance(1min);
  CHECK(idem.purge_expired(3) == 7);
  // Each batch is its own short statement of at most 3 deletions; the short one ends it.
  CHECK(recording->purges ==
        std::vector<std::pair<std::size_t, std::size_t>>{{3, 3}, {3, 3}, {3, 1}});
  CHECK(idem.metrics().purged == 7);
  CHECK(w.rows() == 0);
  CHECK_THROWS_AS(idem.purge_expired(0), idem::error);
  CHECK_THROWS_AS(idem.reap(0), idem::error);
}

TEST_CASE("coordinator: the reaper reports and clears reservations whose lease is long gone") {
  std::vector<std::string> events;
  World w =
      blocking_world({.reap_after = 5min, .log = [&](const idem::LogEvent& e) {
                        events.push_back(std::string(e.event) + " " + std::string(e.key_hash));
                      }});
  // A worker reserved and died: nothing completes or releases the key.
  w.store->reserve({"alpha", "payment.charge", "dead"}, request("dead").fingerprint, w.clock->now(),
                   w.clock->now() + 30s);
  w.clock->advance(5min);
  CHECK(w.idem->reap().empty());  // lease ended 4.5 min ago: not yet
  w.clock->advance(1min);
  const auto reaped = w.idem->reap();
  REQUIRE(reaped.size() == 1);
  CHECK(w.idem->metrics().reaped == 1);
  CHECK(events.back() == "reaped " + idem::short_hash({"alpha", "payment.charge", "dead"}));
}

TEST_CASE(
    "coordinator: under raise a duplicate during the first gets InProgress with Retry-After") {
  World w = blocking_world({.in_flight = InFlight::raise});
  w.idem->call(request("k1"), [&] {
    w.clock->advance(50ms);
    try {
      w.idem->call(request("k1"), w.charge_action());
      FAIL("no InProgress");
    } catch (const idem::InProgressError& e) {
      CHECK(e.code() == idem::errc::in_progress);
      CHECK(e.retry_after() == 30s - 50ms);
    }
    return w.charge_action(250ms)();
  });
  CHECK(w.charges() == 1);
  CHECK(w.idem->metrics().in_progress_conflicts == 1);
}

TEST_CASE(
    "coordinator: a zombie whose lease was taken over gets LeaseLost, the new owner's result "
    "stands") {
  World w = blocking_world({.lease = 30s, .heartbeat = 0ms});
  std::string new_owner;
  try {
    w.idem->call(request("k1"), [&] {
      w.clock->advance(31s);  // the first worker stalls past its lease...
      new_owner =
          charge_id(w.idem->call(request("k1"), w.charge_action()));  // ...a retry takes over
      return w.charge_action(0ms)();  // the zombie charges and tries to complete
    });
    FAIL("zombie completed");
  } catch (const idem::LeaseLostError& e) {
    CHECK(e.code() == idem::errc::lease_lost);
  }
  CHECK(new_owner == "ch_1");
  CHECK(w.charges() == 2);  // the takeover ran the action again: at-least-once for a dead worker
  const Outcome replay = w.idem->call(request("k1"), w.charge_action());
  CHECK(charge_id(replay) == "ch_1");
  CHECK(w.charges() == 2);
  const idem::MetricsSnapshot m = w.idem->metrics();
  CHECK(m.taken_over == 1);
  CHECK(m.lease_lost == 1);
}

TEST_CASE(
    "coordinator: a zombie whose action failed cannot release the new owner's reservation: "
    "LeaseLost") {
  World w = blocking_world({.lease = 30s, .heartbeat = 0ms});
  std::int64_t zombie_token = 0;
  try {
    w.idem->call(request("k1"), [&]() -> Response {
      zombie_token = w.store->load({"alpha", "payment.charge", "k1"})->token;
      w.clock->advance(31s);
      w.idem->call(request("k1"), w.charge_action());  // a retry takes over and charges
      throw std::runtime_error("zombie fails");
    });
    FAIL("no error");
  } catch (const idem::LeaseLostError& e) {
    CHECK(e.token() == zombie_token);
    // The action's own failure rides along, nested.
    CHECK_THROWS_WITH_AS(std::rethrow_if_nested(e), "zombie fails", std::runtime_error);
  }
  const idem::MetricsSnapshot m = w.idem->metrics();
  CHECK(m.lease_lost == 1);
  CHECK(m.released == 0);
  const auto record = w.store->load({"alpha", "payment.charge", "k1"});
  CHECK(record->state == idem::State::completed);  // the new owner's record stands
  CHECK(record->token > zombie_token);
  CHECK(w.idem->call(request("k1"), w.charge_action()).replayed());
  CHECK(w.charges() == 1);
}

TEST_CASE(
    "coordinator: a reservation whose reply comes back after its lease ran out does not run the "
    "action, so a retry that took the key over meanwhile charges once") {
  World w = blocking_world({.lease = 1s, .heartbeat = 0ms});
  auto late = std::make_shared<LateReply>(w.faulty, *w.clock);
  idem::Coordinator owner(late, {.lease = 1s, .heartbeat = 0ms, .clock = w.clock});
  std::string retry;
  // The reply takes 2 s; at its end a retry on another node finds the lease over and takes over.
  late->delay_next_reservation(
      2s, [&] { retry = charge_id(w.idem->call(request("k1"), w.charge_action(0ms))); });
  CHECK_THROWS_AS(owner.call(request("k1"), w.charge_action(0ms)), idem::LeaseLostError);
  CHECK(retry == "ch_1");
  CHECK(w.charges() == 1);  // the downstream does not deduplicate: only idem kept it to one
  CHECK(owner.metrics().executed == 0);
  CHECK(owner.metrics().lease_lost == 1);
  CHECK(w.idem->metrics().taken_over == 1);
  const Outcome again = w.idem->call(request("k1"), w.charge_action(0ms));
  CHECK(again.replayed());
  CHECK(charge_id(again) == "ch_1");
  CHECK(w.charges() == 1);
}

TEST_CASE(
    "coordinator: a reservation that comes back with less than the call margin of its lease left "
    "is released unrun, so the key is free at once") {
  World w = blocking_world();
  const idem::Options o{.lease = 10s, .heartbeat = 0ms, .call_margin = 2s, .clock = w.clock};
  auto late = std::make_shared<LateReply>(w.faulty, *w.clock);
  idem::Coordinator owner(late, o);
  late->delay_next_reservation(8500ms);  // 1.5 s of the lease left: less than the margin
  try {
    owner.call(request("k1"), w.charge_action(0ms));
    FAIL("the action ran");
  } catch (const idem::LeaseLostError& e) {
    CHECK(std::string(e.what()).find("the action was not run") != std::string::npos);
    CHECK(e.code() == idem::errc::lease_lost);
  }
  CHECK(w.charges() == 0);
  CHECK(owner.metrics().executed == 0);
  CHECK(owner.metrics().released == 0);  // counted as a lost lease, not as a failed action
  // Released: the next call runs at once instead of waiting out the 10 s lease.
  const Outcome next = w.idem->call(request("k1", 4990), w.charge_action(0ms));
  CHECK(next.source == Outcome::Source::executed);
  CHECK(w.charges() == 1);
  // 2.5 s left (more than the margin): the action runs.
  late->delay_next_reservation(7500ms);
  CHECK(owner.call(request("k2"), w.charge_action(0ms)).source == Outcome::Source::executed);
  CHECK(w.charges() == 2);
}

TEST_CASE(
    "coordinator: a reservation whose reply was lost is looked up, found committed, and the call "
    "goes on with one charge") {
  World w = blocking_world({.in_flight = InFlight::raise, .lease = 30s, .heartbeat = 0ms});
  w.faulty->lose_replies(idem::sim::Operation::reserve);
  const Outcome out = w.idem->call(request("k1"), [&] {
    w.faulty->lose_replies(idem::sim::Operation::reserve, false);
    return w.charge_action(0ms)();
  });
  CHECK(out.source == Outcome::Source::executed);
  CHECK(w.charges() == 1);
  CHECK(w.idem->call(request("k1"), w.charge_action(0ms)).replayed());
  CHECK(w.charges() == 1);
}

TEST_CASE(
    "coordinator: a lost reservation that could not be looked at is released by this "
    "coordinator, not held for its lease") {
  const idem::Options o{.in_flight = InFlight::raise,
                        .lease = 30s,
                        .heartbeat = 0ms,
                        .on_store_failure = idem::FailureMode::fail_closed};
  World w = blocking_world(o);
  w.faulty->lose_replies(idem::sim::Operation::reserve);
  w.faulty->fail(idem::sim::Operation::load);
  CHECK_THROWS_AS(w.idem->call(request("k1"), w.charge_action(0ms)), idem::StoreError);
  w.faulty->lose_replies(idem::sim::Operation::reserve, false);
  w.faulty->fail(idem::sim::Operation::load, false);
  CHECK(w.charges() == 0);
  // The reservation committed and nobody runs it: another node sees the key held.
  idem::Options other_options = o;
  other_options.clock = w.clock;
  idem::Coordinator other(w.faulty, other_options);
  CHECK_THROWS_AS(other.call(request("k1"), w.charge_action(0ms)), idem::InProgressError);
  SUBCASE("the next call of this coordinator with the key releases it and runs") {
    CHECK(w.idem->call(request("k1"), w.charge_action(0ms)).source == Outcome::Source::executed);
    CHECK(w.charges() == 1);
    CHECK(w.idem->release_lost_reservations() == 0);
  }
  SUBCASE("release_lost_reservations frees it for every node") {
    CHECK(w.idem->release_lost_reservations() == 1);
    CHECK(w.idem->metrics().released == 1);
    CHECK(other.call(request("k1"), w.charge_action(0ms)).source == Outcome::Source::executed);
    CHECK(w.charges() == 1);
    CHECK(w.idem->release_lost_reservations() == 0);
  }
}

TEST_CASE(
    "coordinator: a record that does not decode is refused, counted and left alone, never run "
    "again, not even under fail_open") {
  World w = blocking_world({.on_store_failure = idem::FailureMode::fail_open});
  w.idem->call(request("k1"), w.charge_action(0ms));
  const std::string damage = "UPDATE {}idem_keys SET headers = 'not json' WHERE key = 'k1'";
  if (idem::test::worlds_on_postgresql()) {
    idem::test::pg_text(idem::test::test_pg_conninfo(),
                        fmt::format(fmt::runtime(damage), w.pg_schema + "."));
  } else {
    REQUIRE(idem::test::RawDb(w.db_path).exec(fmt::format(fmt::runtime(damage), "")) == 0);
  }
  for (InFlight policy : {InFlight::wait, InFlight::raise, InFlight::run}) {
    idem::Request r = request("k1");
    r.in_flight = policy;
    try {
      w.idem->call(r, w.charge_action(0ms));
      FAIL("the call went on");
    } catch (const idem::CorruptRecordError& e) {
      CHECK(e.code() == idem::errc::corrupt_record);
      CHECK(std::string(e.what()).find("headers") != std::string::npos);
      CHECK(idem::http_status(e.code()) == 500);
    }
  }
  CHECK(w.charges() == 1);
  const idem::MetricsSnapshot m = w.idem->metrics();
  CHECK(m.corrupt_records == 3);
  CHECK(m.ran_unprotected == 0);
  CHECK(w.rows() == 1);
}

TEST_CASE("coordinator: heartbeats keep a slow honest action from being taken over") {
  SUBCASE("with heartbeat: the duplicate at 2 s sees the key in progress") {
    World w = blocking_world({.in_flight = InFlight::raise, .lease = 1s, .heartbeat = 300ms});
    const Outcome out = w.idem->call(request("k1"), [&] {
      w.clock->advance(2s);  // heartbeats at 0.3, 0.6, ... renew the 1 s lease
      CHECK_THROWS_AS(w.idem->call(request("k1"), w.charge_action()), idem::InProgressError);
      return w.charge_action(1s)();
    });
    CHECK(out.source == Outcome::Source::executed);
    CHECK(w.charges() == 1);
    CHECK(w.idem->metrics().lease_lost == 0);
  }
  SUBCASE("without heartbeat: the same duplicate takes over and charges again") {
    World w = blocking_world({.in_flight = InFlight::raise, .lease = 1s, .heartbeat = 0ms});
    CHECK_THROWS_AS(w.idem->call(request("k1"),
                                 [&] {
                                   w.clock->advance(2s);
                                   w.idem->call(request("k1"), w.charge_action());
                                   return w.charge_action(1s)();
                                 }),
                    idem::LeaseLostError);
    CHECK(w.charges() == 2);
  }
}

TEST_CASE(
    "coordinator (sqlite): a locked database (past busy_timeout) fails open or closed as "
    "configured") {
  for (idem::FailureMode mode : {idem::FailureMode::fail_open, idem::FailureMode::fail_closed}) {
    World w({.on_store_failure = mode}, kInstant, idem::SqliteOptions{.busy_timeout = 20ms});
    idem::test::RawDb locker(w.db_path);
    REQUIRE(locker.exec("BEGIN IMMEDIATE") == SQLITE_OK);
    if (mode == idem::FailureMode::fail_open) {
      const Outcome out = w.idem->call(request("k1"), w.charge_action());
      CHECK(out.source == Outcome::Source::unprotected);
      CHECK(w.charges() == 1);  // the action ran anyway
      CHECK(w.idem->metrics().store_errors == 1);
      CHECK(w.idem->metrics().ran_unprotected == 1);
    } else {
      try {
        w.idem->call(request("k1"), w.charge_action());
        FAIL("ran under fail_closed");
      } catch (const idem::StoreError& e) {
        CHECK(e.code() == idem::errc::store_unavailable);
        CHECK((e.sqlite_code() & 0xff) == SQLITE_BUSY);
      }
      CHECK(w.charges() == 0);
      CHECK(w.idem->metrics().store_errors == 1);
    }
    locker.exec("ROLLBACK");
    CHECK(w.store->load({"alpha", "payment.charge", "k1"}) == std::nullopt);
  }
}

TEST_CASE("coordinator: an unwritable store fails open or closed as configured") {
  World open_world = blocking_world();
  open_world.faulty->fail(idem::sim::Operation::reserve);
  CHECK(open_world.idem->call(request("k1"), open_world.charge_action()).source ==
        Outcome::Source::unprotected);
  CHECK(open_world.charges() == 1);
  World closed = blocking_world({.on_store_failure = idem::FailureMode::fail_closed});
  closed.faulty->fail(idem::sim::Operation::reserve);
  CHECK_THROWS_AS(closed.idem->call(request("k1"), closed.charge_action()), idem::StoreError);
  CHECK(closed.charges() == 0);
}

TEST_CASE(
    "coordinator: a store failure after the action keeps the key reserved, a derived key keeps the "
    "retry single-charge") {
  World w = blocking_world({.lease = 30s, .heartbeat = 0ms});
  const std::string downstream = idem::derived_key({"alpha", "payment.charge", "k1"}, "charge");
  w.faulty->fail(idem::sim::Operation::complete);
  const Outcome first = w.idem->call(request("k1"), w.charge_action(300ms, downstream));
  CHECK(first.source == Outcome::Source::executed);  // the caller still gets its answer
  CHECK(w.idem->metrics().store_errors == 1);
  w.faulty->fail(idem::sim::Operation::complete, false);
  CHECK(w.store->load({"alpha", "payment.charge", "k1"})->state == idem::State::in_progress);
  w.clock->advance(30s);  // the lease ends; the retry takes over and runs the action again...
  const Outcome retry = w.idem->call(request("k1"), w.charge_action(300ms, downstream));
  CHECK(charge_id(retry) == charge_id(first));  // ...but the provider recognised the derived key
  CHECK(w.charges() == 1);
}

TEST_CASE("coordinator: a same-process waiter is woken by the completion itself") {
  // The simulated clock never moves in this test: no deadline or poll can fire, so the
  // waiting thread can only be woken by the holder's completion.
  World w = blocking_world({.in_flight = InFlight::wait});
  std::latch holder_running(1);
  std::atomic<bool> release_holder{false};
  std::thread holder([&] {
    w.idem->call(request("k1"), [&] {
      holder_running.count_down();
      while (!release_holder.load()) std::this_thread::yield();
      return w.charge_action(0ms)();
    });
  });
  holder_running.wait();
  std::thread duplicate([&] {
    const Outcome out = w.idem->call(request("k1"), w.charge_action(0ms));
    CHECK(out.replayed());
    CHECK(charge_id(out) == "ch_1");
  });
  while (w.idem->metrics().waited == 0) std::this_thread::yield();
  release_holder = true;
  holder.join();
  duplicate.join();
  CHECK(w.charges() == 1);
  CHECK(w.idem->metrics().waited == 1);
}

TEST_CASE("coordinator: InFlight::run replays sequential duplicates like a cache") {
  World w = blocking_world({.in_flight = InFlight::run});
  w.idem->call(request("k1"), w.charge_action());
  CHECK(w.idem->call(request("k1"), w.charge_action()).replayed());
  CHECK_THROWS_AS(w.idem->call(request("k1", 5), w.charge_action()), idem::KeyReuseError);
  CHECK(w.charges() == 1);
}

TEST_CASE("coordinator: log events name each decision and carry a short hash, never the key") {
  std::vector<std::string> events;
  std::vector<std::string> lines;
  std::mutex mutex;
  World w = blocking_world(
      {.in_flight = InFlight::raise,
       .lease = 1s,
       .heartbeat = 0ms,
       .log = [&](const idem::LogEvent& e) {
         std::lock_guard lock(mutex);
         events.emplace_back(e.event);
         lines.push_back(fmt::format("{} {} {} {}", e.event, e.key_hash, e.operation, e.message));
       }});
  const std::string secret = "cust-42-jane.doe@example.com";
  w.provider->inject(idem::sim::Fault::timeout);
  CHECK_THROWS_AS(w.idem->call(request(secret), w.charge_action()), idem::sim::ProviderTimeout);
  CHECK_THROWS_AS(w.idem->call(request(secret),
                               [&] {
                                 CHECK_THROWS_AS(w.idem->call(request(secret), w.charge_action()),
                                                 idem::InProgressError);
                                 CHECK_THROWS_AS(
                                     w.idem->call(request(secret, 5), w.charge_action()),
                                     idem::KeyReuseError);
                                 w.clock->advance(2s);
                                 w.idem->call(request(secret), w.charge_action());
                                 return w.charge_action()();
                               }),
                  idem::LeaseLostError);
  CHECK(events == std::vector<std::string>{"reserved", "released",      // the timeout
                                           "reserved",                  // the zombie-to-be
                                           "in_progress", "key_reuse",  // two refusals
                                           "taken_over", "completed",   // the new owner
                                           "lease_lost"});              // the zombie
  for (const std::string& line : lines) {
    CHECK_MESSAGE(line.find(secret) == std::string::npos, line);
    CHECK_MESSAGE(
        line.find(idem::short_hash({"alpha", "payment.charge", secret})) != std::string::npos,
        line);
  }
}

TEST_CASE("coordinator: metrics are a snapshot and export as Prometheus text") {
  World w = blocking_world();
  w.idem->call(request("k1"), w.charge_action());
  w.idem->call(request("k1"), w.charge_action());
  const idem::MetricsSnapshot m = w.idem->metrics();
  CHECK(m.reserved == 1);
  CHECK(m.executed == 1);
  CHECK(m.completed == 1);
  CHECK(m.replayed == 1);
  const std::string text = m.to_prometheus();
  CHECK(text.find("idem_replayed_total 1\n") != std::string::npos);
  CHECK(text.find("# TYPE idem_store_errors_total counter\n") != std::string::npos);
}

TEST_CASE(
    "coordinator: latency histograms count every call by how it ended, and Prometheus's parser "
    "reads them with consistent buckets, sum and count") {
  World w = blocking_world({.on_store_failure = idem::FailureMode::fail_open,
                            .missing_key = idem::MissingKey::run_unprotected});
  for (const char* k : {"h1", "h2", "h3"}) w.idem->call(request(k), w.charge_action(0ms));
  w.idem->call(request("h1"), w.charge_action(0ms));  // replayed
  w.idem->call(request("h1"), w.charge_action(0ms));  // replayed
  CHECK_THROWS_AS(w.idem->call(request("h1", 5), w.charge_action(0ms)), idem::KeyReuseError);
  w.idem->call(request("h4"), [&] {  // executed, with a duplicate refused inside it
    idem::Request dup = request("h4");
    dup.in_flight = InFlight::raise;
    CHECK_THROWS_AS(w.idem->call(dup, w.charge_action(0ms)), idem::InProgressError);
    return w.charge_action(0ms)();
  });
  w.provider->inject(idem::sim::Fault::timeout);  // the action fails: released
  CHECK_THROWS_AS(w.idem->call(request("h5"), w.charge_action(0ms)), idem::sim::ProviderTimeout);
  idem::Request keyless = request("");
  keyless.key.reset();
  w.idem->call(keyless, w.charge_action(0ms));  // no key: run unprotected
  w.faulty->set_unreachable(true);
  w.idem->call(request("h6"), w.charge_action(0ms));  // fail_open
  w.faulty->set_unreachable(false);
  CHECK(w.charges() == 4 + 1 + 1);  // h1..h4, the one without a key, h6 run unprotected

  const idem::MetricsSnapshot m = w.idem->metrics();
  const std::map<std::string, std::uint64_t> expected = {
      {"executed", 4}, {"replayed", 2},    {"conflict", 1}, {"reuse", 1},
      {"released", 1}, {"failed_open", 1}, {"no_key", 1},   {"error", 0}};
  REQUIRE(m.call_duration.size() == expected.size());
  for (const auto& entry : expected) {
    const std::string& outcome = entry.first;  // (not a structured binding: clang 14 cannot
    const auto n = entry.second;               // capture one in CAPTURE's lambda)
    CAPTURE(outcome);
    const idem::HistogramSnapshot& h = m.call_duration.at(outcome);
    CHECK(h.count == n);
    CHECK(h.buckets.size() == h.bounds.size() + 1);
    CHECK(std::is_sorted(h.bounds.begin(), h.bounds.end()));
    CHECK(h.sum >= 0);
  }
  CHECK(m.wait_duration.count == 0);
  // Every write went through a group-commit round: as many rounds timed as batches sized, and
  // no round without a write.
  const idem::HistogramSnapshot& apply = m.store_duration.at("apply");
  CHECK(apply.count > 0);
  CHECK(m.commit_batch_size.count == apply.count);
  CHECK(m.commit_batch_size.sum >= static_cast<double>(apply.count));
  CHECK(m.store_duration.at("load").count > 0);  // at least the look after the reuse

  const nlohmann::json parsed = idem::test::prometheus_parsed(m.to_prometheus());
  for (const auto& entry : expected) {
    const std::string& outcome = entry.first;  // (not a structured binding: clang 14 cannot
    const auto n = entry.second;               // capture one in CAPTURE's lambda)
    CAPTURE(outcome);
    CHECK(idem::test::histogram_count(parsed, "idem_call_duration_seconds", "outcome=" + outcome) ==
          static_cast<double>(n));
  }
  CHECK(idem::test::histogram_count(parsed, "idem_wait_duration_seconds") == 0);
  for (const char* op : {"load", "apply", "renew", "purge", "reap"}) {
    CAPTURE(op);
    CHECK(idem::test::histogram_count(parsed, "idem_store_duration_seconds",
                                      std::string("operation=") + op) ==
          static_cast<double>(m.store_duration.at(op).count));
  }
  CHECK(idem::test::histogram_count(parsed, "idem_commit_batch_size") ==
        static_cast<double>(apply.count));
  CHECK(parsed.at("counters").at("idem_replayed_total") == 2);
}

namespace {

struct MemoryPayloads final : idem::PayloadStore {
  std::mutex mutex;
  std::map<std::string, std::string> blobs;
  std::string put(const idem::KeyId& id, const std::string& body) override {
    std::lock_guard lock(mutex);
    const std::string ref = "blob/" + idem::short_hash(id);
    blobs[ref] = body;
    return ref;
  }
  std::string get(const std::string& ref) override {
    std::lock_guard lock(mutex);
    return blobs.at(ref);
  }
};

struct Charge {
  std::string id;
  int amount = 0;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Charge, id, amount)

}  // namespace

TEST_CASE("coordinator: bodies over the inline limit are stored by reference and replayed whole") {
  auto payloads = std::make_shared<MemoryPayloads>();
  World w = blocking_world({.inline_body_limit = 16, .payload_store = payloads});
  const std::string big(1000, 'x');
  int ran = 0;
  auto action = [&] {
    ++ran;
    return Response{200, big, {}};
  };
  w.idem->call(request("k1"), action);
  const auto rec = w.store->load({"alpha", "payment.charge", "k1"});
  CHECK(rec->response.body.empty());
  CHECK(rec->body_ref == "blob/" + idem::short_hash({"alpha", "payment.charge", "k1"}));
  const Outcome replay = w.idem->call(request("k1"), action);
  CHECK(replay.replayed());
  CHECK(replay.response.body == big);
  CHECK(ran == 1);
}

TEST_CASE("coordinator: typed results round-trip through JSON, including null and void") {
  World w = blocking_world();
  int ran = 0;
  const auto first = idem::call<Charge>(*w.idem, request("t1"), [&] {
    ++ran;
    return Charge{"ch_1", 4990};
  });
  const auto again = idem::call<Charge>(*w.idem, request("t1"), [&] {
    ++ran;
    return Charge{"ch_9", 1};
  });
  CHECK(again.replayed());
  CHECK(again.value.id == "ch_1");
  CHECK(again.value.amount == 4990);
  CHECK_FALSE(first.replayed());

  const auto none = idem::call<std::optional<int>>(*w.idem, request("t2"), [&] {
    ++ran;
    return std::optional<int>{};
  });
  const auto none_again = idem::call<std::optional<int>>(*w.idem, request("t2"), [&] {
    ++ran;
    return std::optional<int>{7};
  });
  CHECK_FALSE(none.value.has_value());
  CHECK(none_again.replayed());
  CHECK_FALSE(none_again.value.has_value());

  idem::call<void>(*w.idem, request("t3"), [&] { ++ran; });
  CHECK(idem::call<void>(*w.idem, request("t3"), [&] { ++ran; }).replayed());
  CHECK(ran == 3);
}

TEST_CASE(
    "coordinator: Request::max_wait bounds a wait below Options::max_wait, and a negative one is "
    "refused") {
  World w = blocking_world({});  // InFlight::wait, max_wait 10 s
  w.idem->call(request("k1"), [&] {
    // The holder runs on this thread, and the simulated clock does not move: a duplicate that
    // waited Options::max_wait would wait for good.
    idem::Request now = request("k1");
    now.max_wait = 0ms;
    CHECK_THROWS_AS(w.idem->call(now, w.charge_action()), idem::InProgressError);
    idem::Request negative = request("k1");
    negative.max_wait = -1ms;
    CHECK_THROWS_WITH_AS(w.idem->call(negative, w.charge_action()),
                         doctest::Contains("max_wait must not be negative"), idem::error);
    return Response{200, "{}", {}};
  });
  CHECK(w.charges() == 0);
  CHECK(w.idem->metrics().in_progress_conflicts == 1);
}

TEST_CASE("coordinator: a 409 and a 422 leave the record exactly as it was") {
  World w = blocking_world({.in_flight = InFlight::raise});
  const idem::KeyId id{"alpha", "payment.charge", "k1"};
  w.idem->call(request("k1"), [&] {
    const idem::Record before = *w.store->load(id);
    w.clock->advance(50ms);
    try {
      w.idem->call(request("k1"), w.charge_action());
      FAIL("no InProgress");
    } catch (const idem::InProgressError& e) {
      CHECK(e.retry_after() == 30s - 50ms);  // the holder's lease, to the millisecond
      const Response http = idem::to_http(e);
      CHECK(http.status == 409);
      CHECK(std::find(http.headers.begin(), http.headers.end(),
                      idem::Header{"Retry-After", "30"}) != http.headers.end());
    }
    CHECK_THROWS_AS(w.idem->call(request("k1", 5), w.charge_action()), idem::KeyReuseError);
    const idem::Record after = *w.store->load(id);
    CHECK(after.state == before.state);
    CHECK(after.token == before.token);
    CHECK(after.fingerprint == before.fingerprint);
    CHECK(after.lease_until == before.lease_until);
    CHECK(after.created_at == before.created_at);
    CHECK(after.expires_at == before.expires_at);
    return w.charge_action(250ms)();
  });
  CHECK(w.charges() == 1);
}

TEST_CASE("coordinator: Retry-After is whole seconds rounded up, never below 1") {
  auto retry_after = [](std::chrono::milliseconds left) {
    for (const idem::Header& h : idem::to_http(idem::InProgressError(left)).headers) {
      if (h.name == "Retry-After") return h.value;
    }
    return std::string("none");
  };
  CHECK(retry_after(29950ms) == "30");
  CHECK(retry_after(30000ms) == "30");
  CHECK(retry_after(30001ms) == "31");
  CHECK(retry_after(1ms) == "1");
  CHECK(retry_after(-5s) == "1");  // a lease that ended while we looked
}

TEST_CASE(
    "coordinator: Outcome::expires_at is the record's TTL end, replayed alike, epoch when nothing "
    "was stored") {
  World w = blocking_world({.ttl = 2h});
  const idem::TimePoint t0 = w.clock->now();
  const Outcome first = w.idem->call(request("k1"), w.charge_action(300ms));
  CHECK(first.expires_at == t0 + 300ms + 2h);  // completed after the action's 300 ms
  CHECK(w.store->load({"alpha", "payment.charge", "k1"})->expires_at == first.expires_at);
  w.clock->advance(1h);
  const Outcome replay = w.idem->call(request("k1"), w.charge_action());
  CHECK(replay.replayed());
  CHECK(replay.expires_at == first.expires_at);
  w.faulty->fail(idem::sim::Operation::complete);
  CHECK(w.idem->call(request("k2"), w.charge_action()).expires_at == idem::TimePoint{});
  w.faulty->set_unreachable(true);
  const Outcome unprotected = w.idem->call(request("k3"), w.charge_action());
  CHECK(unprotected.source == Outcome::Source::unprotected);
  CHECK(unprotected.expires_at == idem::TimePoint{});
}

TEST_CASE(
    "coordinator: the defaults are TTL 24 h, lease 30 s, heartbeat 10 s, max_wait 10 s, reap_after "
    "5 min") {
  const idem::Options o;
  CHECK(o.in_flight == InFlight::wait);
  CHECK(o.ttl == 24h);
  CHECK(o.lease == 30s);
  CHECK(o.heartbeat == 10s);
  CHECK(o.max_wait == 10s);
  CHECK(o.poll_initial == 1ms);
  CHECK(o.poll_max == 8ms);
  CHECK(o.reap_after == 5min);
  CHECK(o.on_store_failure == idem::FailureMode::fail_open);
  CHECK(o.missing_key == idem::MissingKey::reject);
  CHECK(o.inline_body_limit == 0);

  // And they act: a reservation holds 30 s, a heartbeat at 10 s moves it to 40 s, a
  // completion is remembered 24 h, and the reaper waits 5 min after a lease's end.
  World w = blocking_world();
  const idem::KeyId id{"alpha", "payment.charge", "k1"};
  const idem::TimePoint t0 = w.clock->now();
  const Outcome out = w.idem->call(request("k1"), [&] {
    CHECK(w.store->load(id)->lease_until == t0 + 30s);
    w.clock->advance(9999ms);
    CHECK(w.store->load(id)->lease_until == t0 + 30s);
    w.clock->advance(1ms);  // the heartbeat, 10 s in
    CHECK(w.store->load(id)->lease_until == t0 + 40s);
    return w.charge_action(0ms)();
  });
  CHECK(out.expires_at == t0 + 10s + 24h);
  w.store->reserve({"alpha", "payment.charge", "dead"}, request("dead").fingerprint, w.clock->now(),
                   w.clock->now() + 30s);
  w.clock->advance(30s + 5min);
  CHECK(w.idem->reap().empty());  // exactly reap_after past the lease: not yet
  w.clock->advance(1ms);
  CHECK(w.idem->reap().size() == 1);
}

TEST_CASE("coordinator: a failed renewal is logged and retried, the next one keeps the lease") {
  std::vector<std::string> events;
  World w = blocking_world({.in_flight = InFlight::raise,
                            .lease = 1s,
                            .heartbeat = 300ms,
                            .log = [&](const idem::LogEvent& e) { events.emplace_back(e.event); }});
  const Outcome out = w.idem->call(request("k1"), [&] {
    w.faulty->fail(idem::sim::Operation::renew);
    w.clock->advance(700ms);  // renewals at 300 and 600 ms fail
    w.faulty->fail(idem::sim::Operation::renew, false);
    w.clock->advance(300ms);  // the one at 900 ms moves the lease to 1.9 s
    w.clock->advance(600ms);
    // 1.5 s in: without the retried renewal the lease would have ended at 1 s.
    CHECK_THROWS_AS(w.idem->call(request("k1"), w.charge_action()), idem::InProgressError);
    return w.charge_action(0ms)();
  });
  CHECK(out.source == Outcome::Source::executed);
  CHECK(std::count(events.begin(), events.end(), "renew_failed") == 2);
  CHECK(w.idem->metrics().store_errors == 2);
  CHECK(w.idem->metrics().lease_lost == 0);
  CHECK(w.charges() == 1);
}

TEST_CASE(
    "coordinator: a failed release is logged, the action's error propagates and the key stays "
    "reserved until its lease ends") {
  std::vector<std::string> events;
  World w = blocking_world({.lease = 30s, .heartbeat = 0ms, .log = [&](const idem::LogEvent& e) {
                              events.emplace_back(e.event);
                            }});
  w.faulty->fail(idem::sim::Operation::release);
  w.provider->inject(idem::sim::Fault::timeout);
  CHECK_THROWS_AS(w.idem->call(request("k1"), w.charge_action()), idem::sim::ProviderTimeout);
  CHECK(std::count(events.begin(), events.end(), "release_failed") == 1);
  CHECK(w.idem->metrics().store_errors == 1);
  CHECK(w.idem->metrics().released == 0);
  w.faulty->fail(idem::sim::Operation::release, false);
  CHECK(w.store->load({"alpha", "payment.charge", "k1"})->state == idem::State::in_progress);
  idem::Request retry = request("k1");
  retry.in_flight = InFlight::raise;
  CHECK_THROWS_AS(w.idem->call(retry, w.charge_action()), idem::InProgressError);
  CHECK(w.charges() == 0);
  w.clock->advance(30s);  // the lease ends: the retry takes over and really runs
  CHECK(w.idem->call(retry, w.charge_action()).source == Outcome::Source::executed);
  CHECK(w.charges() == 1);
}
