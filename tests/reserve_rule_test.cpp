// The reservation rule's table (lib/src/reserve_rule.hpp): every case is checked against the
// pure function, against SqliteStore (which calls it) and against PgStore (whose idem_reserve
// carries the rule in PL/pgSQL), so the two engines cannot drift apart.
#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "../lib/src/reserve_rule.hpp"
#include "idem/sim/simulated_clock.hpp"
#include "store_engines.hpp"

using namespace std::chrono_literals;
using idem::Reservation;
using idem::State;

namespace {

const idem::TimePoint T0 = idem::sim::kSimulationStart;
const idem::KeyId kId{"alpha", "payment.charge", "k1"};
const idem::Fingerprint kFp = idem::Fingerprint::of(nlohmann::json{{"amount", 1}});
const idem::Fingerprint kOtherFp = idem::Fingerprint::of(nlohmann::json{{"amount", 2}});
constexpr auto kLease = 30s;
constexpr auto kTtl = std::chrono::hours(1);

// The record a key holds when the second reservation comes, as the store's own writes leave it.
enum class Before {
  none,                          // no record
  in_progress_live,              // reserved at T0, lease to T0 + 30 s
  in_progress_expired,           // the same, its lease over
  in_progress_expired_progress,  // reserved, a step committed, its owner vanished
  completed_live,                // completed, TTL 1 h
  completed_expired,             // completed, its TTL over
  released,                      // released (no progress): counts as absent
  released_progress_kept,        // a step committed, then released for its retry, TTL 1 h
  released_progress_past_ttl,    // the same, its TTL over
};

struct Case {
  const char* name;
  Before before;
  bool same_request;  // the second reservation has the first one's fingerprint
  idem::TimePoint at;
  Reservation::Kind expect;
  bool resumes;  // the replacement keeps the record's progress and request (when it has any)
};

// clang-format off
const std::array kCases{
  Case{"no record",                                 Before::none,                         true,  T0,             Reservation::Kind::reserved,   false},
  Case{"in progress, lease running",                Before::in_progress_live,             true,  T0 + 10s,       Reservation::Kind::existing,   false},
  Case{"in progress, lease running, other request", Before::in_progress_live,             false, T0 + 10s,       Reservation::Kind::existing,   false},
  Case{"in progress, lease over",                   Before::in_progress_expired,          true,  T0 + 31s,       Reservation::Kind::taken_over, true},
  Case{"in progress, lease over, other request",    Before::in_progress_expired,          false, T0 + 31s,       Reservation::Kind::taken_over, false},
  Case{"with progress, lease over",                 Before::in_progress_expired_progress, true,  T0 + 31s,       Reservation::Kind::taken_over, true},
  Case{"with progress, lease over, other request",  Before::in_progress_expired_progress, false, T0 + 31s,       Reservation::Kind::existing,   false},
  Case{"completed, TTL running",                    Before::completed_live,               true,  T0 + 10s,       Reservation::Kind::existing,   false},
  Case{"completed, TTL running, other request",     Before::completed_live,               false, T0 + 10s,       Reservation::Kind::existing,   false},
  Case{"completed, TTL over",                       Before::completed_expired,            true,  T0 + 2h,        Reservation::Kind::reserved,   false},
  Case{"completed, TTL over, other request",        Before::completed_expired,            false, T0 + 2h,        Reservation::Kind::reserved,   false},
  Case{"released",                                  Before::released,                     true,  T0 + 10s,       Reservation::Kind::reserved,   false},
  Case{"released, other request",                   Before::released,                     false, T0 + 10s,       Reservation::Kind::reserved,   false},
  Case{"released with progress, TTL running",       Before::released_progress_kept,       true,  T0 + 10s,       Reservation::Kind::reserved,   true},
  Case{"released with progress, other request",     Before::released_progress_kept,       false, T0 + 10s,       Reservation::Kind::existing,   false},
  Case{"released with progress, TTL over",          Before::released_progress_past_ttl,   true,  T0 + 2h,        Reservation::Kind::reserved,   false},
  Case{"released with progress, TTL over, other",   Before::released_progress_past_ttl,   false, T0 + 2h,        Reservation::Kind::reserved,   false},
};
// clang-format on

bool has_progress(Before b) {
  return b == Before::in_progress_expired_progress || b == Before::released_progress_kept ||
         b == Before::released_progress_past_ttl;
}

// The record each `Before` stands for, as the pure function gets it.
std::optional<idem::Record> record_of(Before b) {
  if (b == Before::none) return std::nullopt;
  idem::Record r;
  r.fingerprint = kFp;
  r.token = 1000;
  r.created_at = T0;
  r.lease_until = T0 + kLease;
  r.expires_at = T0 + kLease;
  switch (b) {
    case Before::completed_live:
    case Before::completed_expired:
      r.state = State::completed;
      r.expires_at = T0 + 1s + kTtl;
      break;
    case Before::released:
      r.state = State::released;
      r.expires_at = T0 + 1s;
      break;
    case Before::released_progress_kept:
    case Before::released_progress_past_ttl:
      r.state = State::released;
      r.expires_at = T0 + 1s + kTtl;
      break;
    default:
      break;
  }
  return r;
}

// Leaves the key in `b` through the store's own writes; returns the token that holds it (0
// for none).
std::int64_t arrange(idem::Store& s, Before b) {
  if (b == Before::none) return 0;
  const Reservation r = s.reserve(kId, kFp, T0, T0 + kLease);
  REQUIRE(r.kind == Reservation::Kind::reserved);
  if (has_progress(b)) {
    idem::StepStore& steps = idem::steps_of(s);
    const auto began = steps.begin_steps(kId, r.token, "the first request");
    REQUIRE(began);
    REQUIRE(steps.commit_step(kId, r.token, began->origin,
                              idem::StepCommit{idem::StepResult{"debited", "ch_1"}, T0}));
  }
  switch (b) {
    case Before::completed_live:
    case Before::completed_expired:
      REQUIRE(s.complete(kId, r.token, idem::StoredResponse{{200, "ok", {}}, ""}, T0 + 1s + kTtl));
      break;
    case Before::released:
      REQUIRE(s.release(kId, r.token, T0 + 1s));
      break;
    case Before::released_progress_kept:
    case Before::released_progress_past_ttl: {
      // The release a failed call makes: kept for the request's retry until the TTL.
      idem::StoreOp op{.kind = idem::StoreOp::Kind::release,
                       .id = &kId,
                       .now = T0 + 1s,
                       .expires_at = T0 + 1s + kTtl,
                       .token = r.token};
      idem::StoreOp* ops[] = {&op};
      s.apply(ops);
      REQUIRE_FALSE(op.error);
      REQUIRE(op.applied);
      break;
    }
    default:
      break;
  }
  return r.token;
}

}  // namespace

TEST_CASE("reserve rule: the table, against the pure function") {
  for (const Case& c : kCases) {
    CAPTURE(c.name);
    const std::optional<idem::Record> before = record_of(c.before);
    const idem::detail::ReserveAnswer a =
        idem::detail::reserve_rule(before ? &*before : nullptr, has_progress(c.before),
                                   c.same_request ? kFp : kOtherFp, c.at, 5'000'000);
    CHECK(a.kind == c.expect);
    CHECK(a.resume == c.resumes);
    if (c.expect != Reservation::Kind::existing) {
      CHECK(a.token >= 5'000'000);
      if (before) CHECK(a.token > before->token);
    }
  }
  // The token passes the record's when the clock is behind it (after a clock step back).
  const std::optional<idem::Record> ahead = record_of(Before::released);
  CHECK(idem::detail::reserve_rule(&*ahead, false, kFp, T0 + 10s, 10).token == ahead->token + 1);
}

TEST_CASE_TEMPLATE("reserve rule: the table, against each engine", E, idem::test::SqliteEngine,
                   idem::test::PgEngine) {
  for (const Case& c : kCases) {
    CAPTURE(c.name);
    E engine;  // a database of its own for each case
    IDEM_ENGINE_OR_SKIP(engine);
    const auto s = engine.open();
    const std::int64_t first = arrange(*s, c.before);
    const Reservation r = s->reserve(kId, c.same_request ? kFp : kOtherFp, c.at, c.at + kLease);
    CHECK(r.kind == c.expect);
    if (r.kind == Reservation::Kind::existing) {
      REQUIRE(r.existing);
      CHECK(r.existing->token == first);
      CHECK(r.existing->fingerprint == kFp);
      continue;
    }
    CHECK(r.token > first);
    const std::optional<idem::Record> now = s->load(kId);
    REQUIRE(now);
    CHECK(now->state == State::in_progress);
    CHECK(now->token == r.token);
    CHECK(now->lease_until == c.at + kLease);
    CHECK(now->fingerprint == (c.same_request ? kFp : kOtherFp));
    // Resumed: the first owner's step and request are there. Otherwise the new owner starts
    // afresh.
    const bool kept = c.resumes && has_progress(c.before);
    const auto progress = idem::steps_of(*s).begin_steps(kId, r.token, "the second request");
    REQUIRE(progress);
    CHECK(progress->steps.size() == (kept ? 1u : 0u));
    CHECK(progress->request == (kept ? "the first request" : "the second request"));
  }
}
