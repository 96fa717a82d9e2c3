#include "idem/sqlite_store.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <array>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "idem/errors.hpp"
#include "test_support.hpp"

using namespace std::chrono_literals;
using idem::Reservation;
using idem::State;
using idem::test::RawDb;
using idem::test::TempDir;

namespace {

const idem::TimePoint T0 = idem::sim::kSimulationStart;
const idem::KeyId kId{"alpha", "payment.charge", "k1"};
const idem::Fingerprint kFp = idem::Fingerprint::of(nlohmann::json{{"amount", 1}});
const idem::Fingerprint kOtherFp = idem::Fingerprint::of(nlohmann::json{{"amount", 2}});

idem::StoredResponse response(std::string body, int status = 200) {
  return idem::StoredResponse{idem::Response{status, std::move(body), {}}, ""};
}

// The WAL's length in frames: mxFrame of the wal-index header at the start of the -shm file
// (a native-endian u32 at byte 16; sqlite.org/walformat.html). Read without locks, so a
// running checkpoint cannot make it fail; -1 if the file cannot be read.
long long wal_frames(const std::string& db_path) {
  std::ifstream shm(db_path + "-shm", std::ios::binary);
  std::array<char, 20> header{};
  if (!shm.read(header.data(), header.size())) return -1;
  std::uint32_t mx_frame = 0;
  std::memcpy(&mx_frame, header.data() + 16, sizeof mx_frame);
  return mx_frame;
}

Reservation reserve_at(idem::SqliteStore& s, idem::TimePoint t, const idem::Fingerprint& fp = kFp,
                       const idem::KeyId& id = kId) {
  return s.reserve(id, fp, t, t + 30s);
}

long long raw_rows(const TempDir& dir) {
  RawDb raw(dir.file("k.db"));
  return raw.rows();
}

}  // namespace

TEST_CASE("sqlite_store: reserve makes an in_progress record, a second reserve sees it") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"));
  const Reservation first = reserve_at(s, T0);
  CHECK(first.kind == Reservation::Kind::reserved);
  CHECK(first.token > 0);
  const Reservation second = reserve_at(s, T0 + 1s);
  REQUIRE(second.kind == Reservation::Kind::existing);
  CHECK(second.existing->state == State::in_progress);
  CHECK(second.existing->token == first.token);
  CHECK(second.existing->lease_until == T0 + 30s);
  CHECK(second.existing->fingerprint == kFp);
}

TEST_CASE("sqlite_store: uniqueness is on (tenant, operation, key), enforced by the database") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"));
  CHECK(reserve_at(s, T0).kind == Reservation::Kind::reserved);
  CHECK(reserve_at(s, T0, kFp, {"beta", "payment.charge", "k1"}).kind ==
        Reservation::Kind::reserved);
  CHECK(reserve_at(s, T0, kFp, {"alpha", "order.cancel", "k1"}).kind ==
        Reservation::Kind::reserved);
  RawDb raw(dir.file("k.db"));
  CHECK(raw.rows() == 3);
  // A second row for the same triple violates the PRIMARY KEY, whoever tries to write it.
  CHECK(raw.exec("INSERT INTO idem_keys (tenant, operation, key, fingerprint, state, token, "
                 "lease_until, created_at, expires_at) SELECT tenant, operation, key, fingerprint, "
                 "state, token, lease_until, created_at, expires_at FROM idem_keys LIMIT 1") ==
        SQLITE_CONSTRAINT);
  // The table is STRICT: a text token is refused.
  CHECK(raw.exec("UPDATE idem_keys SET token = 'x'") == SQLITE_CONSTRAINT);
}

TEST_CASE("sqlite_store: complete needs the current token and stores the response byte for byte") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"));
  const Reservation r = reserve_at(s, T0);
  idem::StoredResponse resp = response(std::string("{\"id\":\"ch_1\"}\0tail", 18), 402);
  resp.response.headers = {{"X-Trace", "abc"}, {"Content-Type", "application/json"}};
  CHECK_FALSE(s.complete(kId, r.token + 1, resp, T0 + 24h));
  CHECK(s.complete(kId, r.token, resp, T0 + 24h));
  CHECK_FALSE(s.complete(kId, r.token, resp, T0 + 24h));  // no longer in progress
  const auto rec = s.load(kId);
  REQUIRE(rec);
  CHECK(rec->state == State::completed);
  CHECK(rec->response == resp.response);
  CHECK(rec->response.body.size() == 18);
  CHECK(rec->expires_at == T0 + 24h);
}

TEST_CASE(
    "sqlite_store: an expired lease is taken over with a larger token, the zombie is fenced") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"));
  const Reservation first = reserve_at(s, T0);
  CHECK(reserve_at(s, T0 + 29s).kind == Reservation::Kind::existing);
  const Reservation second = reserve_at(s, T0 + 30s);
  CHECK(second.kind == Reservation::Kind::taken_over);
  CHECK(second.token > first.token);
  CHECK_FALSE(s.complete(kId, first.token, response("zombie"), T0 + 24h));
  CHECK_FALSE(s.release(kId, first.token, T0 + 31s));
  CHECK_FALSE(s.renew(kId, first.token, T0 + 90s));
  CHECK(s.complete(kId, second.token, response("owner"), T0 + 24h));
  CHECK(s.load(kId)->response.body == "owner");
}

TEST_CASE("sqlite_store: tokens grow across release, expiry and purge") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"));
  const Reservation a = reserve_at(s, T0);
  CHECK(s.release(kId, a.token, T0 + 1ms));
  CHECK(s.load(kId)->state == State::released);
  const Reservation b = reserve_at(s, T0 + 1ms);  // released counts as absent
  CHECK(b.kind == Reservation::Kind::reserved);
  CHECK(b.token > a.token);
  CHECK(s.complete(kId, b.token, response("x"), T0 + 2min));
  CHECK(reserve_at(s, T0 + 2min - 1ms).kind == Reservation::Kind::existing);
  const Reservation c = reserve_at(s, T0 + 2min);  // TTL over: counts as absent
  CHECK(c.kind == Reservation::Kind::reserved);
  CHECK(c.token > b.token);
  CHECK(s.release(kId, c.token, T0 + 2min));
  CHECK(s.purge_expired(T0 + 3min, 10) == 1);
  CHECK_FALSE(s.load(kId));
  CHECK(reserve_at(s, T0 + 3min).token > c.token);
}

TEST_CASE("sqlite_store: renew extends only the current lease") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"));
  const Reservation r = reserve_at(s, T0);
  CHECK(s.renew(kId, r.token, T0 + 60s));
  CHECK(reserve_at(s, T0 + 45s).kind == Reservation::Kind::existing);
  CHECK(reserve_at(s, T0 + 60s).kind == Reservation::Kind::taken_over);
}

TEST_CASE("sqlite_store: a takeover by the same request keeps the recovery point") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"));
  const Reservation r = reserve_at(s, T0);
  CHECK(s.set_recovery_point(kId, r.token, "debited"));
  CHECK_FALSE(s.set_recovery_point(kId, r.token + 1, "notified"));
  const Reservation same = reserve_at(s, T0 + 31s);
  CHECK(same.kind == Reservation::Kind::taken_over);
  CHECK(same.recovery_point == std::optional<std::string>("debited"));
  // A different request taking over an abandoned key starts from scratch.
  const Reservation other = reserve_at(s, T0 + 62s, kOtherFp);
  CHECK(other.kind == Reservation::Kind::taken_over);
  CHECK_FALSE(other.recovery_point);
  CHECK_FALSE(s.load(kId)->recovery_point);
}

TEST_CASE("sqlite_store: store_if_absent stores once and returns the winner to the loser") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"));
  CHECK_FALSE(s.store_if_absent(kId, kFp, response("ch_1"), T0, T0 + 24h));
  const auto winner = s.store_if_absent(kId, kFp, response("ch_2"), T0 + 1s, T0 + 24h);
  REQUIRE(winner);
  CHECK(winner->response.body == "ch_1");
  CHECK_FALSE(s.store_if_absent(kId, kFp, response("ch_3"), T0 + 25h, T0 + 48h));
  CHECK(s.load(kId)->response.body == "ch_3");
}

TEST_CASE("sqlite_store: purge deletes only records that no longer count, in bounded batches") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"));
  for (int i = 0; i < 25; ++i) {
    const idem::KeyId id{"alpha", "op", "k" + std::to_string(i)};
    const Reservation r = reserve_at(s, T0, kFp, id);
    if (i < 20) CHECK(s.complete(id, r.token, response("x"), T0 + (i < 15 ? 1min : 1h)));
  }
  // 15 expired at +1min, 5 live until +1h, 5 in progress (never purged, only reaped).
  CHECK(s.purge_expired(T0 + 2min, 10) == 10);
  CHECK(s.purge_expired(T0 + 2min, 10) == 5);
  CHECK(s.purge_expired(T0 + 2min, 10) == 0);
  RawDb raw(dir.file("k.db"));
  CHECK(raw.rows() == 10);
}

TEST_CASE("sqlite_store: reap clears reservations whose lease ended long ago") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"));
  const Reservation old = reserve_at(s, T0);
  reserve_at(s, T0 + 10min, kFp, {"alpha", "payment.charge", "fresh"});
  const auto reaped = s.reap(T0 + 6min, 100);
  REQUIRE(reaped.size() == 1);
  CHECK(reaped[0].token == old.token);
  CHECK(reaped[0].key_hash == idem::short_hash(kId));
  CHECK(reaped[0].lease_until == T0 + 30s);
  CHECK_FALSE(s.load(kId));
  CHECK(s.load({"alpha", "payment.charge", "fresh"}));
}

TEST_CASE("sqlite_store: the schema is versioned and a newer schema is refused") {
  TempDir dir;
  { idem::SqliteStore s(dir.file("k.db")); }
  {
    RawDb raw(dir.file("k.db"));
    CHECK(raw.scalar("PRAGMA user_version") == idem::SqliteStore::schema_version());
    CHECK(raw.text("PRAGMA journal_mode") == "wal");
  }
  { idem::SqliteStore again(dir.file("k.db")); }  // reopening migrates nothing
  {
    RawDb raw(dir.file("k.db"));
    CHECK(raw.exec("PRAGMA user_version = 99") == SQLITE_OK);
  }
  try {
    idem::SqliteStore s(dir.file("k.db"));
    FAIL("opened a database from the future");
  } catch (const idem::StoreError& e) {
    CHECK(std::string(e.what()).find("schema version 99 is newer") != std::string::npos);
  }
}

TEST_CASE("sqlite_store: a version 1 database is migrated with its records intact") {
  TempDir dir;
  {
    // What the first release created: the v1 table, written here verbatim.
    RawDb raw(dir.file("k.db"));
    REQUIRE(raw.exec(R"sql(
PRAGMA journal_mode=WAL;
CREATE TABLE idem_keys (
  tenant TEXT NOT NULL, operation TEXT NOT NULL, key TEXT NOT NULL,
  fingerprint BLOB NOT NULL CHECK (length(fingerprint) = 32),
  state INTEGER NOT NULL CHECK (state IN (1, 2, 3)),
  token INTEGER NOT NULL, lease_until INTEGER NOT NULL, created_at INTEGER NOT NULL,
  expires_at INTEGER NOT NULL, status INTEGER, headers TEXT, body BLOB, body_ref TEXT,
  recovery_point TEXT,
  PRIMARY KEY (tenant, operation, key)
) STRICT, WITHOUT ROWID;
CREATE INDEX idem_keys_expiry ON idem_keys (expires_at);
PRAGMA user_version = 1;
)sql") == SQLITE_OK);
    // Two records as the first release wrote them: a stored rejection and a held key.
    REQUIRE(raw.exec(R"sql(
INSERT INTO idem_keys VALUES ('alpha', 'payment.charge', 'k1', zeroblob(32), 2, 7, 1700000030000,
  1700000000000, 1700086400000, 402, '[["X-A","1"]]', CAST('{"error":"card_declined"}' AS BLOB), NULL, NULL);
INSERT INTO idem_keys VALUES ('alpha', 'payment.charge', 'held', zeroblob(32), 1, 8, 1700000030000,
  1700000000000, 1700000030000, NULL, NULL, NULL, NULL, 'step-2');
)sql") == SQLITE_OK);
  }
  const idem::TimePoint t0{std::chrono::milliseconds(1'700'000'000'000)};
  { idem::SqliteStore s(dir.file("k.db")); }
  RawDb raw(dir.file("k.db"));
  CHECK(raw.scalar("PRAGMA user_version") == idem::SqliteStore::schema_version());
  CHECK(
      raw.text("SELECT sql FROM sqlite_master WHERE name = 'idem_keys'").find("BETWEEN 1 AND 3") !=
      std::string::npos);
  CHECK(raw.scalar("SELECT count(*) FROM sqlite_master WHERE name = 'idem_keys_expiry'") == 1);
  CHECK(raw.rows() == 2);
  // The constraint still holds after the rebuild.
  CHECK(raw.exec("UPDATE idem_keys SET state = 4") != SQLITE_OK);
  idem::SqliteStore s(dir.file("k.db"));
  const auto done = s.load(kId);
  REQUIRE(done);
  CHECK(done->state == idem::State::completed);
  CHECK(done->response.status == 402);
  CHECK(done->response.body == R"({"error":"card_declined"})");
  REQUIRE(done->response.headers.size() == 1);
  CHECK(done->response.headers[0].value == "1");
  CHECK(done->token == 7);
  CHECK(done->expires_at == t0 + 24h);
  const auto held = s.load({"alpha", "payment.charge", "held"});
  REQUIRE(held);
  CHECK(held->state == idem::State::in_progress);
  CHECK(held->token == 8);
  CHECK(held->lease_until == t0 + 30s);
  CHECK(held->recovery_point == "step-2");
}

TEST_CASE("sqlite_store: an unopenable path is a StoreError with SQLite's code") {
  TempDir dir;
  try {
    idem::SqliteStore s(dir.file("no/such/dir/k.db"));
    FAIL("opened");
  } catch (const idem::StoreError& e) {
    CHECK(e.code() == idem::errc::store_unavailable);
    CHECK(e.sqlite_code() == SQLITE_CANTOPEN);
  }
}

TEST_CASE("sqlite_store: a write lock held past busy_timeout is a StoreError (SQLITE_BUSY)") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"), idem::SqliteOptions{20ms, idem::Synchronous::normal});
  RawDb locker(dir.file("k.db"));
  REQUIRE(locker.exec("BEGIN IMMEDIATE") == SQLITE_OK);
  try {
    reserve_at(s, T0);
    FAIL("reserved under a held write lock");
  } catch (const idem::StoreError& e) {
    CHECK((e.sqlite_code() & 0xff) == SQLITE_BUSY);
  }
  locker.exec("ROLLBACK");
  CHECK(reserve_at(s, T0).kind == Reservation::Kind::reserved);  // nothing half-written
}

TEST_CASE("sqlite_store: group commit: one transaction, each op its own outcome") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"));
  const idem::KeyId k1{"alpha", "op", "k1"}, k2{"alpha", "op", "k2"}, k3{"alpha", "op", "k3"};
  const Reservation held = reserve_at(s, T0, kFp, k2);  // k2: live, someone else's
  const Reservation mine = reserve_at(s, T0, kFp, k3);  // k3: ours, to complete
  const auto before = s.commit_stats();

  idem::StoreOp fresh, dup, busy, done, stale;
  fresh.kind = dup.kind = busy.kind = idem::StoreOp::Kind::reserve;
  fresh.id = dup.id = &k1;
  busy.id = &k2;
  fresh.fingerprint = dup.fingerprint = busy.fingerprint = &kFp;
  fresh.now = dup.now = busy.now = T0 + 1s;
  fresh.lease_until = dup.lease_until = busy.lease_until = T0 + 31s;
  const idem::StoredResponse body = response("ch_3");
  done.kind = stale.kind = idem::StoreOp::Kind::complete;
  done.id = &k3;
  stale.id = &k2;
  done.token = mine.token;
  stale.token = held.token + 1;  // not current
  done.response = stale.response = &body;
  done.expires_at = stale.expires_at = T0 + 24h;
  std::vector<idem::StoreOp*> ops = {&fresh, &dup, &busy, &done, &stale};
  s.apply(ops);

  CHECK(fresh.reservation.kind == Reservation::Kind::reserved);
  CHECK(dup.reservation.kind == Reservation::Kind::existing);  // the same key earlier in the batch
  CHECK(dup.reservation.existing->token == fresh.reservation.token);
  CHECK(busy.reservation.kind == Reservation::Kind::existing);
  CHECK(busy.reservation.existing->token == held.token);
  CHECK(done.applied);
  CHECK_FALSE(stale.applied);
  for (const idem::StoreOp* op : ops) CHECK_FALSE(op->error);
  const auto after = s.commit_stats();
  CHECK(after.transactions - before.transactions == 1);
  CHECK(after.ops - before.ops == 5);
  CHECK(s.load(k3)->response.body == "ch_3");
  CHECK(s.load(k2)->state == State::in_progress);
}

TEST_CASE(
    "sqlite_store: group commit: a write lock held past busy_timeout fails every op of the batch, "
    "changing nothing") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"), idem::SqliteOptions{.busy_timeout = 20ms});
  RawDb locker(dir.file("k.db"));
  REQUIRE(locker.exec("BEGIN IMMEDIATE") == SQLITE_OK);
  const idem::KeyId k1{"alpha", "op", "k1"}, k2{"alpha", "op", "k2"};
  idem::StoreOp a, b;
  a.id = &k1;
  b.id = &k2;
  a.fingerprint = b.fingerprint = &kFp;
  a.now = b.now = T0;
  a.lease_until = b.lease_until = T0 + 30s;
  std::vector<idem::StoreOp*> ops = {&a, &b};
  s.apply(ops);
  CHECK(a.error);
  CHECK(b.error);
  locker.exec("ROLLBACK");
  CHECK(raw_rows(dir) == 0);
}

TEST_CASE(
    "sqlite_store: background checkpoints keep the WAL starting over, and every record intact") {
  TempDir dir;
  const std::string path = dir.file("k.db");
  idem::SqliteOptions options;
  options.checkpoint_pages = 64;
  std::uint64_t transactions = 0;
  int written = 0;
  {
    idem::SqliteStore s(path, options);
    const idem::StoredResponse body = response("ch_1");
    // Write until the checkpointer has finished three checkpoints (progress, not time, ends
    // the loop; the bound only turns a checkpointer that never runs into a failure).
    for (; s.commit_stats().checkpoints < 3; ++written) {
      REQUIRE(written < 200000);
      const idem::KeyId id{"alpha", "payment.charge", fmt::format("k{}", written)};
      const auto r = s.reserve(id, kFp, T0, T0 + 30s);
      REQUIRE(r.kind == Reservation::Kind::reserved);
      REQUIRE(s.complete(id, r.token, body, T0 + 24h));
    }
    transactions = s.commit_stats().transactions;
    // A WAL that never started over would hold at least one frame per transaction; after a
    // checkpoint it holds only what was written since.
    const long long frames = wal_frames(path);
    CHECK(frames >= 0);
    CHECK(frames < static_cast<long long>(transactions));
    for (int i : {0, written / 2, written - 1}) {
      const auto rec = s.load({"alpha", "payment.charge", fmt::format("k{}", i)});
      REQUIRE(rec);
      CHECK(rec->state == idem::State::completed);
      CHECK(rec->response.body == body.response.body);
    }
  }
  RawDb raw(path);
  CHECK(raw.text("PRAGMA integrity_check") == "ok");
  CHECK(raw.rows() == written);
}

TEST_CASE(
    "sqlite_store: a response header that is not UTF-8 fails its own completion, not its batch's") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"));
  const idem::KeyId good{"alpha", "op", "good"}, bad{"alpha", "op", "bad"};
  const Reservation rg = reserve_at(s, T0, kFp, good);
  const Reservation rb = reserve_at(s, T0, kFp, bad);
  const idem::StoredResponse ok{idem::Response{200, "fine", {{"X-Ok", "yes"}}}, ""};
  const idem::StoredResponse latin1{idem::Response{200, "body", {{"X-Name", "caf\xe9"}}}, ""};
  idem::StoreOp a{.kind = idem::StoreOp::Kind::complete,
                  .id = &good,
                  .expires_at = T0 + 1h,
                  .token = rg.token,
                  .response = &ok};
  idem::StoreOp b{.kind = idem::StoreOp::Kind::complete,
                  .id = &bad,
                  .expires_at = T0 + 1h,
                  .token = rb.token,
                  .response = &latin1};
  idem::StoreOp* ops[] = {&b, &a};
  s.apply(ops);
  CHECK(a.applied);
  CHECK_FALSE(a.error);
  REQUIRE(b.error);
  CHECK_THROWS_AS(std::rethrow_exception(b.error), idem::StoreError);
  CHECK(s.load(good)->state == idem::State::completed);
  CHECK(s.load(bad)->state == idem::State::in_progress);
}
