#include "idem/sqlite_store.hpp"
#include "idem/internal/store_stats.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <array>
#include <cstring>
#include <fstream>
#include <future>
#include <thread>

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
  // v5: the expiry index gave way to idem_due, one entry per record at its expires_at.
  CHECK(raw.scalar("SELECT count(*) FROM sqlite_master WHERE name = 'idem_keys_expiry'") == 0);
  CHECK(raw.scalar("SELECT count(*) FROM idem_due d JOIN idem_keys k USING (tenant, operation, "
                   "key) WHERE d.due_at = k.expires_at") == 2);
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

// The due times (lib/src/sql.hpp, migration v5): what the request path writes, and how
// maintenance moves and takes the entries.
namespace {
long long ms_at(idem::TimePoint t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}
// The record's due entries as "t1,t2,..." in milliseconds after T0.
std::string due_after_t0(RawDb& raw, const idem::KeyId& id) {
  return raw.text(fmt::format(
      "SELECT coalesce(group_concat(due_at - {}, ','), '') FROM (SELECT due_at FROM idem_due "
      "WHERE tenant = '{}' AND operation = '{}' AND key = '{}' ORDER BY due_at)",
      ms_at(T0), id.tenant, id.operation, id.key));
}
}  // namespace

TEST_CASE(
    "sqlite_store: a completion writes its record's page only, and purge moves the kept "
    "record's due entry once, then deletes the record at its TTL's end") {
  TempDir dir;
  const std::string path = dir.file("k.db");
  idem::SqliteStore s(path);
  RawDb raw(path);
  const Reservation r = reserve_at(s, T0);
  CHECK(due_after_t0(raw, kId) == "30000");  // the lease's end
  const long long before = wal_frames(path);
  CHECK(s.complete(kId, r.token, response("ch_1"), T0 + 1h));
  // One page: the record's. The due entry stays where the reservation put it.
  CHECK(wal_frames(path) - before == 1);
  CHECK(due_after_t0(raw, kId) == "30000");
  // Past the lease, before the TTL: nothing to delete; the entry moves to the TTL's end.
  CHECK(s.purge_expired(T0 + 1min, 10) == 0);
  CHECK(due_after_t0(raw, kId) == "3600000");
  CHECK(s.load(kId)->response.body == "ch_1");
  CHECK(s.purge_expired(T0 + 1h - 1ms, 10) == 0);
  CHECK(s.purge_expired(T0 + 1h, 10) == 1);
  CHECK_FALSE(s.load(kId));
  CHECK(raw.scalar("SELECT count(*) FROM idem_due") == 0);
}

TEST_CASE(
    "sqlite_store: a write that makes a record end sooner adds a due entry, a renewal adds "
    "none, and the reaper waits for the renewed lease") {
  TempDir dir;
  const std::string path = dir.file("k.db");
  idem::SqliteStore s(path);
  RawDb raw(path);
  const Reservation r = reserve_at(s, T0);
  CHECK(s.renew(kId, r.token, T0 + 10min));
  CHECK(due_after_t0(raw, kId) == "30000");
  // Past the first lease's end, not the renewed one's: the entry moves, nothing is reaped.
  CHECK(s.reap(T0 + 6min, 10).empty());
  CHECK(due_after_t0(raw, kId) == "600000");
  // A release ends the record now: an entry at the release time, taken by the next purge.
  CHECK(s.release(kId, r.token, T0 + 7min));
  CHECK(due_after_t0(raw, kId) == "420000,600000");
  CHECK(s.purge_expired(T0 + 7min, 10) == 1);
  // The other entry's record is gone: it is dropped when its time comes.
  CHECK(due_after_t0(raw, kId) == "600000");
  CHECK(s.purge_expired(T0 + 10min, 10) == 0);
  CHECK(raw.scalar("SELECT count(*) FROM idem_due") == 0);

  const Reservation again = reserve_at(s, T0 + 11min);
  CHECK(s.reap(T0 + 11min + 30s, 10).empty());
  const auto reaped = s.reap(T0 + 11min + 30s + 1ms, 10);
  REQUIRE(reaped.size() == 1);
  CHECK(reaped[0].token == again.token);
  CHECK(raw.scalar("SELECT count(*) FROM idem_due") == 0);
}

TEST_CASE(
    "sqlite_store: purge walks a backlog of kept records in batches, moving each entry once and "
    "deleting exactly the dead ones") {
  TempDir dir;
  const std::string path = dir.file("k.db");
  idem::SqliteStore s(path);
  RawDb raw(path);
  auto key = [](int i) { return idem::KeyId{"alpha", "op", fmt::format("k{:03}", i)}; };
  // 250 records: every third kept for an hour, the others for two minutes.
  for (int i = 0; i < 250; ++i) {
    const Reservation r = reserve_at(s, T0, kFp, key(i));
    REQUIRE(s.complete(key(i), r.token, response("x"), T0 + (i % 3 == 0 ? 1h : 2min)));
  }
  // At +1 min every entry is due (the leases ended) and no record is dead: 250 entries are
  // looked at, in batches of 100, and each moves to its record's TTL end.
  CHECK(s.purge_expired(T0 + 1min, 100) == 0);
  CHECK(raw.scalar(fmt::format("SELECT count(*) FROM idem_due WHERE due_at = {}",
                               ms_at(T0 + 2min))) == 166);
  CHECK(raw.scalar(
            fmt::format("SELECT count(*) FROM idem_due WHERE due_at = {}", ms_at(T0 + 1h))) == 84);
  // At +3 min: 166 dead, taken 100 then 66; the kept ones are not due yet.
  CHECK(s.purge_expired(T0 + 3min, 100) == 100);
  CHECK(s.purge_expired(T0 + 3min, 100) == 66);
  CHECK(s.purge_expired(T0 + 3min, 100) == 0);
  for (int i = 0; i < 250; ++i) {
    CAPTURE(i);
    CHECK(s.load(key(i)).has_value() == (i % 3 == 0));
  }
  CHECK(raw.scalar("SELECT count(*) FROM idem_due") == 84);
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

TEST_CASE(
    "sqlite_store: a call of this process that holds the connection past busy_timeout fails "
    "the calls waiting behind it with StoreError (SQLITE_BUSY), nothing done") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"), idem::SqliteOptions{20ms, idem::Synchronous::normal});
  const Reservation r = reserve_at(s, T0);
  REQUIRE(r.kind == Reservation::Kind::reserved);
  const auto began = s.begin_steps(kId, r.token, "the request");
  REQUIRE(began);
  // A local step that does not end holds the store's connection (its transaction) until the
  // test lets it go, or for 30 s at most: a bound, never a synchronisation.
  std::promise<void> holding, go;
  std::shared_future<void> gone = go.get_future().share();
  std::thread holder([&] {
    s.commit_step(
        kId, r.token, began->origin,
        idem::StepCommit{idem::StepResult{"debited", "ch_1"}, T0, [&](idem::LocalTransaction&) {
                           holding.set_value();
                           gone.wait_for(30s);
                         }});
  });
  holding.get_future().wait();
  const idem::KeyId other{"alpha", "payment.charge", "k2"};
  const auto busy = [](const idem::StoreError& e) {
    CHECK((e.sqlite_code() & 0xff) == SQLITE_BUSY);
    CHECK(std::string(e.what()).find("busy_timeout") != std::string::npos);
  };
  bool reserve_failed = false, load_failed = false;
  try {
    reserve_at(s, T0, kFp, other);
  } catch (const idem::StoreError& e) {
    busy(e);
    reserve_failed = true;
  }
  try {
    s.load(kId);
  } catch (const idem::StoreError& e) {
    busy(e);
    load_failed = true;
  }
  idem::StoreOp op{.kind = idem::StoreOp::Kind::reserve,
                   .id = &other,
                   .fingerprint = &kFp,
                   .now = T0,
                   .lease_until = T0 + 30s};
  idem::StoreOp* const ops[] = {&op};
  s.apply(ops);  // never throws: the op holds the error
  const bool applied_failed = static_cast<bool>(op.error);
  go.set_value();
  holder.join();
  CHECK(reserve_failed);
  CHECK(load_failed);
  CHECK(applied_failed);
  CHECK_FALSE(s.load(other));  // nothing was written for k2
  CHECK(reserve_at(s, T0, kFp, other).kind == Reservation::Kind::reserved);
}

// Each op's own outcome is the store contract's (store_contract_test.cpp); SQLite commits the
// whole batch in one transaction.
TEST_CASE("sqlite_store: group commit: a batch of ops is one transaction") {
  TempDir dir;
  idem::SqliteStore s(dir.file("k.db"));
  const idem::KeyId k1{"alpha", "op", "k1"}, k2{"alpha", "op", "k2"}, k3{"alpha", "op", "k3"};
  const Reservation held = reserve_at(s, T0, kFp, k2);  // k2: live, someone else's
  const Reservation mine = reserve_at(s, T0, kFp, k3);  // k3: ours, to complete
  const auto before = idem::detail::StoreStats::of(s);

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
  stale.token = held.token + 1;  // not current: a conflict, not a failed batch
  done.response = stale.response = &body;
  done.expires_at = stale.expires_at = T0 + 24h;
  std::vector<idem::StoreOp*> ops = {&fresh, &dup, &busy, &done, &stale};
  s.apply(ops);

  for (const idem::StoreOp* op : ops) CHECK_FALSE(op->error);
  CHECK(done.applied);
  CHECK_FALSE(stale.applied);
  const auto after = idem::detail::StoreStats::of(s);
  CHECK(after.transactions - before.transactions == 1);
  CHECK(after.ops - before.ops == 5);
}

TEST_CASE(
    "sqlite_store: load_many reads each key as load() does, and a record that does not decode "
    "fails its own read only") {
  TempDir dir;
  const std::string path = dir.file("k.db");
  idem::SqliteStore s(path);
  const idem::KeyId k1{"alpha", "op", "k1"}, k2{"alpha", "op", "k2"}, k3{"alpha", "op", "k3"},
      absent{"alpha", "op", "nobody"};
  for (const idem::KeyId* id : {&k1, &k2, &k3}) {
    const Reservation r = reserve_at(s, T0, kFp, *id);
    REQUIRE(s.complete(*id, r.token, response("ch_" + id->key), T0 + 24h));
  }
  REQUIRE(RawDb(path).exec("UPDATE idem_keys SET headers = 'not json' WHERE key = 'k2'") ==
          SQLITE_OK);
  std::vector<idem::StoreRead> reads = {{&k1}, {&k2}, {&absent}, {&k3}, {&k1}};
  std::vector<idem::StoreRead*> batch;
  for (idem::StoreRead& r : reads) batch.push_back(&r);
  s.load_many(batch);
  for (const idem::StoreRead* r : {&reads[0], &reads[3], &reads[4]}) {
    CAPTURE(r->id->key);
    CHECK_FALSE(r->error);
    REQUIRE(r->record);
    CHECK(r->record->response.body == "ch_" + r->id->key);
    CHECK(r->record->state == State::completed);
  }
  CHECK_FALSE(reads[2].error);
  CHECK_FALSE(reads[2].record);
  REQUIRE(reads[1].error);
  CHECK_THROWS_AS(std::rethrow_exception(reads[1].error), idem::CorruptRecordError);
  CHECK_FALSE(reads[1].record);
  CHECK_THROWS_AS(s.load(k2), idem::CorruptRecordError);  // as load() answers it
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
    for (; idem::detail::StoreStats::of(s).checkpoints < 3; ++written) {
      REQUIRE(written < 200000);
      const idem::KeyId id{"alpha", "payment.charge", fmt::format("k{}", written)};
      const auto r = s.reserve(id, kFp, T0, T0 + 30s);
      REQUIRE(r.kind == Reservation::Kind::reserved);
      REQUIRE(s.complete(id, r.token, body, T0 + 24h));
    }
    transactions = idem::detail::StoreStats::of(s).transactions;
    // A WAL that never started over would hold at least one frame per transaction; after a
    // checkpoint it holds only what was written since.
    const long long frames = wal_frames(path);
    CAPTURE(frames);  // what a failure needs to be understood
    CAPTURE(transactions);
    CAPTURE(written);
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
