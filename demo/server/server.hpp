// `idem-demo serve`: HTTP/1.1 on Boost.Beast and Asio coroutines, carrying the payments API
// (payments_api.hpp) or the conformance fixture (conformance_app.hpp).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "conformance_app.hpp"
#include "payments_api.hpp"

namespace idem::demo {

enum class AppKind { payments, conformance };

struct ServerOptions {
  std::string host = "127.0.0.1";  // loopback unless told otherwise
  unsigned short port = 8080;      // 0: any free port (see Server::port())
  AppKind app = AppKind::payments;
  // The payments API; its db, policy, fail_closed, ttl and lease serve both apps.
  ApiOptions api;
  bool idempotency_layer = true;  // conformance only: false serves its routes without idem
  bool handwritten = false;  // conformance only, without the layer: by hand (ConformanceOptions)
  FixtureOptions fixture{};  // conformance only: tenant field, replay marker, limits
  std::size_t body_limit = 64 * 1024;   // larger bodies: 413, connection closed
  std::size_t header_limit = 8 * 1024;  // larger header sections: 431, connection closed
  // A request must arrive whole within read_timeout of its first byte; a keep-alive
  // connection with no request for idle_timeout is closed.
  std::chrono::milliseconds read_timeout{std::chrono::seconds(10)};
  std::chrono::milliseconds idle_timeout{std::chrono::seconds(30)};
  // Connections open at once. 0: the process's file-descriptor limit less 64 (kept for the
  // databases and the server itself). At the cap, a new connection closes the connection
  // idle the longest; when none is idle, new connections wait in the listen backlog. A
  // failed accept (descriptors gone all the same) backs off from 5 ms to 1 s.
  std::size_t max_connections = 0;
  // After stop() (or SIGINT/SIGTERM), requests in flight get this long to be answered;
  // then, or at a second signal, the server stops without them (their keys stay reserved
  // until their leases end, as after a crash).
  std::chrono::milliseconds drain_timeout{std::chrono::seconds(10)};
  bool handle_signals = false;  // SIGINT/SIGTERM stop the server gracefully
};

// Thread-safety: run() on one thread; stop() from any thread (or a signal).
class Server {
 public:
  // Opens the app's databases and listens. Throws on failure (port taken, bad database).
  explicit Server(ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  unsigned short port() const noexcept;
  std::size_t max_connections() const noexcept;

  // Serves until stop(): then stops accepting, lets every request in flight finish and be
  // answered (for up to drain_timeout), closes idle connections, and returns. Returns
  // false if it stopped with requests still unanswered (the drain bound or a second signal).
  bool run();
  void stop();

  PaymentsApi& api();             // throws std::logic_error under AppKind::conformance
  ConformanceApp& conformance();  // throws std::logic_error under AppKind::payments

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem::demo
