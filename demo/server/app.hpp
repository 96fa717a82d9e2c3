// What `idem-demo serve` carries: an application answers parsed requests; the transport
// (server.cpp) owns sockets, limits, HEAD and shutdown.
#pragma once

#include <boost/beast/core/error.hpp>
#include <optional>
#include <string>

#include "idem/beast.hpp"

namespace idem::demo {

using Request = http::Request;
using Reply = http::Reply;

// Who sent the request.
struct Peer {
  std::string address;  // "127.0.0.1", "::1", ...
};

// Thread-safety: handle() runs on the server's one io thread.
class App {
 public:
  virtual ~App() = default;
  // Never throws for bad input: every failure is a reply.
  virtual boost::asio::awaitable<Reply> handle(Request request, Peer peer) = 0;
};

// Beast's string_view as the standard one.
inline std::string_view sv(boost::beast::string_view s) { return {s.data(), s.size()}; }

// problem+json (RFC 9457) with a stable "error" member.
Reply problem_reply(int status, std::string_view code, std::string_view title,
                    std::string_view detail);
Reply body_reply(int status, std::string body, std::string_view content_type);
// 405 method_not_allowed with Allow: `allow`.
Reply method_not_allowed(std::string_view allow);

// What the transport answers to a request it could not read: 413 over the body limit, 431
// over the header limit, 400 for malformed HTTP; nullopt where it closes without an answer
// (closed, timed out, cancelled, cut short).
std::optional<Reply> read_failure(const boost::beast::error_code& ec);
// The transport's headers on every reply: HTTP/1.1, Server, Date, a JSON Content-Type when a
// body has none, keep-alive, and Content-Length unless set or the reply is chunked.
void finish_reply(Reply& res, bool keep_alive);

}  // namespace idem::demo
