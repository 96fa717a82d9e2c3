// The payments API of `idem-demo serve`: seed 000's design (POST /v1/payments with an
// Idempotency-Key, tenants from API keys, 400/401/402/409/422/502/503/504) behind idem's
// HTTP layer (idem/beast.hpp). Only what is about payments lives here: authentication,
// validation, the provider, the payments table; everything idempotency-shaped is the layer's.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "app.hpp"
#include "idem/asio.hpp"
#include "idem/coordinator.hpp"

namespace idem::sim {
class MailSender;
class Provider;
}  // namespace idem::sim

namespace idem::demo {

struct ApiOptions {
  // Idempotency keys, payments and the outbox: a SQLite file, or a postgresql:// URI for a
  // database several servers share (database.hpp).
  std::string db;
  std::string ledger;                 // provider ledger; empty: in memory
  InFlight policy = InFlight::raise;  // a public API should not hold connections
  std::chrono::milliseconds provider_latency{300};
  // The provider deduplicates on the key it is given (the debit step's derived key). Off, a
  // second debit of the same payment is a second charge: what tests count to see that idem,
  // not the provider, kept it to one.
  bool provider_dedup = true;
  bool fail_closed = false;
  // API key -> tenant. Empty: the two demo keys sk_test_alpha -> alpha, sk_test_beta -> beta.
  std::map<std::string, std::string> api_keys{};
  std::chrono::milliseconds ttl{std::chrono::hours(24)};
  // How long a server that died mid-request keeps its keys from the others (Options::lease;
  // renewed every third of it while the request runs).
  std::chrono::milliseconds lease{std::chrono::seconds(30)};
  std::chrono::milliseconds store_busy_timeout{std::chrono::seconds(5)};
  // Who reads the operator routes (/metrics, /v1/provider/charges, every tenant's data).
  // Empty: clients connecting from operator_addresses, without a tenant's API key. Set:
  // only requests bearing "Authorization: Bearer <operator_key>".
  std::string operator_key{};
  std::vector<std::string> operator_addresses{"127.0.0.1", "::1"};
  // Purge, reap, the completer and the outbox dispatcher (to the mail sender, whose journal
  // is the ledger file, or memory), on their own thread.
  MaintenanceOptions maintenance{};
  // false: no maintenance loop (a test runs PaymentsApi::maintenance().run_once() itself).
  bool maintenance_loop = true;
  // Every time of the API (keys, provider, mail, maintenance). Default: the system clock.
  std::shared_ptr<Clock> clock{};
  // Completed records held in memory in front of the store (idem::ReplayCache), in bytes;
  // 0: none. Its counters join /metrics.
  std::size_t replay_cache_bytes = 0;
};

// Reads "api_key tenant" lines ('#' starts a comment). Throws std::runtime_error naming the
// line that is not of that form, a key given twice, or a file with no key at all (it never
// falls back to the public demo keys).
std::map<std::string, std::string> load_api_keys(const std::string& path);

// Thread-safety: one PaymentsApi serves the coroutines of one io_context thread.
class PaymentsApi final : public App {
 public:
  explicit PaymentsApi(ApiOptions options);
  ~PaymentsApi() override;
  PaymentsApi(const PaymentsApi&) = delete;
  PaymentsApi& operator=(const PaymentsApi&) = delete;

  // Routes one request. Never throws for bad input: every failure is a problem+json answer.
  boost::asio::awaitable<Reply> handle(Request request, Peer peer) override;

  Coordinator& coordinator() noexcept;
  sim::Provider& provider() noexcept;
  sim::MailSender& mail() noexcept;
  Maintenance& maintenance() noexcept;

  // Stops the maintenance task and waits for it and the operator thread's work to finish
  // (the server calls it before its io_context goes).
  void join_background();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem::demo
