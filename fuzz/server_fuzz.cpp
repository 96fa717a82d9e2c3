// Fuzz target: the demo server's request path, from raw bytes to the bytes of the answer.
//
// The input is what a client sends on one connection: one or more pipelined HTTP/1.1
// requests. Each is parsed as `idem-demo serve` parses it (Beast's request parser with the
// server's body and header limits; a malformed request is 400, too large 413/431, and ends
// the connection), handed to the same PaymentsApi (its HTTP layer, SQLite store in a file,
// the simulated provider with no latency, a simulated clock) on an io_context driven on
// simulated time, and its reply finished and serialised as the server sends it (HEAD
// without body). Properties: every complete request gets exactly one answer; its status
// is 100..599; the answer's bytes parse back as an HTTP response with the same status; the
// API never throws; a replay or a 4xx charges nothing and no request charges twice.
// IDEM_FUZZ_TRACE=1 in the environment prints each request's status and body.
#include <unistd.h>

#include <utility>  // Boost 1.74's awaitable.hpp needs std::exchange declared first

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

#include "fuzz_support.hpp"
#include "idem/sim/driver.hpp"
#include "idem/sim/provider.hpp"
#include "idem/sim/simulated_clock.hpp"
#include "payments_api.hpp"

namespace {

namespace fs = std::filesystem;
namespace bh = boost::beast::http;
using idem::fuzz::require;

// The server's limits (ServerOptions' defaults).
constexpr std::size_t kBodyLimit = 64 * 1024;
constexpr std::uint32_t kHeaderLimit = 8 * 1024;
// Pipelined requests answered per input at most.
constexpr int kMaxRequests = 8;
// Inputs served by one API before a fresh one (a fresh database) replaces it.
constexpr std::size_t kInputsPerApi = 2048;

// A directory of the target's own for the API's database, removed at exit.
struct TempDir {
  fs::path path;
  TempDir() {
    const fs::path base = fs::exists("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    std::string tmpl = (base / "idem-server-fuzz-XXXXXX").string();
    require(::mkdtemp(tmpl.data()) != nullptr, "a temporary directory can be made");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

struct World {
  TempDir dir;
  // One io_context for the whole run, as in the server: the operator routes' thread posts
  // back to it, and may still be letting go of it after the reply is out. Its work is held
  // for the whole run, as the server's pending accept holds it: otherwise that thread's late
  // release can find the count at zero and stop the context after serve() restarted it,
  // and run_one() returns 0 under a request that is only waiting for that thread.
  boost::asio::io_context io;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> busy{io.get_executor()};
  std::shared_ptr<idem::sim::SimulatedClock> clock;
  std::unique_ptr<idem::demo::PaymentsApi> api;
  std::size_t inputs = 0;
  std::size_t generation = 0;

  void renew() {
    api.reset();
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir.path, ec)) fs::remove(entry.path(), ec);
    clock = std::make_shared<idem::sim::SimulatedClock>();
    idem::demo::ApiOptions o;
    o.db = (dir.path / ("api-" + std::to_string(generation++) + ".db")).string();
    o.provider_latency = std::chrono::milliseconds(0);
    o.maintenance_loop = false;
    o.clock = clock;
    api = std::make_unique<idem::demo::PaymentsApi>(o);
  }
  idem::demo::PaymentsApi& next() {
    if (inputs++ % kInputsPerApi == 0) renew();
    return *api;
  }
};

// The reply as the server writes it (finish_reply, then the bytes Server::Impl::send writes).
std::string send(idem::demo::Reply res, bool keep_alive, bool head) {
  idem::demo::finish_reply(res, keep_alive);
  std::ostringstream out;
  if (head) {
    out << bh::response<bh::empty_body>{std::move(res.base())};
  } else {
    out << res;
  }
  return out.str();
}

// Checks the bytes sent: a whole HTTP response with `status` (a HEAD answer has no body).
void check_sent(const std::string& bytes, unsigned status, bool head) {
  bh::response_parser<bh::string_body> parser;
  parser.eager(true);
  parser.skip(head);
  parser.body_limit(bytes.size());
  boost::beast::error_code ec;
  std::size_t used = 0;
  while (!ec && !parser.is_done() && used < bytes.size()) {
    const std::size_t n =
        parser.put(boost::asio::buffer(bytes.data() + used, bytes.size() - used), ec);
    if (n == 0) break;
    used += n;
  }
  if (!parser.is_done() && !ec) parser.put_eof(ec);
  require(!ec && parser.is_done(), "the answer's bytes are one whole HTTP response");
  require(used == bytes.size(), "the answer's bytes hold nothing after the response");
  require(parser.get().result_int() == status, "the answer's bytes carry its status");
}

// Runs the API on one request until its reply is ready.
idem::demo::Reply serve(boost::asio::io_context& io, idem::demo::PaymentsApi& api,
                        idem::sim::SimulatedClock& clock, idem::demo::Request req) {
  std::optional<idem::demo::Reply> reply;
  std::exception_ptr threw;
  boost::asio::co_spawn(io, api.handle(std::move(req), idem::demo::Peer{"127.0.0.1"}),
                        [&](std::exception_ptr e, idem::demo::Reply r) {
                          threw = e;
                          if (!e) reply = std::move(r);
                        });
  for (;;) {
    idem::sim::run(io, clock);  // every handler, on simulated time
    if (reply || threw) break;
    // Work on another thread (the operator routes' reads) posts back to `io`. Within 5 s:
    // a reply that never comes is a finding with this message, before libFuzzer's timeout.
    io.restart();
    require(io.run_one_for(std::chrono::seconds(5)) > 0,
            "a request in flight always gets its reply");
  }
  require(!threw, "the API never throws for a request");
  return std::move(*reply);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static World world;
  idem::demo::PaymentsApi& api = world.next();
  const char* bytes = reinterpret_cast<const char*>(data);
  std::size_t used = 0;
  for (int n = 0; n < kMaxRequests && used < size; ++n) {
    bh::request_parser<bh::string_body> parser;
    parser.eager(true);
    parser.body_limit(kBodyLimit);
    parser.header_limit(kHeaderLimit);
    boost::beast::error_code ec;
    while (!parser.is_done()) {
      const std::size_t got = parser.put(boost::asio::buffer(bytes + used, size - used), ec);
      used += got;
      if (ec || got == 0 || used == size) break;
    }
    if (ec == bh::error::need_more || (!ec && !parser.is_done())) {
      // The client stopped mid-request: the server waits, times out and closes, answering
      // nothing (the end of the stream is a partial message).
      return 0;
    }
    if (ec) {
      if (std::optional<idem::demo::Reply> answer = idem::demo::read_failure(ec)) {
        const unsigned status = answer->result_int();
        check_sent(send(std::move(*answer), false, false), status, false);
      }
      return 0;  // the server closes the connection
    }
    idem::demo::Request req = parser.release();
    const bool client_keep_alive = req.keep_alive();
    const bool head = req.method() == bh::verb::head;
    if (head) req.method(bh::verb::get);
    const std::size_t charges_before = api.provider().charge_count();
    idem::demo::Reply reply = serve(world.io, api, *world.clock, std::move(req));
    const unsigned status = reply.result_int();
    if (std::getenv("IDEM_FUZZ_TRACE") != nullptr) {
      std::fprintf(stderr, "server_fuzz: request %d -> %u %s\n", n, status, reply.body().c_str());
    }
    require(status >= 100 && status <= 599, "the status is 100..599");
    const std::size_t charges = api.provider().charge_count() - charges_before;
    require(charges <= 1, "one request charges at most once");
    if (reply["Idempotent-Replayed"] == "true" || (status >= 400 && status < 500)) {
      require(charges == 0, "a replay or a refusal charges nothing");
    }
    const bool keep_alive = client_keep_alive && reply.keep_alive();
    check_sent(send(std::move(reply), keep_alive, head), status, head);
    if (!keep_alive) return 0;
  }
  return 0;
}
