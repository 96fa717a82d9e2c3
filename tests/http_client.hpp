// A small synchronous HTTP/1.1 client for the server tests (Boost.Beast), and a raw socket
// for sending bytes that are not HTTP at all.
#pragma once

#include <utility>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
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

// Sends `bytes` on a fresh connection, optionally half-closes, and returns everything the
// server sends until it closes (or 5 s pass).
inline std::string raw_exchange(unsigned short port, const std::string& bytes, bool half_close) {
  net::io_context io;
  net::ip::tcp::socket s(io);
  s.connect(net::ip::tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
  struct timeval tv {
    5, 0
  };
  ::setsockopt(s.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  beast::error_code ec;
  net::write(s, net::buffer(bytes), ec);
  if (half_close) s.shutdown(net::ip::tcp::socket::shutdown_send, ec);
  std::string out;
  char buf[4096];
  for (;;) {
    const std::size_t n = s.read_some(net::buffer(buf), ec);
    if (ec) break;
    out.append(buf, n);
  }
  return out;
}

}  // namespace idem::test
