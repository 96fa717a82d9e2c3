// The Store contract (idem/store.hpp), one body per rule run against every engine: what the
// coordinator relies on must hold whichever database keeps the keys. Engine-specific
// behaviour (files, schema versions, locks, commit counts) stays in each engine's own tests.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "idem/errors.hpp"
#include "idem/store.hpp"
#include "store_engines.hpp"

using namespace std::chrono_literals;
using idem::LocalTransaction;
using idem::Reservation;
using idem::State;
using idem::StepCommit;
using idem::StepResult;
using idem::Store;
using idem::StoreOp;
using idem::test::PgEngine;
using idem::test::SqliteEngine;

namespace {

const idem::TimePoint T0 = idem::sim::kSimulationStart;
const idem::KeyId kId{"alpha", "payment.charge", "k1"};
const idem::Fingerprint kFp = idem::Fingerprint::of(nlohmann::json{{"amount", 1}});
const idem::Fingerprint kOtherFp = idem::Fingerprint::of(nlohmann::json{{"amount", 2}});

idem::StoredResponse response(std::string body, int status = 200) {
  return idem::StoredResponse{idem::Response{status, std::move(body), {}}, ""};
}

Reservation reserve_at(Store& s, idem::TimePoint t, const idem::Fingerprint& fp = kFp,
                       const idem::KeyId& id = kId) {
  return s.reserve(id, fp, t, t + 30s);
}

// What an external step's mark confirms at `t`: a lease that still runs a second from then,
// renewed to a whole lease (30 s) from then.
idem::LeaseCheck lease_at(idem::TimePoint t) { return {t, t + 1s, t + 30s}; }

// The application's table local steps write: one order per id.
template <class E>
std::string create_orders(const E& e) {
  return fmt::format("CREATE TABLE IF NOT EXISTS {} (id TEXT PRIMARY KEY, amount BIGINT)",
                     e.table("app_orders"));
}

template <class E>
std::string insert_order(const E& e) {
  const std::string t = e.table("app_orders");
  return e.sql(fmt::format("INSERT INTO {} (id, amount) VALUES (?1, ?2)", t),
               fmt::format("INSERT INTO {} (id, amount) VALUES ($1, $2)", t));
}

// A local step's work: makes sure the table is there, then inserts one order.
template <class E>
std::function<void(LocalTransaction&)> add_order(const E& e, std::string id, std::int64_t amount) {
  return [&e, id, amount](LocalTransaction& tx) {
    tx.execute(create_orders(e));
    tx.execute(insert_order(e), {id, amount});
  };
}

// A value a local step read, as text: strings quoted, so a number that came back as text
// shows.
std::string text_of(const LocalTransaction::Value& v) {
  if (const auto* n = std::get_if<std::int64_t>(&v)) return std::to_string(*n);
  if (const auto* t = std::get_if<std::string>(&v)) return "'" + *t + "'";
  if (const auto* d = std::get_if<double>(&v)) return fmt::format("{}", *d);
  return "NULL";
}

// The orders committed so far, as "'id'=amount" in id order, read by a local step of a key of
// its own (operation "probe", so abandoned() of the tests' operations never sees it).
template <class E>
std::string orders(const E& e, Store& s) {
  static int probes = 0;
  const idem::KeyId probe{"alpha", "probe", fmt::format("p{}", probes++)};
  const Reservation r = s.reserve(probe, kFp, T0, T0 + 1000h);
  REQUIRE(r.kind == Reservation::Kind::reserved);
  REQUIRE(idem::steps_of(s).begin_steps(probe, r.token, "probe"));
  std::string out;
  const StepCommit read{
      StepResult{"read", "", false}, T0, [&](LocalTransaction& tx) {
        tx.execute(create_orders(e));
        for (const LocalTransaction::Row& row : tx.execute(
                 fmt::format("SELECT id, amount FROM {} ORDER BY id", e.table("app_orders")))) {
          if (!out.empty()) out += ' ';
          for (std::size_t c = 0; c < row.size(); ++c) {
            if (c > 0) out += '=';
            out += text_of(row[c]);
          }
        }
      }};
  REQUIRE(idem::steps_of(s).commit_step(probe, r.token, r.token, read));
  return out;
}

// The progress recorded on the record `token` holds, read back through begin_steps (which
// returns the recorded progress and changes nothing once there is one).
std::optional<idem::Progress> progress_of(Store& s, const idem::KeyId& id, std::int64_t token) {
  return idem::steps_of(s).begin_steps(id, token, "not stored: a request is stored once");
}

// The payloads of `messages`, in order, separated by spaces.
std::string payloads(const std::vector<idem::OutboxMessage>& messages) {
  std::string out;
  for (const idem::OutboxMessage& m : messages) out += (out.empty() ? "" : " ") + m.payload;
  return out;
}

// Commits a step on a fresh key `key` at `now` that queues one message with `payload`;
// returns the message's id.
std::string queue_message(Store& s, const std::string& key, idem::TimePoint now,
                          const std::string& payload) {
  const idem::KeyId id{"alpha", "checkout", key};
  const Reservation r = s.reserve(id, kFp, now, now + 30s);
  REQUIRE(r.kind == Reservation::Kind::reserved);
  REQUIRE(idem::steps_of(s).begin_steps(id, r.token, "{}"));
  std::string message_id;
  const StepCommit step{StepResult{"notified", "", false}, now,
                        [&](LocalTransaction& tx) { message_id = tx.enqueue("mail", payload); }};
  REQUIRE(idem::steps_of(s).commit_step(id, r.token, r.token, step));
  return message_id;
}

}  // namespace

// ---- reservations, completion and fencing ------------------------------------------------

TEST_CASE_TEMPLATE("store contract: reserve makes an in_progress record, a second reserve sees it",
                   E, SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const Reservation first = reserve_at(*s, T0);
  CHECK(first.kind == Reservation::Kind::reserved);
  CHECK(first.token > 0);
  const Reservation second = reserve_at(*s, T0 + 1s);
  REQUIRE(second.kind == Reservation::Kind::existing);
  CHECK(second.existing->state == State::in_progress);
  CHECK(second.existing->token == first.token);
  CHECK(second.existing->lease_until == T0 + 30s);
  CHECK(second.existing->fingerprint == kFp);
  // Another store on the same database (another process) sees it too.
  const auto other = engine.open();
  const Reservation third = reserve_at(*other, T0 + 2s);
  REQUIRE(third.kind == Reservation::Kind::existing);
  CHECK(third.existing->token == first.token);
  // Uniqueness is on the whole triple.
  CHECK(reserve_at(*s, T0, kFp, {"beta", "payment.charge", "k1"}).kind ==
        Reservation::Kind::reserved);
  CHECK(reserve_at(*s, T0, kFp, {"alpha", "order.cancel", "k1"}).kind ==
        Reservation::Kind::reserved);
}

TEST_CASE_TEMPLATE(
    "store contract: complete needs the current token and stores the response byte for byte", E,
    SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const Reservation r = reserve_at(*s, T0);
  idem::StoredResponse resp = response(std::string("{\"id\":\"ch_1\"}\0tail", 18), 402);
  resp.response.headers = {{"X-Trace", "abc"}, {"Content-Type", "application/json"}};
  CHECK_FALSE(s->complete(kId, r.token + 1, resp, T0 + 24h));
  CHECK(s->complete(kId, r.token, resp, T0 + 24h));
  CHECK_FALSE(s->complete(kId, r.token, resp, T0 + 24h));  // no longer in progress
  const auto rec = s->load(kId);
  REQUIRE(rec);
  CHECK(rec->state == State::completed);
  CHECK(rec->token == r.token);
  CHECK(rec->response == resp.response);
  CHECK(rec->response.body.size() == 18);
  CHECK(rec->body_ref.empty());
  CHECK(rec->expires_at == T0 + 24h);
  // A body kept elsewhere is stored as its reference.
  const idem::KeyId by_ref{"alpha", "payment.charge", "k2"};
  const Reservation r2 = reserve_at(*s, T0, kFp, by_ref);
  CHECK(s->complete(by_ref, r2.token, idem::StoredResponse{{201, "", {}}, "blob/7"}, T0 + 24h));
  CHECK(s->load(by_ref)->body_ref == "blob/7");
  CHECK(s->load(by_ref)->response.status == 201);
}

TEST_CASE_TEMPLATE("store contract: load_many answers each read as load() does", E, SqliteEngine,
                   PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const idem::KeyId done{"alpha", "payment.charge", "done"},
      absent{"alpha", "payment.charge", "no"};
  const Reservation held = reserve_at(*s, T0);  // kId: in progress
  const Reservation r = reserve_at(*s, T0, kFp, done);
  REQUIRE(s->complete(done, r.token, response("ch_2", 201), T0 + 24h));
  std::vector<idem::StoreRead> reads = {{&kId}, {&done}, {&absent}, {&done}};
  std::vector<idem::StoreRead*> batch;
  for (idem::StoreRead& read : reads) batch.push_back(&read);
  s->load_many(batch);
  for (const idem::StoreRead& read : reads) {
    CHECK_FALSE(read.error);
    const std::optional<idem::Record> alone = s->load(*read.id);
    REQUIRE(read.record.has_value() == alone.has_value());
    if (!alone) continue;
    CHECK(read.record->state == alone->state);
    CHECK(read.record->token == alone->token);
    CHECK(read.record->response == alone->response);
    CHECK(read.record->expires_at == alone->expires_at);
  }
  CHECK(reads[0].record->token == held.token);
  CHECK(reads[0].record->state == State::in_progress);
  CHECK(reads[1].record->response.body == "ch_2");
  CHECK_FALSE(reads[2].record);
  s->load_many({});  // nothing to read: nothing happens
}

TEST_CASE_TEMPLATE(
    "store contract: an expired lease is taken over with a larger token, the zombie is fenced", E,
    SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const Reservation first = reserve_at(*s, T0);
  CHECK(reserve_at(*s, T0 + 29s).kind == Reservation::Kind::existing);
  const Reservation second = reserve_at(*s, T0 + 30s);
  CHECK(second.kind == Reservation::Kind::taken_over);
  CHECK(second.token > first.token);
  CHECK_FALSE(s->complete(kId, first.token, response("zombie"), T0 + 24h));
  CHECK_FALSE(s->release(kId, first.token, T0 + 31s));
  CHECK_FALSE(s->renew(kId, first.token, T0 + 90s));
  CHECK(s->complete(kId, second.token, response("owner"), T0 + 24h));
  CHECK(s->load(kId)->response.body == "owner");
}

TEST_CASE_TEMPLATE("store contract: tokens grow across release, expiry and purge", E, SqliteEngine,
                   PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const Reservation a = reserve_at(*s, T0);
  CHECK(s->release(kId, a.token, T0 + 1ms));
  CHECK(s->load(kId)->state == State::released);
  const Reservation b = reserve_at(*s, T0 + 1ms);  // released counts as absent
  CHECK(b.kind == Reservation::Kind::reserved);
  CHECK(b.token > a.token);
  CHECK(s->complete(kId, b.token, response("x"), T0 + 2min));
  CHECK(reserve_at(*s, T0 + 2min - 1ms).kind == Reservation::Kind::existing);
  const Reservation c = reserve_at(*s, T0 + 2min);  // TTL over: counts as absent
  CHECK(c.kind == Reservation::Kind::reserved);
  CHECK(c.token > b.token);
  CHECK(s->release(kId, c.token, T0 + 2min));
  CHECK(s->purge_expired(T0 + 3min, 10) == 1);
  CHECK_FALSE(s->load(kId));
  CHECK(reserve_at(*s, T0 + 3min).token > c.token);
}

TEST_CASE_TEMPLATE("store contract: renew extends only the current lease", E, SqliteEngine,
                   PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const Reservation r = reserve_at(*s, T0);
  CHECK_FALSE(s->renew(kId, r.token + 1, T0 + 90s));
  CHECK(s->renew(kId, r.token, T0 + 60s));
  CHECK(s->load(kId)->lease_until == T0 + 60s);
  CHECK(reserve_at(*s, T0 + 45s).kind == Reservation::Kind::existing);
  CHECK(reserve_at(*s, T0 + 60s).kind == Reservation::Kind::taken_over);
}

TEST_CASE_TEMPLATE("store contract: a takeover by the same request keeps the recovery point", E,
                   SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const Reservation r = reserve_at(*s, T0);
  const auto began = s->begin_steps(kId, r.token, "request-1");
  REQUIRE(began);
  CHECK(s->commit_step(kId, r.token, began->origin, StepCommit{StepResult{"debited", "ch_1"}, T0}));
  CHECK_FALSE(s->commit_step(kId, r.token + 1, began->origin,
                             StepCommit{StepResult{"notified", "m_1"}, T0}));
  CHECK(s->load(kId)->recovery_point == std::optional<std::string>("debited"));
  const Reservation same = reserve_at(*s, T0 + 31s);
  CHECK(same.kind == Reservation::Kind::taken_over);
  CHECK(s->load(kId)->recovery_point == std::optional<std::string>("debited"));
  const auto resumed = s->begin_steps(kId, same.token, "request-1");
  REQUIRE(resumed);
  REQUIRE(resumed->steps.size() == 1);
  CHECK(resumed->steps[0].step == "debited");
  // A different request is refused even once that lease is over: money may have moved under
  // the first (the rule's table, tests/reserve_rule_test.cpp, has the case without progress).
  const Reservation other = reserve_at(*s, T0 + 62s, kOtherFp);
  CHECK(other.kind == Reservation::Kind::existing);
  CHECK(s->load(kId)->recovery_point == std::optional<std::string>("debited"));
  CHECK(s->load(kId)->fingerprint == kFp);
}

TEST_CASE_TEMPLATE(
    "store contract: store_if_absent stores once and returns the winner to the loser", E,
    SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  CHECK_FALSE(s->store_if_absent(kId, kFp, response("ch_1"), T0, T0 + 24h));
  const auto winner = s->store_if_absent(kId, kFp, response("ch_2"), T0 + 1s, T0 + 24h);
  REQUIRE(winner);
  CHECK(winner->state == State::completed);
  CHECK(winner->response.body == "ch_1");
  CHECK_FALSE(s->store_if_absent(kId, kFp, response("ch_3"), T0 + 25h, T0 + 48h));
  CHECK(s->load(kId)->response.body == "ch_3");
  CHECK(s->load(kId)->expires_at == T0 + 48h);
}

TEST_CASE_TEMPLATE(
    "store contract: purge deletes only records that no longer count, in bounded batches", E,
    SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  auto key = [](int i) { return idem::KeyId{"alpha", "op", "k" + std::to_string(i)}; };
  for (int i = 0; i < 25; ++i) {
    const Reservation r = reserve_at(*s, T0, kFp, key(i));
    if (i < 20) CHECK(s->complete(key(i), r.token, response("x"), T0 + (i < 15 ? 1min : 1h)));
  }
  // 15 expired at +1min, 5 live until +1h, 5 in progress (never purged, only reaped).
  CHECK(s->purge_expired(T0 + 2min, 10) == 10);
  CHECK(s->purge_expired(T0 + 2min, 10) == 5);
  CHECK(s->purge_expired(T0 + 2min, 10) == 0);
  for (int i = 0; i < 25; ++i) {
    CAPTURE(i);
    CHECK(s->load(key(i)).has_value() == (i >= 15));
  }
}

TEST_CASE_TEMPLATE("store contract: reap clears reservations whose lease ended long ago", E,
                   SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const Reservation old = reserve_at(*s, T0);
  reserve_at(*s, T0 + 10min, kFp, {"alpha", "payment.charge", "fresh"});
  const auto reaped = s->reap(T0 + 6min, 100);
  REQUIRE(reaped.size() == 1);
  CHECK(reaped[0].token == old.token);
  CHECK(reaped[0].key_hash == idem::short_hash(kId));
  CHECK(reaped[0].operation == "payment.charge");
  CHECK(reaped[0].lease_until == T0 + 30s);
  CHECK_FALSE(s->load(kId));
  CHECK(s->load({"alpha", "payment.charge", "fresh"}));
  CHECK(s->reap(T0 + 6min, 100).empty());
}

TEST_CASE_TEMPLATE("store contract: a renewed lease is reaped only once the renewed lease ended", E,
                   SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const Reservation r = reserve_at(*s, T0);
  CHECK(s->renew(kId, r.token, T0 + 10min));
  CHECK(s->reap(T0 + 6min, 100).empty());
  CHECK(s->load(kId)->state == State::in_progress);
  CHECK(s->reap(T0 + 10min, 100).empty());
  const auto reaped = s->reap(T0 + 10min + 1ms, 100);
  REQUIRE(reaped.size() == 1);
  CHECK(reaped[0].lease_until == T0 + 10min);
  CHECK_FALSE(s->load(kId));
}

TEST_CASE_TEMPLATE("store contract: group commit: apply gives each op its own outcome", E,
                   SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const idem::KeyId k1{"alpha", "op", "k1"}, k2{"alpha", "op", "k2"}, k3{"alpha", "op", "k3"},
      k4{"alpha", "op", "k4"}, k5{"alpha", "op", "k5"};
  const Reservation held = reserve_at(*s, T0, kFp, k2);  // k2: live, someone else's
  const Reservation mine = reserve_at(*s, T0, kFp, k3);  // k3: ours, to complete
  const Reservation gone = reserve_at(*s, T0, kFp, k5);  // k5: ours, to release

  StoreOp fresh, dup, busy, done, stale;
  fresh.kind = dup.kind = busy.kind = StoreOp::Kind::reserve;
  fresh.id = dup.id = &k1;
  busy.id = &k2;
  fresh.fingerprint = dup.fingerprint = busy.fingerprint = &kFp;
  fresh.now = dup.now = busy.now = T0 + 1s;
  fresh.lease_until = dup.lease_until = busy.lease_until = T0 + 31s;
  const idem::StoredResponse body = response("ch_3");
  done.kind = stale.kind = StoreOp::Kind::complete;
  done.id = &k3;
  stale.id = &k2;
  done.token = mine.token;
  stale.token = held.token + 1;  // not current
  done.response = stale.response = &body;
  done.expires_at = stale.expires_at = T0 + 24h;
  const idem::StoredResponse run = response("ch_4");
  StoreOp cached{.kind = StoreOp::Kind::store_if_absent,
                 .id = &k4,
                 .fingerprint = &kFp,
                 .now = T0 + 1s,
                 .expires_at = T0 + 24h,
                 .response = &run};
  StoreOp released{.kind = StoreOp::Kind::release, .id = &k5, .now = T0 + 1s, .token = gone.token};
  std::vector<StoreOp*> ops = {&fresh, &dup, &busy, &done, &stale, &cached, &released};
  s->apply(ops);

  for (const StoreOp* op : ops) CHECK_FALSE(op->error);
  CHECK(fresh.reservation.kind == Reservation::Kind::reserved);
  // The same key earlier in the batch holds it.
  REQUIRE(dup.reservation.kind == Reservation::Kind::existing);
  CHECK(dup.reservation.existing->token == fresh.reservation.token);
  REQUIRE(busy.reservation.kind == Reservation::Kind::existing);
  CHECK(busy.reservation.existing->token == held.token);
  CHECK(done.applied);
  CHECK_FALSE(stale.applied);
  CHECK(cached.reservation.kind == Reservation::Kind::reserved);  // it stored its response
  CHECK(released.applied);
  CHECK(s->load(k1)->token == fresh.reservation.token);
  CHECK(s->load(k2)->state == State::in_progress);
  CHECK(s->load(k3)->response.body == "ch_3");
  CHECK(s->load(k4)->response.body == "ch_4");
  CHECK(s->load(k5)->state == State::released);
}

// ---- multi-step operations ----------------------------------------------------------------

TEST_CASE_TEMPLATE(
    "store contract: begin_steps stores the request once and starts a fresh progress at the "
    "token, a stale token gets nothing",
    E, SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const Reservation r = reserve_at(*s, T0);
  const auto fresh = s->begin_steps(kId, r.token, "request-1");
  REQUIRE(fresh);
  CHECK(fresh->origin == r.token);
  CHECK(fresh->steps.empty());
  CHECK_FALSE(fresh->pending);
  CHECK(fresh->request == "request-1");
  CHECK_FALSE(s->begin_steps(kId, r.token + 1, "request-1"));
  REQUIRE(s->commit_step(kId, r.token, fresh->origin,
                         StepCommit{StepResult{"debited", "ch_1", false}, T0 + 1s}));
  // The owner vanishes; the same request takes over and resumes with what was stored.
  const Reservation next = reserve_at(*s, T0 + 31s);
  REQUIRE(next.kind == Reservation::Kind::taken_over);
  CHECK(s->load(kId)->recovery_point == std::optional<std::string>("debited"));
  CHECK_FALSE(s->begin_steps(kId, r.token, "request-1"));  // the old owner is stale now
  const auto resumed = s->begin_steps(kId, next.token, "request-2");
  REQUIRE(resumed);
  CHECK(resumed->origin == r.token);
  CHECK(resumed->request == "request-1");
  REQUIRE(resumed->steps.size() == 1);
  CHECK(resumed->steps[0].step == "debited");
  CHECK(resumed->steps[0].result == "ch_1");
  CHECK_FALSE(resumed->steps[0].reconciled);
}

TEST_CASE_TEMPLATE(
    "store contract: commit_step runs the local work, appends the step and queues its messages "
    "in one transaction",
    E, SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const Reservation r = reserve_at(*s, T0);
  const auto p = s->begin_steps(kId, r.token, "{}");
  REQUIRE(p);
  const std::int64_t origin = p->origin;

  // An external step: pending before its call, cleared when its result is recorded.
  CHECK(s->mark_pending(kId, r.token, origin, "debited", lease_at(T0)));
  CHECK_FALSE(s->mark_pending(kId, r.token + 1, origin, "debited", lease_at(T0)));
  REQUIRE(progress_of(*s, kId, r.token));
  CHECK(progress_of(*s, kId, r.token)->pending == std::optional<std::string>("debited"));
  CHECK(progress_of(*s, kId, r.token)->origin == origin);
  CHECK(s->commit_step(kId, r.token, origin,
                       StepCommit{StepResult{"debited", "ch_1", true}, T0 + 1s}));
  CHECK_FALSE(progress_of(*s, kId, r.token)->pending);
  CHECK(s->load(kId)->recovery_point == std::optional<std::string>("debited"));

  // A local step: the order row, the message and the recovery point commit together; a
  // pending mark of another step stays.
  CHECK(s->mark_pending(kId, r.token, origin, "shipped", lease_at(T0 + 2s)));
  std::int64_t inserted = -1;
  std::string message;
  const StepCommit order{StepResult{"order_created", "A-1", false}, T0 + 2s,
                         [&](LocalTransaction& tx) {
                           add_order(engine, "A-1", 4990)(tx);
                           inserted = tx.changes();
                           message = tx.enqueue("mail", "receipt A-1");
                         }};
  CHECK(s->commit_step(kId, r.token, origin, order));
  CHECK(inserted == 1);
  CHECK(message == idem::outbox_message_id(kId, origin, "order_created", 0));
  CHECK(orders(engine, *s) == "'A-1'=4990");
  CHECK(s->outbox_counts().pending == 1);
  CHECK(s->load(kId)->recovery_point == std::optional<std::string>("order_created"));
  const auto after = progress_of(*s, kId, r.token);
  REQUIRE(after);
  CHECK(after->origin == origin);
  CHECK(after->pending == std::optional<std::string>("shipped"));
  REQUIRE(after->steps.size() == 2);
  CHECK(after->steps[0].step == "debited");
  CHECK(after->steps[0].result == "ch_1");
  CHECK(after->steps[0].reconciled);
  CHECK(after->steps[1].step == "order_created");
  CHECK(after->steps[1].result == "A-1");
  CHECK_FALSE(after->steps[1].reconciled);
  // The message as a dispatcher gets it.
  const auto claimed = s->claim_outbox(T0 + 2s, T0 + 12s, 10);
  REQUIRE(claimed.size() == 1);
  CHECK(claimed[0].id == message);
  CHECK(claimed[0].topic == "mail");
  CHECK(claimed[0].payload == "receipt A-1");
  CHECK(claimed[0].attempts == 0);
  CHECK(claimed[0].created_at == T0 + 2s);
}

TEST_CASE_TEMPLATE(
    "store contract: a reservation keeps the claim its writer chose, for load() and for a "
    "duplicate's reservation to return",
    E, SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  StoreOp op{.kind = StoreOp::Kind::reserve,
             .id = &kId,
             .fingerprint = &kFp,
             .now = T0,
             .lease_until = T0 + 30s,
             .claim = 0x7eadbeef12345};
  StoreOp* one = &op;
  s->apply(std::span<StoreOp* const>(&one, 1));
  REQUIRE_FALSE(op.error);
  REQUIRE(op.reservation.kind == Reservation::Kind::reserved);
  CHECK(s->load(kId)->claim == 0x7eadbeef12345);
  const Reservation dup = reserve_at(*s, T0 + 1s);
  REQUIRE(dup.kind == Reservation::Kind::existing);
  CHECK(dup.existing->claim == 0x7eadbeef12345);
  // A takeover writes its own claim (here none).
  const Reservation next = reserve_at(*s, T0 + 31s);
  REQUIRE(next.kind == Reservation::Kind::taken_over);
  CHECK(s->load(kId)->claim == 0);
}

TEST_CASE_TEMPLATE(
    "store contract: mark_pending refuses a current token whose lease ends before the call "
    "margin, and renews the lease it accepts",
    E, SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const Reservation r = reserve_at(*s, T0);  // leased until T0 + 30 s
  const auto p = s->begin_steps(kId, r.token, "{}");
  REQUIRE(p);
  const std::int64_t origin = p->origin;
  const auto lease_until = [&] { return s->load(kId)->lease_until; };

  // Half a second left, a second needed: refused, nothing written.
  CHECK_FALSE(
      s->mark_pending(kId, r.token, origin, "debited", {T0 + 29500ms, T0 + 30500ms, T0 + 59500ms}));
  CHECK_FALSE(progress_of(*s, kId, r.token)->pending);
  CHECK(lease_until() == T0 + 30s);
  // Enough left: marked, and the lease renewed to a whole lease from the mark.
  CHECK(s->mark_pending(kId, r.token, origin, "debited", {T0 + 10s, T0 + 11s, T0 + 40s}));
  CHECK(progress_of(*s, kId, r.token)->pending == std::optional<std::string>("debited"));
  CHECK(lease_until() == T0 + 40s);
  // A lease that already runs longer than the renewal is kept as it is.
  CHECK(s->mark_pending(kId, r.token, origin, "shipped", {T0 + 5s, T0 + 6s, T0 + 35s}));
  CHECK(lease_until() == T0 + 40s);
  CHECK(progress_of(*s, kId, r.token)->pending == std::optional<std::string>("shipped"));
  // Too close to its end again, then past it with nobody taking the key over: the token is
  // still current, and both are refused all the same.
  CHECK_FALSE(s->mark_pending(kId, r.token, origin, "debited", {T0 + 39s, T0 + 41s, T0 + 69s}));
  CHECK_FALSE(s->mark_pending(kId, r.token, origin, "debited", {T0 + 45s, T0 + 46s, T0 + 75s}));
  CHECK(lease_until() == T0 + 40s);
  CHECK(progress_of(*s, kId, r.token)->pending == std::optional<std::string>("shipped"));
}

TEST_CASE_TEMPLATE(
    "store contract: a zombie's commit_step returns false and neither runs nor commits anything", E,
    SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto zombie_store = engine.open();
  const auto owner_store = engine.open();  // the new owner is another process
  const Reservation zombie = reserve_at(*zombie_store, T0);
  const auto p = idem::steps_of(*zombie_store).begin_steps(kId, zombie.token, "{}");
  REQUIRE(p);
  REQUIRE(idem::steps_of(*zombie_store)
              .commit_step(kId, zombie.token, p->origin,
                           StepCommit{StepResult{"debited", "ch_1", false}, T0 + 1s,
                                      add_order(engine, "A-1", 4990)}));
  const Reservation owner = reserve_at(*owner_store, T0 + 31s);
  REQUIRE(owner.kind == Reservation::Kind::taken_over);

  bool ran = false;
  const StepCommit late{StepResult{"order_created", "Z-1", false}, T0 + 32s,
                        [&](LocalTransaction& tx) {
                          ran = true;
                          add_order(engine, "Z-1", 1)(tx);
                          tx.enqueue("mail", "from the zombie");
                        }};
  CHECK_FALSE(idem::steps_of(*zombie_store).commit_step(kId, zombie.token, p->origin, late));
  CHECK_FALSE(ran);
  CHECK_FALSE(idem::steps_of(*zombie_store)
                  .mark_pending(kId, zombie.token, p->origin, "order_created", lease_at(T0 + 32s)));
  CHECK(orders(engine, *owner_store) == "'A-1'=4990");
  CHECK(idem::steps_of(*owner_store).outbox_counts().pending == 0);
  CHECK(owner_store->load(kId)->recovery_point == std::optional<std::string>("debited"));
  const auto progress = progress_of(*owner_store, kId, owner.token);
  REQUIRE(progress);
  CHECK_FALSE(progress->pending);
  REQUIRE(progress->steps.size() == 1);
  CHECK(progress->steps[0].step == "debited");
  // Once the owner completed, no token may add a step.
  CHECK(owner_store->complete(kId, owner.token, response("done"), T0 + 24h));
  CHECK_FALSE(idem::steps_of(*owner_store).commit_step(kId, owner.token, p->origin, late));
  CHECK_FALSE(ran);
}

TEST_CASE_TEMPLATE("store contract: a local step that throws rolls back the whole step", E,
                   SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const Reservation r = reserve_at(*s, T0);
  const auto p = s->begin_steps(kId, r.token, "{}");
  REQUIRE(p);
  REQUIRE(s->commit_step(
      kId, r.token, p->origin,
      StepCommit{StepResult{"debited", "ch_1", false}, T0 + 1s, add_order(engine, "A-1", 4990)}));
  REQUIRE(s->mark_pending(kId, r.token, p->origin, "order_created", lease_at(T0 + 1s)));

  // The application's own exception propagates as it was thrown.
  std::string first_id;
  const StepCommit failing{StepResult{"order_created", "B-2", false}, T0 + 2s,
                           [&](LocalTransaction& tx) {
                             add_order(engine, "B-2", 10)(tx);
                             first_id = tx.enqueue("mail", "receipt B-2");
                             throw std::runtime_error("disk full in the middle");
                           }};
  CHECK_THROWS_WITH_AS(s->commit_step(kId, r.token, p->origin, failing), "disk full in the middle",
                       std::runtime_error);
  // A statement the database refuses (a second A-1) is a StoreError, and rolls back too.
  const StepCommit refused{
      StepResult{"order_created", "B-2", false}, T0 + 2s, [&](LocalTransaction& tx) {
        add_order(engine, "B-2", 10)(tx);
        tx.enqueue("mail", "receipt B-2");
        tx.execute(insert_order(engine), {std::string("A-1"), std::int64_t{1}});
      }};
  CHECK_THROWS_AS(s->commit_step(kId, r.token, p->origin, refused), idem::StoreError);

  CHECK(orders(engine, *s) == "'A-1'=4990");
  CHECK(s->outbox_counts().pending == 0);
  CHECK(s->load(kId)->recovery_point == std::optional<std::string>("debited"));
  const auto unchanged = progress_of(*s, kId, r.token);
  REQUIRE(unchanged);
  CHECK(unchanged->pending == std::optional<std::string>("order_created"));
  REQUIRE(unchanged->steps.size() == 1);
  CHECK(unchanged->steps[0].step == "debited");

  // The key is still ours: the step commits on a retry, its message under the same id.
  std::string retry_id;
  const StepCommit retry{StepResult{"order_created", "B-2", false}, T0 + 3s,
                         [&](LocalTransaction& tx) {
                           add_order(engine, "B-2", 10)(tx);
                           retry_id = tx.enqueue("mail", "receipt B-2");
                         }};
  CHECK(s->commit_step(kId, r.token, p->origin, retry));
  CHECK(retry_id == first_id);
  CHECK(orders(engine, *s) == "'A-1'=4990 'B-2'=10");
  CHECK(s->outbox_counts().pending == 1);
  CHECK_FALSE(progress_of(*s, kId, r.token)->pending);
}

TEST_CASE_TEMPLATE(
    "store contract: abandoned finds operations whose owner vanished mid-way, of the operations "
    "asked, oldest first",
    E, SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  // Key names run against lease order, so an engine that returns rows in key order fails.
  struct Op {
    idem::KeyId id;
    idem::TimePoint at;
    idem::TimePoint lease_until;
    bool step;      // made progress
    bool complete;  // finished
  };
  const std::vector<Op> ops = {
      {{"alpha", "checkout", "k3"}, T0, T0 + 30s, true, false},        // abandoned first
      {{"alpha", "refund", "k2"}, T0 + 5s, T0 + 35s, true, false},     // another operation
      {{"alpha", "checkout", "k1"}, T0 + 10s, T0 + 40s, true, false},  // abandoned second
      {{"alpha", "checkout", "k4"}, T0, T0 + 30s, false, false},       // no progress: the reaper's
      {{"alpha", "checkout", "k5"}, T0, T0 + 30s, true, true},         // completed
      {{"alpha", "checkout", "k6"}, T0, T0 + 5min, true, false},       // its lease still runs
  };
  for (const Op& op : ops) {
    const Reservation r = s->reserve(op.id, kFp, op.at, op.lease_until);
    REQUIRE(r.kind == Reservation::Kind::reserved);
    REQUIRE(s->begin_steps(op.id, r.token, "request of " + op.id.key));
    if (op.step) {
      REQUIRE(s->commit_step(op.id, r.token, r.token,
                             StepCommit{StepResult{"debited", "ch", false}, op.at}));
    }
    if (op.complete) REQUIRE(s->complete(op.id, r.token, response("done"), T0 + 24h));
  }
  const std::vector<std::string> checkout = {"checkout"};
  const auto found = s->abandoned(T0 + 1min, T0 + 1min, 10, checkout);
  REQUIRE(found.size() == 2);
  CHECK(found[0].id == ops[0].id);
  CHECK(found[0].state == State::in_progress);
  CHECK(found[0].fingerprint == kFp);
  CHECK(found[0].request == "request of k3");
  CHECK(found[1].id == ops[2].id);
  CHECK(found[1].request == "request of k1");

  const auto first = s->abandoned(T0 + 1min, T0 + 1min, 1, checkout);
  REQUIRE(first.size() == 1);
  CHECK(first[0].id == ops[0].id);
  // Idle since before 35 s: k1's lease ran until 40 s.
  const auto idle = s->abandoned(T0 + 35s, T0 + 1min, 10, checkout);
  REQUIRE(idle.size() == 1);
  CHECK(idle[0].id == ops[0].id);

  const std::vector<std::string> both = {"checkout", "refund"};
  const auto all = s->abandoned(T0 + 1min, T0 + 1min, 10, both);
  REQUIRE(all.size() == 3);
  CHECK(all[0].id == ops[0].id);
  CHECK(all[1].id == ops[1].id);
  CHECK(all[2].id == ops[2].id);
  const std::vector<std::string> none = {"payment.charge"};
  CHECK(s->abandoned(T0 + 1min, T0 + 1min, 10, none).empty());
}

TEST_CASE_TEMPLATE(
    "store contract: a released record with progress is kept for its retry until the TTL counted "
    "from its origin",
    E, SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const idem::KeyId retried{"alpha", "checkout", "retried"};
  const idem::KeyId kept{"alpha", "checkout", "kept"};
  const idem::KeyId plain{"alpha", "checkout", "plain"};
  // Each began at T0, recorded a step and failed at T0 + 10s.
  std::vector<Reservation> began;
  for (const idem::KeyId* id : {&retried, &kept, &plain}) {
    const Reservation r = reserve_at(*s, T0, kFp, *id);
    REQUIRE(s->begin_steps(*id, r.token, "request of " + id->key));
    REQUIRE(s->commit_step(*id, r.token, r.token,
                           StepCommit{StepResult{"debited", "ch_1", false}, T0 + 1s}));
    began.push_back(r);
  }
  // The release a failed call makes: StoreOp with a TTL of 1 h (expires_at - now).
  StoreOp release_retried{.kind = StoreOp::Kind::release,
                          .id = &retried,
                          .now = T0 + 10s,
                          .expires_at = T0 + 10s + 1h,
                          .token = began[0].token};
  StoreOp release_kept = release_retried;
  release_kept.id = &kept;
  release_kept.token = began[1].token;
  StoreOp stale = release_kept;
  stale.token = began[1].token + 1;
  std::vector<StoreOp*> ops = {&release_retried, &release_kept, &stale};
  s->apply(ops);
  for (const StoreOp* op : ops) CHECK_FALSE(op->error);
  CHECK(release_retried.applied);
  CHECK(release_kept.applied);
  CHECK_FALSE(stale.applied);
  // The single-op release keeps nothing: its record is gone with the first purge.
  CHECK(s->release(plain, began[2].token, T0 + 10s));
  CHECK(s->load(kept)->state == State::released);
  CHECK(s->purge_expired(T0 + 10s, 10) == 1);
  CHECK_FALSE(s->load(plain));

  // Another request under the key is refused meanwhile: money may have moved under the first.
  const Reservation other = reserve_at(*s, T0 + 20s, kOtherFp, retried);
  REQUIRE(other.kind == Reservation::Kind::existing);
  CHECK(other.existing->state == State::released);
  // The same request resumes: at once (no lease to wait out), with its progress.
  const Reservation again = reserve_at(*s, T0 + 20s, kFp, retried);
  CHECK(again.kind == Reservation::Kind::reserved);
  CHECK(again.token > began[0].token);
  CHECK(s->load(retried)->recovery_point == std::optional<std::string>("debited"));
  const auto resumed = s->begin_steps(retried, again.token, "a new request");
  REQUIRE(resumed);
  CHECK(resumed->origin == began[0].token);
  CHECK(resumed->request == "request of retried");
  REQUIRE(resumed->steps.size() == 1);
  CHECK(resumed->steps[0].result == "ch_1");
  CHECK(s->complete(retried, again.token, response("done"), T0 + 24h));

  // The completer sees the kept record while it is kept, as released.
  const std::vector<std::string> checkout = {"checkout"};
  const auto found = s->abandoned(T0 + 30min, T0 + 30min, 10, checkout);
  REQUIRE(found.size() == 1);
  CHECK(found[0].id == kept);
  CHECK(found[0].state == State::released);
  CHECK(found[0].request == "request of kept");
  // The TTL runs from the origin (T0), not from the release (T0 + 10s).
  CHECK(s->abandoned(T0 + 30min, T0 + 1h + 1s, 10, checkout).empty());
  CHECK(s->purge_expired(T0 + 1h - 1s, 10) == 0);
  CHECK(s->purge_expired(T0 + 1h + 1s, 10) == 1);
  CHECK_FALSE(s->load(kept));
}

// ---- the outbox ---------------------------------------------------------------------------

TEST_CASE_TEMPLATE(
    "store contract: claim_outbox returns due messages oldest first, and not again before "
    "claim_until",
    E, SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  // Queued out of order: the second message first.
  const std::string second = queue_message(*s, "k1", T0 + 2s, "second");
  const std::string first = queue_message(*s, "k2", T0 + 1s, "first");
  const std::string later = queue_message(*s, "k3", T0 + 5s, "later");
  CHECK(s->outbox_counts().pending == 3);

  CHECK(s->claim_outbox(T0, T0 + 10s, 10).empty());  // nothing due yet
  const auto oldest = s->claim_outbox(T0 + 3s, T0 + 13s, 1);
  REQUIRE(oldest.size() == 1);
  CHECK(oldest[0].id == first);
  CHECK(oldest[0].payload == "first");
  CHECK(oldest[0].created_at == T0 + 1s);
  const auto claimed = s->claim_outbox(T0 + 3s, T0 + 13s, 10);
  REQUIRE(claimed.size() == 1);
  CHECK(claimed[0].id == second);
  CHECK(claimed[0].payload == "second");
  CHECK(claimed[0].created_at == T0 + 2s);
  // Claimed messages are skipped until their claim ends.
  const auto next = s->claim_outbox(T0 + 12s, T0 + 22s, 10);
  CHECK(payloads(next) == "later");
  REQUIRE(next.size() == 1);
  CHECK(next[0].id == later);
  CHECK(s->claim_outbox(T0 + 12s + 999ms, T0 + 22s, 10).empty());
  // A claim that ended without an outcome (the dispatcher died) makes them due again.
  CHECK(payloads(s->claim_outbox(T0 + 13s, T0 + 23s, 10)) == "first second");
  CHECK(s->outbox_counts().pending == 3);  // claimed is still pending
}

TEST_CASE_TEMPLATE(
    "store contract: delivered, failed (retried or parked), counted and purged outbox messages", E,
    SqliteEngine, PgEngine) {
  E engine;
  IDEM_ENGINE_OR_SKIP(engine);
  const auto s = engine.open();
  const std::string m1 = queue_message(*s, "k1", T0, "m1");
  const std::string m2 = queue_message(*s, "k2", T0 + 1ms, "m2");
  const std::string m3 = queue_message(*s, "k3", T0 + 2ms, "m3");
  const std::string m4 = queue_message(*s, "k4", T0 + 3ms, "m4");
  const std::string m5 = queue_message(*s, "k5", T0 + 4ms, "m5");
  const auto all = s->claim_outbox(T0 + 1s, T0 + 31s, 10);
  CHECK(payloads(all) == "m1 m2 m3 m4 m5");
  REQUIRE(all.size() == 5);
  CHECK(all[0].id == m1);
  CHECK(all[4].id == m5);

  using Ids = std::vector<std::string>;
  CHECK(s->outbox_delivered(Ids{m1}, T0 + 2s) == 1);
  CHECK(s->outbox_delivered(Ids{m1}, T0 + 3s) == 0);  // no longer pending
  CHECK(s->outbox_delivered(Ids{}, T0 + 3s) == 0);
  // Several at once: only the pending ones count (m1 is delivered already, the last id is
  // nobody's); the others are left as they are.
  CHECK(s->outbox_delivered(Ids{m4, m1, m5, "msg_unknown"}, T0 + 4s) == 2);
  s->outbox_failed(m2, T0 + 10s, false, "timeout");  // due again at T0 + 10s
  s->outbox_failed(m3, T0 + 10s, true, "rejected");  // parked for good
  CHECK(s->outbox_delivered(Ids{m3}, T0 + 5s) == 0);
  idem::OutboxCounts c = s->outbox_counts();
  CHECK(c.pending == 1);
  CHECK(c.delivered == 3);
  CHECK(c.parked == 1);

  // The retry comes at retry_at, not at the end of the claim, with the failure counted.
  CHECK(s->claim_outbox(T0 + 10s - 1ms, T0 + 20s, 10).empty());
  const auto retry = s->claim_outbox(T0 + 10s, T0 + 20s, 10);
  REQUIRE(retry.size() == 1);
  CHECK(retry[0].id == m2);
  CHECK(retry[0].attempts == 1);
  CHECK(retry[0].payload == "m2");
  // A parked message is never due again; m2 is, once its claim is over.
  CHECK(payloads(s->claim_outbox(T0 + 100h, T0 + 101h, 10)) == "m2");

  // Purge takes delivered messages only, delivered strictly before the bound, in batches.
  CHECK(s->purge_outbox(T0 + 2s, 10) == 0);
  CHECK(s->purge_outbox(T0 + 5s, 2) == 2);
  CHECK(s->purge_outbox(T0 + 5s, 2) == 1);
  CHECK(s->purge_outbox(T0 + 100h, 10) == 0);
  c = s->outbox_counts();
  CHECK(c.pending == 1);
  CHECK(c.delivered == 0);
  CHECK(c.parked == 1);
  CHECK(s->outbox_delivered(Ids{m2}, T0 + 101h) == 1);
  CHECK(s->outbox_counts().delivered == 1);
}

TEST_CASE_TEMPLATE("store contract: a local step's changes() counts its last write, never a SELECT",
                   E, SqliteEngine, PgEngine) {
  E e;
  IDEM_ENGINE_OR_SKIP(e);
  auto s = e.open();
  const idem::KeyId id{"alpha", "checkout", "counted"};
  const Reservation r = s->reserve(id, kFp, T0, T0 + 30s);
  REQUIRE(r.kind == Reservation::Kind::reserved);
  REQUIRE(s->begin_steps(id, r.token, "{}"));
  std::int64_t after_insert = -1, after_update = -1, after_select = -1;
  const std::string t = e.table("app_orders");
  const StepCommit step{StepResult{"counted", "", false}, T0, [&](LocalTransaction& tx) {
                          tx.execute(create_orders(e));
                          tx.execute(insert_order(e), {std::string("o1"), std::int64_t{5}});
                          after_insert = tx.changes();
                          tx.execute(
                              e.sql(fmt::format("UPDATE {} SET amount = 6 WHERE amount > ?1", t),
                                    fmt::format("UPDATE {} SET amount = 6 WHERE amount > $1", t)),
                              {std::int64_t{100}});
                          after_update = tx.changes();
                          CHECK(tx.execute(fmt::format("SELECT id FROM {}", t)).size() == 1);
                          after_select = tx.changes();
                        }};
  REQUIRE(s->commit_step(id, r.token, r.token, step));
  CHECK(after_insert == 1);
  CHECK(after_update == 0);
  CHECK(after_select == 0);  // still the UPDATE's
}

TEST_CASE_TEMPLATE(
    "store contract: a delivery's error that is not UTF-8 is recorded, the message retried", E,
    SqliteEngine, PgEngine) {
  E e;
  IDEM_ENGINE_OR_SKIP(e);
  auto s = e.open();
  const std::string message = queue_message(*s, "m1", T0, "hello");
  REQUIRE(s->claim_outbox(T0, T0 + 1min, 10).size() == 1);
  s->outbox_failed(message, T0 + 2min, false, "refused: \xff\xfe not text");
  CHECK(s->outbox_counts().pending == 1);
  const auto again = s->claim_outbox(T0 + 2min, T0 + 3min, 10);
  REQUIRE(again.size() == 1);
  CHECK(again[0].attempts == 1);
}
