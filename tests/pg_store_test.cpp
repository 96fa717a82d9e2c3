// What only PostgreSQL has: batches in one pipeline, the database's clock, lost connections,
// schema versions on a server, and several nodes (stores with their own connections) racing
// on one key. The contract both engines keep is store_contract_test.cpp's.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <libpq-fe.h>
#include <poll.h>

#include <atomic>
#include <latch>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "idem/errors.hpp"
#include "idem/internal/store_stats.hpp"
#include "idem/replay_cache.hpp"
#include "store_engines.hpp"

using namespace std::chrono_literals;
using idem::Reservation;
using idem::StoreOp;
using idem::test::PgEngine;
using idem::test::request;

namespace {

const idem::TimePoint T0 = idem::sim::kSimulationStart;
const idem::Fingerprint kFp = idem::Fingerprint::of(nlohmann::json{{"amount", 1}});

idem::StoredResponse response(std::string body) {
  return idem::StoredResponse{idem::Response{200, std::move(body), {}}, ""};
}

// A plain libpq connection, for looking at (or breaking) what a store does.
class Raw {
 public:
  explicit Raw(const std::string& conninfo) : conn_(PQconnectdb(conninfo.c_str())) {
    if (PQstatus(conn_) != CONNECTION_OK) throw std::runtime_error(PQerrorMessage(conn_));
  }
  ~Raw() { PQfinish(conn_); }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;

  // The first column of the first row as text ("" when there is no row).
  std::string scalar(const std::string& sql) {
    PGresult* r = PQexec(conn_, sql.c_str());
    const ExecStatusType status = PQresultStatus(r);
    if (status != PGRES_TUPLES_OK && status != PGRES_COMMAND_OK) {
      const std::string why = PQresultErrorMessage(r);
      PQclear(r);
      throw std::runtime_error(why);
    }
    std::string out = PQntuples(r) > 0 ? PQgetvalue(r, 0, 0) : "";
    PQclear(r);
    return out;
  }

 private:
  PGconn* conn_;
};

std::vector<StoreOp*> pointers(std::vector<StoreOp>& ops) {
  std::vector<StoreOp*> out;
  for (StoreOp& op : ops) out.push_back(&op);
  return out;
}

// A store on the caller's clock whose connections carry `app` as their application_name,
// so a test can cut them (cut_connections).
std::unique_ptr<idem::PgStore> named_store(const PgEngine& e, const std::string& app,
                                           std::size_t batch_connections) {
  return std::make_unique<idem::PgStore>(e.conninfo + " application_name=" + app,
                                         idem::PgOptions{.schema = e.schema,
                                                         .clock = idem::PgClock::caller,
                                                         .batch_connections = batch_connections});
}

// Terminates the server sessions named `app` and waits (5 s at most) until they are gone.
// Returns how many there were.
int cut_connections(const std::string& conninfo, const std::string& app) {
  return std::stoi(Raw(conninfo).scalar(
      fmt::format("SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity "
                  "WHERE application_name = '{}'",
                  app)));
}

}  // namespace

TEST_CASE("postgresql: a batch is one transaction in one round trip, each op its own outcome") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  auto store = std::dynamic_pointer_cast<idem::PgStore>(e.open());
  const idem::KeyId held{"alpha", "pay", "held"};
  const Reservation r = store->reserve(held, kFp, T0, T0 + 30s);
  const idem::KeyId a{"alpha", "pay", "a"}, b{"alpha", "pay", "b"};
  const idem::StoredResponse done = response("ok");
  std::vector<StoreOp> ops = {
      {.kind = StoreOp::Kind::reserve,
       .id = &b,
       .fingerprint = &kFp,
       .now = T0,
       .lease_until = T0 + 30s},
      {.kind = StoreOp::Kind::reserve,
       .id = &held,
       .fingerprint = &kFp,
       .now = T0,
       .lease_until = T0 + 30s},
      {.kind = StoreOp::Kind::complete,
       .id = &held,
       .expires_at = T0 + 1h,
       .token = r.token + 1,
       .response = &done},
      {.kind = StoreOp::Kind::reserve,
       .id = &a,
       .fingerprint = &kFp,
       .now = T0,
       .lease_until = T0 + 30s},
      {.kind = StoreOp::Kind::complete,
       .id = &held,
       .expires_at = T0 + 1h,
       .token = r.token,
       .response = &done},
  };
  const idem::detail::PgStats before = idem::detail::StoreStats::of(*store);
  store->apply(pointers(ops));
  const idem::detail::PgStats after = idem::detail::StoreStats::of(*store);
  CHECK(after.transactions - before.transactions == 1);
  CHECK(after.round_trips - before.round_trips == 1);
  CHECK(after.ops - before.ops == 5);
  for (const StoreOp& op : ops) CHECK_FALSE(op.error);
  CHECK(ops[0].reservation.kind == Reservation::Kind::reserved);
  CHECK(ops[1].reservation.kind == Reservation::Kind::existing);
  CHECK_FALSE(ops[2].applied);  // a stale token
  CHECK(ops[3].reservation.kind == Reservation::Kind::reserved);
  CHECK(ops[4].applied);  // after the stale one, in the batch's order for this key
  CHECK(store->load(held)->response.body == "ok");
}

TEST_CASE("postgresql: an op the server refuses fails alone, its neighbours commit") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  auto store = e.open();
  // Not UTF-8: the server refuses the key (a text column); the Coordinator never sends one.
  const idem::KeyId bad{"alpha", "pay", "\xff\xfe"}, good1{"alpha", "pay", "g1"},
      good2{"alpha", "pay", "g2"};
  std::vector<StoreOp> ops;
  for (const idem::KeyId* id : {&good1, &bad, &good2}) {
    ops.push_back({.kind = StoreOp::Kind::reserve,
                   .id = id,
                   .fingerprint = &kFp,
                   .now = T0,
                   .lease_until = T0 + 30s});
  }
  store->apply(pointers(ops));
  CHECK_FALSE(ops[0].error);
  REQUIRE(ops[1].error);
  CHECK_THROWS_WITH_AS(std::rethrow_exception(ops[1].error), doctest::Contains("postgresql:"),
                       idem::StoreError);
  CHECK_FALSE(ops[2].error);
  CHECK(ops[0].reservation.kind == Reservation::Kind::reserved);
  CHECK(ops[2].reservation.kind == Reservation::Kind::reserved);
  CHECK(store->load(good1));
  CHECK(store->load(good2));
}

TEST_CASE("postgresql: on the database's clock, a skewed node's times are stored on the server's") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  // A node whose clock is months behind the server's (a simulated clock that stands still).
  auto node_clock = std::make_shared<idem::sim::SimulatedClock>();
  idem::PgStore store(e.conninfo, idem::PgOptions{.schema = e.schema, .local_clock = node_clock});
  const idem::KeyId id{"alpha", "pay", "k"};
  const idem::TimePoint now = node_clock->now();
  REQUIRE(store.reserve(id, kFp, now, now + 30s).kind == Reservation::Kind::reserved);
  // Read back on the node's clock: a 30 s lease, started when the write reached the server
  // (this test's own round trips later than the node's `now`).
  const auto stored = store.load(id)->lease_until;
  CHECK(stored >= now + 30s - 1s);
  CHECK(stored <= now + 30s + 5s);
  CHECK(store.clock_offset() > 24h);
  // Stored on the server's: the lease ends 30 s after the server's time of the write, so a
  // node with another skew judges it alike. (The slack is for this test's own round trips.)
  Raw raw(e.conninfo);
  const long long left = std::stoll(raw.scalar(
      fmt::format("SELECT lease_until - (extract(epoch FROM clock_timestamp()) * 1000)::bigint "
                  "FROM {}.idem_keys WHERE key = 'k'",
                  e.schema)));
  CHECK(left <= 31'000);
  CHECK(left > 20'000);
  // A second node, its clock an hour ahead of the first, sees the lease as live until the
  // same server instant: 30 s after its own now, not an hour off.
  auto ahead = std::make_shared<idem::sim::SimulatedClock>();
  ahead->advance(1h);
  idem::PgStore other(e.conninfo, idem::PgOptions{.schema = e.schema, .local_clock = ahead});
  const auto seen = other.load(id);
  REQUIRE(seen);
  CHECK(seen->lease_until - ahead->now() <= 31s);
  CHECK(seen->lease_until - ahead->now() > 20s);
  CHECK(other.reserve(id, kFp, ahead->now(), ahead->now() + 30s).kind ==
        Reservation::Kind::existing);
}

TEST_CASE("postgresql: a lost connection is a StoreError, and the next call reconnects") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  const std::string app = fmt::format("victim_{}", e.schema);
  // The main connection only (reads and writes alike); batch connections: the next case.
  const auto named = named_store(e, app, 0);
  idem::PgStore& store = *named;
  const idem::KeyId id{"alpha", "pay", "k"};
  const Reservation r = store.reserve(id, kFp, T0, T0 + 30s);
  CHECK(idem::detail::StoreStats::of(store).connects == 1);
  CHECK(cut_connections(e.conninfo, app) == 1);
  CHECK_THROWS_AS(store.load(id), idem::StoreError);
  // The record outlives the connection; the store connects again by itself.
  const auto rec = store.load(id);
  REQUIRE(rec);
  CHECK(rec->token == r.token);
  CHECK(idem::detail::StoreStats::of(store).connects == 2);
  CHECK(store.complete(id, r.token, response("ok"), T0 + 1h));
}

// Waits for a started batch on this thread, as an event loop would: until its socket is
// readable, then advance().
void wait_for(idem::PendingApply& pending) {
  while (!pending.done()) {
    pollfd p{pending.descriptor(), POLLIN, 0};
    REQUIRE(::poll(&p, 1, 10'000) == 1);  // a failure bound: the server answers in ms
    pending.advance();
  }
}

std::vector<StoreOp> reserves(const std::vector<idem::KeyId>& ids) {
  std::vector<StoreOp> ops;
  for (const idem::KeyId& id : ids) {
    ops.push_back({.kind = StoreOp::Kind::reserve,
                   .id = &id,
                   .fingerprint = &kFp,
                   .now = T0,
                   .lease_until = T0 + 30s});
  }
  return ops;
}

TEST_CASE("postgresql: batches in flight at once go out on their own connections, unblocked") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  idem::PgStore store(
      e.conninfo,
      idem::PgOptions{.schema = e.schema, .clock = idem::PgClock::caller, .batch_connections = 2});
  CHECK(store.concurrent_applies() == 2);
  // Two batches racing for one key ("dup") from two connections, and keys of their own.
  const std::vector<idem::KeyId> ids1{{"alpha", "pay", "a1"}, {"alpha", "pay", "dup"}},
      ids2{{"alpha", "pay", "b1"}, {"alpha", "pay", "dup"}}, ids3{{"alpha", "pay", "c1"}};
  std::vector<StoreOp> ops1 = reserves(ids1), ops2 = reserves(ids2), ops3 = reserves(ids3);
  const std::vector<StoreOp*> p1 = pointers(ops1), p2 = pointers(ops2), p3 = pointers(ops3);
  const idem::detail::PgStats before = idem::detail::StoreStats::of(store);
  std::unique_ptr<idem::PendingApply> first = store.start_apply(p1);
  std::unique_ptr<idem::PendingApply> second = store.start_apply(p2);
  REQUIRE(first);
  REQUIRE(second);
  CHECK_FALSE(first->done());
  CHECK_FALSE(second->done());
  CHECK(first->descriptor() != second->descriptor());
  // Both batch connections are busy: a third batch is not started, and apply() runs it on
  // the main connection at once, while the two are still unread.
  CHECK_FALSE(store.start_apply(p3));
  store.apply(p3);
  CHECK_FALSE(ops3[0].error);
  CHECK(ops3[0].reservation.kind == Reservation::Kind::reserved);
  wait_for(*second);
  wait_for(*first);
  CHECK(first->descriptor() == -1);
  for (const StoreOp& op : ops1) CHECK_FALSE(op.error);
  for (const StoreOp& op : ops2) CHECK_FALSE(op.error);
  CHECK(ops1[0].reservation.kind == Reservation::Kind::reserved);
  CHECK(ops2[0].reservation.kind == Reservation::Kind::reserved);
  // One of the two reservations of "dup" won; the other found it.
  const int won = (ops1[1].reservation.kind == Reservation::Kind::reserved ? 1 : 0) +
                  (ops2[1].reservation.kind == Reservation::Kind::reserved ? 1 : 0);
  CHECK(won == 1);
  const idem::detail::PgStats after = idem::detail::StoreStats::of(store);
  CHECK(after.async_batches - before.async_batches == 2);
  CHECK(after.most_batches_in_flight == 2);
  CHECK(after.transactions - before.transactions == 3);
  CHECK(after.ops - before.ops == 5);
  // A free connection again: the next batch starts.
  const std::vector<idem::KeyId> ids4{{"alpha", "pay", "d1"}};
  std::vector<StoreOp> ops4 = reserves(ids4);  // points into ids4
  const std::vector<StoreOp*> ptrs_ops4 = pointers(ops4);
  auto again = store.start_apply(ptrs_ops4);
  REQUIRE(again);
  wait_for(*again);
  CHECK(ops4[0].reservation.kind == Reservation::Kind::reserved);
}

TEST_CASE("postgresql: a batch abandoned or cut off fails alone, and the next one reconnects") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  const std::string app = fmt::format("cut_{}", e.schema);
  const auto named = named_store(e, app, 1);
  idem::PgStore& store = *named;
  const std::vector<idem::KeyId> ids{{"alpha", "pay", "a"}, {"alpha", "pay", "b"}};
  {
    std::vector<StoreOp> ops = reserves(ids);
    const std::vector<StoreOp*> ptrs_ops = pointers(ops);
    auto pending = store.start_apply(ptrs_ops);
    REQUIRE(pending);
  }  // destroyed unread: its connection is dropped (whether it committed is unknown)
  const std::uint64_t connects = idem::detail::StoreStats::of(store).connects;
  const std::vector<idem::KeyId> c{{"alpha", "pay", "c"}}, d{{"alpha", "pay", "d"}},
      e_{{"alpha", "pay", "e"}}, f{{"alpha", "pay", "f"}};
  std::vector<StoreOp> next = reserves(c);
  const std::vector<StoreOp*> ptrs_next = pointers(next);
  auto pending = store.start_apply(ptrs_next);
  REQUIRE(pending);
  wait_for(*pending);
  CHECK_FALSE(next[0].error);
  CHECK(next[0].reservation.kind == Reservation::Kind::reserved);
  CHECK(idem::detail::StoreStats::of(store).connects == connects + 1);
  // The batch connection is cut while a batch waits: that batch fails with StoreError, the
  // next one connects again and succeeds.
  std::vector<StoreOp> cut = reserves(d);
  const std::vector<StoreOp*> ptrs_cut = pointers(cut);
  std::vector<StoreOp> before_cut = reserves(e_);
  store.apply(pointers(before_cut));  // the batch connection is the one in use
  REQUIRE(cut_connections(e.conninfo, app) >= 1);
  auto doomed = store.start_apply(ptrs_cut);
  if (doomed) wait_for(*doomed);  // null: it could not even be sent, and apply() would run it
  if (!doomed) store.apply(ptrs_cut);
  REQUIRE(cut[0].error);
  CHECK_THROWS_WITH_AS(std::rethrow_exception(cut[0].error), doctest::Contains("postgresql:"),
                       idem::StoreError);
  std::vector<StoreOp> after = reserves(f);
  const std::vector<StoreOp*> ptrs_after = pointers(after);
  auto retry = store.start_apply(ptrs_after);
  if (retry) wait_for(*retry);
  if (!retry) store.apply(ptrs_after);
  CHECK_FALSE(after[0].error);
  CHECK(after[0].reservation.kind == Reservation::Kind::reserved);
}

TEST_CASE("postgresql: an unreachable server is a StoreError, and a newer schema is refused") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  CHECK_THROWS_WITH_AS(idem::PgStore("host=/nonexistent-idem-dir port=1 connect_timeout=2"),
                       doctest::Contains("postgresql: cannot connect"), idem::StoreError);
  { idem::PgStore first(e.conninfo, idem::PgOptions{.schema = e.schema}); }
  Raw raw(e.conninfo);
  CHECK(raw.scalar(fmt::format("SELECT version FROM {}.idem_meta", e.schema)) ==
        std::to_string(idem::PgStore::schema_version()));
  // Reopening migrates nothing and keeps the version.
  { idem::PgStore again(e.conninfo, idem::PgOptions{.schema = e.schema}); }
  raw.scalar(fmt::format("UPDATE {}.idem_meta SET version = 99", e.schema));
  CHECK_THROWS_WITH_AS(idem::PgStore(e.conninfo, idem::PgOptions{.schema = e.schema}),
                       doctest::Contains("newer than this library's"), idem::StoreError);
  CHECK_THROWS_AS(idem::PgStore(e.conninfo, idem::PgOptions{.schema = ""}), idem::error);
  CHECK_THROWS_AS(idem::PgStore(e.conninfo, idem::PgOptions{.schema = "a$$b"}), idem::error);
}

TEST_CASE("postgresql race: two nodes, 8 threads, one key a round, 100 rounds: one charge each") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  // Two stores with their own connections are two nodes; each has its own Coordinator.
  auto clock = std::make_shared<idem::SystemClock>();
  const idem::Options options{.in_flight = idem::InFlight::wait, .max_wait = 20s, .clock = clock};
  idem::Coordinator node_a(
      std::make_shared<idem::PgStore>(e.conninfo, idem::PgOptions{.schema = e.schema}), options);
  idem::Coordinator node_b(
      std::make_shared<idem::PgStore>(e.conninfo, idem::PgOptions{.schema = e.schema}), options);
  auto provider = std::make_shared<idem::sim::Provider>(
      clock, idem::sim::ProviderOptions{.latency = 2ms, .dedup = false});
  constexpr int kRounds = 100, kThreads = 8;
  std::size_t found_held = 0;  // calls that found the key reserved by another: proof of overlap
  for (int round = 0; round < kRounds; ++round) {
    const std::size_t charges_before = provider->charge_count();
    std::latch start(kThreads);
    std::mutex mutex;
    std::vector<std::string> answers;
    std::atomic<int> executed{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        idem::Coordinator& node = t % 2 == 0 ? node_a : node_b;
        start.arrive_and_wait();
        const idem::Outcome o = node.call(request(fmt::format("round-{}", round)), [&] {
          return idem::Response{200, provider->charge("A-1", 4990, "").charge_id, {}};
        });
        if (o.source == idem::Outcome::Source::executed) ++executed;
        std::lock_guard lock(mutex);
        answers.push_back(o.response.body);
      });
    }
    for (auto& t : threads) t.join();
    REQUIRE(provider->charge_count() - charges_before == 1);
    REQUIRE(executed == 1);
    REQUIRE(answers.size() == kThreads);
    for (const auto& a : answers) REQUIRE(a == answers.front());
  }
  CHECK(provider->charge_count() == kRounds);
  found_held = node_a.metrics().waited + node_b.metrics().waited;
  CHECK(found_held > 0);
}

TEST_CASE("postgresql: replays of a hot key through the replay cache make no round trip") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  auto clock = std::make_shared<idem::sim::SimulatedClock>();
  auto pg = std::make_shared<idem::PgStore>(
      e.conninfo, idem::PgOptions{.schema = e.schema, .clock = idem::PgClock::caller});
  idem::Coordinator idem(
      std::make_shared<idem::ReplayCache>(pg, idem::ReplayCacheOptions{.clock = clock}),
      idem::Options{.clock = clock});
  int charges = 0;
  const auto charge = [&] {
    ++charges;
    return idem::Response{200, "ch_1", {}};
  };
  CHECK(idem.call(request("hot"), charge).source == idem::Outcome::Source::executed);
  CHECK(idem.call(request("hot"), charge).replayed());  // read once from PostgreSQL, then held
  const std::uint64_t round_trips = idem::detail::StoreStats::of(*pg).round_trips;
  for (int i = 0; i < 50; ++i) CHECK(idem.call(request("hot"), charge).replayed());
  CHECK_THROWS_AS(idem.call(request("hot", 1), charge), idem::KeyReuseError);
  CHECK(idem::detail::StoreStats::of(*pg).round_trips == round_trips);
  CHECK(charges == 1);
}

TEST_CASE("postgresql: the store's transactions are READ COMMITTED whatever the role's default") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  // A role whose transactions default to SERIALIZABLE: there a duplicate's reservation would
  // meet a serialization failure instead of the winner's record.
  Raw raw(e.conninfo);
  const std::string role = "strict_" + e.schema;
  raw.scalar(fmt::format("CREATE ROLE {} LOGIN SUPERUSER", role));
  raw.scalar(fmt::format("ALTER ROLE {} SET default_transaction_isolation = 'serializable'", role));
  CHECK(Raw(e.conninfo + " user=" + role).scalar("SHOW transaction_isolation") == "serializable");
  idem::PgStore store(e.conninfo + " user=" + role,
                      idem::PgOptions{.schema = e.schema, .clock = idem::PgClock::caller});
  const idem::KeyId id{"alpha", "pay", "k"};
  const Reservation r = store.reserve(id, kFp, T0, T0 + 30s);
  REQUIRE(store.begin_steps(id, r.token, "{}"));
  std::string level;
  const idem::StepCommit look{
      idem::StepResult{"look", "", false}, T0, [&](idem::LocalTransaction& tx) {
        level = std::get<std::string>(tx.execute("SHOW transaction_isolation").at(0).at(0));
      }};
  REQUIRE(store.commit_step(id, r.token, r.token, look));
  CHECK(level == "read committed");
}

TEST_CASE("postgresql: a duplicate waiting in another node is woken by NOTIFY, not by its poll") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  // Node B's clock never moves: its poll timer, its lease check and its give-up never fire,
  // so only a wake-up can end its wait. Node A holds the key until the test lets it go; its
  // clock is frozen too, but its own, so that a timer on B's clock is B's sleep.
  auto frozen = std::make_shared<idem::sim::SimulatedClock>();
  auto a_clock = std::make_shared<idem::sim::SimulatedClock>();
  const idem::PgOptions notifying{
      .schema = e.schema, .clock = idem::PgClock::caller, .notify = true};
  auto a_store = std::make_shared<idem::PgStore>(e.conninfo, notifying);
  auto b_store = std::make_shared<idem::PgStore>(e.conninfo, notifying);
  idem::Coordinator node_a(a_store, idem::Options{.clock = a_clock});
  idem::Coordinator node_b(b_store,
                           idem::Options{.in_flight = idem::InFlight::wait, .clock = frozen});
  idem::sim::Provider provider(frozen, {.latency = 0ms, .dedup = false});

  std::latch release(1);
  std::thread holder([&] {
    node_a.call(request("woken"), [&] {
      release.wait();
      return idem::Response{200, provider.charge("A-1", 4990, "").charge_id, {}};
    });
  });
  REQUIRE(idem::test::eventually([&] { return node_a.metrics().reserved == 1; }));
  std::atomic<bool> done{false};
  idem::Outcome waited;
  std::thread duplicate([&] {
    waited = node_b.call(request("woken"), [&] {
      return idem::Response{200, provider.charge("A-1", 4990, "").charge_id, {}};
    });
    done = true;
  });
  REQUIRE(idem::test::eventually([&] { return node_b.metrics().waited == 1; }));
  // B's LISTEN runs on its own thread and connection; a NOTIFY committed before it takes
  // effect is never delivered (B would poll, but its clock is frozen).
  REQUIRE(
      idem::test::eventually([&] { return idem::detail::StoreStats::of(*b_store).listens >= 1; }));
  // B asleep: past the look it takes after subscribing (lib/src/flow.cpp, wait_for), which,
  // made after A's completion, would find the record done with no wake-up at all.
  REQUIRE(idem::test::eventually([&] { return !frozen->idle(); }));
  release.count_down();
  holder.join();
  // A failure bound, not a measurement: without the wake-up, B would wait forever; then the
  // clock is moved past its give-up so the thread ends and the test fails.
  const bool woken = idem::test::eventually([&] { return done.load(); }, 30s);
  if (!woken) frozen->advance(1h);
  duplicate.join();
  CHECK(woken);
  CHECK(waited.replayed());
  CHECK(provider.charge_count() == 1);
  CHECK(idem::detail::StoreStats::of(*b_store).wakeups >= 1);
  CHECK(idem::detail::StoreStats::of(*a_store).notify_batches >= 1);
}

TEST_CASE(
    "postgresql: calls queued behind a slow server wait in line for the connection no longer "
    "than one call ahead may take, then fail having sent nothing") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  // Waiting in line: connect_timeout + statement_timeout + reply_margin = 500 ms at most.
  idem::PgStore store(e.conninfo, idem::PgOptions{.schema = e.schema,
                                                  .clock = idem::PgClock::caller,
                                                  .statement_timeout = 200ms,
                                                  .reply_margin = 100ms,
                                                  .connect_timeout = 200ms,
                                                  .batch_connections = 0});
  const idem::KeyId id{"alpha", "pay", "slow"};
  CHECK_FALSE(store.load(id));  // connected and prepared
  // Another node holds the table: each statement waits for it until statement_timeout.
  Raw other(e.conninfo);
  other.scalar("BEGIN");
  other.scalar(fmt::format("LOCK TABLE {}.idem_keys IN ACCESS EXCLUSIVE MODE", e.schema));
  constexpr int kCallers = 8;
  std::latch together(kCallers);
  struct Answer {
    std::string error;
    bool unavailable = false;
  };
  std::vector<Answer> answers(kCallers);  // one each: no two threads write the same object
  std::vector<std::thread> callers;
  for (Answer& answer : answers) {
    callers.emplace_back([&] {
      together.arrive_and_wait();
      try {
        store.load(id);
        answer.error = "answered";
      } catch (const idem::StoreError& err) {
        answer.error = err.what();
        answer.unavailable = err.code() == idem::errc::store_unavailable;
      }
    });
  }
  for (std::thread& t : callers) t.join();
  other.scalar("ROLLBACK");
  int cancelled = 0, in_line = 0;
  for (const Answer& answer : answers) {
    CAPTURE(answer.error);
    CHECK(answer.unavailable);
    if (answer.error.find("statement timeout") != std::string::npos) ++cancelled;
    if (answer.error.find("in line for the connection") != std::string::npos) ++in_line;
  }
  // The first callers' statements ran and were cancelled by the server; those that would have
  // waited for all of them gave up in line, having sent nothing.
  CHECK(cancelled + in_line == kCallers);
  CHECK(cancelled >= 1);
  CHECK(in_line >= 1);
  CHECK_FALSE(store.load(id));  // the connection serves again
}
