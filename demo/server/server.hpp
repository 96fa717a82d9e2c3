// `idem-demo serve`: the payments API over HTTP/1.1 on Boost.Beast and Asio coroutines.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "payments_api.hpp"

namespace idem::demo {

struct ServerOptions {
  std::string host = "127.0.0.1";  // loopback unless told otherwise
  unsigned short port = 8080;      // 0: any free port (see Server::port())
  ApiOptions api;
  std::size_t body_limit = 64 * 1024;   // larger bodies: 413, connection closed
  std::size_t header_limit = 8 * 1024;  // larger header sections: 431, connection closed
  // A request must arrive whole within read_timeout of its first byte; a keep-alive
  // connection with no request for idle_timeout is closed.
  std::chrono::milliseconds read_timeout{std::chrono::seconds(10)};
  std::chrono::milliseconds idle_timeout{std::chrono::seconds(30)};
  bool handle_signals = false;  // SIGINT/SIGTERM stop the server gracefully
};

// Thread-safety: run() on one thread; stop() from any thread (or a signal).
class Server {
 public:
  // Opens the API's databases and listens. Throws on failure (port taken, bad database).
  explicit Server(ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  unsigned short port() const noexcept;

  // Serves until stop(): then stops accepting, lets every request in flight finish and be
  // answered, closes idle connections, and returns.
  void run();
  void stop();

  PaymentsApi& api() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem::demo
