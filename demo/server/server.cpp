#include "server.hpp"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <csignal>
#include <iostream>
#include <set>

#include "idem/http.hpp"

namespace idem::demo {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

}  // namespace

struct Server::Impl {
  ServerOptions options;
  PaymentsApi api;
  net::io_context io{1};
  tcp::acceptor acceptor{io};
  net::signal_set signals{io};
  bool stopping = false;  // io thread only
  // Sessions waiting for a request (io thread only): cancelled when the server stops.
  std::set<beast::tcp_stream*> reading;

  explicit Impl(ServerOptions o) : options(std::move(o)), api(options.api) {
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
    signals.cancel(ec);
    for (beast::tcp_stream* s : reading) s->cancel();
  }

  static HttpRequest to_request(http::request<http::string_body>&& req) {
    HttpRequest out;
    out.method = std::string(req.method_string());
    out.target = std::string(req.target());
    for (const auto& field : req)
      out.headers.push_back({std::string(field.name_string()), std::string(field.value())});
    out.body = std::move(req.body());
    return out;
  }

  net::awaitable<void> send(beast::tcp_stream& stream, const Response& r, bool keep_alive) {
    http::response<http::string_body> res{static_cast<http::status>(r.status), 11};
    res.set(http::field::server, "idem-demo");
    for (const Header& h : r.headers) res.set(h.name, h.value);
    if (res.find(http::field::content_type) == res.end())
      res.set(http::field::content_type, "application/json");
    res.body() = r.body;
    res.keep_alive(keep_alive);
    res.prepare_payload();
    stream.expires_after(options.read_timeout);
    beast::error_code ec;
    co_await http::async_write(stream, res, net::redirect_error(net::use_awaitable, ec));
  }

  // The answer to a request that could not be read, or nullopt to just close.
  static std::optional<Response> read_failure(const beast::error_code& ec) {
    if (ec == http::error::body_limit) {
      return problem(413, "payload_too_large", "Payload too large",
                     "the body exceeds the server's limit");
    }
    if (ec == http::error::header_limit) {
      return problem(431, "headers_too_large", "Request header fields too large",
                     "the header section exceeds the server's limit");
    }
    static const auto& http_errors = beast::error_code(http::error::bad_method).category();
    if (ec.category() == http_errors && ec != http::error::end_of_stream &&
        ec != http::error::partial_message) {
      return problem(400, "bad_request", "Malformed HTTP request", ec.message());
    }
    return std::nullopt;  // closed, timed out, cancelled, or cut short: nobody to answer
  }

  net::awaitable<void> session(tcp::socket socket) {
    beast::tcp_stream stream(std::move(socket));
    beast::flat_buffer buffer;
    for (;;) {
      beast::error_code ec;
      // Idle: wait for the first byte of the next request (unless pipelined bytes wait).
      reading.insert(&stream);
      if (buffer.size() == 0) {
        stream.expires_after(options.idle_timeout);
        const std::size_t n = co_await stream.async_read_some(
            buffer.prepare(4096), net::redirect_error(net::use_awaitable, ec));
        buffer.commit(n);
      }
      http::request_parser<http::string_body> parser;
      parser.body_limit(options.body_limit);
      parser.header_limit(static_cast<std::uint32_t>(options.header_limit));
      if (!ec) {
        stream.expires_after(options.read_timeout);
        co_await http::async_read(stream, buffer, parser,
                                  net::redirect_error(net::use_awaitable, ec));
      }
      reading.erase(&stream);
      if (ec) {
        if (std::optional<Response> answer = read_failure(ec); answer && !stopping) {
          co_await send(stream, *answer, false);
        }
        break;
      }
      http::request<http::string_body> req = parser.release();
      const bool client_keep_alive = req.keep_alive();
      HttpRequest request = to_request(std::move(req));
      Response response = co_await api.handle(std::move(request));
      const bool keep_alive = client_keep_alive && !stopping;
      co_await send(stream, response, keep_alive);
      if (!keep_alive) break;
    }
    beast::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
  }

  net::awaitable<void> listen() {
    for (;;) {
      beast::error_code ec;
      tcp::socket socket =
          co_await acceptor.async_accept(net::redirect_error(net::use_awaitable, ec));
      if (stopping) co_return;
      if (ec) continue;  // a failed accept (fd limits...) does not stop the server
      net::co_spawn(io, session(std::move(socket)), [](std::exception_ptr e) {
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
PaymentsApi& Server::api() noexcept { return impl_->api; }

void Server::run() {
  Impl& d = *impl_;
  if (d.options.handle_signals) {
    d.signals.add(SIGINT);
    d.signals.add(SIGTERM);
    d.signals.async_wait([&d](const beast::error_code& ec, int) {
      if (!ec) d.begin_stop();
    });
  }
  net::co_spawn(d.io, d.listen(), net::detached);
  d.io.run();
}

void Server::stop() {
  net::post(impl_->io, [d = impl_.get()] { d->begin_stop(); });
}

}  // namespace idem::demo
