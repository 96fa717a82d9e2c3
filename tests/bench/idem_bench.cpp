// scripts/bench: what idem costs, measured against the bare SQLite floor in the same run.
//
//   idem_bench [--quick] [--json] [--dir DIR]    the scenarios of issue 5
//   idem_bench --child ...                       one process of a multi-process scenario
//   idem_bench --chart RESULTS.json OUT.svg      the README's chart from a --json run
#include <utility>  // before Asio (Boost 1.74)

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <cstdio>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <iostream>
#include <latch>
#include <mutex>
#include <random>
#include <thread>

#include "bench.hpp"
#include "idem/asio.hpp"
#include "idem/coordinator.hpp"
#include "idem/sqlite_store.hpp"
#include "sql.hpp"
#include "sqlite_handle.hpp"

extern char** environ;

namespace idem::bench {
namespace {

namespace net = boost::asio;
using nlohmann::json;
using namespace std::chrono_literals;

struct Config {
  bool quick = false;
  bool json_out = false;
  std::string dir;
  std::string self;  // this program, for child processes
};

const Fingerprint kFp = Fingerprint::of(json{{"amount", 4990}, {"currency", "RUB"}});
const std::string kTenant = "alpha", kOperation = "payment.charge";

std::string key_of(std::size_t i, const std::string& prefix = "k") { return fmt::format("{}{:08}", prefix, i); }

Request request_for(const std::string& key) {
  Request r;
  r.tenant = kTenant;
  r.operation = kOperation;
  r.key = key;
  r.fingerprint = kFp;
  return r;
}

Response small_response() { return Response{200, R"({"charge_id":"ch_1"})", {}}; }

std::string fresh_db(const Config& c, const std::string& name) {
  const std::string path = c.dir + "/" + name + ".db";
  for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(path + suffix);
  return path;
}

// ---- the naive floor: idem's own statements straight through the sqlite3 C API ------------

class Floor {
 public:
  Floor(const std::string& path, Synchronous sync) : db_(detail::open_connection(path, &busy_)) {
    detail::enable_wal(db_.get(), busy_);
    detail::exec(db_.get(), sync == Synchronous::full ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=NORMAL");
    // Default checkpointing (wal_autocheckpoint=1000), as any naive user would have.
    detail::exec(db_.get(), "BEGIN IMMEDIATE");
    if (query_int("PRAGMA user_version") == 0) {
      for (auto m : sql::kMigrations) detail::exec(db_.get(), m);
      detail::exec(db_.get(), fmt::format("PRAGMA user_version = {}", sql::kMigrations.size()));
    }
    detail::exec(db_.get(), "COMMIT");
    begin_ = std::make_unique<detail::Statement>(db_.get(), sql::kBeginImmediate);
    commit_ = std::make_unique<detail::Statement>(db_.get(), sql::kCommit);
    reserve_ = std::make_unique<detail::Statement>(db_.get(), sql::kReserve);
    complete_ = std::make_unique<detail::Statement>(db_.get(), sql::kComplete);
    load_ = std::make_unique<detail::Statement>(db_.get(), sql::kLoad);
  }

  // One protected call done naively: the reservation in one transaction, the completion in a
  // second.
  void call(const std::string& key, const std::string& body, std::int64_t now_ms) {
    step(*begin_);
    reserve_->bind(1, kTenant);
    reserve_->bind(2, kOperation);
    reserve_->bind(3, key);
    reserve_->bind_blob(4, kFp.bytes().data(), kFp.bytes().size());
    reserve_->bind(5, now_ms);
    reserve_->bind(6, now_ms + 30000);
    reserve_->bind(7, now_ms);
    const bool got = reserve_->step();
    const std::int64_t token = got ? reserve_->int64(0) : 0;
    reserve_->reset();
    step(*commit_);
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
  static void step(detail::Statement& s) {
    s.step();
    s.reset();
  }
  std::int64_t query_int(const char* sql) {
    detail::Statement s(db_.get(), sql);
    s.step();
    return s.int64(0);
  }
  detail::BusyPolicy busy_{std::chrono::seconds(10), {}};
  detail::Connection db_;
  std::unique_ptr<detail::Statement> begin_, commit_, reserve_, complete_, load_;
};

std::int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

Stats floor_fresh(const Config& c, Synchronous sync, std::size_t n) {
  Floor f(fresh_db(c, "floor"), sync);
  const std::string body = small_response().body;
  std::vector<double> lat;
  lat.reserve(n);
  const auto t0 = Clock::now();
  for (std::size_t i = 0; i < n; ++i) {
    const auto t = Clock::now();
    f.call(key_of(i), body, now_ms());
    lat.push_back(micros_since(t));
  }
  return summarize(std::move(lat), micros_since(t0) / 1e6);
}

Stats floor_replay(const Config& c, Synchronous sync, std::size_t keys, std::size_t n) {
  Floor f(fresh_db(c, "floor-replay"), sync);
  const std::string body = small_response().body;
  for (std::size_t i = 0; i < keys; ++i) f.call(key_of(i), body, now_ms());
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

std::unique_ptr<Coordinator> make_idem(const std::string& path, Synchronous sync, Options options = {}) {
  return std::make_unique<Coordinator>(std::make_shared<SqliteStore>(path, SqliteOptions{.synchronous = sync}),
                                       std::move(options));
}

Stats idem_fresh_blocking(const Config& c, Synchronous sync, std::size_t n) {
  auto idem = make_idem(fresh_db(c, "idem-blocking"), sync);
  std::vector<double> lat;
  lat.reserve(n);
  const auto t0 = Clock::now();
  for (std::size_t i = 0; i < n; ++i) {
    const Request r = request_for(key_of(i));
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
    net::co_spawn(io, worker(), [](std::exception_ptr e) { if (e) std::rethrow_exception(e); });
  }
  io.run();
  return summarize(std::move(lat), micros_since(t0) / 1e6);
}

Stats idem_threads(Coordinator& idem, std::size_t n, std::size_t threads,
                   const std::function<std::string(std::size_t)>& key_at) {
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
        idem.call(r, small_response);
        lat[i] = micros_since(t1);
      }
    });
  }
  const auto t0 = Clock::now();
  start.arrive_and_wait();
  for (auto& t : pool) t.join();
  return summarize(std::move(lat), micros_since(t0) / 1e6);
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

// ---- report -----------------------------------------------------------------------------------

struct Report {
  json out = json::object();
  bool human = true;

  void line(const std::string& name, const Stats& s, const Stats* floor = nullptr) {
    out["raw"][name] = s.json();
    if (!human) return;
    std::cout << fmt::format("  {:<46} {:>10.0f}/s  p50 {:>8.1f} us  p99 {:>8.1f} us  max {:>9.1f} us", name,
                             s.per_s, s.p50_us, s.p99_us, s.max_us);
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
    const std::string mode = sync == Synchronous::normal ? "normal" : "full";
    const std::size_t calls = sync == Synchronous::full ? n / 4 : n;
    report.heading(fmt::format("synchronous={}: fresh keys, no-op action", mode));
    const Stats floor = floor_fresh(c, sync, calls);
    report.line(fmt::format("{}: naive floor (INSERT txn + UPDATE txn)", mode), floor);
    const Stats blocking = idem_fresh_blocking(c, sync, calls);
    report.line(fmt::format("{}: idem, one caller, blocking", mode), blocking, &floor);
    {
      auto idem = make_idem(fresh_db(c, "idem-async1"), sync);
      const Stats s = idem_async(*idem, calls, 1, [](std::size_t i) { return key_of(i); });
      report.line(fmt::format("{}: idem, one caller, asio", mode), s, &floor);
    }
    Stats concurrent;
    {
      auto idem = make_idem(fresh_db(c, "idem-async64"), sync);
      concurrent = idem_async(*idem, calls, 64, [](std::size_t i) { return key_of(i); });
      report.line(fmt::format("{}: idem, 64 in flight on one io_context", mode), concurrent, &floor);
    }
    {
      auto idem = make_idem(fresh_db(c, "idem-threads"), sync);
      const Stats s = idem_threads(*idem, calls, 8, [](std::size_t i) { return key_of(i); });
      report.line(fmt::format("{}: idem, 8 threads, blocking", mode), s, &floor);
    }
    report.heading(fmt::format("synchronous={}: replay of completed keys", mode));
    const std::size_t keys = 2000;
    const Stats floor_r = floor_replay(c, sync, keys, calls);
    report.line(fmt::format("{}: naive floor (SELECT by primary key)", mode), floor_r);
    Stats replay1;
    {
      auto idem = make_idem(fresh_db(c, "idem-replay"), sync);
      populate(*idem, keys);
      replay1 = idem_threads(*idem, calls, 1, [&](std::size_t i) { return key_of(i % keys); });
      report.line(fmt::format("{}: idem replay, one caller", mode), replay1, &floor_r);
      const Stats r64 = idem_async(*idem, calls, 64, [&](std::size_t i) { return key_of(i % keys); });
      report.line(fmt::format("{}: idem replay, 64 in flight", mode), r64, &floor_r);
    }
    if (sync == Synchronous::normal) {
      o["fresh_key_ratio"] = blocking.per_s / floor.per_s;
      o["replay_ratio"] = replay1.per_s / floor_r.per_s;
      o["concurrent_fresh_calls_per_s"] = concurrent.per_s;
    } else {
      o["concurrent_fresh_calls_per_s_full"] = concurrent.per_s;
    }
  }

  // 8. Bytes on disk per stored key, with a 200-byte response.
  {
    const std::size_t keys = c.quick ? 20000 : 100000;
    const std::string path = fresh_db(c, "bytes");
    {
      auto idem = make_idem(path, Synchronous::normal);
      const std::string body(200, 'x');
      idem_threads(*idem, keys, 1, [](std::size_t i) { return key_of(i, "7f3c1e8a-4b2d-4e91-a5f6-"); });
      (void)body;
    }
    // Closing the last connection checkpoints the WAL into the file.
    o["bytes_per_key"] = file_bytes(path) / static_cast<double>(keys);
    report.heading("storage");
    report.note(fmt::format("bytes on disk per stored key: {:.0f}", o["bytes_per_key"].get<double>()));
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
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") c.quick = true;
    else if (a == "--json") c.json_out = true;
    else if (a == "--dir" && i + 1 < argc) c.dir = argv[++i];
    else {
      std::cerr << "usage: idem_bench [--quick] [--json] [--dir DIR]\n";
      return 2;
    }
  }
  std::filesystem::create_directories(c.dir);
  const int rc = idem::bench::run_all(c);
  std::filesystem::remove_all(c.dir);
  return rc;
}
