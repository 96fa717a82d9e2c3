// scripts/bench: what idem costs, measured against the bare SQLite floor (and, in the pg
// section, a bare PostgreSQL one) in the same run.
//
//   idem_bench [--quick] [--json] [--dir DIR] [--only SECTION,...] [--pg CONNINFO]
//       sections: calls,sweep,processes,handoff,growth,purge,maintenance,bytes,http,pg,grpc
//       pg: idem over PgStore against libpq floors on the server CONNINFO names (skipped
//       without --pg; scripts/bench starts a durable throwaway one); it also runs the SQLite
//       replay cache's ratio, which calls runs too
//       grpc: idem::grpc's guard on loopback gRPC against the same service unguarded (only in
//       a build with gRPC, IDEM_GRPC; skipped in a full run without it, an error when named)
//   idem_bench --child ...                     one process of a multi-process scenario
//   idem_bench --pg-waiter ...                 the other node of the pg section's hand-off
//   idem_bench --chart RESULTS.json OUT.svg    the README's chart from a --json run
#include <utility>  // before Asio (Boost 1.74)

#include <fcntl.h>
#include <spawn.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <atomic>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/thread_pool.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <latch>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "bench.hpp"
#include "calls.hpp"
#include "floor_sql.hpp"
#include "grpc_bench.hpp"
#include "http_bench.hpp"
#include "idem/asio.hpp"
#include "idem/coordinator.hpp"
#include "idem/internal/sqlite.hpp"
#include "idem/replay_cache.hpp"
#include "idem/sqlite_store.hpp"
#include "idem/steps.hpp"
#include "pg_bench.hpp"

extern char** environ;

namespace idem::bench {
namespace {

namespace net = boost::asio;
using nlohmann::json;
using namespace std::chrono_literals;

struct Config {
  bool quick = false;
  bool json_out = false;
  std::vector<std::string> only;  // sections to run (--only); empty: all
  bool wants(std::string_view section) const {
    return only.empty() || std::find(only.begin(), only.end(), section) != only.end();
  }
  std::string dir;
  std::string self;  // this program, for child processes
  std::string pg;    // --pg: the PostgreSQL server of the pg section; empty: skipped
};

std::string fresh_db(const Config& c, const std::string& name) {
  const std::string path = c.dir + "/" + name + ".db";
  for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(path + suffix);
  return path;
}

// ---- the naive floor: idem's own statements straight through the sqlite3 C API ------------

class Floor {
 public:
  // `checkpoints` false: never checkpoint (the WAL grows without bound), to show what
  // checkpoints cost the floor; not a configuration anyone should run.
  Floor(const std::string& path, Synchronous sync, bool checkpoints = true)
      : db_(open_floor(path, busy_)) {
    if (!checkpoints) sqlite3_wal_autocheckpoint(db_.get(), 0);
    sqlite::enable_wal(db_.get(), busy_);
    sqlite::exec(db_.get(),
                 sync == Synchronous::full ? sql::kSynchronousFull : sql::kSynchronousNormal);
    // Default checkpointing (wal_autocheckpoint=1000), as any naive user would have.
    tx_ = std::make_unique<sqlite::TransactionStatements>(db_.get());
    reserve_ = std::make_unique<sqlite::Statement>(db_.get(), sql::kReserve);
    complete_ = std::make_unique<sqlite::Statement>(db_.get(), sql::kComplete);
    load_ = std::make_unique<sqlite::Statement>(db_.get(), sql::kLoad);
  }

  // One protected call done naively: the reservation in one transaction, the completion in a
  // second.
  void call(const std::string& key, const std::string& body, std::int64_t now_ms) {
    sqlite::Transaction reservation(*tx_);
    reserve_->bind(1, kTenant);
    reserve_->bind(2, kOperation);
    reserve_->bind(3, key);
    reserve_->bind_blob(4, kFp.bytes().data(), kFp.bytes().size());
    reserve_->bind(5, now_ms);
    reserve_->bind(6, now_ms + 30000);
    reserve_->bind(7, now_ms);
    reserve_->step();
    const std::int64_t token = reserve_->changes() == 1 ? now_ms : 0;
    reserve_->reset();
    reservation.commit();
    complete_->bind(1, kTenant);
    complete_->bind(2, kOperation);
    complete_->bind(3, key);
    complete_->bind(4, token);
    complete_->bind(5, std::int64_t{200});
    complete_->bind_null(6);
    complete_->bind_blob(7, body.data(), body.size());
    complete_->bind_null(8);
    complete_->bind(9, now_ms + 86400000);
    step(*complete_);
  }

  // A replay done naively: the SELECT by primary key.
  std::size_t replay(const std::string& key) {
    load_->bind(1, kTenant);
    load_->bind(2, kOperation);
    load_->bind(3, key);
    std::size_t n = 0;
    if (load_->step()) n = load_->blob(8).size();
    load_->reset();
    return n;
  }

 private:
  // idem's schema, made by idem itself (the floor runs no migrations of its own).
  static sqlite::Connection open_floor(const std::string& path, sqlite::BusyPolicy& busy) {
    { SqliteStore schema(path); }
    return sqlite::open_connection(path, &busy);
  }
  static void step(sqlite::Statement& s) {
    s.step();
    s.reset();
  }
  sqlite::BusyPolicy busy_{std::chrono::seconds(10), {}};
  sqlite::Connection db_;
  std::unique_ptr<sqlite::TransactionStatements> tx_;
  std::unique_ptr<sqlite::Statement> reserve_, complete_, load_;
};

// The naive design without idem's schema (sql::kMinimalSchema): what a user would write from
// seed 000's SQL, with WAL and default checkpointing.
class MinimalFloor {
 public:
  MinimalFloor(const std::string& path, Synchronous sync)
      : db_(sqlite::open_connection(path, &busy_)) {
    sqlite::enable_wal(db_.get(), busy_);
    sqlite::exec(db_.get(),
                 sync == Synchronous::full ? sql::kSynchronousFull : sql::kSynchronousNormal);
    sqlite::exec(db_.get(), sql::kMinimalSchema);
    tx_ = std::make_unique<sqlite::TransactionStatements>(db_.get());
    reserve_ = std::make_unique<sqlite::Statement>(db_.get(), sql::kMinimalReserve);
    complete_ = std::make_unique<sqlite::Statement>(db_.get(), sql::kMinimalComplete);
  }

  void call(const std::string& key, const std::string& body, std::int64_t now_ms) {
    std::int64_t token = 0;
    {
      sqlite::Transaction reservation(*tx_);
      sqlite::ResetGuard reset(*reserve_);
      reserve_->bind(1, kTenant);
      reserve_->bind(2, kOperation);
      reserve_->bind(3, key);
      reserve_->bind_blob(4, kFp.bytes().data(), kFp.bytes().size());
      reserve_->bind(5, now_ms + 30000);
      reserve_->bind(6, now_ms);
      if (reserve_->step()) token = reserve_->int64(0);
      while (reserve_->step()) {
      }
      reservation.commit();
    }
    sqlite::ResetGuard reset(*complete_);
    complete_->bind(1, kTenant);
    complete_->bind(2, kOperation);
    complete_->bind(3, key);
    complete_->bind(4, token);
    complete_->bind(5, std::int64_t{200});
    complete_->bind_blob(6, body.data(), body.size());
    complete_->step();
  }

 private:
  sqlite::BusyPolicy busy_{std::chrono::seconds(10), {}};
  sqlite::Connection db_;
  std::unique_ptr<sqlite::TransactionStatements> tx_;
  std::unique_ptr<sqlite::Statement> reserve_, complete_;
};

std::int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

using KeyAt = std::function<std::string(std::size_t)>;

std::string sequential_key(std::size_t i) { return key_of(i); }

// Keys as clients make them (random, as UUIDs are; the same ones in every run of a process):
// a fresh key's insert then lands on any leaf of the table, not on the last one as key_of's
// do. random_keys(n) makes the first n (call it before timing); random_key(i) is the i-th.
const std::vector<std::string>& random_keys(std::size_t n) {
  static std::mt19937_64 rng(20261207);
  static std::vector<std::string> keys;
  while (keys.size() < n) keys.push_back(fmt::format("{:016x}{:016x}", rng(), rng()));
  return keys;
}

std::string random_key(std::size_t i) { return random_keys(i + 1)[i]; }

// n fresh keys through a floor's call(), timed one by one.
template <class AnyFloor>
Stats fresh_calls(AnyFloor& f, std::size_t n, const KeyAt& key_at = sequential_key) {
  const std::string body = small_response().body;
  std::vector<double> lat;
  lat.reserve(n);
  const auto t0 = Clock::now();
  for (std::size_t i = 0; i < n; ++i) {
    const std::string key = key_at(i);
    const auto t = Clock::now();
    f.call(key, body, now_ms());
    lat.push_back(micros_since(t));
  }
  return summarize(std::move(lat), micros_since(t0) / 1e6);
}

Stats floor_fresh(const Config& c, Synchronous sync, std::size_t n, bool checkpoints = true) {
  Floor f(fresh_db(c, "floor"), sync, checkpoints);
  return fresh_calls(f, n);
}

Stats minimal_floor_fresh(const Config& c, Synchronous sync, std::size_t n,
                          const KeyAt& key_at = sequential_key) {
  MinimalFloor f(fresh_db(c, "minimal-floor"), sync);
  return fresh_calls(f, n, key_at);
}

Stats floor_replay(const Config& c, Synchronous sync, std::size_t keys, std::size_t n) {
  const std::string path = fresh_db(c, "floor-replay");
  const std::string body = small_response().body;
  {
    Floor fill(path, sync);
    for (std::size_t i = 0; i < keys; ++i) fill.call(key_of(i), body, now_ms());
  }
  Floor f(path, sync);
  std::vector<double> lat;
  lat.reserve(n);
  std::size_t sink = 0;
  const auto t0 = Clock::now();
  for (std::size_t i = 0; i < n; ++i) {
    const auto t = Clock::now();
    sink += f.replay(key_of(i % keys));
    lat.push_back(micros_since(t));
  }
  if (sink == 0) std::cerr << "floor replay found nothing\n";
  return summarize(std::move(lat), micros_since(t0) / 1e6);
}

// ---- idem ------------------------------------------------------------------------------------

std::unique_ptr<Coordinator> make_idem(const std::string& path, Synchronous sync,
                                       Options options = {}) {
  return std::make_unique<Coordinator>(
      std::make_shared<SqliteStore>(path, SqliteOptions{.synchronous = sync}), std::move(options));
}

Stats idem_fresh_blocking(const Config& c, Synchronous sync, std::size_t n,
                          const KeyAt& key_at = sequential_key) {
  auto idem = make_idem(fresh_db(c, "idem-blocking"), sync);
  std::vector<double> lat;
  lat.reserve(n);
  const auto t0 = Clock::now();
  for (std::size_t i = 0; i < n; ++i) {
    const Request r = request_for(key_at(i));
    const auto t = Clock::now();
    idem->call(r, small_response);
    lat.push_back(micros_since(t));
  }
  return summarize(std::move(lat), micros_since(t0) / 1e6);
}

// `inflight` coroutines on one io_context share `n` calls; keys from `key_at(i)`.
Stats idem_async(Coordinator& idem, std::size_t n, std::size_t inflight,
                 const std::function<std::string(std::size_t)>& key_at) {
  net::io_context io(1);
  std::vector<double> lat(n);
  std::atomic<std::size_t> next{0};
  auto worker = [&]() -> net::awaitable<void> {
    for (std::size_t i = next++; i < n; i = next++) {
      Request r = request_for(key_at(i));
      AsyncAction action = []() -> net::awaitable<Response> { co_return small_response(); };
      const auto t = Clock::now();
      co_await async_call(idem, std::move(r), std::move(action));
      lat[i] = micros_since(t);
    }
  };
  const auto t0 = Clock::now();
  for (std::size_t w = 0; w < inflight; ++w) {
    net::co_spawn(io, worker(), [](std::exception_ptr e) {
      if (e) std::rethrow_exception(e);
    });
  }
  io.run();
  return summarize(std::move(lat), micros_since(t0) / 1e6);
}

Stats idem_threads(Coordinator& idem, std::size_t n, std::size_t threads,
                   const std::function<std::string(std::size_t)>& key_at,
                   const std::function<Response()>& action = small_response) {
  std::vector<double> lat(n);
  std::atomic<std::size_t> next{0};
  std::latch start(static_cast<std::ptrdiff_t>(threads) + 1);
  std::vector<std::thread> pool;
  for (std::size_t t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      start.arrive_and_wait();
      for (std::size_t i = next++; i < n; i = next++) {
        const Request r = request_for(key_at(i));
        const auto t1 = Clock::now();
        idem.call(r, action);
        lat[i] = micros_since(t1);
      }
    });
  }
  const auto t0 = Clock::now();
  start.arrive_and_wait();
  for (auto& t : pool) t.join();
  return summarize(std::move(lat), micros_since(t0) / 1e6);
}

// n fresh keys shared by `threads` threads on the blocking API, on a fresh file.
Stats idem_fresh_threads(const Config& c, Synchronous sync, std::size_t n, std::size_t threads) {
  auto idem = make_idem(fresh_db(c, "idem-threads"), sync);
  return idem_threads(*idem, n, threads, [](std::size_t i) { return key_of(i); });
}

// The same while two threads of other work (a service's own computation beside idem) keep both
// CPUs busy: a leader's yield then hands its CPU to one of them, not to a writer. Group
// commit's back-off after a slow yield (lib/src/group_commit.cpp) is for this case.
Stats idem_fresh_threads_busy(const Config& c, std::size_t n, std::size_t threads) {
  std::atomic<bool> stop{false};
  std::vector<std::thread> busy;
  for (int i = 0; i < 2; ++i) {
    busy.emplace_back([&stop] {
      std::uint64_t spins = 0;
      while (!stop.load(std::memory_order_relaxed)) ++spins;
      return spins;
    });
  }
  const Stats s = idem_fresh_threads(c, Synchronous::normal, n, threads);
  stop.store(true);
  for (std::thread& t : busy) t.join();
  return s;
}

void populate(Coordinator& idem, std::size_t keys, const std::string& prefix = "k") {
  idem_threads(idem, keys, 1, [&](std::size_t i) { return key_of(i, prefix); });
}

double file_bytes(const std::string& path) {
  double total = 0;
  for (const char* suffix : {"", "-wal"}) {
    std::error_code ec;
    const auto n = std::filesystem::file_size(path + suffix, ec);
    if (!ec) total += static_cast<double>(n);
  }
  return total;
}

// One caller replaying `keys` completed keys, `n` calls, on a store reopened after they were
// written (closing checkpoints: nothing runs behind the measurement).
Stats idem_replay(const Config& c, Synchronous sync, std::size_t keys, std::size_t n) {
  const std::string path = fresh_db(c, "idem-replay");
  { populate(*make_idem(path, sync), keys); }
  auto idem = make_idem(path, sync);
  return idem_threads(*idem, n, 1, [&](std::size_t i) { return key_of(i % keys); });
}

// The same through idem::ReplayCache over SqliteStore: `keys` hot keys, served from memory
// once read.
Stats idem_replay_cached(const Config& c, std::size_t keys, std::size_t n) {
  const std::string path = fresh_db(c, "idem-replay-cache");
  { populate(*make_idem(path, Synchronous::normal), keys); }
  Coordinator idem(std::make_shared<ReplayCache>(std::make_shared<SqliteStore>(path)), {});
  return idem_threads(idem, n, 1, [&](std::size_t i) { return key_of(i % keys); });
}

// ---- 5. several processes on one database file ---------------------------------------------

// Child: waits for one byte on `gate_fd`, makes `n` fresh calls, prints its stats as JSON.
int run_child(const std::string& db, std::size_t n, const std::string& prefix, Synchronous sync,
              int gate_fd) {
  auto idem = make_idem(db, sync);
  char go = 0;
  if (read(gate_fd, &go, 1) != 1) return 3;
  const Stats s = idem_threads(*idem, n, 1, [&](std::size_t i) { return key_of(i, prefix); });
  std::cout << s.json().dump() << std::endl;
  return 0;
}

struct Spawned {
  pid_t pid;
  std::string out;
};

Spawned spawn_self(const Config& c, std::vector<std::string> args, const std::string& out,
                   int close_fd) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (close_fd >= 0) posix_spawn_file_actions_addclose(&actions, close_fd);
  args.insert(args.begin(), c.self);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawn(&pid, c.self.c_str(), &actions, nullptr, argv.data(), environ) != 0) {
    throw std::runtime_error("posix_spawn failed");
  }
  posix_spawn_file_actions_destroy(&actions);
  return {pid, out};
}

json wait_json(const Spawned& s) {
  int status = 0;
  waitpid(s.pid, &status, 0);
  std::ifstream in(s.out);
  return json::parse(in);
}

struct MultiProcess {
  double per_s = 0;
  double worst_ms = 0;
  json raw;
};

MultiProcess processes(const Config& c, std::size_t procs, std::size_t n_each, Synchronous sync) {
  const std::string db = fresh_db(c, fmt::format("procs-{}", procs));
  { make_idem(db, sync); }  // create the schema first
  int gate[2];
  if (pipe(gate) != 0) throw std::runtime_error("pipe failed");
  std::vector<Spawned> kids;
  for (std::size_t p = 0; p < procs; ++p) {
    kids.push_back(
        spawn_self(c,
                   {"--child", db, std::to_string(n_each), fmt::format("p{}-", p),
                    sync == Synchronous::full ? "full" : "normal", std::to_string(gate[0])},
                   c.dir + fmt::format("/child-{}.json", p), gate[1]));
  }
  close(gate[0]);
  const std::string go(procs, 'G');
  if (write(gate[1], go.data(), go.size()) != static_cast<ssize_t>(go.size()))
    throw std::runtime_error("gate");
  close(gate[1]);
  MultiProcess out;
  double longest = 0;
  std::size_t calls = 0;
  for (const Spawned& k : kids) {
    const json j = wait_json(k);
    out.raw.push_back(j);
    calls += j.at("calls").get<std::size_t>();
    longest = std::max(longest, j.at("seconds").get<double>());
    out.worst_ms = std::max(out.worst_ms, j.at("max_us").get<double>() / 1000);
  }
  out.per_s = static_cast<double>(calls) / longest;
  return out;
}

// ---- 6. hand-off to waiting duplicates --------------------------------------------------------

double mono_us() {
  return std::chrono::duration<double, std::micro>(Clock::now().time_since_epoch()).count();
}

// 20 coroutines wait for `key` held elsewhere; returns each one's return time (monotonic us).
std::vector<double> wait_for(Coordinator& idem, const std::string& key, std::size_t waiters) {
  net::io_context io(1);
  std::vector<double> returned(waiters);
  for (std::size_t i = 0; i < waiters; ++i) {
    net::co_spawn(
        io,
        [&idem, &returned, key, i]() -> net::awaitable<void> {
          Request r = request_for(key);
          AsyncAction action = []() -> net::awaitable<Response> { co_return small_response(); };
          co_await async_call(idem, std::move(r), std::move(action));
          returned[i] = mono_us();
        },
        [](std::exception_ptr e) {
          if (e) std::rethrow_exception(e);
        });
  }
  io.run();
  return returned;
}

// Waits (a benchmark may sleep) until `key` is reserved in `store`. A holder that died before
// reserving would leave it waiting for ever: after 30 s it gives up and says which key.
void until_reserved(Store& store, const std::string& key) {
  const KeyId id{kTenant, kOperation, key};
  const auto give_up = std::chrono::steady_clock::now() + 30s;
  while (std::chrono::steady_clock::now() < give_up) {
    auto r = store.load(id);
    if (r && r->state == State::in_progress) return;
    std::this_thread::sleep_for(200us);
  }
  throw std::runtime_error(fmt::format("handoff: {} was not reserved within 30 s", key));
}

Stats handoff_in_process(const Config& c, std::size_t rounds) {
  auto store = std::make_shared<SqliteStore>(fresh_db(c, "handoff"));
  Coordinator idem(store, {});
  std::vector<double> lat;
  for (std::size_t round = 0; round < rounds; ++round) {
    const std::string key = fmt::format("handoff-{}", round);
    double action_end = 0;
    std::thread holder([&] {
      idem.call(request_for(key), [&] {
        std::this_thread::sleep_for(300ms);
        action_end = mono_us();
        return small_response();
      });
    });
    until_reserved(*store, key);
    const std::vector<double> returned = wait_for(idem, key, 20);
    holder.join();
    for (double t : returned) lat.push_back(t - action_end);
  }
  return summarize(std::move(lat), 0);
}

int run_holder(const std::string& db, const std::string& key) {
  auto idem = make_idem(db, Synchronous::normal);
  double action_end = 0;
  idem->call(request_for(key), [&] {
    std::this_thread::sleep_for(300ms);
    action_end = mono_us();
    return small_response();
  });
  std::cout << json{{"action_end_us", action_end}}.dump() << std::endl;
  return 0;
}

Stats handoff_cross_process(const Config& c, std::size_t rounds) {
  const std::string db = fresh_db(c, "handoff-x");
  auto store = std::make_shared<SqliteStore>(db);
  Coordinator idem(store, {});
  std::vector<double> lat;
  for (std::size_t round = 0; round < rounds; ++round) {
    const std::string key = fmt::format("handoff-x-{}", round);
    const Spawned holder = spawn_self(c, {"--hold", db, key}, c.dir + "/holder.json", -1);
    until_reserved(*store, key);
    const std::vector<double> returned = wait_for(idem, key, 20);
    const double action_end = wait_json(holder).at("action_end_us").get<double>();
    for (double t : returned) lat.push_back(t - action_end);
  }
  return summarize(std::move(lat), 0);
}

// ---- 7. growth and purge --------------------------------------------------------------------

// Writes `count` completed records straight into the table (fast, for sizing), with keys in
// random order like real UUIDs, expiring at `expires_ms`.
void bulk_fill(const std::string& path, std::size_t count, std::int64_t expires_ms,
               const std::string& prefix) {
  { SqliteStore schema(path); }
  sqlite::BusyPolicy busy{std::chrono::seconds(10), {}};
  sqlite::Connection db = sqlite::open_connection(path, &busy);
  sqlite::exec(db.get(), sql::kSynchronousOff);
  sqlite::exec(db.get(), sql::kBigCache);
  sqlite::Statement insert(db.get(), sql::kBulkInsert);
  sqlite::TransactionStatements tx(db.get());
  std::mt19937_64 rng(42);
  const std::string body(200, 'x');
  for (std::size_t done = 0; done < count;) {
    sqlite::Transaction fill(tx);
    for (std::size_t i = 0; i < 100000 && done < count; ++i, ++done) {
      const std::string key = fmt::format("{}{:016x}{:016x}", prefix, rng(), done);
      insert.bind(1, key);
      insert.bind_blob(2, kFp.bytes().data(), kFp.bytes().size());
      insert.bind(3, expires_ms);
      insert.bind_blob(4, body.data(), body.size());
      insert.step();
      insert.reset();
    }
    fill.commit();
  }
  sqlite::exec(db.get(), sql::kCheckpointTruncate);
  // The fill ran with synchronous=OFF: put it on disk now, as a store that has been running
  // a while would have it, or the first checkpoint measured would pay for the whole fill.
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0 || ::fsync(fd) != 0) throw std::runtime_error("fsync of the filled database failed");
  ::close(fd);
}

struct Growth {
  Stats reserve, replay;
};

Growth growth_at(const Config& c, std::size_t stored) {
  const std::string path = fresh_db(c, "growth");
  bulk_fill(path, stored, now_ms() + 86400000, "g");
  auto idem = make_idem(path, Synchronous::normal);
  const std::size_t n = 2000;
  Growth g;
  g.reserve = idem_threads(*idem, n, 1, [](std::size_t i) {
    return fmt::format("fresh-{:016x}", i * 0x9e3779b97f4a7c15ULL);
  });
  g.replay = idem_threads(*idem, n, 1, [](std::size_t i) {
    return fmt::format("fresh-{:016x}", i * 0x9e3779b97f4a7c15ULL);
  });
  return g;
}

struct Purge {
  double seconds = 0;
  std::size_t purged = 0;
  double max_reserve_wait_ms = 0;
  std::size_t reserves = 0;
};

Purge purge_while_serving(const Config& c, std::size_t expired) {
  const std::string path = fresh_db(c, "purge");
  bulk_fill(path, expired, now_ms() - 1000, "e");
  auto idem = make_idem(path, Synchronous::normal);
  Purge p;
  std::atomic<bool> done{false};
  std::thread purger([&] {
    const auto t0 = Clock::now();
    p.purged = idem->purge_expired();  // default batches
    p.seconds = micros_since(t0) / 1e6;
    done = true;
  });
  std::vector<double> lat;
  for (std::size_t i = 0; !done; ++i) {
    const Request r = request_for(key_of(i, "live-"));
    const auto t = Clock::now();
    idem->call(r, small_response);
    lat.push_back(micros_since(t));
  }
  purger.join();
  p.reserves = lat.size();
  for (double l : lat) p.max_reserve_wait_ms = std::max(p.max_reserve_wait_ms, l / 1000);
  return p;
}

// Maintenance on a schedule (purge, reap, completer, outbox) while one caller runs two-step
// operations (a local step that queues a message, so the dispatcher has work): the longest
// call while `expired` expired keys are purged, next to the longest call of the same load
// with no maintenance, measured in the same run.
struct MaintenanceWait {
  double max_wait_ms = 0;   // with maintenance running
  double floor_max_ms = 0;  // the same calls, no maintenance
  std::size_t calls = 0;
  std::size_t purged = 0;
  std::size_t delivered = 0;
};

MaintenanceWait maintenance_while_serving(const Config& c, std::size_t expired) {
  auto run = [&](bool with_maintenance, std::size_t& calls, std::size_t& purged,
                 std::size_t& delivered) {
    const std::string path = fresh_db(c, with_maintenance ? "maintenance" : "maintenance-floor");
    bulk_fill(path, expired, now_ms() - 1000, "e");
    auto idem = make_idem(path, Synchronous::normal);
    std::atomic<std::size_t> sent{0};
    Maintenance maintenance(*idem,
                            MaintenanceOptions{.purge_every = std::chrono::milliseconds(5),
                                               .reap_every = std::chrono::milliseconds(5),
                                               .complete_every = std::chrono::milliseconds(5),
                                               .dispatch_every = std::chrono::milliseconds(5)});
    maintenance.deliver([&sent](const OutboxMessage&) { ++sent; });
    boost::asio::thread_pool pool(1);
    if (with_maintenance) maintenance.start(pool.get_executor());
    double worst = 0;
    const auto t0 = Clock::now();
    for (std::size_t i = 0;; ++i) {
      if (with_maintenance ? maintenance.totals().purged >= expired && i >= 200 : i >= calls) break;
      Request r = request_for(key_of(i, "step-"));
      r.payload = "{}";
      const auto t = Clock::now();
      idem->call_steps(r, [](Attempt& a) {
        a.local("queued", [](LocalTransaction& tx) { return tx.enqueue("mail", "{}"); });
        return small_response();
      });
      worst = std::max(worst, micros_since(t) / 1000);
      if (with_maintenance) calls = i + 1;
      if (micros_since(t0) > 120e6) break;  // a bound, whatever happens
    }
    maintenance.stop();
    pool.join();
    purged = maintenance.totals().purged;
    delivered = sent.load();
    return worst;
  };
  MaintenanceWait m;
  std::size_t floor_purged = 0, floor_delivered = 0;
  m.max_wait_ms = run(true, m.calls, m.purged, m.delivered);
  m.floor_max_ms = run(false, m.calls, floor_purged, floor_delivered);
  return m;
}

// ---- the README's chart, from a --json run ----------------------------------------------------

struct Series {
  std::string name, color;
  std::vector<std::pair<double, double>> points;  // (x, y)
};

// One line chart with a logarithmic x axis and a linear y axis from 0, as SVG elements.
std::string panel(double left, const std::string& title, const std::string& x_label,
                  const std::string& y_label, const std::vector<Series>& series) {
  const double w = 420, h = 260, top = 40, pad = 50;
  double xmin = 1e300, xmax = 0, ymax = 0;
  for (const auto& s : series) {
    for (auto [x, y] : s.points) {
      xmin = std::min(xmin, x);
      xmax = std::max(xmax, x);
      ymax = std::max(ymax, y);
    }
  }
  if (xmax <= xmin) xmax = xmin * 10;
  ymax = ymax * 1.1 + 1e-9;
  auto px = [&](double x) {
    return left + pad +
           (std::log10(x) - std::log10(xmin)) / (std::log10(xmax) - std::log10(xmin)) *
               (w - pad - 10);
  };
  auto py = [&](double y) { return top + h - y / ymax * h; };
  std::string out =
      fmt::format(R"svg(<text x="{}" y="20" font-size="14" font-weight="bold">{}</text>)svg",
                  left + pad, title);
  out += fmt::format(
      R"svg(<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="black"/><line x1="{0}" y1="{2}" x2="{3}" y2="{2}" stroke="black"/>)svg",
      left + pad, top, top + h, left + w);
  for (int i = 0; i <= 4; ++i) {
    const double y = ymax * i / 4;
    out +=
        fmt::format(R"svg(<text x="{}" y="{}" font-size="10" text-anchor="end">{:.0f}</text>)svg",
                    left + pad - 4, py(y) + 3, y);
  }
  for (const auto& s : series) {
    for (auto [x, y] : s.points) {
      (void)y;
      out += fmt::format(
          R"svg(<text x="{}" y="{}" font-size="10" text-anchor="middle">{:g}</text>)svg", px(x),
          top + h + 14, x);
    }
    break;
  }
  out += fmt::format(R"svg(<text x="{}" y="{}" font-size="11" text-anchor="middle">{}</text>)svg",
                     left + pad + (w - pad) / 2, top + h + 32, x_label);
  out += fmt::format(
      R"svg(<text x="{}" y="{}" font-size="11" transform="rotate(-90 {} {})" text-anchor="middle">{}</text>)svg",
      left + 12, top + h / 2, left + 12, top + h / 2, y_label);
  int legend = 0;
  for (const auto& s : series) {
    std::string pts;
    for (auto [x, y] : s.points) pts += fmt::format("{:.1f},{:.1f} ", px(x), py(y));
    out += fmt::format(R"svg(<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>)svg",
                       s.color, pts);
    for (auto [x, y] : s.points)
      out += fmt::format(R"svg(<circle cx="{:.1f}" cy="{:.1f}" r="3" fill="{}"/>)svg", px(x), py(y),
                         s.color);
    out += fmt::format(R"svg(<text x="{}" y="{}" font-size="11" fill="{}">{}</text>)svg",
                       left + pad + 10, top + 12 + 14 * legend++, s.color, s.name);
  }
  return out;
}

int chart(const std::string& results, const std::string& out_path) {
  std::ifstream in(results);
  const json r = json::parse(in);
  Series reserve_p50{"fresh call p50", "#1f77b4", {}}, reserve_p99{"fresh call p99", "#aec7e8", {}},
      replay_p50{"replay p50", "#d62728", {}}, replay_p99{"replay p99", "#ff9896", {}};
  for (const auto& g : r.at("growth")) {
    const double keys = g.at("keys").get<double>();
    reserve_p50.points.emplace_back(keys, g.at("reserve").at("p50_us").get<double>());
    reserve_p99.points.emplace_back(keys, g.at("reserve").at("p99_us").get<double>());
    replay_p50.points.emplace_back(keys, g.at("replay").at("p50_us").get<double>());
    replay_p99.points.emplace_back(keys, g.at("replay").at("p99_us").get<double>());
  }
  Series throughput{"fresh calls/s", "#2ca02c", {}};
  for (const auto& p : r.at("inflight_sweep")) {
    throughput.points.emplace_back(p.at("inflight").get<double>(), p.at("per_s").get<double>());
  }
  std::ofstream out(out_path);
  out << R"svg(<svg xmlns="http://www.w3.org/2000/svg" width="900" height="340" font-family="sans-serif">)svg"
      << R"svg(<rect width="100%" height="100%" fill="white"/>)svg"
      << panel(0, "Latency against keys stored", "keys stored", "microseconds",
               {reserve_p50, reserve_p99, replay_p50, replay_p99})
      << panel(450, "Throughput against calls in flight", "calls in flight (one io_context)",
               "calls per second", {throughput})
      << "</svg>\n";
  return out ? 0 : 1;
}

// ---- report -----------------------------------------------------------------------------------

struct Report {
  json out = json::object();
  bool human = true;

  void line(const std::string& name, const Stats& s, const Stats* floor = nullptr) {
    out["raw"][name] = s.json();
    if (!human) return;
    std::cout << fmt::format(
        "  {:<46} {:>10.0f}/s  p50 {:>8.1f} us  p99 {:>8.1f} us  max {:>9.1f} us", name, s.per_s,
        s.p50_us, s.p99_us, s.max_us);
    if (floor != nullptr) std::cout << fmt::format("   x{:.2f} of floor", s.per_s / floor->per_s);
    std::cout << '\n';
  }
  void heading(const std::string& h) {
    if (human) std::cout << '\n' << h << '\n';
  }
  void note(const std::string& text) {
    if (human) std::cout << "  " << text << '\n';
  }
};

int run_all(const Config& c) {
  Report report;
  report.human = !c.json_out;
  const std::size_t n = c.quick ? 4000 : 20000;
  json& o = report.out;
  o["machine"] = {{"cores", std::thread::hardware_concurrency()}};
  o["quick"] = c.quick;

  for (Synchronous sync : {Synchronous::normal, Synchronous::full}) {
    if (!c.wants("calls")) break;
    const std::string mode = sync == Synchronous::normal ? "normal" : "full";
    const std::size_t calls = sync == Synchronous::full ? n / 4 : n;
    report.heading(fmt::format("synchronous={}: fresh keys, no-op action", mode));
    const Stats minimal = minimal_floor_fresh(c, sync, calls);
    report.line(fmt::format("{}: naive floor, minimal table (2 txns)", mode), minimal);
    const Stats floor = floor_fresh(c, sync, calls);
    report.line(fmt::format("{}: same-schema floor (idem's SQL, 2 txns)", mode), floor);
    const Stats uncheckpointed = floor_fresh(c, sync, calls, false);
    report.line(fmt::format("{}: the same, checkpoints never run", mode), uncheckpointed, &floor);
    const Stats blocking = idem_fresh_blocking(c, sync, calls);
    report.line(fmt::format("{}: idem, one caller, blocking", mode), blocking, &floor);
    report.line(fmt::format("{}: the same against the minimal table", mode), blocking, &minimal);
    Stats random_minimal, random_blocking;
    if (sync == Synchronous::normal) {
      random_keys(calls);
      random_minimal = minimal_floor_fresh(c, sync, calls, random_key);
      report.line(fmt::format("{}: naive floor, minimal table, random keys", mode), random_minimal);
      random_blocking = idem_fresh_blocking(c, sync, calls, random_key);
      report.line(fmt::format("{}: idem, one caller, blocking, random keys", mode), random_blocking,
                  &random_minimal);
    }
    {
      auto idem = make_idem(fresh_db(c, "idem-async1"), sync);
      const Stats s = idem_async(*idem, calls, 1, [](std::size_t i) { return key_of(i); });
      report.line(fmt::format("{}: idem, one caller, asio", mode), s, &floor);
    }
    Stats concurrent;
    {
      auto idem = make_idem(fresh_db(c, "idem-async64"), sync);
      concurrent = idem_async(*idem, calls, 64, [](std::size_t i) { return key_of(i); });
      report.line(fmt::format("{}: idem, 64 in flight on one io_context", mode), concurrent,
                  &floor);
    }
    const Stats threads8 = idem_fresh_threads(c, sync, calls, 8);
    report.line(fmt::format("{}: idem, 8 threads, blocking", mode), threads8, &floor);
    report.line(fmt::format("{}: the same against one blocking caller", mode), threads8, &blocking);
    if (sync == Synchronous::normal) {
      const Stats busy = idem_fresh_threads_busy(c, calls, 8);
      report.line(fmt::format("{}: idem, 8 threads, both CPUs busy with other work", mode), busy,
                  &threads8);
      o["threads_busy_fresh_calls_per_s"] = busy.per_s;
      o["threads_busy_p99_us"] = busy.p99_us;
    }
    report.heading(fmt::format("synchronous={}: replay of completed keys", mode));
    const std::size_t keys = 2000;
    const Stats floor_r = floor_replay(c, sync, keys, calls);
    report.line(fmt::format("{}: naive floor (SELECT by primary key)", mode), floor_r);
    const Stats replay1 = idem_replay(c, sync, keys, calls);
    report.line(fmt::format("{}: idem replay, one caller", mode), replay1, &floor_r);
    {
      const std::string path = fresh_db(c, "idem-replay64");
      { populate(*make_idem(path, sync), keys); }
      auto idem = make_idem(path, sync);
      const Stats r64 =
          idem_async(*idem, calls, 64, [&](std::size_t i) { return key_of(i % keys); });
      report.line(fmt::format("{}: idem replay, 64 in flight", mode), r64, &floor_r);
    }
    if (sync == Synchronous::normal) {
      // The two ratios from pairs run back to back (floor, then idem, on fresh files), the
      // median of kPairs: this VM's speed drifts by ±15 % over seconds, and a ratio of two
      // runs taken a minute apart measures the drift as much as idem.
      constexpr int kPairs = 5;
      std::vector<double> fresh{blocking.per_s / floor.per_s},
          minimal_pairs{blocking.per_s / minimal.per_s}, replay{replay1.per_s / floor_r.per_s},
          threads{threads8.per_s / blocking.per_s},
          random{random_blocking.per_s / random_minimal.per_s};
      for (int pair = 1; pair < kPairs; ++pair) {
        const double m = minimal_floor_fresh(c, sync, calls).per_s;
        const double f = floor_fresh(c, sync, calls).per_s;
        const double i = idem_fresh_blocking(c, sync, calls).per_s;
        fresh.push_back(i / f);
        minimal_pairs.push_back(i / m);
        const double rm = minimal_floor_fresh(c, sync, calls, random_key).per_s;
        random.push_back(idem_fresh_blocking(c, sync, calls, random_key).per_s / rm);
        threads.push_back(idem_fresh_threads(c, sync, calls, 8).per_s / i);
        const double r = floor_replay(c, sync, keys, calls).per_s;
        replay.push_back(idem_replay(c, sync, keys, calls).per_s / r);
      }
      o["raw"]["fresh_key_ratio_pairs"] = fresh;
      o["raw"]["minimal_fresh_key_ratio_pairs"] = minimal_pairs;
      o["minimal_fresh_key_ratio"] = median(minimal_pairs);
      o["raw"]["random_key_ratio_pairs"] = random;
      o["random_key_ratio"] = median(random);
      o["random_key_calls_per_s"] = random_blocking.per_s;
      o["random_key_minimal_floor_calls_per_s"] = random_minimal.per_s;
      o["raw"]["threads_ratio_pairs"] = threads;
      o["threads_ratio"] = median(threads);
      o["threads_fresh_calls_per_s"] = threads8.per_s;
      o["threads_p99_us"] = threads8.p99_us;
      o["raw"]["replay_ratio_pairs"] = replay;
      o["fresh_key_ratio"] = median(fresh);
      o["replay_ratio"] = median(replay);
      report.note(fmt::format(
          "ratios, median of {} back-to-back runs: fresh key {:.2f} (against the minimal table "
          "{:.2f}; random keys against it {:.2f}), 8 threads against one caller {:.2f}, replay "
          "{:.2f}",
          kPairs, o["fresh_key_ratio"].get<double>(), o["minimal_fresh_key_ratio"].get<double>(),
          o["random_key_ratio"].get<double>(), o["threads_ratio"].get<double>(),
          o["replay_ratio"].get<double>()));
      o["concurrent_fresh_calls_per_s"] = concurrent.per_s;
    } else {
      // One durable caller against the naive floor (the minimal table) under FULL, where each
      // commit waits for its fsync: pairs back to back, as above.
      constexpr int kPairs = 3;
      std::vector<double> full{blocking.per_s / minimal.per_s};
      for (int pair = 1; pair < kPairs; ++pair) {
        const double m = minimal_floor_fresh(c, sync, calls).per_s;
        full.push_back(idem_fresh_blocking(c, sync, calls).per_s / m);
      }
      o["raw"]["full_one_caller_ratio_pairs"] = full;
      o["full_one_caller_ratio"] = median(full);
      o["full_one_caller_calls_per_s"] = blocking.per_s;
      o["full_naive_floor_calls_per_s"] = minimal.per_s;
      report.note(fmt::format(
          "one durable caller against the naive floor, median of {} back-to-back runs: {:.2f}",
          kPairs, o["full_one_caller_ratio"].get<double>()));
      o["concurrent_fresh_calls_per_s_full"] = concurrent.per_s;
    }
  }

  // Throughput against calls in flight (for the chart).
  if (c.wants("sweep"))
    report.heading("normal: fresh keys, throughput against calls in flight (asio)");
  for (const std::size_t inflight : std::vector<std::size_t>{1, 4, 16, 64, 256}) {
    if (!c.wants("sweep")) break;
    auto idem = make_idem(fresh_db(c, "sweep"), Synchronous::normal);
    const Stats s = idem_async(*idem, n, inflight, [](std::size_t i) { return key_of(i); });
    report.line(fmt::format("normal: {} in flight", inflight), s);
    o["inflight_sweep"].push_back(
        {{"inflight", inflight}, {"per_s", s.per_s}, {"p99_us", s.p99_us}});
  }

  // 5. Processes on one file, distinct keys, FULL (where starvation used to show).
  if (c.wants("processes")) report.heading("several processes on one database file, distinct keys");
  for (Synchronous sync : {Synchronous::normal, Synchronous::full}) {
    if (!c.wants("processes")) break;
    for (const std::size_t procs : std::vector<std::size_t>{2, 4}) {
      const std::size_t each = (c.quick ? 1000u : 4000u) / (sync == Synchronous::full ? 4u : 1u);
      const MultiProcess m = processes(c, procs, each, sync);
      const std::string mode = sync == Synchronous::full ? "full" : "normal";
      report.note(
          fmt::format("{}: {} processes: {:.0f} calls/s together, worst single call {:.1f} ms",
                      mode, procs, m.per_s, m.worst_ms));
      o["raw"][fmt::format("{}_processes_{}", procs, mode)] = {
          {"per_s", m.per_s}, {"worst_ms", m.worst_ms}, {"children", m.raw}};
      if (procs == 2) {
        o["two_process_worst_wait_ms"] =
            std::max(o.value("two_process_worst_wait_ms", 0.0), m.worst_ms);
      }
    }
  }

  // 6. Hand-off: 20 duplicates waiting on a 300 ms action.
  if (c.wants("handoff")) {
    report.heading(
        "hand-off: 20 duplicates wait on a 300 ms action; from its end to each waiter's return");
    const std::size_t rounds = c.quick ? 3 : 10;
    const Stats in = handoff_in_process(c, rounds);
    report.line("hand-off, same process (woken by the completion)", in);
    const Stats cross = handoff_cross_process(c, rounds);
    report.line("hand-off, holder in another process (polling)", cross);
    o["handoff_in_process_p99_ms"] = in.p99_us / 1000;
    o["handoff_cross_process_p99_ms"] = cross.p99_us / 1000;
  }

  // 7. Growth: reserve and replay latency against stored keys; purge under load.
  if (c.wants("growth")) {
    report.heading("growth: latency against keys stored");
    std::vector<std::size_t> sizes = {10000, 100000};
    if (!c.quick) sizes = {10000, 1000000, 10000000};
    double first_p99 = 0, last_p99 = 0;
    for (std::size_t stored : sizes) {
      const Growth g = growth_at(c, stored);
      report.line(fmt::format("{} keys stored: fresh reserve+complete", stored), g.reserve);
      report.line(fmt::format("{} keys stored: replay", stored), g.replay);
      o["growth"].push_back(
          {{"keys", stored}, {"reserve", g.reserve.json()}, {"replay", g.replay.json()}});
      if (first_p99 == 0) first_p99 = g.reserve.p99_us;
      last_p99 = g.reserve.p99_us;
    }
    o["reserve_p99_growth_ratio"] = last_p99 / first_p99;
  }
  if (c.wants("purge")) {
    const std::size_t expired = c.quick ? 100000 : 1000000;
    const Purge p = purge_while_serving(c, expired);
    report.note(
        fmt::format("purge of {} expired keys: {:.2f} s; {} calls meanwhile, longest {:.1f} ms",
                    p.purged, p.seconds, p.reserves, p.max_reserve_wait_ms));
    o["purge_max_reserve_wait_ms"] = p.max_reserve_wait_ms;
    o["raw"]["purge"] = {{"expired", p.purged},
                         {"seconds", p.seconds},
                         {"calls_meanwhile", p.reserves},
                         {"max_reserve_wait_ms", p.max_reserve_wait_ms}};
  }

  if (c.wants("maintenance")) {
    const std::size_t expired = c.quick ? 50000 : 300000;
    // Pairs back to back (with maintenance, then the same calls without); the first is shown.
    const int pairs = c.quick ? 1 : 3;
    std::vector<double> ratios;
    MaintenanceWait m;
    for (int pair = 0; pair < pairs; ++pair) {
      const MaintenanceWait p = maintenance_while_serving(c, expired);
      ratios.push_back(p.max_wait_ms / p.floor_max_ms);
      if (pair == 0) m = p;
    }
    report.note(fmt::format(
        "maintenance (purge of {} expired keys, outbox of {} messages, every 5 ms): {} two-step "
        "calls meanwhile, longest {:.1f} ms; the same calls without maintenance: longest {:.1f} "
        "ms; with / without, median of {} pairs: {:.2f}",
        m.purged, m.delivered, m.calls, m.max_wait_ms, m.floor_max_ms, pairs, median(ratios)));
    o["maintenance_max_request_wait_ms"] = m.max_wait_ms;
    o["maintenance_wait_ratio"] = median(ratios);
    o["raw"]["maintenance_wait_ratio_pairs"] = ratios;
    o["raw"]["maintenance"] = {{"expired_purged", m.purged},
                               {"delivered", m.delivered},
                               {"calls", m.calls},
                               {"max_request_wait_ms", m.max_wait_ms},
                               {"floor_max_request_wait_ms", m.floor_max_ms}};
  }

  // 8. Bytes on disk per stored key, with a 200-byte response.
  if (c.wants("bytes")) {
    const std::size_t keys = c.quick ? 20000 : 100000;
    const std::string path = fresh_db(c, "bytes");
    {
      auto idem = make_idem(path, Synchronous::normal);
      const Response response{200, std::string(200, 'x'), {}};
      idem_threads(
          *idem, keys, 1, [](std::size_t i) { return key_of(i, "7f3c1e8a-4b2d-4e91-a5f6-"); },
          [&] { return response; });
    }
    // Closing the last connection checkpoints the WAL into the file.
    o["bytes_per_key"] = file_bytes(path) / static_cast<double>(keys);
    report.heading("storage");
    report.note(
        fmt::format("bytes on disk per stored key: {:.0f}", o["bytes_per_key"].get<double>()));
  }

  // 9. HTTP: the demo server end to end, with its idempotency layer and without.
  if (c.wants("http")) {
    try {
      o.update(run_http(c.quick, c.dir, report.human ? &std::cout : nullptr));
    } catch (const std::exception& e) {
      std::cerr << "idem_bench: " << e.what() << '\n';
      return 1;
    }
  }

  // 10. The replay cache on SQLite (with calls, and with pg): hot keys through ReplayCache
  // against the SELECT floor, the median of back-to-back pairs.
  if (c.wants("calls") || c.wants("pg")) {
    const std::size_t keys = 100, calls = c.quick ? 100000 : 500000;
    report.heading(fmt::format("normal: replay of {} hot keys through ReplayCache", keys));
    std::vector<double> pairs;
    Stats floor_r, cached;
    for (int pair = 0; pair < 5; ++pair) {
      const Stats f = floor_replay(c, Synchronous::normal, keys, calls);
      const Stats r = idem_replay_cached(c, keys, calls);
      pairs.push_back(r.per_s / f.per_s);
      if (pair == 0) {
        floor_r = f;
        cached = r;
      }
    }
    report.line("normal: naive floor (SELECT by primary key), hot", floor_r);
    report.line("normal: idem replay through ReplayCache", cached, &floor_r);
    report.note(
        fmt::format("replay cache ratio, median of 5 back-to-back runs: {:.1f}", median(pairs)));
    o["raw"]["replay_cache_ratio_pairs"] = pairs;
    o["replay_cache_calls_per_s"] = cached.per_s;
    o["replay_cache_ratio"] = median(pairs);
  }

  // 11. PostgreSQL: idem over PgStore against libpq floors on one durable server.
  if (c.wants("pg") && c.pg.empty()) {
    std::cerr << "idem_bench: pg section skipped: no PostgreSQL server (--pg CONNINFO; "
                 "scripts/bench starts one)\n";
  } else if (c.wants("pg")) {
    try {
      o.update(run_pg({c.quick, c.pg, c.self, c.dir}, report.human ? &std::cout : nullptr));
    } catch (const std::exception& e) {
      std::cerr << "idem_bench: " << e.what() << '\n';
      return 1;
    }
  }

  // 12. gRPC: the guard on loopback gRPC, with it and without, in the same run. Last, so that
  // gRPC's threads, which outlive its servers, never run beside another section.
  if (c.wants("grpc")) {
#ifdef IDEM_BENCH_GRPC
    try {
      o.update(run_grpc(c.quick, c.dir, report.human ? &std::cout : nullptr));
    } catch (const std::exception& e) {
      std::cerr << "idem_bench: " << e.what() << '\n';
      return 1;
    }
#else
    std::cerr << "idem_bench: grpc section skipped: this build has no gRPC (IDEM_GRPC off)\n";
#endif
  }

  if (c.json_out) std::cout << o.dump(2) << '\n';
  return 0;
}

}  // namespace
}  // namespace idem::bench

int main(int argc, char** argv) {
  idem::bench::Config c;
  c.self = argv[0];
  c.dir = std::filesystem::temp_directory_path() / fmt::format("idem-bench-{}", getpid());
  if (argc == 7 && std::string(argv[1]) == "--child") {
    return idem::bench::run_child(
        argv[2], std::stoul(argv[3]), argv[4],
        std::string(argv[5]) == "full" ? idem::Synchronous::full : idem::Synchronous::normal,
        std::stoi(argv[6]));
  }
  if (argc >= 2 && std::string(argv[1]) == "--pg-waiter")
    return idem::bench::run_pg_waiter(argc - 2, argv + 2);
  if (argc == 4 && std::string(argv[1]) == "--hold")
    return idem::bench::run_holder(argv[2], argv[3]);
  if (argc == 4 && std::string(argv[1]) == "--chart") return idem::bench::chart(argv[2], argv[3]);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      c.quick = true;
    else if (a == "--json")
      c.json_out = true;
    else if (a == "--dir" && i + 1 < argc)
      c.dir = argv[++i];
    else if (a == "--pg" && i + 1 < argc)
      c.pg = argv[++i];
    else if (a == "--only" && i + 1 < argc) {
      std::stringstream list(argv[++i]);
      for (std::string name; std::getline(list, name, ',');) c.only.push_back(name);
    } else {
      std::cerr << "usage: idem_bench [--quick] [--json] [--dir DIR] [--only SECTION,...] "
                   "[--pg CONNINFO]\n"
                   "sections: calls sweep processes handoff growth purge maintenance bytes http "
                   "pg grpc\n";
      return 2;
    }
  }
#ifndef IDEM_BENCH_GRPC
  // Asked for by name, the section's absence is an error, told before any other section runs.
  if (std::find(c.only.begin(), c.only.end(), "grpc") != c.only.end()) {
    std::cerr << "idem_bench: the grpc section is not built: this build has no gRPC (configure "
                 "with -DIDEM_GRPC=ON; needs libgrpc++-dev, libprotobuf-dev, "
                 "protobuf-compiler-grpc)\n";
    return 2;
  }
#endif
  std::filesystem::create_directories(c.dir);
  const int rc = idem::bench::run_all(c);
  std::filesystem::remove_all(c.dir);
  return rc;
}
