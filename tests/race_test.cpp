// Races for real: coroutines on one io_context run by several threads, threads on the
// blocking API, and separate processes on one database file. Real time (SystemClock) and a
// provider with real latency, so the duplicates overlap the first; correctness is the
// provider's ledger: exactly one charge per key, every caller answered with that charge.
// (Test names start with "race:" so the TSan preset can select them.)
#include <utility>  // before Asio (Boost 1.74)

#include <doctest/doctest.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <fstream>
#include <latch>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "idem/asio.hpp"
#include "idem/internal/store_stats.hpp"
#include "idem/sim/async_provider.hpp"
#include "store_engines.hpp"
#include "test_support.hpp"

extern char** environ;

using namespace std::chrono_literals;
namespace net = boost::asio;
using idem::test::request;

namespace {

struct RealWorld {
  idem::test::TempDir dir;
  std::shared_ptr<idem::SystemClock> clock = std::make_shared<idem::SystemClock>();
  std::shared_ptr<idem::sim::Provider> provider;
  std::unique_ptr<idem::Coordinator> idem;

  explicit RealWorld(std::chrono::milliseconds latency) {
    provider = std::make_shared<idem::sim::Provider>(
        clock, idem::sim::ProviderOptions{.latency = latency, .dedup = false});
    idem = std::make_unique<idem::Coordinator>(
        std::make_shared<idem::SqliteStore>(dir.file("keys.db")),
        idem::Options{.in_flight = idem::InFlight::wait, .max_wait = 20s, .clock = clock});
  }
};

}  // namespace

TEST_CASE("race: 50 coroutines on one io_context (4 threads), one key, 100 rounds") {
  std::uint64_t waited = 0;  // proof that duplicates really overlapped the first
  for (int round = 0; round < 100; ++round) {
    RealWorld w(2ms);
    net::io_context io;
    std::mutex mutex;
    std::vector<std::string> answers;
    std::atomic<int> executed{0};
    for (int i = 0; i < 50; ++i) {
      net::co_spawn(
          io,
          [&]() -> net::awaitable<void> {
            // Named locals, not temporaries, in a co_await expression (g++ 12).
            idem::Request req = request("k");
            idem::AsyncAction action = [&]() -> net::awaitable<idem::Response> {
              const auto r = co_await idem::sim::async_charge(*w.provider, "A-1", 4990, "");
              co_return idem::Response{200, r.charge_id, {}};
            };
            const idem::Outcome o =
                co_await idem::async_call(*w.idem, std::move(req), std::move(action));
            if (o.source == idem::Outcome::Source::executed) ++executed;
            std::lock_guard lock(mutex);
            answers.push_back(o.response.body);
          },
          [](std::exception_ptr e) {
            if (e) std::rethrow_exception(e);
          });
    }
    std::vector<std::thread> runners;
    for (int t = 0; t < 4; ++t) runners.emplace_back([&] { io.run(); });
    for (auto& t : runners) t.join();
    REQUIRE(w.provider->charge_count() == 1);
    REQUIRE(executed == 1);
    REQUIRE(answers.size() == 50);
    for (const auto& a : answers) REQUIRE(a == "ch_1");
    waited += w.idem->metrics().waited;
  }
  CHECK(waited > 0);
}

TEST_CASE("race: 64 coroutines on two threads, PostgreSQL batches in flight at once, 20 rounds") {
  idem::test::PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  // Each round: 16 keys, each sent by 4 coroutines at once, on an io_context run by two
  // threads; the group commit keeps two batches in the database at a time, each waited for on
  // the io_context (PgStore::start_apply). Every key charges once.
  constexpr int kKeys = 16, kCopies = 4, kRounds = 20;
  auto clock = std::make_shared<idem::SystemClock>();
  auto store = std::make_shared<idem::PgStore>(
      e.conninfo, idem::PgOptions{.schema = e.schema, .batch_connections = 2});
  idem::Coordinator idem(
      store, idem::Options{.in_flight = idem::InFlight::wait, .max_wait = 20s, .clock = clock});
  std::uint64_t waited = 0;
  for (int round = 0; round < kRounds; ++round) {
    auto provider = std::make_shared<idem::sim::Provider>(
        clock, idem::sim::ProviderOptions{.latency = 1ms, .dedup = false});
    net::io_context io;
    std::mutex mutex;
    std::map<std::string, std::vector<std::string>> answers;
    for (int k = 0; k < kKeys; ++k) {
      for (int c = 0; c < kCopies; ++c) {
        net::co_spawn(
            io,
            [&, k]() -> net::awaitable<void> {
              const std::string key = fmt::format("r{}-k{}", round, k);
              idem::Request req = request(key);
              idem::AsyncAction action = [&, key]() -> net::awaitable<idem::Response> {
                const auto r = co_await idem::sim::async_charge(*provider, key, 4990, "");
                co_return idem::Response{200, r.charge_id, {}};
              };
              const idem::Outcome o =
                  co_await idem::async_call(idem, std::move(req), std::move(action));
              std::lock_guard lock(mutex);
              answers[key].push_back(o.response.body);
            },
            [](std::exception_ptr x) {
              if (x) std::rethrow_exception(x);
            });
      }
    }
    std::thread other([&] { io.run(); });
    io.run();
    other.join();
    REQUIRE(provider->charge_count() == kKeys);
    REQUIRE(answers.size() == static_cast<std::size_t>(kKeys));
    for (const auto& [key, bodies] : answers) {
      REQUIRE(bodies.size() == static_cast<std::size_t>(kCopies));
      for (const auto& b : bodies) REQUIRE(b == bodies.front());
    }
  }
  waited = idem.metrics().waited;
  CHECK(waited > 0);  // duplicates overlapped their first
  const idem::detail::PgStats s = idem::detail::StoreStats::of(*store);
  CHECK(s.async_batches > 0);            // the io_context waited for the batches
  CHECK(s.most_batches_in_flight == 2);  // and two were in the database at once
}

TEST_CASE("race: 16 threads on the blocking API, one key, 100 rounds") {
  std::uint64_t waited = 0;
  for (int round = 0; round < 100; ++round) {
    RealWorld w(1ms);
    std::latch start(16);
    std::mutex mutex;
    std::vector<std::string> answers;
    std::atomic<int> executed{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < 16; ++i) {
      threads.emplace_back([&] {
        start.arrive_and_wait();
        const idem::Outcome o = w.idem->call(request("k"), [&] {
          return idem::Response{200, w.provider->charge("A-1", 4990, "").charge_id, {}};
        });
        if (o.source == idem::Outcome::Source::executed) ++executed;
        std::lock_guard lock(mutex);
        answers.push_back(o.response.body);
      });
    }
    for (auto& t : threads) t.join();
    REQUIRE(w.provider->charge_count() == 1);
    REQUIRE(executed == 1);
    REQUIRE(answers.size() == 16);
    for (const auto& a : answers) REQUIRE(a == "ch_1");
    waited += w.idem->metrics().waited;
  }
  CHECK(waited > 0);
}

// `processes` processes race on one key a round for `rounds` rounds, each through its own
// Coordinator on `store` (a SQLite file, or "postgresql:SCHEMA" for IDEM_TEST_PG's server).
// Every round must charge once and answer every process with that charge; returns how many
// processes found the key held by another (the proof that they overlapped).
int process_race(const std::string& store, int rounds, int processes) {
  idem::test::TempDir dir;
  int waited = 0;
  const std::string helper = IDEM_RACE_HELPER;
  for (int round = 0; round < rounds; ++round) {
    const std::string ledger = dir.file(fmt::format("ledger-{}.db", round));
    const std::string key = fmt::format("round-{}", round);  // the store is shared by every round
    int gate[2];
    REQUIRE(pipe(gate) == 0);
    std::vector<pid_t> pids;
    std::vector<std::string> outputs;
    for (int p = 0; p < processes; ++p) {
      outputs.push_back(dir.file(fmt::format("out-{}-{}.json", round, p)));
      posix_spawn_file_actions_t actions;
      posix_spawn_file_actions_init(&actions);
      posix_spawn_file_actions_addopen(&actions, 1, outputs.back().c_str(),
                                       O_WRONLY | O_CREAT | O_TRUNC, 0644);
      posix_spawn_file_actions_addclose(&actions, gate[1]);
      const std::string fd = std::to_string(gate[0]);
      std::vector<std::string> args = {helper, store, ledger, key, fd, "20"};
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      pid_t pid = 0;
      REQUIRE(posix_spawn(&pid, helper.c_str(), &actions, nullptr, argv.data(), environ) == 0);
      posix_spawn_file_actions_destroy(&actions);
      pids.push_back(pid);
    }
    close(gate[0]);
    // Open the gate: one byte for each process, all at once.
    const std::string bytes(static_cast<std::size_t>(processes), 'G');
    REQUIRE(write(gate[1], bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
    close(gate[1]);
    for (pid_t pid : pids) {
      int status = 0;
      REQUIRE(waitpid(pid, &status, 0) == pid);
      CAPTURE(status);
      REQUIRE(WIFEXITED(status));
      REQUIRE(WEXITSTATUS(status) == 0);
    }
    int executed = 0;
    for (const std::string& path : outputs) {
      std::ifstream in(path);
      const auto line = nlohmann::json::parse(in);
      CAPTURE(line.dump());
      if (line.at("outcome") == "executed") ++executed;
      if (line.at("waited") == true) ++waited;
      REQUIRE(line.at("charge_id") == "ch_1");
    }
    REQUIRE(executed == 1);
    auto clock = std::make_shared<idem::SystemClock>();
    idem::sim::Provider statement(clock, {.ledger_path = ledger});
    REQUIRE(statement.charge_count() == 1);
  }
  return waited;
}

TEST_CASE("race: 8 processes on one database file, one key, 25 rounds") {
  idem::test::TempDir dir;
  CHECK(process_race(dir.file("keys.db"), 25, 8) > 0);
}

TEST_CASE("race: 8 processes (nodes) on one PostgreSQL database, one key, 25 rounds") {
  idem::test::PgEngine e;
  IDEM_ENGINE_OR_SKIP(e);
  CHECK(process_race("postgresql:" + e.schema, 25, 8) > 0);
}
