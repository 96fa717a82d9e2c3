// The store's paths under failing SQLite I/O calls, power loss and a full disk, through
// idem::sim::FaultyVfs (SQLite's default VFS for each test's scope).
#include "idem/sim/faulty_vfs.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sqlite3.h>

#include <functional>
#include <map>
#include <optional>
#include <sstream>

#include "idem/coordinator.hpp"
#include "idem/errors.hpp"
#include "idem/sim/simulated_clock.hpp"
#include "idem/sqlite_store.hpp"
#include "test_support.hpp"

using namespace std::chrono_literals;
using idem::sim::FaultyVfs;
using idem::sim::FileRole;
using idem::sim::IoCall;
using idem::sim::ScopedDefaultVfs;
using idem::test::TempDir;

namespace {

// The store as the tests here use it: no background checkpointer thread (determinism).
idem::SqliteOptions quiet(idem::Synchronous sync = idem::Synchronous::normal,
                          int checkpoint_pages = 1000) {
  idem::SqliteOptions o;
  o.background_checkpoint = false;
  o.synchronous = sync;
  o.checkpoint_pages = checkpoint_pages;
  return o;
}

// A connection through SQLite's own unix VFS, never through the faulty one.
class Direct {
 public:
  explicit Direct(const std::string& path) {
    if (sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READWRITE, "unix") != SQLITE_OK) {
      const std::string msg = sqlite3_errmsg(db_);
      sqlite3_close_v2(db_);
      throw std::runtime_error("open failed: " + msg);
    }
  }
  ~Direct() { sqlite3_close_v2(db_); }
  Direct(const Direct&) = delete;
  Direct& operator=(const Direct&) = delete;

  std::string integrity() {
    std::string out;
    sqlite3_stmt* s = nullptr;
    if (sqlite3_prepare_v2(db_, "PRAGMA integrity_check", -1, &s, nullptr) != SQLITE_OK)
      return sqlite3_errmsg(db_);
    int rc = 0;
    while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
      if (!out.empty()) out += "; ";
      out += reinterpret_cast<const char*>(sqlite3_column_text(s, 0));
    }
    if (rc != SQLITE_DONE) out += fmt::format(" [step: {}]", sqlite3_errmsg(db_));
    sqlite3_finalize(s);
    return out;
  }

  // The key's row: state, token, lease_until, whether a status is stored, body.
  struct Row {
    int state;
    long long token;
    long long lease_until;
    bool has_status;
    std::string body;
  };
  std::optional<Row> row(const std::string& key) {
    sqlite3_stmt* s = nullptr;
    const char* q =
        "SELECT state, token, lease_until, status IS NOT NULL, body FROM idem_keys "
        "WHERE tenant = 'alpha' AND operation = 'payment.charge' AND key = ?1";
    if (sqlite3_prepare_v2(db_, q, -1, &s, nullptr) != SQLITE_OK)
      throw std::runtime_error(sqlite3_errmsg(db_));
    sqlite3_bind_text(s, 1, key.c_str(), -1, SQLITE_TRANSIENT);
    std::optional<Row> out;
    if (sqlite3_step(s) == SQLITE_ROW) {
      const auto* body = static_cast<const char*>(sqlite3_column_blob(s, 4));
      out = Row{sqlite3_column_int(s, 0), sqlite3_column_int64(s, 1), sqlite3_column_int64(s, 2),
                sqlite3_column_int(s, 3) != 0,
                body != nullptr
                    ? std::string(body, static_cast<std::size_t>(sqlite3_column_bytes(s, 4)))
                    : std::string()};
    }
    sqlite3_finalize(s);
    return out;
  }

  long long rows() {
    sqlite3_stmt* s = nullptr;
    sqlite3_prepare_v2(db_, "SELECT count(*) FROM idem_keys", -1, &s, nullptr);
    long long n = -1;
    if (sqlite3_step(s) == SQLITE_ROW) n = sqlite3_column_int64(s, 0);
    sqlite3_finalize(s);
    return n;
  }

 private:
  sqlite3* db_ = nullptr;
};

idem::KeyId id_of(const std::string& key) { return {"alpha", "payment.charge", key}; }

std::string body_of(const std::string& key) { return fmt::format("{{\"charge\":\"{}\"}}", key); }

// One fresh database, a store through the faulty VFS and a coordinator on simulated time.
struct World {
  TempDir dir;
  std::string path = dir.file("k.db");
  std::shared_ptr<idem::sim::SimulatedClock> clock = std::make_shared<idem::sim::SimulatedClock>();
  std::shared_ptr<idem::SqliteStore> store;
  std::unique_ptr<idem::Coordinator> idem;
  int runs = 0;  // how many times actions really ran

  explicit World(idem::FailureMode mode = idem::FailureMode::fail_closed,
                 idem::SqliteOptions options = quiet()) {
    open(mode, options);
  }

  void open(idem::FailureMode mode, idem::SqliteOptions options) {
    idem.reset();
    store.reset();  // the last connection closes: checkpoint, WAL deleted
    store = std::make_shared<idem::SqliteStore>(path, options);
    idem::Options o;
    o.clock = clock;
    o.heartbeat = 0ms;
    o.on_store_failure = mode;
    idem = std::make_unique<idem::Coordinator>(store, o);
  }

  idem::Response answer(const std::string& key) {
    ++runs;
    return idem::Response{200, body_of(key), {}};
  }

  // A call that must execute its action once and store the response.
  void serve(const std::string& key) {
    const int before = runs;
    const idem::Outcome out = idem->call(idem::test::request(key), [&] { return answer(key); });
    CHECK(out.source == idem::Outcome::Source::executed);
    CHECK(runs == before + 1);
    const idem::Outcome again = idem->call(idem::test::request(key), [&] { return answer(key); });
    CHECK(again.replayed());
    CHECK(again.response.body == body_of(key));
    CHECK(runs == before + 1);
  }
};

// Where a path begins and ends: the counting run records the calls in between, a failing
// run arms its fault at the beginning and lifts it at the end.
struct Hooks {
  std::function<void()> begin, end;
};

struct PathUnderTest {
  std::string name;
  idem::FailureMode mode = idem::FailureMode::fail_closed;
  std::function<void(World&)> setup;
  // Runs the path between hooks.begin() and hooks.end(); returns what happened, for the log.
  std::function<std::string(World&, const Hooks&)> run;
};

bool failable(IoCall c) {
  return c != IoCall::close && c != IoCall::file_control && c != IoCall::shm_barrier;
}

// Fails each I/O call the path makes, once, each time on a fresh database; after each, checks
// the database's integrity and that the same store serves a new key. Twice: with the store's
// page cache warm under synchronous=NORMAL (the common case: no reads, no syncs), then with a
// store just reopened (its cache cold, so the path reads the database) under
// synchronous=FULL (so it syncs too). Returns how many calls were failed.
std::size_t fail_each_call(FaultyVfs& vfs, const PathUnderTest& path) {
  std::size_t failed_calls = 0;
  for (const bool cold : {false, true}) {
    const idem::SqliteOptions options =
        quiet(cold ? idem::Synchronous::full : idem::Synchronous::normal);
    const auto prepare = [&](World& w) {
      path.setup(w);
      if (cold) w.open(path.mode, options);
    };
    std::vector<idem::sim::IoCallRecord> trace;
    {
      World w(path.mode, options);
      prepare(w);
      const Hooks counting{[&] {
                             vfs.reset_counts();
                             vfs.record_calls(true);
                           },
                           [&] { vfs.record_calls(false); }};
      path.run(w, counting);
      for (const auto& c : vfs.calls())
        if (failable(c.call)) trace.push_back(c);
    }
    REQUIRE(!trace.empty());
    std::ostringstream log;
    log << path.name << (cold ? ", reopened store, synchronous=FULL: " : ", warm cache: ")
        << trace.size() << " I/O calls, each failed once\n";
    for (const auto& c : trace) {
      CAPTURE(path.name);
      CAPTURE(cold);
      CAPTURE(to_string(c.call));
      CAPTURE(to_string(c.role));
      CAPTURE(c.ordinal);
      World w(path.mode, options);
      prepare(w);
      std::vector<idem::sim::FailedIoCall> failed;
      const Hooks failing{[&] {
                            vfs.reset_counts();
                            vfs.fail_nth(c.call, c.role, c.ordinal);
                          },
                          [&] {
                            vfs.clear_faults();
                            failed = vfs.failed();
                          }};
      const std::string what = path.run(w, failing);
      CHECK(failed.size() == 1);  // the run met the call it was failing
      for (const auto& f : failed)
        log << "  " << to_string(f.call) << ' ' << to_string(f.role) << " #" << f.ordinal << " -> "
            << f.code << ": " << what << '\n';
      {
        Direct direct(w.path);
        CHECK(direct.integrity() == "ok");
      }
      w.serve("served-after");  // the same store object serves again, without restart
    }
    MESSAGE(log.str());
    failed_calls += trace.size();
  }
  return failed_calls;
}

// What a StoreError says, checked: a store_unavailable error naming SQLite and its code.
std::string store_error(const idem::StoreError& e) {
  CHECK(e.code() == idem::errc::store_unavailable);
  CHECK(e.sqlite_code() != 0);
  CHECK(std::string(e.what()).find("sqlite:") != std::string::npos);
  return fmt::format("StoreError({})", e.what());
}

}  // namespace

TEST_CASE("faulty vfs: every I/O call of reserve, failed once, leaves no row or a whole one") {
  FaultyVfs vfs;
  vfs.set_real_sync(false);  // temporary files: the VFS's model of a sync is enough
  ScopedDefaultVfs as_default(vfs);
  for (const idem::FailureMode mode :
       {idem::FailureMode::fail_closed, idem::FailureMode::fail_open}) {
    const bool closed = mode == idem::FailureMode::fail_closed;
    PathUnderTest p;
    p.name = closed ? "reserve (fail_closed)" : "reserve (fail_open)";
    p.mode = mode;
    p.setup = [](World& w) { w.serve("other"); };
    p.run = [closed](World& w, const Hooks& hooks) -> std::string {
      std::string what;
      const int before = w.runs;
      std::optional<idem::Outcome> out;
      hooks.begin();
      try {
        out = w.idem->call(idem::test::request("k"), [&] {
          hooks.end();  // the reserve path ends where the action begins
          return w.answer("k");
        });
      } catch (const idem::StoreError& e) {
        hooks.end();
        what = store_error(e);
      }
      Direct direct(w.path);
      const auto row = direct.row("k");
      if (!out) {
        CHECK(closed);             // fail_open never refuses
        CHECK(w.runs == before);   // fail_closed: the action did not run
        if (row) {                 // the reservation committed before the error: whole
          CHECK(row->state == 1);  // in_progress, with a token and a lease, no response
          CHECK(row->token > 0);
          CHECK(row->lease_until > 0);
          CHECK(!row->has_status);
        }
        return what;
      }
      CHECK(w.runs == before + 1);  // ran exactly once
      CHECK(out->response.body == body_of("k"));
      if (out->source == idem::Outcome::Source::unprotected) {
        CHECK(!closed);
        CHECK((!row || row->state == 1));
        return "ran unprotected (fail_open)";
      }
      CHECK(out->source == idem::Outcome::Source::executed);
      REQUIRE(row);
      CHECK(row->state == 2);
      CHECK(row->body == body_of("k"));
      return "served (the failed call was retried or not needed)";
    };
    fail_each_call(vfs, p);
  }
}

TEST_CASE("faulty vfs: every I/O call of complete, failed once, leaves in_progress or completed") {
  FaultyVfs vfs;
  vfs.set_real_sync(false);  // temporary files: the VFS's model of a sync is enough
  ScopedDefaultVfs as_default(vfs);
  PathUnderTest p;
  p.name = "complete";
  p.setup = [](World& w) { w.serve("other"); };
  p.run = [](World& w, const Hooks& hooks) -> std::string {
    long long token = 0;
    const idem::Outcome out = w.idem->call(idem::test::request("k"), [&] {
      token = w.store->load(id_of("k"))->token;
      hooks.begin();  // the complete path begins where the action ends
      return w.answer("k");
    });
    hooks.end();
    // A failure after the action ran is logged and counted, never thrown: the caller gets
    // the response, the action ran once.
    CHECK(w.runs == 2);
    CHECK(out.source == idem::Outcome::Source::executed);
    CHECK(out.response.body == body_of("k"));
    Direct direct(w.path);
    const auto row = direct.row("k");
    REQUIRE(row);
    CHECK(row->token == token);
    if (row->state == 1) {  // the old state, whole: same token, no response
      CHECK(!row->has_status);
      CHECK(row->body.empty());
      CHECK(w.idem->metrics().store_errors == 1);
      return "in_progress, same token, no response (the key waits for its lease)";
    }
    CHECK(row->state == 2);  // the new state, whole
    CHECK(row->has_status);
    CHECK(row->body == body_of("k"));
    return w.idem->metrics().store_errors == 0 ? "completed" : "completed (error after commit)";
  };
  fail_each_call(vfs, p);
}

TEST_CASE("faulty vfs: every I/O call of release, failed once, leaves in_progress or released") {
  FaultyVfs vfs;
  vfs.set_real_sync(false);  // temporary files: the VFS's model of a sync is enough
  ScopedDefaultVfs as_default(vfs);
  PathUnderTest p;
  p.name = "release";
  p.setup = [](World& w) { w.serve("other"); };
  p.run = [](World& w, const Hooks& hooks) -> std::string {
    long long token = 0;
    bool propagated = false;
    try {
      w.idem->call(idem::test::request("k"), [&]() -> idem::Response {
        token = w.store->load(id_of("k"))->token;
        ++w.runs;
        hooks.begin();  // the release path begins where the action throws
        throw std::runtime_error("provider timed out");
      });
    } catch (const std::runtime_error& e) {
      propagated = std::string(e.what()) == "provider timed out";
    }
    hooks.end();
    CHECK(propagated);  // the action's own exception, whatever the release did
    CHECK(w.runs == 2);
    Direct direct(w.path);
    const auto row = direct.row("k");
    REQUIRE(row);
    CHECK(row->token == token);
    CHECK(!row->has_status);
    if (row->state == 1) return "in_progress, same token (the key waits for its lease)";
    CHECK(row->state == 3);
    // Released: the retry really runs again, once.
    w.serve("k");
    CHECK(w.runs == 3);
    return "released";
  };
  fail_each_call(vfs, p);
}

TEST_CASE("faulty vfs: every I/O call of renew, failed once, leaves the old lease or the new one") {
  FaultyVfs vfs;
  vfs.set_real_sync(false);  // temporary files: the VFS's model of a sync is enough
  ScopedDefaultVfs as_default(vfs);
  PathUnderTest p;
  p.name = "renew";
  p.setup = [](World& w) {
    w.serve("other");
    w.store->reserve(id_of("k"), idem::test::request("k").fingerprint, w.clock->now(),
                     w.clock->now() + 30s);
  };
  p.run = [](World& w, const Hooks& hooks) -> std::string {
    Direct direct(w.path);
    const auto before = direct.row("k");
    REQUIRE(before);
    std::string what = "renewed";
    hooks.begin();
    try {
      const bool renewed = w.store->renew(id_of("k"), before->token, w.clock->now() + 60s);
      CHECK(renewed);
    } catch (const idem::StoreError& e) {
      what = store_error(e);
    }
    hooks.end();
    const auto after = direct.row("k");
    REQUIRE(after);
    CHECK(after->state == 1);
    CHECK(after->token == before->token);
    const long long renewed = before->lease_until + 30'000;
    CHECK((after->lease_until == before->lease_until || after->lease_until == renewed));
    if (after->lease_until == renewed && what != "renewed") what += " (after commit)";
    return what;
  };
  fail_each_call(vfs, p);
}

TEST_CASE("faulty vfs: every I/O call of purge, failed once, deletes all of a batch or none") {
  FaultyVfs vfs;
  vfs.set_real_sync(false);  // temporary files: the VFS's model of a sync is enough
  ScopedDefaultVfs as_default(vfs);
  PathUnderTest p;
  p.name = "purge";
  p.setup = [](World& w) {
    w.serve("old-1");
    w.serve("old-2");
    w.clock->advance(25h);  // past the 24 h TTL
    w.serve("live");
  };
  p.run = [](World& w, const Hooks& hooks) -> std::string {
    std::string what;
    hooks.begin();
    try {
      const std::size_t purged = w.idem->purge_expired();
      CHECK(purged == 2);
      what = "purged 2";
    } catch (const idem::StoreError& e) {
      what = store_error(e);
    }
    hooks.end();
    Direct direct(w.path);
    const long long rows = direct.rows();
    CHECK((rows == 1 || rows == 3));  // one batch, one transaction
    REQUIRE(direct.row("live"));
    CHECK(direct.row("live")->state == 2);
    if (rows == 1 && what != "purged 2") what += " (after commit)";
    return what;
  };
  fail_each_call(vfs, p);
}

namespace {

const idem::TimePoint T0 = idem::sim::kSimulationStart;

idem::StoredResponse stored(const std::string& body) {
  return idem::StoredResponse{idem::Response{200, body, {}}, ""};
}

// Reserves and completes `key` with `body`; true when the caller saw both succeed. A
// StoreError is returned through `error` (if given).
bool complete_key(idem::SqliteStore& s, const std::string& key, const std::string& body,
                  std::optional<idem::StoreError>* error = nullptr) {
  try {
    const idem::Reservation r =
        s.reserve(id_of(key), idem::test::request(key).fingerprint, T0, T0 + 30s);
    if (r.kind != idem::Reservation::Kind::reserved) return false;
    return s.complete(id_of(key), r.token, stored(body), T0 + 24h);
  } catch (const idem::StoreError& e) {
    if (error != nullptr) error->emplace(e);
    return false;
  }
}

// Every acknowledged key replays its exact response through a coordinator on a store
// opened afresh (the action never runs); the file passes integrity_check.
void check_acknowledged_replay(const std::string& path, const std::vector<std::string>& acked,
                               const std::map<std::string, std::string>& bodies) {
  {
    Direct direct(path);
    CHECK(direct.integrity() == "ok");
    for (const std::string& key : acked) {
      CAPTURE(key);
      const auto row = direct.row(key);
      REQUIRE(row);
      CHECK(row->state == 2);
    }
  }
  auto clock = std::make_shared<idem::sim::SimulatedClock>();
  idem::Options o;
  o.clock = clock;
  o.heartbeat = 0ms;
  o.in_flight = idem::InFlight::raise;  // a lost completion fails here instead of waiting
  o.on_store_failure = idem::FailureMode::fail_closed;
  idem::Coordinator idem(std::make_shared<idem::SqliteStore>(path, quiet()), o);
  int runs = 0;
  for (const std::string& key : acked) {
    CAPTURE(key);
    const idem::Outcome out = idem.call(idem::test::request(key), [&] {
      ++runs;
      return idem::Response{200, "ran again", {}};
    });
    CHECK(out.replayed());
    CHECK(out.response.body == bodies.at(key));
  }
  CHECK(runs == 0);
}

struct PowerCut {
  IoCall call;
  FileRole role;
  std::uint64_t n;
};

struct PowerLossRun {
  std::vector<std::string> acked;  // keys whose caller saw success
  std::map<std::string, std::string> bodies;
  std::size_t failed_after = 0;  // calls failed on the dead machine
  std::string path;
};

// Completes `keys` keys one by one with the power going out at `cut` (or after the last key),
// then closes the dead machine's store.
PowerLossRun run_until_power_loss(FaultyVfs& vfs, const TempDir& dir, idem::SqliteOptions o,
                                  int keys, std::optional<PowerCut> cut) {
  PowerLossRun run;
  run.path = dir.file("k.db");
  {
    idem::SqliteStore store(run.path, o);
    vfs.reset_counts();
    if (cut) vfs.power_loss_at(cut->call, cut->role, cut->n);
    for (int i = 0; i < keys; ++i) {
      const std::string key = fmt::format("k{}", i);
      // Bodies of a few hundred bytes, different per key.
      const std::string body = fmt::format("{{\"charge\":\"ch_{}\",\"pad\":\"{}\"}}", i,
                                           std::string(static_cast<std::size_t>(200 + i), 'x'));
      run.bodies[key] = body;
      if (complete_key(store, key, body)) run.acked.push_back(key);
    }
    run.failed_after = vfs.failed().size();
    if (run.failed_after == 0) vfs.power_loss();  // the cut was not reached: now
    vfs.clear_faults();
  }  // the dead machine's store closes: nothing it does reaches the disk
  return run;
}

}  // namespace

TEST_CASE("faulty vfs: power loss under synchronous=FULL keeps every acknowledged completion") {
  FaultyVfs vfs;
  vfs.set_real_sync(false);  // temporary files: the VFS's model of a sync is enough
  ScopedDefaultVfs as_default(vfs);
  // Small checkpoints, so the stream also overwrites the database file and restarts the WAL.
  const idem::SqliteOptions o = quiet(idem::Synchronous::full, 8);
  std::vector<std::optional<PowerCut>> cuts = {std::nullopt};
  for (const std::uint64_t n : {1u, 2u, 3u, 5u, 8u, 13u, 21u, 34u, 55u, 89u, 144u, 233u})
    cuts.push_back(PowerCut{IoCall::write, FileRole::wal, n});
  for (const std::uint64_t n : {1u, 2u, 5u, 9u}) {
    cuts.push_back(PowerCut{IoCall::sync, FileRole::wal, n});
    cuts.push_back(PowerCut{IoCall::write, FileRole::main_db, n});
  }
  std::ostringstream log;
  log << "power loss under synchronous=FULL (24 keys each):\n";
  for (const auto& cut : cuts) {
    const std::string where =
        cut ? fmt::format("before {} {} #{}", to_string(cut->call), to_string(cut->role), cut->n)
            : std::string("after the last key");
    CAPTURE(where);
    TempDir dir;
    const PowerLossRun run = run_until_power_loss(vfs, dir, o, 24, cut);
    log << fmt::format("  {}: {} acknowledged, {} calls failed on the dead machine\n", where,
                       run.acked.size(), run.failed_after);
    check_acknowledged_replay(run.path, run.acked, run.bodies);
  }
  MESSAGE(log.str());
}

TEST_CASE(
    "faulty vfs: power loss under synchronous=NORMAL may lose recent completions, never "
    "corrupts") {
  FaultyVfs vfs;
  vfs.set_real_sync(false);  // temporary files: the VFS's model of a sync is enough
  ScopedDefaultVfs as_default(vfs);
  const idem::SqliteOptions o = quiet(idem::Synchronous::normal, 8);
  std::ostringstream log;
  for (const auto& cut :
       {std::optional<PowerCut>{}, std::optional<PowerCut>{{IoCall::write, FileRole::wal, 100}}}) {
    TempDir dir;
    const PowerLossRun run = run_until_power_loss(vfs, dir, o, 24, cut);
    std::vector<std::string> survivors;
    {
      Direct direct(run.path);
      CHECK(direct.integrity() == "ok");
      for (const std::string& key : run.acked) {
        const auto row = direct.row(key);
        if (!row || row->state != 2) continue;
        CHECK(row->body == run.bodies.at(key));  // what survives, survives whole
        survivors.push_back(key);
      }
    }
    check_acknowledged_replay(run.path, survivors, run.bodies);
    log << fmt::format("synchronous=NORMAL, power lost {}: {} of {} acknowledged keys survived\n",
                       cut ? "before WAL write #100" : "after the last key", survivors.size(),
                       run.acked.size());
  }
  MESSAGE(log.str());
}

TEST_CASE(
    "faulty vfs: a full disk is a clear StoreError, loses nothing, and the same store "
    "serves again once space returns") {
  FaultyVfs vfs;
  vfs.set_real_sync(false);  // temporary files: the VFS's model of a sync is enough
  ScopedDefaultVfs as_default(vfs);
  TempDir dir;
  const std::string path = dir.file("k.db");
  // SQLite's automatic checkpoint at 1000 pages: the disk fills before the WAL reaches it.
  idem::SqliteStore store(path, quiet());
  std::map<std::string, std::string> bodies;
  std::vector<std::string> acked;
  int next = 0;
  // Completes keys until the disk is full; returns how many fitted and the error.
  const auto fill = [&](std::optional<idem::StoreError>& error) {
    int fitted = 0;
    for (; next < 5000; ++next) {
      const std::string key = fmt::format("k{}", next);
      const std::string body =
          fmt::format("{{\"charge\":\"ch_{}\",\"pad\":\"{}\"}}", next, std::string(400, 'x'));
      bodies[key] = body;
      if (!complete_key(store, key, body, &error)) break;
      acked.push_back(key);
      ++fitted;
    }
    ++next;
    return fitted;
  };

  const std::uint64_t base = vfs.tracked_bytes();
  constexpr std::uint64_t kRoom = 256 * 1024, kMore = 64 * 1024;
  vfs.set_quota(base + kRoom);
  std::optional<idem::StoreError> error;
  const int first = fill(error);
  REQUIRE(error);
  const std::uint64_t wal_when_full = vfs.file_bytes(path + "-wal");
  const std::uint64_t db_when_full = vfs.file_bytes(path);
  const std::string full_error = error->what();
  // The error says the disk is full, in words and in SQLite's code; it is a store_unavailable.
  CHECK(error->code() == idem::errc::store_unavailable);
  CHECK((error->sqlite_code() & 0xff) == SQLITE_FULL);
  CHECK(std::string(error->what()).find("full") != std::string::npos);
  // Nothing committed is lost.
  for (const std::string& key : acked) {
    CAPTURE(key);
    const std::optional<idem::Record> r = store.load(id_of(key));
    REQUIRE(r);
    CHECK(r->state == idem::State::completed);
  }
  check_acknowledged_replay(path, acked, bodies);
  // Space returns: the same store serves again by itself, and the space the WAL held while it
  // could not be checkpointed is usable too.
  vfs.set_quota(base + kRoom + kMore);
  error.reset();
  const int second = fill(error);
  REQUIRE(error);
  const std::uint64_t wal_after = vfs.file_bytes(path + "-wal");
  MESSAGE(fmt::format(
      "quota {} KiB: {} keys fitted, then SQLITE_FULL with a WAL of {} KiB and a database of {} "
      "KiB ({})\nquota raised by {} KiB: {} more keys fitted (WAL {} KiB, database {} KiB)",
      kRoom / 1024, first, wal_when_full / 1024, db_when_full / 1024, full_error, kMore / 1024,
      second, wal_after / 1024, vfs.file_bytes(path) / 1024));
  // The WAL's bytes came back: more keys fit than the raise alone would take as WAL frames.
  CHECK(second * 2 >= first);
  check_acknowledged_replay(path, acked, bodies);
}

TEST_CASE(
    "faulty vfs: a disk that stops syncing fails every commit whole, and the same store "
    "serves once it syncs again") {
  FaultyVfs vfs;
  vfs.set_real_sync(false);  // temporary files: the VFS's model of a sync is enough
  ScopedDefaultVfs as_default(vfs);
  World w(idem::FailureMode::fail_closed, quiet(idem::Synchronous::full));
  w.serve("before");
  vfs.reset_counts();
  vfs.fail_every(IoCall::sync);
  for (int i = 0; i < 3; ++i) {
    const std::string key = fmt::format("k{}", i);
    CHECK_THROWS_AS(w.idem->call(idem::test::request(key), [&] { return w.answer(key); }),
                    idem::StoreError);
    Direct direct(w.path);
    CHECK(!direct.row(key));  // no half-written reservation
  }
  CHECK(w.runs == 1);  // fail_closed: none of them ran
  const auto failed = vfs.failed();
  CHECK(failed.size() >= 3);
  for (const auto& f : failed) CHECK(f.code == SQLITE_IOERR_FSYNC);
  vfs.clear_faults();
  w.serve("after");
  Direct direct(w.path);
  CHECK(direct.integrity() == "ok");
}

TEST_CASE("faulty vfs: a write that waited for another writer's lock says so, others do not") {
  // SQLITE_BUSY from a WAL-index lock is what another process's write transaction gives.
  // The coordinator reads before reserving while its writes wait (read_first.hpp).
  FaultyVfs vfs;
  vfs.set_real_sync(false);
  ScopedDefaultVfs as_default(vfs);
  TempDir dir;
  idem::SqliteStore store(dir.file("c.db"), quiet());
  const idem::Fingerprint fp = idem::test::request("k").fingerprint;
  const auto reserve = [&](const idem::KeyId& id) {
    idem::StoreOp op{.kind = idem::StoreOp::Kind::reserve,
                     .id = &id,
                     .fingerprint = &fp,
                     .now = idem::sim::kSimulationStart,
                     .lease_until = idem::sim::kSimulationStart + 30s};
    idem::StoreOp* one = &op;
    store.apply(std::span<idem::StoreOp* const>(&one, 1));
    return op;
  };
  const idem::KeyId plain{"alpha", "op", "plain"};
  const idem::StoreOp first = reserve(plain);
  CHECK_FALSE(first.error);
  CHECK_FALSE(first.contended);
  // Each WAL-index lock of the next write in turn answers SQLITE_BUSY once: the writer's
  // busy handler waits and retries, and the write goes through marked contended.
  int contended = 0;
  for (std::uint64_t n = 1; n <= 8; ++n) {
    const idem::KeyId id{"alpha", "op", fmt::format("busy-{}", n)};
    vfs.fail_nth(idem::sim::IoCall::shm_lock, idem::sim::FileRole::shm, n, SQLITE_BUSY);
    const idem::StoreOp op = reserve(id);
    vfs.clear_faults();
    CAPTURE(n);
    CHECK_FALSE(op.error);  // a busy lock is waited for, never an error
    CHECK(op.reservation.kind == idem::Reservation::Kind::reserved);
    if (op.contended) ++contended;
  }
  CHECK(contended > 0);
  CHECK_FALSE(reserve({"alpha", "op", "after"}).contended);  // no fault: no wait
}
