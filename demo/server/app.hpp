// What `idem-demo serve` carries: an application answers parsed requests; the transport
// (server.cpp) owns sockets, limits, HEAD and shutdown.
#pragma once

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

}  // namespace idem::demo
