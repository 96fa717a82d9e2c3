#include "server.hpp"

#include <sys/resource.h>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <csignal>
#include <iostream>
#include <map>
#include <set>
#include <stdexcept>

namespace idem::demo {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace bh = beast::http;
using tcp = net::ip::tcp;

// Descriptors kept back from the connection cap: the databases (each with its WAL and
// shared memory), the ledger, the event loop's own, stdio.
constexpr std::size_t kReservedDescriptors = 64;

std::size_t default_max_connections() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 4096;
  const auto descriptors = static_cast<std::size_t>(limit.rlim_cur);
  return descriptors > kReservedDescriptors + 16 ? descriptors - kReservedDescriptors : 16;
}

}  // namespace

struct Server::Impl {
  ServerOptions options;
  std::unique_ptr<PaymentsApi> payments;
  std::unique_ptr<ConformanceApp> fixture;
  App* app = nullptr;
  std::size_t cap = 0;
  net::io_context io{1};
  tcp::acceptor acceptor{io};
  net::signal_set signals{io};
  net::steady_timer drain{io};
  net::steady_timer room{io};           // the listener waits here while the cap is reached
  net::steady_timer backoff_timer{io};  // and here after a failed accept
  // Everything below: io thread only.
  bool stopping = false;
  bool forced = false;
  std::size_t sessions = 0;
  std::uint64_t idle_since = 0;
  // Sessions waiting for the first byte of a request, longest idle first: the ones a new
  // connection may close at the cap, and the ones stop() closes at once.
  std::map<std::uint64_t, beast::tcp_stream*> idle;
  // Sessions reading a request: cancelled when the server stops.
  std::set<beast::tcp_stream*> reading;

  ~Impl() {
    // The app's background work may post back to `io`: finish it while `io` exists.
    if (payments) payments->join_background();
  }

  explicit Impl(ServerOptions o) : options(std::move(o)) {
    if (options.app == AppKind::conformance) {
      fixture = std::make_unique<ConformanceApp>(
          ConformanceOptions{options.api.db, options.api.policy, options.api.fail_closed,
                             options.idempotency_layer, options.api.ttl, options.api.lease,
                             options.fixture, options.handwritten, options.api.replay_cache_bytes});
      app = fixture.get();
    } else {
      payments = std::make_unique<PaymentsApi>(options.api);
      app = payments.get();
    }
    cap = options.max_connections != 0 ? options.max_connections : default_max_connections();
    const tcp::endpoint endpoint(net::ip::make_address(options.host), options.port);
    acceptor.open(endpoint.protocol());
    acceptor.set_option(net::socket_base::reuse_address(true));
    acceptor.bind(endpoint);
    acceptor.listen(net::socket_base::max_listen_connections);
  }

  void begin_stop() {  // io thread
    if (stopping) return;
    stopping = true;
    beast::error_code ec;
    acceptor.close(ec);
    room.cancel();
    backoff_timer.cancel();
    for (auto& [since, s] : idle) s->cancel();
    for (beast::tcp_stream* s : reading) s->cancel();
    if (sessions == 0) {
      signals.cancel(ec);
      return;
    }
    drain.expires_after(options.drain_timeout);
    drain.async_wait([this](const beast::error_code& e) {
      if (e) return;
      std::cerr << "idem-demo serve: " << sessions
                << " request(s) still running after the drain timeout; stopping without them\n";
      force();
    });
  }

  void force() {
    forced = sessions > 0;
    io.stop();
  }

  void on_signal(const beast::error_code& ec, int) {
    if (ec) return;
    if (stopping) {
      std::cerr << "idem-demo serve: second signal; stopping now\n";
      force();
      return;
    }
    begin_stop();
    if (sessions > 0)
      signals.async_wait([this](const beast::error_code& e, int s) { on_signal(e, s); });
  }

  void session_ended() {
    --sessions;
    room.cancel();
    if (stopping && sessions == 0) {
      beast::error_code ec;
      drain.cancel();
      signals.cancel(ec);
    }
  }

  net::awaitable<void> send(beast::tcp_stream& stream, Reply res, bool keep_alive, bool head) {
    finish_reply(res, keep_alive);
    stream.expires_after(options.read_timeout);
    beast::error_code ec;
    if (head) {
      // The answer to HEAD is the GET's header section, Content-Length included, and no body
      // (RFC 9110 §9.3.2): a body here would be read as the next response.
      bh::response<bh::empty_body> header_only{std::move(res.base())};
      co_await bh::async_write(stream, header_only, net::redirect_error(net::use_awaitable, ec));
    } else {
      co_await bh::async_write(stream, res, net::redirect_error(net::use_awaitable, ec));
    }
  }

  net::awaitable<void> session(tcp::socket socket) {
    beast::tcp_stream stream(std::move(socket));
    beast::flat_buffer buffer;
    beast::error_code peer_ec;
    const Peer peer{stream.socket().remote_endpoint(peer_ec).address().to_string()};
    for (;;) {
      beast::error_code ec;
      // Idle: wait for the first byte of the next request (unless pipelined bytes wait).
      if (buffer.size() == 0 && !stopping) {
        const std::uint64_t since = ++idle_since;
        idle.emplace(since, &stream);
        room.cancel();  // an idle session makes room for a new connection at the cap
        stream.expires_after(options.idle_timeout);
        const std::size_t n = co_await stream.async_read_some(
            buffer.prepare(4096), net::redirect_error(net::use_awaitable, ec));
        buffer.commit(n);
        idle.erase(since);
      }
      if (stopping && buffer.size() == 0) break;
      bh::request_parser<bh::string_body> parser;
      parser.body_limit(options.body_limit);
      parser.header_limit(static_cast<std::uint32_t>(options.header_limit));
      if (!ec) {
        reading.insert(&stream);
        stream.expires_after(options.read_timeout);
        co_await bh::async_read(stream, buffer, parser,
                                net::redirect_error(net::use_awaitable, ec));
        reading.erase(&stream);
      }
      if (ec) {
        if (std::optional<Reply> answer = read_failure(ec); answer && !stopping) {
          co_await send(stream, std::move(*answer), false, false);
        }
        break;
      }
      Request req = parser.release();
      const bool client_keep_alive = req.keep_alive();
      const bool head = req.method() == bh::verb::head;
      if (head) req.method(bh::verb::get);  // HEAD is GET without the body
      Reply response;
      try {
        response = co_await app->handle(std::move(req), peer);
      } catch (const std::exception& e) {
        // An app's failure still gets an answer, and the connection closes after it.
        std::cerr << "idem-demo serve: request failed: " << e.what() << '\n';
        response = problem_reply(500, "internal_error", "Internal error", "the request failed");
        response.keep_alive(false);
      }
      const bool keep_alive = client_keep_alive && !stopping && response.keep_alive();
      co_await send(stream, std::move(response), keep_alive, head);
      if (!keep_alive) break;
    }
    beast::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
  }

  net::awaitable<void> listen() {
    std::chrono::milliseconds backoff{0};
    for (;;) {
      beast::error_code ec;
      // At the cap with nobody idle to close: leave new connections in the backlog until a
      // session ends or goes idle.
      while (sessions >= cap && idle.empty() && !stopping) {
        room.expires_after(std::chrono::seconds(1));
        co_await room.async_wait(net::redirect_error(net::use_awaitable, ec));
      }
      if (stopping) co_return;
      tcp::socket socket =
          co_await acceptor.async_accept(net::redirect_error(net::use_awaitable, ec));
      if (stopping) co_return;
      if (ec) {
        // Descriptors or memory ran out (EMFILE, ENFILE, ENOBUFS...): retrying at once would
        // spin; wait, longer each time, for sessions to end.
        if (backoff.count() == 0)
          std::cerr << "idem-demo serve: accept failed (" << ec.message() << "); backing off\n";
        backoff = std::min<std::chrono::milliseconds>(
            std::chrono::seconds(1),
            std::max<std::chrono::milliseconds>(std::chrono::milliseconds(5), backoff * 2));
        backoff_timer.expires_after(backoff);
        co_await backoff_timer.async_wait(net::redirect_error(net::use_awaitable, ec));
        continue;
      }
      backoff = std::chrono::milliseconds(0);
      if (sessions >= cap && !idle.empty()) {
        // Make room: close the connection idle the longest.
        beast::tcp_stream* oldest = idle.begin()->second;
        idle.erase(idle.begin());
        oldest->cancel();
      }
      ++sessions;
      net::co_spawn(io, session(std::move(socket)), [this](std::exception_ptr e) {
        session_ended();
        if (!e) return;
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& x) {
          std::cerr << "idem-demo serve: session ended: " << x.what() << '\n';
        }
      });
    }
  }
};

Server::Server(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Server::~Server() = default;

unsigned short Server::port() const noexcept { return impl_->acceptor.local_endpoint().port(); }
std::size_t Server::max_connections() const noexcept { return impl_->cap; }

PaymentsApi& Server::api() {
  if (!impl_->payments) throw std::logic_error("this server carries the conformance fixture");
  return *impl_->payments;
}

ConformanceApp& Server::conformance() {
  if (!impl_->fixture) throw std::logic_error("this server carries the payments API");
  return *impl_->fixture;
}

bool Server::run() {
  Impl& d = *impl_;
  if (d.options.handle_signals) {
    d.signals.add(SIGINT);
    d.signals.add(SIGTERM);
    d.signals.async_wait([&d](const beast::error_code& ec, int s) { d.on_signal(ec, s); });
  }
  net::co_spawn(d.io, d.listen(), net::detached);
  d.io.run();
  return !d.forced;
}

void Server::stop() {
  net::post(impl_->io, [d = impl_.get()] { d->begin_stop(); });
}

}  // namespace idem::demo
