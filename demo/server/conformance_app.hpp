// `idem-demo serve --app conformance`: a fixed set of routes behind idem's HTTP layer, for
// checking the layer against draft-ietf-httpapi-idempotency-key-header (and for load tests).
// No authentication, one tenant, the key required on POST:
//   POST /echo          201, the request's body bytes and Content-Type (default
//                       application/octet-stream)
//   POST /status/{code} that status (200..599), body "status:{code}", text/plain
//   POST /slow?ms=N     waits N ms (0..60000) without blocking other requests; 200 "slept:N"
//   POST /large?bytes=N 200, N bytes of 'x' (0..16 MiB), application/octet-stream
//   GET  /counter       200 {"count": n}: how many times the four routes above ran (behind
//                       the layer, which passes GETs through: a key on it is ignored)
//   POST /reset         204, the counter set to 0 (outside the layer, no key needed)
//   GET  /idempotency   200, the layer's published policy (Layer::policy())
//   GET  /healthz       200
// Bodies over 1 MiB are kept by reference in a FilePayloadStore beside the database.
#pragma once

#include <memory>
#include <string>

#include "app.hpp"
#include "idem/coordinator.hpp"

namespace idem::demo {

struct ConformanceOptions {
  std::string db;  // idempotency keys (SQLite file); large bodies in "<db>.payloads/"
  InFlight policy = InFlight::raise;
  bool fail_closed = false;
  bool layer = true;  // false: the same routes with no idempotency at all (a bare baseline)
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
