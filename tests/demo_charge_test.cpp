// `idem-demo charge` as separate processes on one database: the single-node multi-process
// promise, and what a crash between the charge and the completion costs with and without
// provider deduplication. Real time: the processes really overlap.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "checkout.hpp"
#include "test_support.hpp"

extern char** environ;

namespace {

struct Run {
  pid_t pid = 0;
  std::string out;
};

// Starts idem-demo with `args`, stdout to a file in `dir`.
Run start(const idem::test::TempDir& dir, const std::string& name, std::vector<std::string> args) {
  Run r;
  r.out = dir.file(name + ".out");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, r.out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  args.insert(args.begin(), IDEM_DEMO);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  REQUIRE(posix_spawn(&r.pid, IDEM_DEMO, &actions, nullptr, argv.data(), environ) == 0);
  posix_spawn_file_actions_destroy(&actions);
  return r;
}

// Waits for `r`; returns its exit status (or 128 + signal) and parses its one JSON line.
int finish(const Run& r, nlohmann::json& line) {
  int status = 0;
  REQUIRE(waitpid(r.pid, &status, 0) == r.pid);
  std::ifstream in(r.out);
  std::stringstream text;
  text << in.rdbuf();
  line = text.str().empty() ? nlohmann::json() : nlohmann::json::parse(text.str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

long long ledger_count(const idem::test::TempDir& dir, const std::string& ledger) {
  nlohmann::json line;
  REQUIRE(finish(start(dir, "ledger", {"ledger", "--ledger", ledger}), line) == 0);
  return line.at("count").get<long long>();
}

// `command` (charge or checkout) for trial `trial`'s own key and order, on `db` and `ledger`,
// with a provider that does not deduplicate.
std::vector<std::string> trial_args(const std::string& command, const std::string& db,
                                    const std::string& ledger, int trial, int lease_ms,
                                    int latency_ms) {
  return {command,
          "--db",
          db,
          "--ledger",
          ledger,
          "--key",
          fmt::format("k{}", trial),
          "--order-id",
          fmt::format("O-{}", trial),
          "--lease-ms",
          std::to_string(lease_ms),
          "--provider-latency-ms",
          std::to_string(latency_ms),
          "--provider-dedup",
          "off"};
}

// Whether a demo command's answer tells its client to ask again with the same key (the
// errors idem/errors.hpp documents as retryable with the same key).
bool is_retryable(const nlohmann::json& line) {
  if (!line.is_object() || !line.contains("outcome")) return false;
  const std::string outcome = line.at("outcome");
  return outcome == "lease_lost" || outcome == "in_progress" || outcome == "outcome_unknown" ||
         outcome == "store_unavailable";
}

}  // namespace

TEST_CASE(
    "demo charge: eight processes with one key print one charge id, the ledger has one charge") {
  idem::test::TempDir dir;
  const std::string db = dir.file("keys.db"), ledger = dir.file("ledger.db");
  std::vector<Run> runs;
  for (int i = 0; i < 8; ++i) {
    runs.push_back(start(dir, "p" + std::to_string(i),
                         {"charge", "--db", db, "--ledger", ledger, "--key", "order-A-10023",
                          "--provider-dedup", "off"}));
  }
  int executed = 0, waited = 0;
  for (const Run& r : runs) {
    nlohmann::json line;
    CHECK(finish(r, line) == 0);
    CAPTURE(line.dump());
    CHECK(line.at("charge_id") == "ch_1");
    if (line.at("outcome") == "executed") ++executed;
    if (line.at("waited") == true) ++waited;
  }
  CHECK(executed == 1);
  CHECK(waited > 0);  // the processes overlapped: some found the key held and waited
  CHECK(ledger_count(dir, ledger) == 1);  // provider dedup off: one charge is idem's doing
}

TEST_CASE(
    "demo charge: a crash after the charge, then a retry past the lease: provider dedup decides") {
  for (const std::string dedup : {"on", "off"}) {
    CAPTURE(dedup);
    idem::test::TempDir dir;
    const std::string db = dir.file("keys.db"), ledger = dir.file("ledger.db");
    const std::vector<std::string> common = {"charge",  "--db",
                                             db,        "--ledger",
                                             ledger,    "--key",
                                             "k-crash", "--lease-ms",
                                             "300",     "--provider-latency-ms",
                                             "20",      "--provider-dedup",
                                             dedup};
    std::vector<std::string> crash = common;
    crash.push_back("--crash-after-charge");
    nlohmann::json line;
    CHECK(finish(start(dir, "crash", crash), line) == 70);  // died after the charge was made
    CHECK(line.is_null());                                  // ...before answering
    CHECK(ledger_count(dir, ledger) == 1);
    // The retry finds the key reserved by the dead process, waits out its lease, takes over
    // and runs again, passing the same derived key to the provider.
    REQUIRE(finish(start(dir, "retry", common), line) == 0);
    CHECK(line.at("outcome") == "executed");
    if (dedup == "on") {
      CHECK(line.at("charge_id") == "ch_1");
      CHECK(ledger_count(dir, ledger) == 1);
    } else {
      CHECK(line.at("charge_id") == "ch_2");
      CHECK(ledger_count(dir, ledger) == 2);
    }
  }
}

TEST_CASE("demo charge: bad input is refused with a clear error and nothing is stored") {
  idem::test::TempDir dir;
  const std::string db = dir.file("keys.db"), ledger = dir.file("ledger.db");
  nlohmann::json line;
  CHECK(finish(start(dir, "bad",
                     {"charge", "--db", db, "--ledger", ledger, "--key", std::string(256, 'k')}),
               line) == 1);
  CHECK(line.at("outcome") == "invalid_key");
  CHECK(line.at("error") == "idempotency key is longer than 255 bytes (256 bytes)");
  CHECK(ledger_count(dir, ledger) == 0);
  idem::test::RawDb raw(db);
  CHECK(raw.rows() == 0);
}

TEST_CASE(
    "demo checkout: 50 processes killed by SIGKILL at random moments, each retried: one debit, "
    "one order, one mail per key") {
  // Seed 000's flow across real processes. A provider that does not deduplicate: a retry that
  // called again blindly would show as a second charge. The kill moment is drawn from a
  // seeded generator over the run's span (process start, debit, order, mail); what it hits is
  // counted, never assumed.
  idem::test::TempDir dir;
  const std::string db = dir.file("keys.db"), ledger = dir.file("ledger.db");
  std::mt19937 random(20261130);
  std::uniform_int_distribution<int> kill_after_us(0, 60000);
  int killed = 0, reconciled_or_resumed = 0, asked_again = 0;
  constexpr int kTrials = 50;
  for (int trial = 0; trial < kTrials; ++trial) {
    CAPTURE(trial);
    const std::vector<std::string> args = trial_args("checkout", db, ledger, trial, 200, 10);
    Run victim = start(dir, "victim", args);
    std::this_thread::sleep_for(std::chrono::microseconds(kill_after_us(random)));
    kill(victim.pid, SIGKILL);
    nlohmann::json line;
    if (finish(victim, line) == 128 + SIGKILL) ++killed;
    // The retry waits out the dead process's lease, takes over and resumes. Like any client it
    // asks again with the same key when told to (lease_lost: its reservation or a renewal came
    // back too late on a loaded machine and nothing was called; in_progress; outcome_unknown),
    // a bounded number of times.
    int retry_exit = finish(start(dir, "retry", args), line);
    for (int again = 0; retry_exit != 0 && again < 4 && is_retryable(line); ++again) {
      MESSAGE("trial " << trial << ": the retry answered " << line.dump() << "; asking again");
      ++asked_again;
      retry_exit = finish(start(dir, "retry", args), line);
    }
    CAPTURE(line.dump());
    REQUIRE(retry_exit == 0);
    CHECK(line.at("status") == 200);
    if (line.at("resumed").get<int>() > 0 || line.at("reconciled").get<int>() > 0)
      ++reconciled_or_resumed;
    REQUIRE(finish(start(dir, "dispatch", {"dispatch", "--db", db, "--ledger", ledger}), line) ==
            0);
  }
  MESSAGE(killed << " of " << kTrials << " runs were killed mid-way; " << reconciled_or_resumed
                 << " retries resumed recorded progress or looked up an unknown outcome; "
                 << asked_again << " retries were asked again");
  CHECK(killed > 0);
  CHECK(ledger_count(dir, ledger) == kTrials);
  CHECK(idem::demo::count_orders(db) == static_cast<std::size_t>(kTrials));
  idem::test::RawDb raw(ledger);
  CHECK(raw.scalar("SELECT count(*) FROM sim_mail_journal") == kTrials);
  // One charge per order, one mail per order.
  CHECK(raw.scalar("SELECT count(DISTINCT order_id) FROM charges") == kTrials);
  idem::test::RawDb keys(db);
  CHECK(keys.scalar("SELECT count(*) FROM idem_outbox WHERE state <> 1") == 0);
}

TEST_CASE(
    "demo charge and checkout: the owner frozen (SIGSTOP) for twice its lease, a retry as it "
    "wakes: one debit per key, and the owner calls nobody") {
  // The owner stops itself where a pause hurts most: the single-step charge right after its
  // reservation committed (the reply not yet used), the checkout just before its debit. It
  // stays stopped for twice its lease (real time: the lease runs on the store's clock, this
  // machine's), then gets SIGCONT and a second process retries the key at once. The provider
  // does not deduplicate: an owner that called out on its ended lease while the retry took
  // over would show as a second charge.
  const int trials = idem::test::pause_trials();
  constexpr int kLeaseMs = 400;
  for (const std::string command : {"charge", "checkout"}) {
    CAPTURE(command);
    idem::test::TempDir dir;
    const std::string db = dir.file("keys.db"), ledger = dir.file("ledger.db");
    int owner_refused = 0;
    for (int trial = 0; trial < trials; ++trial) {
      CAPTURE(trial);
      const std::vector<std::string> args = trial_args(command, db, ledger, trial, kLeaseMs, 200);
      std::vector<std::string> frozen = args;
      frozen.insert(frozen.end(),
                    {"--stop-at", command == "charge" ? "reserved" : "before debited"});
      // The checkout renews its lease while it runs; woken, a heartbeat that renewed first
      // would make the owner's call legitimate (the retry then waits for it), and the race this
      // test is about (a call on an ended lease against a takeover) would not be run.
      if (command == "checkout") frozen.insert(frozen.end(), {"--heartbeat-ms", "0"});
      Run owner = start(dir, "owner", frozen);
      int status = 0;
      REQUIRE(waitpid(owner.pid, &status, WUNTRACED) == owner.pid);
      REQUIRE(WIFSTOPPED(status));  // it holds the key and is frozen where it asked
      std::this_thread::sleep_for(std::chrono::milliseconds(2 * kLeaseMs));  // the pause itself
      REQUIRE(kill(owner.pid, SIGCONT) == 0);
      Run retry = start(dir, "retry", args);
      nlohmann::json owner_line, retry_line;
      const int owner_exit = finish(owner, owner_line);
      CAPTURE(owner_line.dump());
      REQUIRE(finish(retry, retry_line) == 0);
      CAPTURE(retry_line.dump());
      if (owner_exit != 0) {
        // Refused before any call: the lease had ended when it woke.
        const std::string said = command == "charge" ? owner_line.at("outcome").get<std::string>()
                                                     : owner_line.at("error").get<std::string>();
        CHECK(said.find("lease") != std::string::npos);
        ++owner_refused;
      }
      CHECK(ledger_count(dir, ledger) == trial + 1);  // one charge per key, never two
    }
    MESSAGE(command << ": " << owner_refused << " of " << trials
                    << " woken owners ended on their lost lease (the rest renewed it first and "
                       "the retry waited for them)");
    CHECK(owner_refused > 0);
    idem::test::RawDb raw(ledger);
    CHECK(raw.scalar("SELECT count(DISTINCT order_id) FROM charges") == trials);
  }
}
