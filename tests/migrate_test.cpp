// migrate_sqlite_to_pg (idem/migrate.hpp): a SqliteStore's records and outbox moved into a
// PgStore, replayed there byte for byte, fenced against holders from before the move,
// rerunnable, and on the database's clock; and `idem-demo migrate`. The tests count the
// provider's charges, not only the responses.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <libpq-fe.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "demo_process.hpp"
#include "idem/migrate.hpp"
#include "idem/steps.hpp"
#include "store_engines.hpp"

namespace {

using namespace idem;
using namespace std::chrono_literals;
using idem::test::PgEngine;
using idem::test::run_demo;

// A process that dies at a point of its action (its release never happens either).
struct Crash {};
// A migration stopped midway.
struct Stop {};

Options options_on(std::shared_ptr<Clock> clock) {
  Options o;
  o.in_flight = InFlight::raise;
  o.heartbeat = 0ms;  // the tests move the clock past leases on purpose
  o.lease = 10s;
  o.ttl_by_operation = {{"short", 1min}};
  o.clock = std::move(clock);
  return o;
}

const std::string kOrder = "A-1";

Request call_request(const std::string& key, long long amount = 4990,
                     const std::string& operation = "payment.charge") {
  Request r = test::request(key, amount, "alpha", operation);
  r.in_flight = InFlight::raise;
  return r;
}

Request steps_request(const std::string& key) {
  Request r;
  r.tenant = "alpha";
  r.operation = "checkout";
  r.key = key;
  r.fingerprint = Fingerprint::of(nlohmann::json{{"order", kOrder}});
  r.in_flight = InFlight::raise;
  r.payload = kOrder;
  return r;
}

KeyId id_of(const Request& r) { return KeyId{r.tenant, r.operation, *r.key}; }

// A checkout of two steps: a charge (external), then a note that queues three messages
// (local). It stops after `stop_after` by throwing `Crash` (or a runtime_error for "fail").
Response checkout(Attempt& a, sim::Provider& provider, const std::string& stop_after = "") {
  const std::string charge = a.external("charged", [&](const std::string& key) {
    return provider.charge(a.request(), 4990, key).charge_id;
  });
  if (stop_after == "charged") throw Crash{};
  if (stop_after == "charged, then fail") throw std::runtime_error("the next step failed");
  a.local("noted", [&](LocalTransaction& tx) {
    tx.enqueue("mail", "receipt " + charge);
    tx.enqueue("ledger", std::string("entry\0\xff", 7));
    tx.enqueue("audit", "checkout " + charge);
    return std::string("queued");
  });
  if (stop_after == "noted") throw Crash{};
  return Response{200, charge, {}};
}

// The SQLite side before the move: a store on a simulated clock, its coordinator, and a
// provider that never deduplicates, so a second charge would show.
struct Before {
  test::TempDir dir;
  std::string path = dir.file("keys.db");
  std::shared_ptr<sim::SimulatedClock> clock = std::make_shared<sim::SimulatedClock>();
  std::shared_ptr<SqliteStore> sqlite = std::make_shared<SqliteStore>(path);
  std::shared_ptr<sim::FaultyStore> faulty = std::make_shared<sim::FaultyStore>(sqlite);
  std::shared_ptr<sim::Provider> provider =
      std::make_shared<sim::Provider>(clock, sim::ProviderOptions{.latency = 0ms, .dedup = false});
  Coordinator idem{faulty, options_on(clock)};

  std::function<Response()> charging(Response r) {
    return [this, r] {
      provider->charge(kOrder, 4990, "");
      return r;
    };
  }
  // The process running `key`'s checkout dies after `point`: the key stays reserved, with
  // its progress, until the lease ends.
  void crash(const std::string& key, const std::string& point) {
    faulty->fail(sim::Operation::release);
    CHECK_THROWS_AS(idem.call_steps(steps_request(key),
                                    [&](Attempt& a) { return checkout(a, *provider, point); }),
                    Crash);
    faulty->fail(sim::Operation::release, false);
  }
  std::size_t charges() const { return provider->charge_count(); }
};

// The SQLite store of most tests: an expired record, completed ones (a binary body with
// headers, a business rejection, a body stored elsewhere), a checkout in progress after its
// note (three messages: one delivered, one parked, one pending), and a released checkout
// with progress.
struct Populated : Before {
  const std::string binary_body = std::string("ch\0\x01\xff\xfe", 6) + '\0' + "end";
  const Response binary{
      200, binary_body, {{"Content-Type", "application/octet-stream"}, {"X-Charge", "ch_2"}}};
  const Response rejected{402,
                          R"({"error":"payment_declined","reason":"insufficient_funds"})",
                          {{"Content-Type", "application/problem+json"}}};
  std::string mail_id, ledger_id, audit_id;

  Populated() {
    idem.call(call_request("k-old", 4990, "short"), charging(Response{200, "old", {}}));
    clock->advance(2min);  // k-old's TTL (1 min) is over
    CHECK(idem.call(call_request("k-bin"), charging(binary)).source == Outcome::Source::executed);
    CHECK(idem.call(call_request("k-402"), charging(rejected)).source == Outcome::Source::executed);
    const Request ref = call_request("k-ref");
    CHECK_FALSE(sqlite->store_if_absent(id_of(ref), ref.fingerprint,
                                        StoredResponse{Response{200, "", {}}, "payloads/k-ref"},
                                        clock->now(), clock->now() + 1h));
    crash("k-crash", "noted");
    CHECK_THROWS_AS(
        idem.call_steps(steps_request("k-released"),
                        [&](Attempt& a) { return checkout(a, *provider, "charged, then fail"); }),
        std::runtime_error);
    for (const OutboxMessage& m : sqlite->claim_outbox(clock->now(), clock->now() + 1min, 10)) {
      if (m.topic == "mail") mail_id = m.id;
      if (m.topic == "ledger") ledger_id = m.id;
      if (m.topic == "audit") audit_id = m.id;
    }
    REQUIRE(sqlite->outbox_delivered(std::vector<std::string>{audit_id}, clock->now()) == 1);
    sqlite->outbox_failed(ledger_id, clock->now(), true, "mailbox full");
    REQUIRE(charges() == 5);
  }
};

// Everything a schema's tables hold, as one digest.
std::string digest(const PgEngine& e, const std::string& schema) {
  return idem::test::pg_text(
      e.conninfo,
      fmt::format("SELECT md5((SELECT coalesce(string_agg(k::text, '|' ORDER BY tenant, "
                  "operation, key), '') FROM {0}.idem_keys k) || '#' || (SELECT "
                  "coalesce(string_agg(o::text, '|' ORDER BY id), '') FROM {0}.idem_outbox o))",
                  schema));
}

std::shared_ptr<PgStore> pg_on(const PgEngine& e, const std::string& schema) {
  return std::make_shared<PgStore>(e.conninfo,
                                   PgOptions{.schema = schema, .clock = PgClock::caller});
}

MigrationOptions on_clock(const Before& b) { return MigrationOptions{.clock = b.clock}; }

}  // namespace

TEST_CASE(
    "migrate: records and the outbox move to PostgreSQL, replays are byte for byte and nothing "
    "runs again") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  Populated before;
  const Record crashed = *before.sqlite->load(id_of(steps_request("k-crash")));
  REQUIRE(crashed.state == State::in_progress);
  auto pg = pg_on(e, e.schema);

  const MigrationReport r = migrate_sqlite_to_pg(before.path, *pg, on_clock(before));
  CHECK(r.records_copied == 5);   // k-bin, k-402, k-ref, k-crash, k-released
  CHECK(r.records_expired == 1);  // k-old
  CHECK(r.records_unchanged == 0);
  CHECK(r.records_skipped_newer == 0);
  CHECK(r.outbox_copied == 2);  // pending and parked; the delivered one is not copied
  CHECK(r.outbox_skipped == 0);

  Coordinator after(pg, options_on(before.clock));
  const auto must_not_run = [&]() -> Response {
    FAIL("a migrated key ran its action again");
    return {};
  };
  // Completed records replay byte for byte: status, headers, body.
  const Outcome bin = after.call(call_request("k-bin"), must_not_run);
  CHECK(bin.replayed());
  CHECK(bin.response == before.binary);
  CHECK(bin.response.body.size() == 10);
  const Outcome declined = after.call(call_request("k-402"), must_not_run);
  CHECK(declined.replayed());
  CHECK(declined.response == before.rejected);
  // Another payload with a migrated key is a reuse, as it was on SQLite.
  try {
    after.call(call_request("k-bin", 1), must_not_run);
    FAIL("no key reuse");
  } catch (const KeyReuseError& reuse) {
    CHECK(reuse.code() == errc::key_reuse);
  }
  const std::optional<Record> ref = pg->load(id_of(call_request("k-ref")));
  REQUIRE(ref);
  CHECK(ref->body_ref == "payloads/k-ref");
  CHECK(ref->response.body.empty());
  // The expired record stayed behind.
  CHECK_FALSE(pg->load(id_of(call_request("k-old", 4990, "short"))));

  // The checkout in progress: state, times, recovery point, progress and request as they were,
  // at the next token.
  const std::optional<Record> moved = pg->load(id_of(steps_request("k-crash")));
  REQUIRE(moved);
  CHECK(moved->state == State::in_progress);
  CHECK(moved->token == crashed.token + 1);
  CHECK(moved->fingerprint == crashed.fingerprint);
  CHECK(moved->lease_until == crashed.lease_until);
  CHECK(moved->created_at == crashed.created_at);
  CHECK(moved->expires_at == crashed.expires_at);
  CHECK(moved->recovery_point == std::optional<std::string>("noted"));
  test::RawDb raw(before.path);
  for (const char* key : {"k-crash", "k-released"}) {
    CAPTURE(key);
    CHECK(idem::test::pg_text(
              e.conninfo,
              fmt::format("SELECT progress FROM {}.idem_keys WHERE key = '{}'", e.schema, key)) ==
          raw.text(fmt::format("SELECT progress FROM idem_keys WHERE key = '{}'", key)));
    CHECK(
        idem::test::pg_text(
            e.conninfo, fmt::format("SELECT upper(encode(request, 'hex')) FROM {}.idem_keys WHERE "
                                    "key = '{}'",
                                    e.schema, key)) ==
        raw.text(fmt::format("SELECT hex(request) FROM idem_keys WHERE key = '{}'", key)));
  }

  // The outbox: the pending message and the parked one, as they were.
  const OutboxCounts counts = pg->outbox_counts();
  CHECK(counts.pending == 1);
  CHECK(counts.parked == 1);
  CHECK(counts.delivered == 0);
  CHECK(idem::test::pg_text(
            e.conninfo, fmt::format("SELECT attempts || ' ' || last_error || ' ' || key_hash FROM "
                                    "{}.idem_outbox WHERE id = '{}'",
                                    e.schema, before.ledger_id)) ==
        raw.text(fmt::format("SELECT attempts || ' ' || last_error || ' ' || key_hash FROM "
                             "idem_outbox WHERE id = '{}'",
                             before.ledger_id)));
  const std::vector<OutboxMessage> due =
      pg->claim_outbox(before.clock->now() + 2min, before.clock->now() + 3min, 10);
  REQUIRE(due.size() == 1);
  CHECK(due[0].id == before.mail_id);
  CHECK(due[0].payload == "receipt ch_4");
  CHECK(due[0].attempts == 0);
  CHECK(due[0].created_at == crashed.created_at);

  // The released checkout resumes on PostgreSQL: its charge is not made again.
  const Outcome resumed = after.call_steps(
      steps_request("k-released"), [&](Attempt& a) { return checkout(a, *before.provider); });
  CHECK(resumed.source == Outcome::Source::executed);
  CHECK(resumed.response.body == "ch_5");
  CHECK(after.metrics().resumed == 1);
  CHECK(before.charges() == 5);
}

TEST_CASE(
    "migrate: a holder from before the move can write nothing on PostgreSQL, after its lease the "
    "next caller resumes and charges nothing again") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  Before before;
  before.crash("k-z", "charged");  // charged once, then the process hangs (a zombie to be)
  const KeyId id = id_of(steps_request("k-z"));
  const Record held = *before.sqlite->load(id);
  REQUIRE(held.state == State::in_progress);
  REQUIRE(before.charges() == 1);
  auto pg = pg_on(e, e.schema);
  CHECK(migrate_sqlite_to_pg(before.path, *pg, on_clock(before)).records_copied == 1);

  // The zombie's token (held.token, the operation's origin too) is refused by every write.
  const TimePoint now = before.clock->now();
  const std::int64_t zombie = held.token;
  CHECK_FALSE(pg->complete(id, zombie, StoredResponse{Response{200, "zombie", {}}, ""}, now + 1h));
  CHECK_FALSE(pg->release(id, zombie, now));
  CHECK_FALSE(pg->renew(id, zombie, now + 1h));
  CHECK_FALSE(pg->mark_pending(id, zombie, held.token, "noted", {now, now + 1s, now + 1h}));
  CHECK_FALSE(pg->begin_steps(id, zombie, "zombie"));
  bool ran = false;
  CHECK_FALSE(
      pg->commit_step(id, zombie, held.token,
                      StepCommit{StepResult{"noted", "zombie"}, now, [&](LocalTransaction& tx) {
                                   ran = true;
                                   tx.enqueue("mail", "zombie");
                                 }}));
  CHECK_FALSE(ran);
  const std::optional<Record> moved = pg->load(id);
  REQUIRE(moved);
  CHECK(moved->state == State::in_progress);
  CHECK(moved->token == held.token + 1);
  CHECK(moved->lease_until == held.lease_until);
  CHECK(moved->recovery_point == std::optional<std::string>("charged"));
  CHECK(pg->outbox_counts().pending == 0);

  // The new nodes see the key held until the zombie's lease ends, then take it over and
  // resume after the charge: the action runs once more, the charge does not.
  Coordinator after(pg, options_on(before.clock));
  const auto resume = [&](Attempt& a) { return checkout(a, *before.provider); };
  CHECK_THROWS_AS(after.call_steps(steps_request("k-z"), resume), InProgressError);
  before.clock->advance(11s);
  const Outcome o = after.call_steps(steps_request("k-z"), resume);
  CHECK(o.source == Outcome::Source::executed);
  CHECK(o.response.body == "ch_1");
  CHECK(after.metrics().taken_over == 1);
  CHECK(after.metrics().resumed == 1);
  CHECK(after.metrics().executed == 1);
  CHECK(before.charges() == 1);
  CHECK(pg->outbox_counts().pending == 3);
  CHECK(pg->load(id)->token > held.token + 1);
  const Outcome again = after.call_steps(steps_request("k-z"), resume);
  CHECK(again.replayed());
  CHECK(again.response.body == "ch_1");
  CHECK(after.metrics().executed == 1);
  CHECK(before.charges() == 1);
  // Still refused after the takeover and the completion.
  CHECK_FALSE(pg->complete(id, zombie, StoredResponse{Response{200, "zombie", {}}, ""}, now + 1h));
  CHECK(pg->load(id)->response.body == "ch_1");
}

TEST_CASE(
    "migrate: a rerun copies nothing and changes nothing, a run stopped midway and rerun gives "
    "the whole copy") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  Populated before;
  auto whole = pg_on(e, e.schema);
  const MigrationReport first = migrate_sqlite_to_pg(before.path, *whole, on_clock(before));
  REQUIRE(first.records_copied == 5);
  const std::string copied = digest(e, e.schema);

  const MigrationReport rerun = migrate_sqlite_to_pg(before.path, *whole, on_clock(before));
  CHECK(rerun.records_copied == 0);
  CHECK(rerun.records_unchanged == first.records_copied);
  CHECK(rerun.records_expired == first.records_expired);
  CHECK(rerun.records_skipped_newer == 0);
  CHECK(rerun.outbox_copied == 0);
  CHECK(rerun.outbox_skipped == first.outbox_copied);
  CHECK(digest(e, e.schema) == copied);

  // One record per transaction, stopped after the second: what committed stays.
  const std::string other = test::fresh_pg_schema();
  auto part = pg_on(e, other);
  std::size_t batches = 0, copied_before_stop = 0;
  MigrationOptions stopping = on_clock(before);
  stopping.batch = 1;
  stopping.on_batch = [&](const MigrationReport& so_far) {
    if (++batches < 2) return;
    copied_before_stop = so_far.records_copied;
    throw Stop{};
  };
  CHECK_THROWS_AS(migrate_sqlite_to_pg(before.path, *part, stopping), Stop);
  CHECK(copied_before_stop >= 1);
  CHECK(idem::test::pg_text(e.conninfo, fmt::format("SELECT count(*) FROM {}.idem_keys", other)) ==
        std::to_string(copied_before_stop));
  MigrationOptions one_by_one = on_clock(before);
  one_by_one.batch = 1;
  const MigrationReport rest = migrate_sqlite_to_pg(before.path, *part, one_by_one);
  CHECK(rest.records_copied == first.records_copied - copied_before_stop);
  CHECK(rest.records_unchanged == copied_before_stop);
  CHECK(rest.outbox_copied == first.outbox_copied);
  CHECK(digest(e, other) == copied);
}

TEST_CASE(
    "migrate: a rerun brings a record completed on SQLite since up to date, and never "
    "overwrites one taken over on PostgreSQL") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  Before before;
  const Request late = call_request("k-late"), taken = call_request("k-taken");
  const TimePoint t0 = before.clock->now();
  const Reservation late_held = before.sqlite->reserve(id_of(late), late.fingerprint, t0, t0 + 10s);
  const Reservation taken_held =
      before.sqlite->reserve(id_of(taken), taken.fingerprint, t0, t0 + 10s);
  const Request gone = call_request("k-gone");
  const Reservation gone_held = before.sqlite->reserve(id_of(gone), gone.fingerprint, t0, t0 + 10s);
  auto pg = pg_on(e, e.schema);
  CHECK(migrate_sqlite_to_pg(before.path, *pg, on_clock(before)).records_copied == 3);

  // On SQLite, still serving: two holders complete, one fails and lets go (its record no
  // longer counts there, but its copy still would).
  const StoredResponse done{Response{201, "late", {{"X-Order", "A-1"}}}, ""};
  REQUIRE(before.sqlite->complete(id_of(late), late_held.token, done, t0 + 1h));
  REQUIRE(before.sqlite->complete(id_of(taken), taken_held.token, done, t0 + 1h));
  REQUIRE(before.sqlite->release(id_of(gone), gone_held.token, t0));
  // On PostgreSQL meanwhile, a node took k-taken over once its lease ended.
  before.clock->advance(11s);
  const Reservation takeover =
      pg->reserve(id_of(taken), taken.fingerprint, before.clock->now(), before.clock->now() + 10s);
  REQUIRE(takeover.kind == Reservation::Kind::taken_over);

  const MigrationReport rerun = migrate_sqlite_to_pg(before.path, *pg, on_clock(before));
  CHECK(rerun.records_copied == 2);  // k-late, and k-gone's copy brought up to date
  CHECK(rerun.records_skipped_newer == 1);
  CHECK(rerun.records_expired == 0);
  CHECK(pg->load(id_of(gone))->state == State::released);
  const std::optional<Record> refreshed = pg->load(id_of(late));
  REQUIRE(refreshed);
  CHECK(refreshed->state == State::completed);
  CHECK(refreshed->token == late_held.token + 1);
  Coordinator after(pg, options_on(before.clock));
  const Outcome replay = after.call(late, [&]() -> Response {
    FAIL("k-late ran again");
    return {};
  });
  CHECK(replay.replayed());
  CHECK(replay.response == done.response);
  const std::optional<Record> kept = pg->load(id_of(taken));
  REQUIRE(kept);
  CHECK(kept->state == State::in_progress);
  CHECK(kept->token == takeover.token);
}

TEST_CASE(
    "migrate: on the database's clock, leases and TTLs end on the server when they would have "
    "on the node") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  Before before;  // its simulated clock is months away from the server's
  const Outcome done = before.idem.call(call_request("k-done"), before.charging({200, "ch", {}}));
  const Request held_request = call_request("k-held");
  const TimePoint t0 = before.clock->now();
  REQUIRE(
      before.sqlite->reserve(id_of(held_request), held_request.fingerprint, t0, t0 + 30s).kind ==
      Reservation::Kind::reserved);
  before.crash("k-crash", "noted");  // three messages due at t0
  auto pg = std::make_shared<PgStore>(e.conninfo,
                                      PgOptions{.schema = e.schema, .local_clock = before.clock});
  REQUIRE(std::chrono::abs(pg->clock_offset()) > 1h);
  const MigrationReport r = migrate_sqlite_to_pg(before.path, *pg, on_clock(before));
  CHECK(r.records_copied == 3);
  CHECK(r.outbox_copied == 3);

  // On the server's clock: the lease ends 30 s after the server's now, the TTL 24 h after.
  const auto left = [&](const std::string& column, const std::string& key) {
    return std::stoll(idem::test::pg_text(
        e.conninfo, fmt::format("SELECT {} - (extract(epoch FROM clock_timestamp()) * "
                                "1000)::bigint FROM {}.idem_keys WHERE key = '{}'",
                                column, e.schema, key)));
  };
  CHECK(left("lease_until", "k-held") <= 31'000);
  CHECK(left("lease_until", "k-held") > 20'000);
  CHECK(left("expires_at", "k-done") <= 24 * 3600'000LL + 1'000);
  CHECK(left("expires_at", "k-done") > 24 * 3600'000LL - 10'000);
  // And back on the node's clock, as they were.
  CHECK(pg->load(id_of(held_request))->lease_until == t0 + 30s);
  CHECK(pg->load(id_of(call_request("k-done")))->expires_at == done.expires_at);
  Coordinator after(pg, options_on(before.clock));
  const Outcome replay = after.call(call_request("k-done"), [&]() -> Response {
    FAIL("k-done ran again");
    return {};
  });
  CHECK(replay.replayed());
  CHECK_THROWS_AS(after.call(held_request, before.charging({200, "no", {}})), InProgressError);
  CHECK(before.charges() == 2);
  // The messages are due when they were, not before.
  CHECK(pg->claim_outbox(t0 - 1s, t0 + 1min, 10).empty());
  const std::vector<OutboxMessage> due = pg->claim_outbox(t0, t0 + 1min, 10);
  REQUIRE(due.size() == 3);
  CHECK(due[0].created_at == t0);
  // A rerun measures the offset anew: nothing counts as changed.
  PgStore again(e.conninfo, PgOptions{.schema = e.schema, .local_clock = before.clock});
  CHECK(migrate_sqlite_to_pg(before.path, again, on_clock(before)).records_copied == 0);
}

TEST_CASE(
    "migrate: a missing file, one that is not SQLite or not an idem store, a newer schema and a "
    "batch of 0 are invalid arguments") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  auto pg = pg_on(e, e.schema);
  test::TempDir dir;
  const auto refused = [&](const std::string& file, MigrationOptions o = {}) {
    try {
      migrate_sqlite_to_pg(file, *pg, o);
    } catch (const StoreError& s) {
      FAIL("a StoreError: ", s.what());
    } catch (const error& err) {
      return err.code() == errc::invalid_argument;
    }
    return false;
  };
  const std::string missing = dir.file("missing.db");
  CHECK(refused(missing));
  CHECK_FALSE(std::filesystem::exists(missing));  // not created by the attempt
  const std::string text = dir.file("notes.txt");
  {
    std::ofstream out(text);
    for (int i = 0; i < 100; ++i) out << "not a database, line " << i << '\n';
  }
  CHECK(refused(text));
  const std::string other = dir.file("other.db");
  REQUIRE(test::RawDb(other).exec("CREATE TABLE things (x INTEGER)") == 0);
  CHECK(refused(other));
  const std::string newer = dir.file("newer.db");
  { SqliteStore store(newer); }
  REQUIRE(test::RawDb(newer).exec("PRAGMA user_version = 99") == 0);
  CHECK(refused(newer));
  const std::string fine = dir.file("fine.db");
  { SqliteStore store(fine); }
  CHECK(refused(fine, MigrationOptions{.batch = 0}));
  const MigrationReport empty = migrate_sqlite_to_pg(fine, *pg);
  CHECK(empty.records_copied == 0);
  CHECK(empty.outbox_copied == 0);
  CHECK(idem::test::pg_text(e.conninfo,
                            fmt::format("SELECT count(*) FROM {}.idem_keys", e.schema)) == "0");
}

namespace {}  // namespace

TEST_CASE("migrate: idem-demo migrate prints its report as one JSON line, and 1 on an error") {
  PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  test::TempDir dir;
  const std::string file = dir.file("keys.db");
  int runs = 0;
  {
    // On the system clock, as the demo's PgStore is.
    Coordinator idem(std::make_shared<SqliteStore>(file), Options{.in_flight = InFlight::raise});
    for (const char* key : {"d-1", "d-2", "d-3"}) {
      idem.call(call_request(key), [&] {
        ++runs;
        return Response{200, key, {}};
      });
    }
  }
  const std::vector<std::string> args = {"migrate",  "--from", file,      "--to", e.conninfo,
                                         "--schema", e.schema, "--batch", "2"};
  std::string out;
  REQUIRE(run_demo(dir, args, out) == 0);
  nlohmann::json line = nlohmann::json::parse(out);
  CHECK(line.at("records_copied") == 3);
  CHECK(line.at("records_expired") == 0);
  CHECK(line.at("outbox_copied") == 0);
  REQUIRE(run_demo(dir, args, out) == 0);
  line = nlohmann::json::parse(out);
  CHECK(line.at("records_copied") == 0);
  CHECK(line.at("records_unchanged") == 3);

  Coordinator after(std::make_shared<PgStore>(e.conninfo, PgOptions{.schema = e.schema}),
                    Options{.in_flight = InFlight::raise});
  const Outcome replay = after.call(call_request("d-2"), [&] {
    ++runs;
    return Response{200, "again", {}};
  });
  CHECK(replay.replayed());
  CHECK(replay.response.body == "d-2");
  CHECK(runs == 3);

  CHECK(run_demo(dir, {"migrate", "--from", dir.file("missing.db"), "--to", e.conninfo}, out) == 1);
  CHECK(out.empty());
}
