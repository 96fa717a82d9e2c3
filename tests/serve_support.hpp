// An `idem-demo serve` server (either app) on a loopback port in this process or as a child
// process, for the HTTP tests, and bounded waits for what another thread or process makes
// true.
#pragma once

#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "demo_process.hpp"
#include "server.hpp"
#include "test_support.hpp"

namespace idem::test {

using Headers = std::vector<std::pair<std::string, std::string>>;

// The database of a test's server: a SQLite file in `dir`, or, when the suite runs on
// PostgreSQL (IDEM_TEST_ENGINE=postgresql), a fresh database on the test server.
inline std::string server_database(const TempDir& dir) {
  return worlds_on_postgresql() ? fresh_pg_database() : dir.file("server.db");
}

struct Served {
  TempDir dir;
  std::string db;
  std::unique_ptr<demo::Server> server;
  std::thread thread;

  // options.api.db empty: a fresh database (server_database); else the caller's. `db` names it.
  explicit Served(demo::ServerOptions options) {
    options.port = 0;
    db = options.api.db.empty() ? server_database(dir) : options.api.db;
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

}  // namespace idem::test
