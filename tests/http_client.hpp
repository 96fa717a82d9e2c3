// A small synchronous HTTP/1.1 client for the server tests (Boost.Beast), and a raw socket
// for sending bytes that are not HTTP at all.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <utility>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace idem::test {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;

struct HttpReply {
  int status = 0;
  std::map<std::string, std::string> headers;  // names lowercased
  std::string body;
  bool has(const std::string& name) const { return headers.count(name) > 0; }
};

// One connection; requests go out one after another on it (keep-alive).
class HttpClient {
 public:
  explicit HttpClient(unsigned short port) : stream_(io_) {
    stream_.connect(net::ip::tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
  }

  HttpReply send(const std::string& method, const std::string& target,
                 const std::vector<std::pair<std::string, std::string>>& headers = {},
                 const std::string& body = "") {
    write_only(method, target, headers, body);
    return receive();
  }

  // Writes a request without reading the answer (for many clients in parallel).
  void write_only(const std::string& method, const std::string& target,
                  const std::vector<std::pair<std::string, std::string>>& headers,
                  const std::string& body) {
    http::request<http::string_body> req{http::string_to_verb(method), target, 11};
    req.set(http::field::host, "127.0.0.1");
    for (const auto& [name, value] : headers) req.set(name, value);
    req.body() = body;
    req.prepare_payload();
    http::write(stream_, req);
  }

  HttpReply receive() {
    beast::flat_buffer buffer;
    http::response<http::string_body> res;
    http::read(stream_, buffer, res);
    HttpReply out;
    out.status = static_cast<int>(res.result_int());
    for (const auto& f : res) {
      std::string name(f.name_string());
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      out.headers[name] = std::string(f.value());
    }
    out.body = res.body();
    return out;
  }

 private:
  net::io_context io_;
  beast::tcp_stream stream_;
};

// What a raw exchange saw: the bytes the server sent, and whether the server closed the
// connection (false: the client gave up after 5 s of silence, the server still holding it).
struct RawReply {
  std::string bytes;
  bool closed_by_server = false;
};

// Sends `bytes` on a fresh connection, optionally half-closes, and returns everything the
// server sends until it closes (or 5 s pass without a byte).
inline RawReply raw_exchange(unsigned short port, const std::string& bytes, bool half_close) {
  net::io_context io;
  net::ip::tcp::socket s(io);
  s.connect(net::ip::tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
  beast::error_code ec;
  net::write(s, net::buffer(bytes), ec);
  if (half_close) s.shutdown(net::ip::tcp::socket::shutdown_send, ec);
  RawReply out;
  // A bound on a server that never answers nor closes (a failure, not a measurement): plain
  // poll(2), since Asio's blocking reads ignore SO_RCVTIMEO.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        give_up - std::chrono::steady_clock::now());
    pollfd p{s.native_handle(), POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    const ssize_t n = ::recv(s.native_handle(), buf, sizeof buf, 0);
    if (n <= 0) {
      out.closed_by_server = n == 0 || errno == ECONNRESET;
      break;
    }
    out.bytes.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

}  // namespace idem::test
