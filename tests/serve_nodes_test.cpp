// Several `idem-demo serve` processes (nodes) on one PostgreSQL database: the article's
// twenty identical requests spread across three nodes, 200 times over, and a node killed by
// SIGKILL in the middle of a charge. Every test counts the provider's charges in the ledger
// file the nodes share.
#include <doctest/doctest.h>

#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "http_client.hpp"
#include "idem/sim/provider.hpp"
#include "serve_support.hpp"
#include "store_engines.hpp"

using namespace std::chrono_literals;
using idem::test::HttpClient;
using idem::test::HttpReply;
using idem::test::ServeProcess;
using nlohmann::json;

namespace {

// Three (or n) serve processes on one fresh database, sharing one provider ledger.
struct Nodes {
  idem::test::TempDir dir;
  std::string uri = idem::test::fresh_pg_database();
  std::string ledger = dir.file("ledger.db");
  std::vector<std::unique_ptr<ServeProcess>> nodes;

  Nodes(int n, const std::vector<std::string>& extra) {
    for (int i = 0; i < n; ++i) {
      // No deduplication at the provider: a second debit would be a second charge.
      std::vector<std::string> args = {"--store",  uri,    "--ledger",         ledger,
                                       "--policy", "wait", "--provider-dedup", "off"};
      args.insert(args.end(), extra.begin(), extra.end());
      nodes.push_back(std::make_unique<ServeProcess>("", args));
    }
  }

  unsigned short port(std::size_t i) const { return nodes.at(i)->port; }

  // The provider's charges, read from the ledger file itself.
  std::size_t charges() const {
    idem::sim::Provider reader(std::make_shared<idem::SystemClock>(), {.ledger_path = ledger});
    return reader.charge_count();
  }

  // One counter of node i's /metrics (idem_<name>_total).
  long long metric(std::size_t i, const std::string& name) const {
    HttpClient c(port(i));
    const std::string text = c.send("GET", "/metrics").body;
    const std::string line = "\nidem_" + name + "_total ";  // not the # HELP line
    const auto at = text.find(line);
    REQUIRE_MESSAGE(at != std::string::npos, text);
    return std::stoll(text.substr(at + line.size()));
  }

  std::string db_text(const std::string& sql) const { return idem::test::pg_text(uri, sql); }
};

bool postgresql_ready() { return idem::test::engine_ready(idem::test::PgEngine{}); }

std::vector<std::pair<std::string, std::string>> post_headers(const std::string& key) {
  return {{"Authorization", "Bearer sk_test_alpha"},
          {"Idempotency-Key", key},
          {"Content-Type", "application/json"}};
}

std::string payment(const std::string& order_id) {
  return fmt::format(R"({{"amount": 4990, "currency": "RUB", "order_id": "{}"}})", order_id);
}

}  // namespace

TEST_CASE(
    "nodes: twenty identical requests spread over three serve processes on one PostgreSQL "
    "database, 200 rounds: one charge a round, twenty identical answers") {
  if (!postgresql_ready()) return;
  Nodes n(3, {"--provider-latency-ms", "20"});
  // Twenty keep-alive connections, client i on node i % 3.
  std::vector<std::unique_ptr<HttpClient>> clients;
  for (std::size_t i = 0; i < 20; ++i)
    clients.push_back(std::make_unique<HttpClient>(n.port(i % 3)));

  constexpr int kRounds = 200;
  std::set<std::string> charge_ids;
  int rounds_with_one_charge = 0;
  for (int round = 0; round < kRounds; ++round) {
    const std::string key = fmt::format("race-{}", round);
    const std::string body = payment(fmt::format("O-{}", round));
    // All twenty are on the wire before any answer is read.
    for (auto& c : clients) c->write_only("POST", "/v1/payments", post_headers(key), body);
    std::vector<HttpReply> replies;
    for (auto& c : clients) replies.push_back(c->receive());
    bool same = true;
    for (const HttpReply& r : replies) same = same && r.status == 200 && r.body == replies[0].body;
    CHECK_MESSAGE(same, fmt::format("round {}: {} {}", round, replies[0].status, replies[0].body));
    if (replies[0].status == 200) charge_ids.insert(json::parse(replies[0].body).at("charge_id"));
    if (n.charges() == static_cast<std::size_t>(round + 1)) ++rounds_with_one_charge;
  }
  CHECK(rounds_with_one_charge == kRounds);
  CHECK(n.charges() == static_cast<std::size_t>(kRounds));
  CHECK(charge_ids.size() == static_cast<std::size_t>(kRounds));
  CHECK(std::stoll(n.db_text("SELECT count(*) FROM idem.demo_orders")) == kRounds);

  // The callers overlapped: duplicates waited for a holder, and on more than one node (so
  // across processes, woken by the store, not only in-process).
  long long reserved = 0, waited = 0;
  int nodes_that_waited = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    reserved += n.metric(i, "reserved");
    const long long w = n.metric(i, "waited");
    waited += w;
    if (w > 0) ++nodes_that_waited;
  }
  MESSAGE("duplicates that waited for a holder: ", waited);
  CHECK(reserved == kRounds);
  CHECK(waited > 0);
  CHECK(nodes_that_waited >= 2);
}

TEST_CASE(
    "nodes: a serve process killed by SIGKILL mid-charge is taken over by another after its "
    "lease, and the payment is charged once") {
  if (!postgresql_ready()) return;
  Nodes n(3, {"--provider-latency-ms", "1500", "--lease-ms", "1000"});
  const std::string key = "kill-1";
  const std::string body = payment("O-kill");

  // Node 0 takes the request and starts the charge: the record's progress has the debit
  // pending (the provider is answering for 1.5 s).
  HttpClient first(n.port(0));
  first.write_only("POST", "/v1/payments", post_headers(key), body);
  const std::string progress_sql =
      "SELECT coalesce(progress, '') FROM idem.idem_keys WHERE key = 'kill-1'";
  REQUIRE(idem::test::eventually([&] {
    return n.db_text(progress_sql).find("\"pending\":\"debited\"") != std::string::npos;
  }));
  ::kill(n.nodes[0]->pid, SIGKILL);
  CHECK(n.nodes[0]->wait(10s) == 128 + SIGKILL);
  CHECK(n.charges() == 0);  // killed before the provider answered

  // Node 1 gets the client's retry: it waits out node 0's lease, takes the key over, looks
  // the charge up by its derived key (none), charges once and finishes the checkout.
  HttpClient retry(n.port(1));
  const HttpReply r = retry.send("POST", "/v1/payments", post_headers(key), body);
  CHECK(r.status == 200);
  CHECK(n.charges() == 1);
  CHECK(n.metric(1, "taken_over") == 1);
  CHECK(n.metric(1, "resumed") == 1);
  CHECK(std::stoll(n.db_text("SELECT count(*) FROM idem.demo_orders")) == 1);

  // Node 2 replays it byte for byte; still one charge.
  HttpClient third(n.port(2));
  const HttpReply replay = third.send("POST", "/v1/payments", post_headers(key), body);
  CHECK(replay.status == 200);
  CHECK(replay.body == r.body);
  CHECK(replay.has("idempotent-replayed"));
  CHECK(n.charges() == 1);
  // And the payment can be read on any node.
  const std::string id = json::parse(r.body).at("id");
  const HttpReply read =
      third.send("GET", "/v1/payments/" + id, {{"Authorization", "Bearer sk_test_alpha"}});
  CHECK(read.status == 200);
  CHECK(read.body == r.body);
}

TEST_CASE(
    "nodes: payments made by serve on SQLite replay byte for byte on PostgreSQL after "
    "idem-demo migrate, and read by their ids") {
  if (!postgresql_ready()) return;
  idem::test::TempDir dir;
  const std::string file = dir.file("payments.db");
  const std::string uri = idem::test::fresh_pg_database();
  auto serve_on = [&](const std::string& where) {
    idem::demo::ServerOptions o;
    o.port = 0;
    o.api.db = where;
    o.api.ledger = dir.file("ledger.db");
    o.api.provider_latency = 5ms;
    o.api.provider_dedup = false;
    return o;
  };
  std::vector<HttpReply> before;
  {
    idem::test::Served sqlite_node(serve_on(file));
    HttpClient c(sqlite_node.port());
    for (const char* key : {"m-1", "m-2"})
      before.push_back(c.send("POST", "/v1/payments", post_headers(key), payment(key)));
    CHECK(sqlite_node.server->api().provider().charge_count() == 2);
  }
  REQUIRE(before[0].status == 200);
  REQUIRE(before[1].status == 200);

  std::string out;
  REQUIRE(idem::test::run_demo(dir, {"migrate", "--from", file, "--to", uri}, out) == 0);
  const json report = json::parse(out);
  CHECK(report.at("records_copied") == 2);
  CHECK(report.at("orders_copied") == 2);

  idem::test::Served pg_node(serve_on(uri));
  HttpClient c(pg_node.port());
  for (std::size_t i = 0; i < 2; ++i) {
    const std::string key = i == 0 ? "m-1" : "m-2";
    const HttpReply replay = c.send("POST", "/v1/payments", post_headers(key), payment(key));
    CHECK(replay.status == 200);
    CHECK(replay.body == before[i].body);
    CHECK(replay.has("idempotent-replayed"));
    const std::string id = json::parse(before[i].body).at("id");
    const HttpReply read =
        c.send("GET", "/v1/payments/" + id, {{"Authorization", "Bearer sk_test_alpha"}});
    CHECK(read.status == 200);
    CHECK(read.body == before[i].body);
  }
  // A new payment gets an id after the copied ones; still one charge per payment.
  const HttpReply fresh = c.send("POST", "/v1/payments", post_headers("m-3"), payment("m-3"));
  CHECK(fresh.status == 200);
  CHECK(json::parse(fresh.body).at("id") == "pay_3");
  CHECK(pg_node.server->api().provider().charge_count() == 3);
}
