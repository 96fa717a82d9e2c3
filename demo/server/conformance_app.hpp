// `idem-demo serve --app conformance`: routes behind idem's HTTP layer for checking it, or any
// peer's scenario suite, against draft-ietf-httpapi-idempotency-key-header (and for load
// tests). No authentication; one tenant, or the caller's from a request field
// (FixtureOptions::tenant_header); the key required on POST and PATCH. docs/conformance.md
// is the whole reference.
//   POST /echo          201, the request's body bytes and Content-Type (default
//                       application/octet-stream)
//   POST /status/{code} that status (200..599), body "status:{code}", text/plain
//   POST /slow?ms=N     waits N ms (0..60000) without blocking other requests; 200 "slept:N"
//   POST /large?bytes=N 200, N bytes of 'x' (0..16 MiB), application/octet-stream
//   POST /resources, POST /resources/...  (and PATCH): a handler steered per request by
//                       X-Fixture-* fields, which are not part of the fingerprint:
//                       X-Fixture-Status (default 201), X-Fixture-Delay-Ms,
//                       X-Fixture-Header "Name: value" (repeatable), X-Fixture-Body-Bytes,
//                       X-Fixture-Chunked: 1, X-Fixture-Crash: after-claim (SIGKILL inside
//                       the handler, after the key was reserved). Default body: JSON with
//                       the tenant, the key, the run count and the request body.
//   GET  /counter       200 {"count": n}: how many times the five routes above ran (behind
//                       the layer, which passes GETs through: a key on it is ignored)
//   POST /reset         204, the counter set to 0 (outside the layer, no key needed)
//   POST /_fixture/corrupt  loopback peers only: damages a stored record (its headers column
//                       no longer JSON) outside the layer; 204 damaged, 404 no such record
//   GET  /idempotency   200, the layer's published policy (Layer::policy())
//   GET  /metrics       200, the coordinator's counters (Prometheus text)
//   GET  /healthz       200
// A malformed route parameter or control field is a 400 before the layer: nothing runs,
// nothing is stored. Bodies over 1 MiB are kept by reference in a FilePayloadStore beside
// the database.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "app.hpp"
#include "idem/coordinator.hpp"
#include "idem/http.hpp"

namespace idem::demo {

// What only the fixture has (serve's --tenant-header, --replayed-header, --max-wait-ms,
// --max-stored-body-bytes).
struct FixtureOptions {
  // The request field that names the caller: the tenant is its value before the first ':'
  // ("tenant-A:user-1" is tenant-A). A request to a route behind the layer without it (or
  // with it twice, or with an empty tenant) is 400 invalid_request. Default: empty, one
  // tenant ("default") for every caller.
  std::string tenant_header{};
  // The replay marker's name (LayerOptions::replayed_header). Default: Idempotent-Replayed.
  std::string replayed_header{kReplayedHeader};
  // InFlight::wait: the longest a duplicate waits for the first before its 409
  // (Options::max_wait). Default: 10 s.
  std::chrono::milliseconds max_wait{std::chrono::seconds(10)};
  // The largest response body kept for replay (LayerOptions::max_stored_body): a larger one
  // is delivered whole with "Idempotent-Not-Stored: body-too-large" and the key released.
  // Default: nullopt, no limit.
  std::optional<std::size_t> max_stored_body{};
};

struct ConformanceOptions {
  std::string db;  // idempotency keys (SQLite file); large bodies in "<db>.payloads/"
  InFlight policy = InFlight::raise;
  bool fail_closed = false;
  bool layer = true;  // false: the same routes with no idempotency at all (a bare baseline)
  // How long a completed key is replayed (Options::ttl; at least a minute). Default: 24 h.
  std::chrono::milliseconds ttl{std::chrono::hours(24)};
  // How long a process that died mid-request keeps its keys (Options::lease; renewed every
  // third of it while the handler runs). Default: 30 s.
  std::chrono::milliseconds lease{std::chrono::seconds(30)};
  FixtureOptions fixture{};
  // With layer false: idempotency written by hand instead, the way a service without idem
  // would write seed 000's SQL (sql::kHandReserve...: insert the key or find it, run, store
  // the answer; each statement its own transaction, on the io thread, in a table of its own
  // in the same file). No lease, no expiry, no headers kept: a floor for scripts/bench's http
  // section, not a guarantee (a crash mid-request leaves its key in flight for ever).
  bool handwritten = false;
  // Completed records held in memory in front of the store (idem::ReplayCache), in bytes;
  // 0: none. Its counters join /metrics.
  std::size_t replay_cache_bytes = 0;
};

class ConformanceApp final : public App {
 public:
  explicit ConformanceApp(ConformanceOptions options);
  ~ConformanceApp() override;
  boost::asio::awaitable<Reply> handle(Request request, Peer peer) override;

  Coordinator& coordinator() noexcept;
  long long count() const noexcept;  // runs of the counted routes

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem::demo
