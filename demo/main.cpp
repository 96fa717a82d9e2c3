// idem-demo: the article's comparison table, and one-shot commands over the real library.
#include <CLI/CLI.hpp>
#include <iostream>
#include <vector>

#include "commands.hpp"
#include "database.hpp"
#include "migrate.hpp"
#include "scenarios.hpp"
#include "server/server.hpp"
#ifdef IDEM_DEMO_GRPC
#include "grpc_demo.hpp"
#endif

namespace {

// Where a command keeps its keys (and the demo's own tables): --db FILE or --store URI,
// exactly one, both into `where`.
void add_database(CLI::App* command, std::string& where, const std::string& what) {
  CLI::Option_group* g = command->add_option_group("database", "Where " + what + " live");
  g->add_option("--db", where, what + " in a SQLite file (one machine)")
      ->check(CLI::Validator(
          [](const std::string& v) {
            return idem::demo::is_postgresql(v) ? "a postgresql:// URI goes to --store" : "";
          },
          "FILE"));
  g->add_option("--store", where,
                what + " in a PostgreSQL database shared by every node (libpq URI)")
      ->check(CLI::Validator(
          [](const std::string& v) {
            return idem::demo::is_postgresql(v) ? "" : "--store takes a postgresql:// URI";
          },
          "postgresql://..."));
  g->require_option(1);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"idem-demo: why a result cache charges twice, and how idem charges once"};
  app.require_subcommand(0, 1);

  bool timeline = false;
  bool real_time = false;
  CLI::App* table = app.add_subcommand("table", "Print the comparison table (the default)");
  table->add_flag("--timeline", timeline, "Show each scenario's events on its clock");
  table->add_flag("--real-time", real_time, "Real 300 ms timers instead of the simulated clock");
  std::string svg_dir;
  table->add_option("--svg", svg_dir,
                    "Also draw each scenario as an SVG sequence diagram into this directory "
                    "(created if missing); prints the paths written");

  idem::demo::ChargeArgs c;
  std::string dedup = "on";
  CLI::App* charge = app.add_subcommand(
      "charge", "One real-time charge through the coordinator from this process");
  add_database(charge, c.db, "Idempotency keys");
  charge->add_option("--ledger", c.ledger, "Provider ledger (SQLite file, shared by processes)")
      ->required();
  charge->add_option("--key", c.key, "Idempotency key")->required();
  charge->add_option("--tenant", c.tenant, "Tenant")->capture_default_str();
  charge->add_option("--operation", c.operation, "Operation scope")->capture_default_str();
  charge->add_option("--amount", c.amount, "Amount (significant)")->capture_default_str();
  charge->add_option("--currency", c.currency, "Currency (significant)")->capture_default_str();
  charge->add_option("--order-id", c.order_id, "Order id (significant)")->capture_default_str();
  charge->add_option("--policy", c.policy, "In-flight policy")
      ->check(CLI::IsMember({"wait", "raise", "run"}))
      ->capture_default_str();
  charge->add_option("--lease-ms", c.lease_ms, "Lease")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  charge->add_option("--provider-latency-ms", c.provider_latency_ms, "Provider latency")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  charge->add_option("--provider-dedup", dedup, "Provider deduplicates on the derived key")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  charge->add_flag("--fail-closed", c.fail_closed,
                   "Refuse to charge when the store fails (default: fail open)");
  charge->add_flag("--crash-after-charge", c.crash_after_charge,
                   "Die right after the provider recorded the charge");
  charge
      ->add_option("--stop-at", c.stop_at,
                   "Stop this process (SIGSTOP) there, until SIGCONT: 'reserved' (the "
                   "reservation committed, its reply not yet used)")
      ->check(CLI::IsMember({"reserved"}));

  idem::demo::SimulateArgs sim;
  CLI::App* simulate = app.add_subcommand(
      "simulate", "Seeded whole-system scenarios: clients, processes, crashes, faults, checked");
  simulate->add_option("--seed", sim.seed, "First seed")->capture_default_str();
  simulate->add_option("--scenarios", sim.scenarios, "How many seeds, from --seed on")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  simulate->add_option("--steps", sim.steps, "Requests per scenario (0: drawn from the seed)")
      ->capture_default_str();
  simulate->add_option("--minutes", sim.minutes, "Run fresh random seeds for this long instead")
      ->check(CLI::NonNegativeNumber);
  simulate->add_flag("--trace", sim.trace, "Print every scenario's trace, not only failures'");
  simulate->add_option("--svg", sim.svg,
                       "Draw the first failing scenario (else the first) as an SVG timeline");
  simulate
      ->add_option("--mutation", sim.mutation,
                   "Break idem on purpose to watch the simulator catch it")
      ->check(CLI::IsMember({"complete_without_token_check", "wait_runs_unprotected",
                             "release_without_wake", "takeover_reuses_token", "skip_lease_check"}));

  idem::demo::CheckoutArgs k;
  std::string checkout_dedup = "on";
  CLI::App* checkout_cmd = app.add_subcommand(
      "checkout", "Seed 000's checkout (debit, order, mail) once, resuming what a dead run began");
  add_database(checkout_cmd, k.db, "Keys, orders and outbox");
  checkout_cmd->add_option("--ledger", k.ledger, "Provider ledger and mail journal (SQLite file)")
      ->required();
  checkout_cmd->add_option("--key", k.key, "Idempotency key")->required();
  checkout_cmd->add_option("--tenant", k.tenant, "Tenant")->capture_default_str();
  checkout_cmd->add_option("--order-id", k.order_id, "Order id")->capture_default_str();
  checkout_cmd->add_option("--amount", k.amount, "Amount")->capture_default_str();
  checkout_cmd->add_option("--lease-ms", k.lease_ms, "Lease")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  checkout_cmd
      ->add_option("--heartbeat-ms", k.heartbeat_ms,
                   "Renew the lease this often (0: never; default: a third of the lease)")
      ->check(CLI::NonNegativeNumber);
  checkout_cmd->add_option("--provider-latency-ms", k.provider_latency_ms, "Provider latency")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  checkout_cmd
      ->add_option("--provider-dedup", checkout_dedup, "Provider deduplicates on the derived key")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  checkout_cmd
      ->add_option("--stop-at", k.stop_at,
                   "Stop this process (SIGSTOP) at this point of the flow, until SIGCONT")
      ->check(CLI::IsMember({"before debited", "debited: charged, not recorded", "after debited",
                             "after order_created", "after notified"}));

  std::string dispatch_db, dispatch_ledger;
  CLI::App* dispatch_cmd =
      app.add_subcommand("dispatch", "Deliver the outbox once (to the simulated mail sender)");
  add_database(dispatch_cmd, dispatch_db, "Keys and outbox");
  dispatch_cmd->add_option("--ledger", dispatch_ledger, "Mail journal (SQLite file)")->required();

  std::string ledger;
  CLI::App* ledger_cmd = app.add_subcommand("ledger", "Print the provider's charges as JSON");
  ledger_cmd->add_option("--ledger", ledger, "Provider ledger (SQLite file)")->required();

  idem::demo::ServerOptions serve_options;
  std::string serve_policy = "raise";
  std::string api_keys_file;
  long long serve_latency_ms = 300;
  CLI::App* serve =
      app.add_subcommand("serve", "Serve the payments API over HTTP (POST /v1/payments ...)");
  serve->add_option("--port", serve_options.port, "TCP port (0: any free port)")
      ->capture_default_str();
  serve->add_option("--host", serve_options.host, "Address to bind")->capture_default_str();
  add_database(serve, serve_options.api.db, "Idempotency keys, payments and outbox");
  serve->add_option("--ledger", serve_options.api.ledger,
                    "Provider ledger (SQLite file; default: in memory)");
  serve->add_option("--policy", serve_policy, "In-flight policy")
      ->check(CLI::IsMember({"raise", "wait"}))
      ->capture_default_str();
  std::string serve_dedup = "on";
  serve->add_option("--provider-dedup", serve_dedup, "Provider deduplicates on the derived key")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  serve->add_option("--provider-latency-ms", serve_latency_ms, "Provider latency")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  std::size_t replay_cache_mb = 0;
  serve
      ->add_option("--replay-cache-mb", replay_cache_mb,
                   "Hold completed records in memory, up to this many MiB (0: off)")
      ->capture_default_str();
  serve->add_flag("--fail-closed", serve_options.api.fail_closed,
                  "Answer 503 instead of charging when the store fails");
  serve->add_option("--api-keys", api_keys_file,
                    "File of \"api_key tenant\" lines (default: sk_test_alpha, sk_test_beta)");
  std::string serve_app = "payments";
  serve
      ->add_option("--app", serve_app,
                   "payments: the payments API; conformance: the Idempotency-Key draft's "
                   "test routes (POST /echo, /status/{code}, /slow, /large; POST /resources "
                   "steered by X-Fixture-* fields; POST /_fixture/corrupt; GET /counter), "
                   "docs/conformance.md")
      ->check(CLI::IsMember({"payments", "conformance"}))
      ->capture_default_str();
  bool no_layer = false;
  serve->add_flag("--no-idempotency", no_layer,
                  "conformance only: serve the routes without idem (a baseline for load tests)");
  std::vector<CLI::Option*> fixture_flags;
  fixture_flags.push_back(serve->add_option(
      "--tenant-header", serve_options.fixture.tenant_header,
      "conformance only: the request field naming the caller; the tenant is its value before "
      "the first ':' and a request without it is 400 (default: none, one tenant)"));
  fixture_flags.push_back(serve
                              ->add_option("--replayed-header",
                                           serve_options.fixture.replayed_header,
                                           "conformance only: the replay marker's name")
                              ->capture_default_str());
  long long max_wait_ms = 10000;
  fixture_flags.push_back(serve
                              ->add_option("--max-wait-ms", max_wait_ms,
                                           "conformance only: under --policy wait, the longest a "
                                           "duplicate waits for the first before its 409")
                              ->check(CLI::Range(0LL, 3600LL * 1000))
                              ->capture_default_str());
  long long max_stored_body = -1;
  fixture_flags.push_back(
      serve
          ->add_option("--max-stored-body-bytes", max_stored_body,
                       "conformance only: the largest response body kept for replay; a larger "
                       "one is delivered whole, marked Idempotent-Not-Stored, and its key "
                       "released (default: no limit)")
          ->check(CLI::NonNegativeNumber));
  long long serve_ttl_s = 86400;
  serve
      ->add_option("--ttl", serve_ttl_s,
                   "Seconds a key is remembered (at least 60); maintenance purges it after")
      ->check(CLI::Range(60LL, 10LL * 365 * 86400))
      ->capture_default_str();
  long long serve_lease_ms = 30000;
  serve
      ->add_option("--lease-ms", serve_lease_ms,
                   "How long a server that died mid-request keeps its keys from the others")
      ->check(CLI::Range(30LL, 3600LL * 1000))
      ->capture_default_str();
  serve->add_option("--operator-key", serve_options.api.operator_key,
                    "Serve /metrics and /v1/provider/charges only to \"Authorization: Bearer "
                    "KEY\" (default: only to loopback clients)");
  long long max_connections = 0;
  serve
      ->add_option("--max-connections", max_connections,
                   "Connections open at once (0: the descriptor limit less 64)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  long long drain_ms = 10000;
  serve
      ->add_option("--drain-timeout-ms", drain_ms,
                   "After SIGINT/SIGTERM, how long requests in flight may finish (a second "
                   "signal stops at once)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();

  idem::demo::MigrateArgs migrate_args;
  CLI::App* migrate_cmd = app.add_subcommand(
      "migrate", "Copy a SQLite store's keys and undelivered outbox into PostgreSQL (rerunnable)");
  migrate_cmd->add_option("--from", migrate_args.from, "The SQLite store (file)")->required();
  migrate_cmd->add_option("--to", migrate_args.to, "PostgreSQL (libpq conninfo or URI)")
      ->required();
  migrate_cmd->add_option("--schema", migrate_args.schema, "PostgreSQL schema of idem's tables")
      ->capture_default_str();
  migrate_cmd->add_option("--batch", migrate_args.batch, "Records per transaction")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();

#ifdef IDEM_DEMO_GRPC
  idem::demo::GrpcServeArgs gs;
  std::string grpc_dedup = "on";
  CLI::App* grpc_serve = app.add_subcommand(
      "grpc-serve", "Serve the payments service of demo/grpc/payments.proto over gRPC");
  grpc_serve->add_option("--port", gs.port, "TCP port (0: any free port)")->capture_default_str();
  grpc_serve->add_option("--host", gs.host, "Address to bind")->capture_default_str();
  add_database(grpc_serve, gs.db, "Idempotency keys, orders and outbox");
  grpc_serve->add_option("--ledger", gs.ledger,
                         "Provider ledger and mail journal (SQLite file; default: in memory)");
  grpc_serve->add_option("--policy", gs.policy, "In-flight policy")
      ->check(CLI::IsMember({"wait", "raise"}))
      ->capture_default_str();
  grpc_serve->add_option("--provider-latency-ms", gs.provider_latency_ms, "Provider latency")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  grpc_serve->add_option("--provider-dedup", grpc_dedup, "Provider deduplicates on the derived key")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  grpc_serve
      ->add_option("--lease-ms", gs.lease_ms,
                   "How long a server that died mid-call keeps its keys from the others")
      ->check(CLI::Range(30LL, 3600LL * 1000))
      ->capture_default_str();
  grpc_serve->add_flag("--fail-closed", gs.fail_closed,
                       "Answer UNAVAILABLE instead of running when the store fails");

  idem::demo::GrpcCallArgs gc;
  CLI::App* grpc_call = app.add_subcommand(
      "grpc-call", "Call a grpc-serve once, with an idempotency key and retries that keep it");
  grpc_call->add_option("--target", gc.target, "host:port of the server")->required();
  grpc_call->add_option("--method", gc.method, "Which method")
      ->check(CLI::IsMember({"charge", "checkout"}))
      ->capture_default_str();
  grpc_call->add_option("--key", gc.key, "Idempotency key (default: a fresh UUID)");
  grpc_call->add_option("--api-key", gc.api_key, "API key (names the tenant)")
      ->capture_default_str();
  grpc_call->add_option("--amount", gc.amount, "Amount (minor units)")->capture_default_str();
  grpc_call->add_option("--currency", gc.currency, "Currency")->capture_default_str();
  grpc_call->add_option("--order-id", gc.order_id, "Order id")->capture_default_str();
  grpc_call->add_option("--attempts", gc.attempts, "The call and its retries with the same key")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  grpc_call->add_option("--deadline-ms", gc.deadline_ms, "Each attempt's deadline")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  grpc_call
      ->add_option("--parallel", gc.parallel,
                   "Make this many identical calls at once, with the same key (the article's 20)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
#endif

  CLI11_PARSE(app, argc, argv);

  try {
    if (charge->parsed()) {
      c.provider_dedup = dedup == "on";
      return idem::demo::run_charge(c);
    }
    if (simulate->parsed()) return idem::demo::run_simulate(sim);
#ifdef IDEM_DEMO_GRPC
    if (grpc_serve->parsed()) {
      gs.provider_dedup = grpc_dedup == "on";
      return idem::demo::run_grpc_serve(gs);
    }
    if (grpc_call->parsed()) return idem::demo::run_grpc_call(gc);
#endif
    if (ledger_cmd->parsed()) return idem::demo::run_ledger(ledger);
    if (migrate_cmd->parsed()) return idem::demo::run_migrate(migrate_args);
    if (checkout_cmd->parsed()) {
      k.provider_dedup = checkout_dedup == "on";
      return idem::demo::run_checkout(k);
    }
    if (dispatch_cmd->parsed()) return idem::demo::run_dispatch(dispatch_db, dispatch_ledger);
    if (serve->parsed()) {
      serve_options.api.policy =
          serve_policy == "wait" ? idem::InFlight::wait : idem::InFlight::raise;
      serve_options.api.provider_latency = std::chrono::milliseconds(serve_latency_ms);
      serve_options.api.provider_dedup = serve_dedup == "on";
      serve_options.api.replay_cache_bytes = replay_cache_mb << 20;
      serve_options.api.ttl = std::chrono::seconds(serve_ttl_s);
      serve_options.api.lease = std::chrono::milliseconds(serve_lease_ms);
      if (!api_keys_file.empty())
        serve_options.api.api_keys = idem::demo::load_api_keys(api_keys_file);
      serve_options.app = serve_app == "conformance" ? idem::demo::AppKind::conformance
                                                     : idem::demo::AppKind::payments;
      if (serve_options.app == idem::demo::AppKind::conformance &&
          idem::demo::is_postgresql(serve_options.api.db)) {
        std::cerr << "idem-demo: the conformance fixture keeps its keys in a SQLite file (--db)\n";
        return 2;
      }
      if (serve_options.app != idem::demo::AppKind::conformance) {
        for (const CLI::Option* flag : fixture_flags) {
          if (flag->count() > 0) {
            std::cerr << "idem-demo: " << flag->get_name()
                      << " is the conformance fixture's (--app "
                      << "conformance)\n";
            return 2;
          }
        }
      }
      if (serve_options.fixture.replayed_header.empty()) {
        std::cerr << "idem-demo: --replayed-header needs a name\n";
        return 2;
      }
      serve_options.fixture.max_wait = std::chrono::milliseconds(max_wait_ms);
      if (max_stored_body >= 0)
        serve_options.fixture.max_stored_body = static_cast<std::size_t>(max_stored_body);
      serve_options.idempotency_layer = !no_layer;
      serve_options.max_connections = static_cast<std::size_t>(max_connections);
      serve_options.drain_timeout = std::chrono::milliseconds(drain_ms);
      serve_options.handle_signals = true;
      idem::demo::Server server(serve_options);
      std::cerr << "idem-demo: serving " << serve_app << " on http://" << serve_options.host << ':'
                << server.port() << " (policy " << serve_policy << "; Ctrl-C stops)" << std::endl;
      if (!server.run()) {
        std::cerr << "idem-demo: stopped with requests unanswered" << std::endl;
        return 1;
      }
      std::cerr << "idem-demo: stopped" << std::endl;
      return 0;
    }
    std::cout << idem::demo::render_table(real_time, timeline);
    if (!svg_dir.empty()) {
      for (const auto& path : idem::demo::write_table_figures(svg_dir))
        std::cout << "wrote " << path.string() << '\n';
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "idem-demo: " << e.what() << '\n';
    return 1;
  }
}
