// The HTTP section: requests per second through the demo server's conformance app on the same
// HTTP stack three ways: with idem's layer; with idempotency written by hand (seed 000's SQL
// around the handler, ConformanceOptions::handwritten: what a user would write instead); and
// bare (the handler alone, nothing stored: what answering costs). Each ratio is the median of
// back-to-back pairs, the three servers running side by side and measured one at a time, in an
// order that turns by one each round (in_turn).
#include <utility>  // before Asio (Boost 1.74)

#include <fmt/format.h>
#include <algorithm>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench.hpp"
#include "http_bench.hpp"
#include "server.hpp"

namespace idem::bench {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using nlohmann::json;
using namespace std::chrono_literals;

using HttpReq = http::request<http::string_body>;
using HttpRes = http::response<http::string_body>;

const std::string kBody = R"({"n":1})";

// Any answer the bench did not expect ends it: counting a wrong answer as throughput would lie.
[[noreturn]] void fail(const std::string& what) { throw std::runtime_error("http bench: " + what); }

std::string str(beast::string_view s) { return {s.data(), s.size()}; }

std::string describe(const HttpRes& res) {
  return fmt::format("{} {}", res.result_int(), res.body().substr(0, 200));
}

HttpReq http_post(const std::string& target, const std::string& key) {
  HttpReq req{http::verb::post, target, 11};
  req.set(http::field::host, "127.0.0.1");
  req.set(http::field::content_type, "application/json");
  req.set("Idempotency-Key", key);
  req.body() = kBody;
  req.prepare_payload();
  return req;
}

HttpReq http_get(const std::string& target) {
  HttpReq req{http::verb::get, target, 11};
  req.set(http::field::host, "127.0.0.1");
  return req;
}

// How a server guards its routes (cached: the layer over idem::ReplayCache).
enum class Guard { layer, cached, handwritten, bare };

const char* name_of(Guard g) {
  return g == Guard::layer         ? "layer"
         : g == Guard::cached      ? "layer + replay cache"
         : g == Guard::handwritten ? "by hand"
                                   : "bare";
}

// The server on its own thread, on a fresh database; stopped and joined however the bench
// leaves (an abort included).
class ServerThread {
 public:
  ServerThread(const std::string& dir, Guard guard)
      : server_(options(dir, guard)), thread_([this] { server_.run(); }) {}
  ~ServerThread() {
    server_.stop();
    thread_.join();
  }
  ServerThread(const ServerThread&) = delete;
  ServerThread& operator=(const ServerThread&) = delete;

  unsigned short port() const noexcept { return server_.port(); }

 private:
  static demo::ServerOptions options(const std::string& dir, Guard guard) {
    demo::ServerOptions o;
    o.port = 0;
    o.app = demo::AppKind::conformance;
    o.idempotency_layer = guard == Guard::layer || guard == Guard::cached;
    o.handwritten = guard == Guard::handwritten;
    if (guard == Guard::cached) o.api.replay_cache_bytes = std::size_t{64} << 20;
    o.api.db = dir + (guard == Guard::layer         ? "/http-layer.db"
                      : guard == Guard::cached      ? "/http-cached.db"
                      : guard == Guard::handwritten ? "/http-hand.db"
                                                    : "/http-bare.db");
    for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(o.api.db + suffix);
    return o;
  }
  demo::Server server_;
  std::thread thread_;
};

// One keep-alive connection of the client.
struct Conn {
  beast::tcp_stream stream;
  beast::flat_buffer buffer;
  explicit Conn(net::io_context& io) : stream(io) {}
};

// One request and its answer. A transport error (a closed connection, a silent server) ends
// the bench like a wrong status does.
net::awaitable<HttpRes> round_trip(Conn& c, const HttpReq& req,
                                   std::chrono::milliseconds timeout = 10s) {
  beast::error_code ec;
  c.stream.expires_after(timeout);
  co_await http::async_write(c.stream, req, net::redirect_error(net::use_awaitable, ec));
  HttpRes res;
  if (!ec) {
    co_await http::async_read(c.stream, c.buffer, res, net::redirect_error(net::use_awaitable, ec));
  }
  if (ec) {
    fail(fmt::format("{} {}: {}", str(req.method_string()), str(req.target()), ec.message()));
  }
  co_return res;
}

// GET /counter: how many times a POST handler has run on the server.
net::awaitable<std::uint64_t> read_counter(Conn& c) {
  const HttpReq req = http_get("/counter");
  const HttpRes res = co_await round_trip(c, req);
  const json j = json::parse(res.body(), nullptr, false);
  if (res.result_int() != 200 || !j.is_object() || !j.contains("count") ||
      !j.at("count").is_number_unsigned()) {
    fail("GET /counter: expected 200 {\"count\": n}, got " + describe(res));
  }
  co_return j.at("count").get<std::uint64_t>();
}

// The client: one io_context on the bench thread, connections to one server.
class Client {
 public:
  explicit Client(unsigned short port) : endpoint_(net::ip::make_address("127.0.0.1"), port) {}

  std::unique_ptr<Conn> connect() {
    auto c = std::make_unique<Conn>(io_);
    c->stream.connect(endpoint_);
    return c;
  }
  std::vector<std::unique_ptr<Conn>> connect(std::size_t n) {
    std::vector<std::unique_ptr<Conn>> out;
    for (std::size_t i = 0; i < n; ++i) out.push_back(connect());
    return out;
  }

  // A coroutine, or a function object returning one; what it throws leaves run().
  template <class F>
  void spawn(F&& f) {
    net::co_spawn(io_, std::forward<F>(f), [](std::exception_ptr e) {
      if (e) std::rethrow_exception(e);
    });
  }

  // Until everything spawned has finished.
  void run() {
    io_.restart();
    io_.run();
  }

  std::uint64_t counter() {
    auto c = connect();
    std::uint64_t n = 0;
    spawn([&]() -> net::awaitable<void> { n = co_await read_counter(*c); });
    run();
    return n;
  }

 private:
  net::io_context io_{1};
  tcp::endpoint endpoint_;
};

// The server's own count of handler runs must match what the answers claim.
void expect_ran(Client& client, std::uint64_t before, std::uint64_t expected,
                const std::string& phase) {
  const std::uint64_t after = client.counter();
  if (after != before + expected) {
    fail(fmt::format("{}: GET /counter went from {} to {}; the answers say {} handler runs", phase,
                     before, after, expected));
  }
}

// What every answer of a phase must be.
using Check = std::function<void(const HttpRes&)>;

// 201 echoing the body; with `replayed`, marked Idempotent-Replayed: true, without it not
// marked (a request that should have run: a replay would mean keys collided).
Check echoed(const std::string& phase, bool replayed) {
  return [phase, replayed](const HttpRes& res) {
    const bool marked = res["Idempotent-Replayed"] == "true";
    if (res.result_int() != 201 || res.body() != kBody || marked != replayed) {
      fail(fmt::format("{}: expected 201 echoing {}{}, got {}{}", phase, kBody,
                       replayed ? " with Idempotent-Replayed: true" : ", not replayed",
                       describe(res), marked ? " (replayed)" : ""));
    }
  };
}

Check conflicted(const std::string& phase) {
  return [phase](const HttpRes& res) {
    if (res.result_int() != 409 || res.find(http::field::retry_after) == res.end())
      fail(fmt::format("{}: expected 409 with Retry-After, got {}", phase, describe(res)));
  };
}

// Requests back to back on one connection until `deadline`, every answer checked.
net::awaitable<void> drive(Conn& c, std::function<HttpReq(std::size_t)> next, Check check,
                           Clock::time_point deadline, Lane& lane) {
  for (std::size_t n = 0; Clock::now() < deadline; ++n) {
    const HttpReq req = next(n);
    const auto t = Clock::now();
    const HttpRes res = co_await round_trip(c, req);
    lane.latencies_us.push_back(micros_since(t));
    check(res);
  }
  lane.ended = Clock::now();
}

// A number no phase of this process has used: keys carry it, so one server serves every phase.
std::size_t next_run() {
  static std::size_t runs = 0;
  return runs++;
}

// Every request a new key: the handler runs every time (with the layer: reserve, run, store).
Stats fresh(Client& client, const std::string& server, std::size_t width,
            std::chrono::milliseconds duration) {
  auto conns = client.connect(width);
  std::vector<Lane> lanes(width);
  const std::string phase = fmt::format("{} fresh at {} connections", server, width);
  const Check check = echoed(phase, false);
  const std::uint64_t before = client.counter();
  const auto t0 = Clock::now();
  for (std::size_t i = 0; i < width; ++i) {
    auto next = [run = next_run(), i](std::size_t n) {
      return http_post("/echo", fmt::format("fresh-{}-{}-{}", run, i, n));
    };
    client.spawn(drive(*conns[i], next, check, t0 + duration, lanes[i]));
  }
  client.run();
  const Stats s = collect(lanes, t0);
  expect_ran(client, before, s.calls, phase);
  return s;
}

// Each connection runs its own key once (not measured), then repeats that request: with the
// layer every repeat is the stored answer; on the bare server every repeat runs again.
Stats replay(Client& client, const std::string& server, bool layer, std::size_t width,
             std::chrono::milliseconds duration) {
  auto conns = client.connect(width);
  std::vector<Lane> lanes(width);
  std::vector<HttpReq> reqs;
  for (std::size_t i = 0; i < width; ++i)
    reqs.push_back(http_post("/echo", fmt::format("replay-{}-{}", next_run(), i)));
  const std::string phase = fmt::format("{} replay at {} connections", server, width);
  const Check first = echoed(phase + " (first request)", false);
  const Check again = echoed(phase, layer);
  const std::uint64_t before = client.counter();
  for (std::size_t i = 0; i < width; ++i) {
    client.spawn([&, i]() -> net::awaitable<void> {
      const HttpRes res = co_await round_trip(*conns[i], reqs[i]);
      first(res);
    });
  }
  client.run();
  const auto t0 = Clock::now();
  for (std::size_t i = 0; i < width; ++i) {
    auto next = [&req = reqs[i]](std::size_t) { return req; };
    client.spawn(drive(*conns[i], next, again, t0 + duration, lanes[i]));
  }
  client.run();
  const Stats s = collect(lanes, t0);
  expect_ran(client, before, layer ? width : width + s.calls, phase);
  return s;
}

// A holder's POST /slow stays in flight past the measurement; `width` connections repeat its
// request and must each get 409 at once, without running the handler.
Stats storm(Client& client, std::size_t width, std::chrono::milliseconds duration) {
  const std::chrono::milliseconds ms = duration + 2000ms;
  const HttpReq slow =
      http_post(fmt::format("/slow?ms={}", ms.count()), fmt::format("storm-{}", width));
  auto holder = client.connect();
  auto control = client.connect();
  auto conns = client.connect(width);
  std::vector<Lane> lanes(width);
  const std::string phase = fmt::format("409 storm at {} connections", width);
  const Check check = conflicted(phase);
  const std::uint64_t before = client.counter();
  HttpRes held;
  client.spawn(
      [&]() -> net::awaitable<void> { held = co_await round_trip(*holder, slow, ms + 10s); });
  Clock::time_point t0;
  client.spawn([&]() -> net::awaitable<void> {
    // The key is in flight once the counter moves (the holder's handler has started).
    net::steady_timer pause(co_await net::this_coro::executor);
    const auto give_up = Clock::now() + 10s;
    for (;;) {
      const std::uint64_t ran = co_await read_counter(*control);
      if (ran == before + 1) break;
      if (ran > before + 1 || Clock::now() > give_up) {
        fail(fmt::format("{}: waiting for the holder's handler, GET /counter went from {} to {}",
                         phase, before, ran));
      }
      pause.expires_after(1ms);
      co_await pause.async_wait(net::use_awaitable);
    }
    t0 = Clock::now();
    for (std::size_t i = 0; i < width; ++i) {
      auto next = [&slow](std::size_t) { return slow; };
      client.spawn(drive(*conns[i], next, check, t0 + duration, lanes[i]));
    }
  });
  client.run();  // returns once the holder is answered too
  if (held.result_int() != 200) fail(phase + ": the holder expected 200, got " + describe(held));
  const Stats s = collect(lanes, t0);
  expect_ran(client, before, 1, phase);
  return s;
}

// The `turn`-th of `items` measured in round `round`: the order turns by one each round, so
// that a drift of the machine's speed within a round does not always fall on the same server.
template <class T, std::size_t N>
const T& in_turn(const T (&items)[N], std::size_t turn, std::size_t round) {
  return items[(turn + round) % N];
}

}  // namespace

json run_http(bool quick, const std::string& dir, std::ostream* human) {
  const std::chrono::milliseconds duration = quick ? 1s : 3s;
  // Five rounds, as the other sections' pairs: with three, the replay ratios' rounds spread
  // from 0.62 to 1.01 in one run (2026-12-05), wide enough to put the median either side of a
  // target.
  const std::size_t pairs = quick ? 1 : 5;
  const std::vector<std::size_t> widths = {1, 64};
  auto heading = [&](const std::string& text) {
    if (human != nullptr) *human << '\n' << text << '\n';
  };
  auto line = [&](const std::string& name, const Stats& s) {
    if (human == nullptr) return;
    *human << fmt::format(
        "  {:<46} {:>10.0f}/s  p50 {:>8.1f} us  p99 {:>8.1f} us  max {:>9.1f} us\n", name, s.per_s,
        s.p50_us, s.p99_us, s.max_us);
  };
  auto label = [](const std::string& what, std::size_t width) {
    return fmt::format("{}, {} connection{}", what, width, width == 1 ? "" : "s");
  };

  heading(fmt::format(
      "http: the conformance app on keep-alive connections, with idem's layer, with idempotency "
      "by hand and bare ({} s a line, {} back-to-back round{})",
      static_cast<double>(duration.count()) / 1000, pairs, pairs == 1 ? "" : "s"));
  json out = json::object();
  json& h = out["http"];
  ServerThread layer_server(dir, Guard::layer), cached_server(dir, Guard::cached),
      hand_server(dir, Guard::handwritten), bare_server(dir, Guard::bare);
  // Clients close their connections before their servers stop (declared after them).
  Client layer(layer_server.port()), cached(cached_server.port()), hand(hand_server.port()),
      bare(bare_server.port());
  struct Server {
    Guard guard;
    Client& client;
  };
  const Server servers[] = {{Guard::layer, layer}, {Guard::handwritten, hand}, {Guard::bare, bare}};

  // Fresh keys: the three servers one after another, `pairs` times, at each width.
  std::map<std::size_t, std::vector<double>> vs_hand, vs_bare;  // by width
  std::map<std::size_t, std::map<Guard, Stats>> first;          // the first round's
  for (std::size_t round = 0; round < pairs; ++round) {
    for (const std::size_t width : widths) {
      std::map<Guard, Stats> got;
      for (std::size_t turn = 0; turn < std::size(servers); ++turn) {
        const Server& s = in_turn(servers, turn, round);
        const std::string name = std::string(name_of(s.guard)) + fmt::format(" #{}", round);
        got[s.guard] = fresh(s.client, name, width, duration);
        if (round == 0)
          line(label(std::string(name_of(s.guard)) + ": fresh keys", width), got[s.guard]);
      }
      vs_hand[width].push_back(got[Guard::layer].per_s / got[Guard::handwritten].per_s);
      vs_bare[width].push_back(got[Guard::layer].per_s / got[Guard::bare].per_s);
      if (round == 0) first[width] = got;
    }
  }
  for (const std::size_t width : widths) {
    for (const Server& s : servers)
      h[name_of(s.guard)]["fresh"][std::to_string(width)] = first[width][s.guard].json();
  }
  // Replays: the layer's stored answer (read from the store, or from the replay cache)
  // against the bare server answering the same request again (its no-op handler runs each
  // time).
  struct Replayer {
    Guard guard;
    Client& client;
    const char* key;    // in the JSON's "http" object
    const char* label;  // in the table
  };
  const Replayer replayers[] = {{Guard::layer, layer, "layer", "layer: replays"},
                                {Guard::cached, cached, "cached", "layer + replay cache: replays"},
                                {Guard::bare, bare, "bare", "bare: repeats, each runs again"}};
  std::map<std::size_t, std::vector<double>> replay_vs_bare, cached_vs_bare;
  std::map<std::size_t, std::map<Guard, Stats>> first_replay;  // the first round's
  for (std::size_t round = 0; round < pairs; ++round) {
    for (const std::size_t width : widths) {
      std::map<Guard, Stats> got;
      for (std::size_t turn = 0; turn < std::size(replayers); ++turn) {
        const Replayer& r = in_turn(replayers, turn, round);
        got[r.guard] = replay(r.client, fmt::format("{} #{}", r.key, round), r.guard != Guard::bare,
                              width, duration);
        if (round == 0) {
          line(label(r.label, width), got[r.guard]);
          h[r.key]["replay"][std::to_string(width)] = got[r.guard].json();
        }
      }
      replay_vs_bare[width].push_back(got[Guard::layer].per_s / got[Guard::bare].per_s);
      cached_vs_bare[width].push_back(got[Guard::cached].per_s / got[Guard::bare].per_s);
      if (round == 0) first_replay[width] = got;
    }
  }
  for (const std::size_t width : widths) {
    const Stats s = storm(layer, width, duration);
    line(label("layer: 409, the key in flight", width), s);
    h["layer"]["conflict_409"][std::to_string(width)] = s.json();
  }

  h["raw"] = {{"layer_vs_handwritten_pairs_64", vs_hand[64]},
              {"layer_vs_handwritten_pairs_1", vs_hand[1]},
              {"layer_vs_noop_pairs_64", vs_bare[64]},
              {"replay_vs_noop_pairs_64", replay_vs_bare[64]},
              {"replay_vs_noop_pairs_1", replay_vs_bare[1]},
              {"replay_cache_vs_noop_pairs_64", cached_vs_bare[64]}};
  out["http_fresh_requests_per_s"] = first[64][Guard::layer].per_s;
  out["http_handwritten_fresh_requests_per_s"] = first[64][Guard::handwritten].per_s;
  out["http_noop_requests_per_s"] = first[64][Guard::bare].per_s;
  out["http_replay_requests_per_s"] = first_replay[64][Guard::layer].per_s;
  out["http_layer_vs_handwritten_ratio"] = median(vs_hand[64]);
  out["http_layer_vs_handwritten_ratio_1conn"] = median(vs_hand[1]);
  out["http_layer_vs_noop_ratio"] = median(vs_bare[64]);
  out["http_replay_vs_noop_ratio"] = median(replay_vs_bare[64]);
  out["http_replay_cache_requests_per_s"] = first_replay[64][Guard::cached].per_s;
  out["http_replay_cache_vs_noop_ratio"] = median(cached_vs_bare[64]);
  // What the layer adds to one request over answering it bare, one connection.
  const Stats& l1 = first[1][Guard::layer];
  const Stats& b1 = first[1][Guard::bare];
  out["http_layer_added_p50_us_1conn"] = l1.p50_us - b1.p50_us;
  out["http_layer_added_p99_us_1conn"] = l1.p99_us - b1.p99_us;
  if (human != nullptr) {
    *human << fmt::format(
        "  medians of {} rounds: layer / by hand {:.2f} at 64 connections, {:.2f} at one; layer / "
        "bare {:.2f} at 64; replays / bare {:.2f} at 64 ({:.2f} with the replay cache); the layer "
        "adds {:.0f} us at p50 and "
        "{:.0f} us at p99 to one connection's request\n",
        pairs, out["http_layer_vs_handwritten_ratio"].get<double>(),
        out["http_layer_vs_handwritten_ratio_1conn"].get<double>(),
        out["http_layer_vs_noop_ratio"].get<double>(),
        out["http_replay_vs_noop_ratio"].get<double>(),
        out["http_replay_cache_vs_noop_ratio"].get<double>(),
        out["http_layer_added_p50_us_1conn"].get<double>(),
        out["http_layer_added_p99_us_1conn"].get<double>());
  }
  return out;
}

}  // namespace idem::bench
