// `idem-demo grpc-serve` and `grpc-call` as processes: the article's twenty identical calls
// over gRPC, a server killed by SIGKILL in the middle of a checkout and the retry on another
// server, and a client no one in the project wrote (Python's grpcio, with stubs generated
// from demo/grpc/payments.proto) seeing the documented statuses. Every test counts the
// provider's charges in the ledger file, with a provider that does not deduplicate.
#include <doctest/doctest.h>

#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "demo_process.hpp"
#include "idem/sim/provider.hpp"
#include "store_engines.hpp"

using namespace std::chrono_literals;
using idem::test::ServeProcess;
using nlohmann::json;

namespace {

std::size_t charges(const std::string& ledger) {
  idem::sim::Provider reader(std::make_shared<idem::SystemClock>(), {.ledger_path = ledger});
  return reader.charge_count();
}

std::string target(const ServeProcess& server) {
  return "127.0.0.1:" + std::to_string(server.port);
}

// The JSON lines grpc-call printed.
std::vector<json> lines_of(const std::string& out) {
  std::vector<json> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) lines.push_back(json::parse(line));
  return lines;
}

}  // namespace

TEST_CASE("grpc demo: 20 parallel identical grpc-call calls to grpc-serve charge once") {
  idem::test::TempDir dir;
  const std::string ledger = dir.file("ledger.db");
  ServeProcess server("",
                      {"--db", dir.file("keys.db"), "--ledger", ledger, "--policy", "wait",
                       "--provider-dedup", "off", "--provider-latency-ms", "300"},
                      "grpc-serve");
  std::string out;
  REQUIRE(idem::test::run_demo(
              dir, {"grpc-call", "--target", target(server), "--key", "twenty", "--parallel", "20"},
              out) == 0);
  const std::vector<json> lines = lines_of(out);
  REQUIRE(lines.size() == 21);
  int replayed = 0;
  for (std::size_t i = 0; i < 20; ++i) {
    CHECK(lines[i]["code"] == "OK");
    if (lines[i]["trailers"].value("idempotent-replayed", "") == "true") ++replayed;
  }
  CHECK(replayed == 19);
  CHECK(lines[20]["ok"] == 20);
  CHECK(lines[20]["charge_ids"].size() == 1);
  CHECK(charges(ledger) == 1);
}

TEST_CASE(
    "grpc demo: a grpc-serve killed by SIGKILL mid-checkout, the retry on another server "
    "debits once") {
  if (!idem::test::engine_ready(idem::test::PgEngine{})) return;
  idem::test::TempDir dir;
  const std::string uri = idem::test::fresh_pg_database();
  const std::string ledger = dir.file("ledger.db");
  const std::vector<std::string> args = {"--store",
                                         uri,
                                         "--ledger",
                                         ledger,
                                         "--policy",
                                         "wait",
                                         "--provider-dedup",
                                         "off",
                                         "--provider-latency-ms",
                                         "1500",
                                         "--lease-ms",
                                         "1000"};
  ServeProcess doomed("", args, "grpc-serve");
  ServeProcess survivor("", args, "grpc-serve");
  const std::vector<std::string> call = {"grpc-call", "--method",   "checkout", "--key",
                                         "kill-1",    "--attempts", "1"};

  // The first server takes the call and begins the debit (the provider answers in 1.5 s).
  std::vector<std::string> to_doomed = call;
  to_doomed.insert(to_doomed.end(), {"--target", target(doomed)});
  const pid_t client = idem::test::start_demo(to_doomed, dir.file("first.out"));
  REQUIRE(idem::test::eventually([&] {
    return idem::test::pg_text(
               uri, "SELECT coalesce(progress, '') FROM idem.idem_keys WHERE key = 'kill-1'")
               .find("\"pending\":\"debited\"") != std::string::npos;
  }));
  ::kill(doomed.pid, SIGKILL);
  CHECK(doomed.wait(10s) == 128 + SIGKILL);
  CHECK(idem::test::wait_bounded(client, 30s) == 1);  // its client got no answer (UNAVAILABLE)
  CHECK(charges(ledger) == 0);                        // killed before the provider answered

  // The client's retry on the other server waits out the dead one's lease, looks the charge
  // up by its derived key (none), debits once and finishes the checkout.
  std::vector<std::string> to_survivor = call;
  to_survivor.insert(to_survivor.end(), {"--target", target(survivor)});
  std::string out;
  REQUIRE(idem::test::run_demo(dir, to_survivor, out) == 0);
  const json retry = lines_of(out).at(0);
  CHECK(retry["code"] == "OK");
  CHECK(retry["reply"]["status"] == "succeeded");
  CHECK(charges(ledger) == 1);
  CHECK(idem::test::pg_text(uri, "SELECT count(*) FROM idem.demo_orders") == "1");

  // Again: a replay of the same payment, still one debit.
  REQUIRE(idem::test::run_demo(dir, to_survivor, out) == 0);
  const json again = lines_of(out).at(0);
  CHECK(again["trailers"]["idempotent-replayed"] == "true");
  CHECK(again["reply"] == retry["reply"]);
  CHECK(charges(ledger) == 1);
}

TEST_CASE(
    "grpc demo: Python's grpcio, with stubs generated from demo/grpc/payments.proto, sees the "
    "documented statuses and trailers") {
  idem::test::TempDir dir;
  const std::string ledger = dir.file("ledger.db");
  ServeProcess server("",
                      {"--db", dir.file("keys.db"), "--ledger", ledger, "--provider-dedup", "off",
                       "--provider-latency-ms", "0"},
                      "grpc-serve");
  // Debian's python3, the one python3-grpcio installs into (not a python3 of one's own on PATH).
  REQUIRE_MESSAGE(
      std::system("/usr/bin/python3 -c 'import grpc, google.protobuf' 2>/dev/null") == 0,
      "python3-grpcio and python3-protobuf are missing (scripts/setup installs them)");
  const std::string stubs = dir.file("stubs");
  const std::string generate = std::string(IDEM_PROTOC) + " -I " + IDEM_DEMO_GRPC_DIR +
                               " --python_out=" + stubs + " --grpc_python_out=" + stubs +
                               " --plugin=protoc-gen-grpc_python=" + IDEM_GRPC_PYTHON_PLUGIN + " " +
                               IDEM_DEMO_GRPC_DIR + "/payments.proto";
  REQUIRE(std::system(("mkdir -p " + stubs + " && " + generate).c_str()) == 0);
  const std::string out = dir.file("python.out");
  const int status =
      std::system(("PYTHONPATH=" + stubs + " /usr/bin/python3 " + IDEM_DEMO_GRPC_DIR +
                   "/client.py " + target(server) + " > " + out + " 2>&1")
                      .c_str());
  std::ifstream in(out);
  std::stringstream text;
  text << in.rdbuf();
  CHECK_MESSAGE(status == 0, text.str());
  CHECK(text.str().find("one charge: ch_1") != std::string::npos);
  CHECK(charges(ledger) == 1);
}
