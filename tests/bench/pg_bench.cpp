// The pg section: idem over PgStore on a durable PostgreSQL server (fsync and
// synchronous_commit on), against floors written with plain libpq on the same server in the
// same run, so the server's and the disk's speed cancel out of the ratios:
//  - the floor: idem's own reservation and completion (floor_sql.hpp), one round trip and
//    one autocommit each, prepared once, one caller, fresh keys;
//  - the SELECT floor: idem's load by primary key, one round trip per call.
// Each scenario starts on an empty schema of its own (bench_*), made by PgStore.
#include <utility>  // before Asio (Boost 1.74)

#include <fcntl.h>
#include <libpq-fe.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <algorithm>
#include <atomic>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "bench.hpp"
#include "calls.hpp"
#include "floor_sql.hpp"
#include "idem/asio.hpp"
#include "idem/coordinator.hpp"
#include "idem/internal/store_stats.hpp"
#include "idem/pg_store.hpp"
#include "idem/replay_cache.hpp"
#include "pg_bench.hpp"

extern char** environ;

namespace idem::bench {
namespace {

namespace net = boost::asio;
using nlohmann::json;
using namespace std::chrono_literals;

// Replays go round a small set of hot keys, the floors' and idem's alike.
constexpr std::size_t kHotKeys = 100;
// The holder's action in the hand-off, as in the SQLite hand-off.
constexpr auto kHold = 300ms;

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error("pg bench: " + what); }

std::int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Steady time comparable between processes on one machine (CLOCK_MONOTONIC).
double mono_us() {
  return std::chrono::duration<double, std::micro>(Clock::now().time_since_epoch()).count();
}

std::string with_schema(std::string_view sql, const std::string& quoted) {
  std::string out(sql);
  for (std::size_t at = out.find("{s}"); at != std::string::npos; at = out.find("{s}", at)) {
    out.replace(at, 3, quoted);
    at += quoted.size();
  }
  return out;
}

// ---- the floors: plain libpq ----------------------------------------------------------------

using Result = std::unique_ptr<PGresult, decltype(&PQclear)>;

class Connection {
 public:
  explicit Connection(const std::string& conninfo)
      : conn_(PQconnectdb(conninfo.c_str()), &PQfinish) {
    if (PQstatus(conn_.get()) != CONNECTION_OK)
      fail(fmt::format("cannot connect: {}", PQerrorMessage(conn_.get())));
    PQsetNoticeProcessor(
        conn_.get(), [](void*, const char*) {}, nullptr);  // DROP's cascade
  }

  std::string quote(const std::string& identifier) {
    char* q = PQescapeIdentifier(conn_.get(), identifier.data(), identifier.size());
    if (q == nullptr) fail(PQerrorMessage(conn_.get()));
    std::string out = q;
    PQfreemem(q);
    return out;
  }

  void exec(const std::string& sql) { check(Result(PQexec(conn_.get(), sql.c_str()), &PQclear)); }

  void prepare(const char* name, const std::string& sql) {
    check(Result(PQprepare(conn_.get(), name, sql.c_str(), 0, nullptr), &PQclear));
  }

  // A prepared statement; parameters as text except those `formats` marks binary (1); text
  // results.
  Result run(const char* name, int count, const char* const* values, const int* lengths,
             const int* formats) {
    return check(
        Result(PQexecPrepared(conn_.get(), name, count, values, lengths, formats, 0), &PQclear));
  }

 private:
  Result check(Result r) {
    const ExecStatusType s = PQresultStatus(r.get());
    if (s != PGRES_COMMAND_OK && s != PGRES_TUPLES_OK) fail(PQresultErrorMessage(r.get()));
    return r;
  }
  std::unique_ptr<PGconn, decltype(&PQfinish)> conn_;
};

// A protected call as a user would write it with libpq and idem's schema: the reservation,
// then the completion, each its own autocommit statement and round trip.
class Floor {
 public:
  // The schema must exist (fresh_store makes it).
  Floor(const std::string& conninfo, const std::string& schema) : conn_(conninfo) {
    const std::string s = conn_.quote(schema);
    conn_.prepare("reserve", with_schema(sql::kPgReserve, s));
    conn_.prepare("complete", with_schema(sql::kPgComplete, s));
    conn_.prepare("load", with_schema(sql::kPgLoad, s));
  }

  // The reservation on the database's clock (no `now`: the server's), as PgStore's default.
  void call(const std::string& key, const std::string& body, std::int64_t now) {
    const std::string lease = "30000";
    const char* fp = reinterpret_cast<const char*>(kFp.bytes().data());
    const char* reserve[] = {kTenant.c_str(), kOperation.c_str(), key.c_str(), fp,
                             nullptr,         lease.c_str(),      nullptr};
    const int reserve_lengths[] = {0, 0, 0, static_cast<int>(kFp.bytes().size()), 0, 0, 0};
    const int reserve_formats[] = {0, 0, 0, 1, 0, 0, 0};
    Result r = conn_.run("reserve", 7, reserve, reserve_lengths, reserve_formats);
    if (PQntuples(r.get()) != 1 || std::string_view(PQgetvalue(r.get(), 0, 0)) != "0")
      fail("the floor's reservation met an existing key: " + key);
    const std::string token = PQgetvalue(r.get(), 0, 1);
    const std::string expires = std::to_string(now + 86400000);
    const char* complete[] = {
        kTenant.c_str(), kOperation.c_str(), key.c_str(), token.c_str(),  "200",
        nullptr,         body.data(),        nullptr,     expires.c_str()};
    const int complete_lengths[] = {0, 0, 0, 0, 0, 0, static_cast<int>(body.size()), 0, 0};
    const int complete_formats[] = {0, 0, 0, 0, 0, 0, 1, 0, 0};
    Result c = conn_.run("complete", 9, complete, complete_lengths, complete_formats);
    if (std::string_view(PQcmdTuples(c.get())) != "1") fail("the floor's completion missed");
  }

  // A replay: the SELECT by primary key. Returns the body's length as sent (hex text).
  std::size_t replay(const std::string& key) {
    const char* values[] = {kTenant.c_str(), kOperation.c_str(), key.c_str()};
    Result r = conn_.run("load", 3, values, nullptr, nullptr);
    return PQntuples(r.get()) == 1 ? static_cast<std::size_t>(PQgetlength(r.get(), 0, 8)) : 0;
  }

 private:
  Connection conn_;
};

// An empty schema `schema` with idem's tables, and a store on it.
std::shared_ptr<PgStore> fresh_store(const std::string& conninfo, const std::string& schema,
                                     PgOptions options = {}) {
  {
    Connection c(conninfo);
    c.exec(with_schema(sql::kPgDropSchema, c.quote(schema)));
  }
  options.schema = schema;
  return std::make_shared<PgStore>(conninfo, std::move(options));
}

// `call(i)` for i = 0, 1, ... until n calls or until `budget` has passed (a slow disk ends a
// run early instead of stretching the bench), each call timed.
template <class Call>
Stats timed(std::size_t n, Clock::duration budget, Call&& call) {
  std::vector<double> lat;
  lat.reserve(n);
  const auto t0 = Clock::now();
  for (std::size_t i = 0; i < n && Clock::now() - t0 < budget; ++i) {
    const auto t = Clock::now();
    call(i);
    lat.push_back(micros_since(t));
  }
  return summarize(std::move(lat), micros_since(t0) / 1e6);
}

// Before a measured run of a pair: the server writes out what the last run left dirty (its
// dead rows, its WAL), so that neither run of a pair pays for the other's.
void settle(const std::string& conninfo) {
  Connection c(conninfo);
  c.exec("CHECKPOINT");
}

Stats floor_fresh(const std::string& conninfo, std::size_t n, Clock::duration budget) {
  fresh_store(conninfo, "bench_floor");
  Floor f(conninfo, "bench_floor");
  const std::string body = small_response().body;
  f.call("warm-up", body, now_ms());  // as idem's run below: the first call is not timed
  settle(conninfo);
  return timed(n, budget, [&](std::size_t i) { f.call(key_of(i, "f"), body, now_ms()); });
}

// ---- idem -----------------------------------------------------------------------------------

// What a store did between two of its stats().
struct Work {
  idem::detail::PgStats before, after;
  double transactions() const {
    return static_cast<double>(after.transactions - before.transactions);
  }
  double ops() const { return static_cast<double>(after.ops - before.ops); }
  double round_trips() const { return static_cast<double>(after.round_trips - before.round_trips); }
  json json_per(std::size_t calls) const {
    const double n = static_cast<double>(calls);
    return {{"transactions", transactions()},
            {"ops", ops()},
            {"round_trips", round_trips()},
            {"ops_per_transaction", transactions() > 0 ? ops() / transactions() : 0},
            {"round_trips_per_call", n > 0 ? round_trips() / n : 0},
            {"transactions_per_call", n > 0 ? transactions() / n : 0}};
  }
};

Stats idem_blocking(Coordinator& idem, std::size_t n, Clock::duration budget,
                    const std::function<std::string(std::size_t)>& key_at) {
  return timed(n, budget,
               [&](std::size_t i) { idem.call(request_for(key_at(i)), small_response); });
}

// `inflight` coroutines on one io_context share `n` calls (fewer if `budget` passes first);
// keys from `key_at(i)`.
Stats idem_async(Coordinator& idem, std::size_t n, std::size_t inflight, Clock::duration budget,
                 const std::function<std::string(std::size_t)>& key_at) {
  net::io_context io(1);
  std::vector<double> lat(n);
  std::atomic<std::size_t> next{0};
  const auto t0 = Clock::now();
  auto worker = [&]() -> net::awaitable<void> {
    while (Clock::now() - t0 < budget) {
      const std::size_t i = next++;
      if (i >= n) break;
      Request r = request_for(key_at(i));
      AsyncAction action = []() -> net::awaitable<Response> { co_return small_response(); };
      const auto t = Clock::now();
      co_await async_call(idem, std::move(r), std::move(action));
      lat[i] = micros_since(t);
    }
  };
  for (std::size_t w = 0; w < inflight; ++w) {
    net::co_spawn(io, worker(), [](std::exception_ptr e) {
      if (e) std::rethrow_exception(e);
    });
  }
  io.run();
  lat.resize(std::min(next.load(), n));  // the calls begun, all of them finished
  return summarize(std::move(lat), micros_since(t0) / 1e6);
}

Stats idem_fresh(const std::string& conninfo, std::size_t n, Clock::duration budget, Work& work,
                 bool notify = false) {
  auto store = fresh_store(conninfo, "bench_fresh", PgOptions{.notify = notify});
  Coordinator idem(store, {});
  // The first call opens the store's connection, prepares its statements and starts the
  // timer thread; the floor's are made before its run too.
  idem.call(request_for("warm-up"), small_response);
  settle(conninfo);
  work.before = idem::detail::StoreStats::of(*store);
  const Stats s = idem_blocking(idem, n, budget, [](std::size_t i) { return key_of(i, "i"); });
  work.after = idem::detail::StoreStats::of(*store);
  return s;
}

Stats idem_concurrent(const std::string& conninfo, std::size_t n, std::size_t inflight,
                      Clock::duration budget, Work& work, bool notify = false) {
  auto store = fresh_store(conninfo, "bench_async", PgOptions{.notify = notify});
  Coordinator idem(store, {});
  work.before = idem::detail::StoreStats::of(*store);
  const Stats s =
      idem_async(idem, n, inflight, budget, [](std::size_t i) { return key_of(i, "a"); });
  work.after = idem::detail::StoreStats::of(*store);
  return s;
}

// An empty schema `schema` with the kHotKeys hot keys completed in it (by idem, all in
// flight at once), and its store.
std::shared_ptr<PgStore> hot_store(const std::string& conninfo, const std::string& schema) {
  auto store = fresh_store(conninfo, schema);
  Coordinator fill(store, {});
  idem_async(fill, kHotKeys, kHotKeys, Clock::duration::max(),
             [](std::size_t i) { return key_of(i, "h"); });
  return store;
}

Stats select_floor(const std::string& conninfo, std::size_t n, Clock::duration budget) {
  hot_store(conninfo, "bench_select");
  Floor f(conninfo, "bench_select");
  std::size_t sink = 0;
  Stats s = timed(n, budget, [&](std::size_t i) { sink += f.replay(key_of(i % kHotKeys, "h")); });
  if (sink == 0) fail("the SELECT floor found nothing");
  return s;
}

// One caller replaying the hot keys, completed beforehand by another coordinator; through a
// ReplayCache when `cache` is set (its counters go to `cache_stats`).
Stats idem_replay(const std::string& conninfo, std::size_t n, Clock::duration budget, bool cache,
                  Work& work, ReplayCache::Stats* cache_stats = nullptr) {
  auto pg = hot_store(conninfo, cache ? "bench_cache" : "bench_replay");
  std::shared_ptr<ReplayCache> cached;
  if (cache) cached = std::make_shared<ReplayCache>(pg);
  Coordinator idem(cache ? std::shared_ptr<Store>(cached) : std::shared_ptr<Store>(pg), {});
  work.before = idem::detail::StoreStats::of(*pg);
  const Stats s =
      idem_blocking(idem, n, budget, [](std::size_t i) { return key_of(i % kHotKeys, "h"); });
  work.after = idem::detail::StoreStats::of(*pg);
  if (cached && cache_stats != nullptr) *cache_stats = cached->stats();
  return s;
}

// ---- a waiting duplicate in another node ------------------------------------------------------

std::string to_string(PgWake wake) {
  switch (wake) {
    case PgWake::poll:
      return "poll";
    case PgWake::notify:
      return "notify";
  }
  return "?";
}

PgWake parse_wake(std::string_view name) {
  if (name == "poll") return PgWake::poll;
  if (name == "notify") return PgWake::notify;
  fail(fmt::format("unknown wake-up '{}'", name));
}

// Both nodes' store options for `wake` (the holder's too: a wake-up would be sent by it).
PgOptions node_store_options(PgWake wake) {
  PgOptions o;
  o.notify = wake == PgWake::notify;
  return o;
}

// The waiting node's coordinator options for `wake`.
Options waiter_options(PgWake wake) {
  Options o;  // InFlight::wait
  switch (wake) {
    case PgWake::poll:  // Options::poll_initial, poll_max: every 1 ms, doubling up to 8 ms
      break;
    case PgWake::notify:  // woken by NOTIFY; the poll is only the safety net
      o.poll_initial = std::chrono::milliseconds(50);
      o.poll_max = std::chrono::milliseconds(1000);
      break;
  }
  return o;
}

// `waiters` coroutines call `key`, held elsewhere, under InFlight::wait; returns each one's
// return time (mono_us). Fails unless each got the holder's response replayed.
std::vector<double> wait_for(Coordinator& idem, const std::string& key, std::size_t waiters) {
  net::io_context io(1);
  std::vector<double> returned(waiters);
  std::size_t replays = 0;
  for (std::size_t i = 0; i < waiters; ++i) {
    net::co_spawn(
        io,
        [&idem, &returned, &replays, key, i]() -> net::awaitable<void> {
          AsyncAction action = []() -> net::awaitable<Response> { co_return small_response(); };
          const Outcome out = co_await async_call(idem, request_for(key), std::move(action));
          returned[i] = mono_us();
          if (out.replayed()) ++replays;
        },
        [](std::exception_ptr e) {
          if (e) std::rethrow_exception(e);
        });
  }
  io.run();
  if (replays != waiters)
    fail(fmt::format("{} of {} waiters got no replay", waiters - replays, waiters));
  return returned;
}

// Waits (a benchmark may sleep) until `key` is reserved in `store`, or the holder is done.
void until_reserved(Store& store, const std::string& key, const std::atomic<bool>& done) {
  const KeyId id{kTenant, kOperation, key};
  while (!done) {
    auto r = store.load(id);
    if (r && r->state == State::in_progress) return;
    std::this_thread::sleep_for(200us);
  }
}

// SIGPIPE ignored while it lives: a waiting node that died is an error from write(), not the
// end of this process.
class IgnoreSigpipe {
 public:
  IgnoreSigpipe() {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &ignore, &old_);
  }
  ~IgnoreSigpipe() { sigaction(SIGPIPE, &old_, nullptr); }
  IgnoreSigpipe(const IgnoreSigpipe&) = delete;
  IgnoreSigpipe& operator=(const IgnoreSigpipe&) = delete;

 private:
  struct sigaction old_ {};
};

std::string handoff_key(std::size_t round) { return fmt::format("handoff-{}", round); }

// This process holds a key for kHold in each round; `waiters` duplicates in another process
// (run_pg_waiter, its own PgStore and connection) wait for it. From the end of the holder's
// action to each waiter's return.
Stats handoff_cross_node(const PgBenchConfig& c, std::size_t rounds, std::size_t waiters,
                         PgWake wake) {
  const std::string schema = "bench_handoff";
  auto store = fresh_store(c.conninfo, schema, node_store_options(wake));
  Coordinator idem(store, {});
  const IgnoreSigpipe ignore_sigpipe;
  int gate[2];
  if (pipe(gate) != 0) fail("pipe failed");
  const std::string out = c.dir + "/pg-waiter.json";
  std::vector<std::string> args = {c.self,          "--pg-waiter",          c.conninfo,
                                   schema,          std::to_string(rounds), std::to_string(waiters),
                                   to_string(wake), std::to_string(gate[0])};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addclose(&actions, gate[1]);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, c.self.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(gate[0]);
  if (spawned != 0) {
    close(gate[1]);
    fail("posix_spawn failed");
  }
  std::vector<double> action_end(rounds);
  bool gate_ok = true;
  std::exception_ptr held_error;
  for (std::size_t round = 0; round < rounds && gate_ok && !held_error; ++round) {
    const std::string key = handoff_key(round);
    std::atomic<bool> done{false};
    std::thread holder([&] {
      try {
        idem.call(request_for(key), [&] {
          std::this_thread::sleep_for(kHold);
          action_end[round] = mono_us();
          return small_response();
        });
      } catch (...) {
        held_error = std::current_exception();
      }
      done = true;
    });
    until_reserved(*store, key, done);
    gate_ok = write(gate[1], "G", 1) == 1;  // the other node calls now
    holder.join();
  }
  close(gate[1]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (held_error) std::rethrow_exception(held_error);
  if (!gate_ok || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail("the waiting node failed (its errors are above)");
  std::ifstream in(out);
  const json j = json::parse(in);
  std::vector<double> lat;
  for (std::size_t round = 0; round < rounds; ++round) {
    for (double t : j.at("returned").at(round)) lat.push_back(t - action_end[round]);
  }
  return summarize(std::move(lat), 0);
}

// ---- the table ------------------------------------------------------------------------------

struct Table {
  std::ostream* human;
  json& raw;

  void heading(const std::string& h) const {
    if (human != nullptr) *human << '\n' << h << '\n';
  }
  void note(const std::string& text) const {
    if (human != nullptr) *human << "  " << text << '\n';
  }
  // A row, beside its floor when it has one.
  void line(const std::string& name, const Stats& s, const Stats* floor = nullptr) const {
    raw[name] = s.json();
    if (human == nullptr) return;
    *human << fmt::format("  {:<46} {:>10.0f}/s  p50 {:>8.1f} us  p99 {:>8.1f} us  max {:>9.1f} us",
                          name, s.per_s, s.p50_us, s.p99_us, s.max_us);
    if (floor != nullptr) {
      *human << fmt::format("   x{:.2f} of floor ({:.0f}/s)", s.per_s / floor->per_s, floor->per_s);
    }
    *human << '\n';
  }
};

}  // namespace

json run_pg(const PgBenchConfig& c, std::ostream* human) {
  json o = json::object();
  json& pg = o["pg"];
  Table t{human, pg["raw"]};
  const int pairs = c.quick ? 3 : 5;
  // The most one measured run takes, whatever its count of calls: a disk whose fsyncs slow
  // down (another build, another benchmark) cuts runs short instead of stretching the bench.
  const Clock::duration budget = c.quick ? 2s : 8s;
  const std::string& ci = c.conninfo;

  // Fresh keys, one caller: the ratio is the median of back-to-back pairs, each run on an
  // empty schema after a checkpoint, as for SQLite: the server's disk drifts between runs. The
  // order alternates (floor first in even pairs, idem first in odd ones), so that whatever
  // the first run of a pair leaves behind (autovacuum of its dead rows) does not always fall
  // on the same side.
  const std::size_t n = c.quick ? 1000 : 4000;
  t.heading(
      "PostgreSQL (durable: fsync, synchronous_commit on): fresh keys, no-op action, one caller");
  Stats floor, fresh;
  Work fresh_work;
  std::vector<double> fresh_ratios;
  for (int pair = 0; pair < pairs; ++pair) {
    Work w;
    Stats f, i;
    if (pair % 2 == 0) {
      f = floor_fresh(ci, n, budget);
      i = idem_fresh(ci, n, budget, w);
    } else {
      i = idem_fresh(ci, n, budget, w);
      f = floor_fresh(ci, n, budget);
    }
    fresh_ratios.push_back(i.per_s / f.per_s);
    if (pair == 0) {
      floor = f;
      fresh = i;
      fresh_work = w;
    }
  }
  t.line("pg: floor (idem's SQL via libpq, 2 autocommits)", floor);
  t.line("pg: idem, one caller, blocking", fresh, &floor);
  t.note(fmt::format(
      "fresh key ratio, median of {} back-to-back pairs: {:.2f}; idem: {:.2f} round trips, "
      "{:.2f} transactions a call",
      pairs, median(fresh_ratios), fresh_work.round_trips() / static_cast<double>(fresh.calls),
      fresh_work.transactions() / static_cast<double>(fresh.calls)));
  {
    // The same caller with PgOptions::notify on: what NOTIFY costs a lone completion.
    Work w;
    const Stats woken = idem_fresh(ci, n, budget, w, true);
    t.line("pg: idem, one caller, blocking, NOTIFY on", woken, &floor);
    o["pg_fresh_calls_per_s_notify"] = woken.per_s;
  }
  pg["fresh_key_ratio_pairs"] = fresh_ratios;
  pg["fresh_store_work"] = fresh_work.json_per(fresh.calls);
  o["pg_floor_calls_per_s"] = floor.per_s;
  o["pg_floor_p50_us"] = floor.p50_us;
  o["pg_floor_p99_us"] = floor.p99_us;
  o["pg_fresh_calls_per_s"] = fresh.per_s;
  o["pg_fresh_p50_us"] = fresh.p50_us;
  o["pg_fresh_p99_us"] = fresh.p99_us;
  o["pg_fresh_key_ratio"] = median(fresh_ratios);

  // 64 in flight on one io_context: the group commit hands PgStore the writes of every
  // coroutine that is ready, one pipeline and one transaction each.
  {
    const std::size_t calls = c.quick ? 10000 : 40000;
    Work w;
    const Stats s = idem_concurrent(ci, calls, 64, budget, w);
    t.line("pg: idem, 64 in flight on one io_context", s, &floor);
    t.note(fmt::format("64 in flight: {:.1f} ops a transaction, {:.3f} round trips a call",
                       w.transactions() > 0 ? w.ops() / w.transactions() : 0,
                       w.round_trips() / static_cast<double>(s.calls)));
    pg["concurrent_store_work"] = w.json_per(s.calls);
    o["pg_concurrent_fresh_calls_per_s"] = s.per_s;
    o["pg_concurrent_p99_us"] = s.p99_us;
    o["pg_concurrent_ops_per_transaction"] = w.transactions() > 0 ? w.ops() / w.transactions() : 0;
    o["pg_concurrent_round_trips_per_call"] = w.round_trips() / static_cast<double>(s.calls);
    // The same with PgOptions::notify on: what the wake-ups cost a busy node.
    Work loud;
    const Stats q = idem_concurrent(ci, calls, 64, budget, loud, true);
    t.line("pg: idem, 64 in flight, NOTIFY on", q, &floor);
    o["pg_concurrent_fresh_calls_per_s_notify"] = q.per_s;
  }

  // Replays of hot keys: with no cache, against the SELECT floor; through ReplayCache.
  {
    t.heading(fmt::format("PostgreSQL: replay of {} hot completed keys, one caller", kHotKeys));
    const std::size_t calls = c.quick ? 3000 : 15000;
    const std::size_t cached_calls = c.quick ? 300000 : 1000000;
    Stats select, replay, cached;
    Work replay_work, cached_work;
    ReplayCache::Stats cache_stats;
    std::vector<double> cache_ratios;
    for (int pair = 0; pair < pairs; ++pair) {
      Work w;
      ReplayCache::Stats cs;
      const Stats f = select_floor(ci, calls, budget);
      const Stats r = idem_replay(ci, cached_calls, budget, true, w, &cs);
      cache_ratios.push_back(r.per_s / f.per_s);
      if (pair == 0) {
        select = f;
        cached = r;
        cached_work = w;
        cache_stats = cs;
      }
    }
    replay = idem_replay(ci, calls, budget, false, replay_work);
    t.line("pg: SELECT floor (by primary key, libpq)", select);
    t.line("pg: idem replay, no cache", replay, &select);
    t.line("pg: idem replay through ReplayCache", cached, &select);
    t.note(fmt::format(
        "replay cache ratio, median of {} pairs: {:.1f}; no cache: {:.2f} round trips a replay; "
        "cache: {} hits, {} misses, {:.0f} round trips in {} replays",
        pairs, median(cache_ratios), replay_work.round_trips() / static_cast<double>(replay.calls),
        cache_stats.hits, cache_stats.misses, cached_work.round_trips(), cached.calls));
    pg["replay_store_work"] = replay_work.json_per(replay.calls);
    pg["replay_cache_store_work"] = cached_work.json_per(cached.calls);
    pg["replay_cache"] = {{"hits", cache_stats.hits}, {"misses", cache_stats.misses}};
    pg["replay_cache_ratio_pairs"] = cache_ratios;
    o["pg_select_floor_per_s"] = select.per_s;
    o["pg_replay_calls_per_s"] = replay.per_s;
    o["pg_replay_ratio"] = replay.per_s / select.per_s;
    o["pg_replay_cache_calls_per_s"] = cached.per_s;
    o["pg_replay_cache_ratio"] = median(cache_ratios);
  }

  // A duplicate waiting in another node (process) on the same database.
  {
    const std::size_t rounds = c.quick ? 3 : 10, waiters = 20;
    t.heading(fmt::format(
        "PostgreSQL hand-off: {} duplicates in another node wait on a {} ms action; from its end "
        "to each waiter's return",
        waiters, kHold.count()));
    const Stats woken = handoff_cross_node(c, rounds, waiters, PgWake::notify);
    t.line("pg: hand-off, waiters in another node (NOTIFY; polls 50 ms to 1 s)", woken);
    o["pg_handoff_cross_node_p99_ms"] = woken.p99_us / 1000;
    o["pg_handoff_cross_node_p50_ms"] = woken.p50_us / 1000;
    const Stats polled = handoff_cross_node(c, rounds, waiters, PgWake::poll);
    t.line("pg: hand-off, waiters in another node (no NOTIFY; polls 1 to 8 ms)", polled);
    o["pg_handoff_cross_node_poll_p99_ms"] = polled.p99_us / 1000;
    pg["handoff_wake"] = "notify";
  }
  return o;
}

int run_pg_waiter(int argc, char** argv) {
  if (argc != 6) {
    std::cerr << "usage: idem_bench --pg-waiter CONNINFO SCHEMA ROUNDS WAITERS WAKE GATE_FD\n";
    return 2;
  }
  try {
    const std::size_t rounds = std::stoul(argv[2]), waiters = std::stoul(argv[3]);
    const int gate = std::stoi(argv[5]);
    const PgWake wake = parse_wake(argv[4]);
    PgOptions store_options = node_store_options(wake);
    store_options.schema = argv[1];
    Coordinator idem(std::make_shared<PgStore>(argv[0], std::move(store_options)),
                     waiter_options(wake));
    json returned = json::array();
    for (std::size_t round = 0; round < rounds; ++round) {
      char go = 0;
      if (read(gate, &go, 1) != 1) fail("the holder's node went away");
      returned.push_back(wait_for(idem, handoff_key(round), waiters));
    }
    std::cout << json{{"returned", returned}}.dump() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "idem_bench --pg-waiter: " << e.what() << '\n';
    return 1;
  }
}

}  // namespace idem::bench
