// An `idem-demo serve` server (either app) on a loopback port in this process, for the HTTP
// tests, and a bounded wait for what another thread makes true.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "server.hpp"
#include "test_support.hpp"

namespace idem::test {

using Headers = std::vector<std::pair<std::string, std::string>>;

struct Served {
  TempDir dir;
  std::string db = dir.file("server.db");
  std::unique_ptr<demo::Server> server;
  std::thread thread;

  explicit Served(demo::ServerOptions options) {
    options.port = 0;
    options.api.db = db;
    server = std::make_unique<demo::Server>(std::move(options));
    thread = std::thread([this] { server->run(); });
  }
  ~Served() {
    server->stop();
    thread.join();
  }
  unsigned short port() const { return server->port(); }
};

// Polls `done` until it holds or `bound` passes (a failure bound, not a measurement).
template <class Predicate>
bool eventually(Predicate done, std::chrono::seconds bound = std::chrono::seconds(30)) {
  const auto give_up = std::chrono::steady_clock::now() + bound;
  while (!done()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::yield();
  }
  return true;
}

}  // namespace idem::test
