// The HTTP example of docs/http.md: idem's layer in front of a handler in your own Boost.Beast
// server (here blocking, a thread per connection). Built with the project and run by ctest:
// it fails unless three retries of one POST created one order.
#include <idem/beast.hpp>
#include <idem/sqlite_store.hpp>

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <iostream>
#include <thread>

namespace net = boost::asio;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;

int main() {
  idem::Coordinator idem(std::make_shared<idem::SqliteStore>(":memory:"), idem::Options{});
  idem::http::LayerOptions options;  // POST and PATCH protected, key required
  // Scope keys per customer (in a real service, from verified credentials).
  options.tenant = [](const idem::http::Request& req) { return std::string(req["X-Customer"]); };
  idem::http::Layer layer(idem, options);

  int orders = 0;  // the side effect that must not repeat
  const idem::http::Handler create_order = [&](const idem::http::Request& req,
                                               const idem::http::Context& call) {
    ++orders;  // orders.insert(req.body(), idem::derived_key(call.id, "order")) in a real service
    idem::http::Reply res{http::status::created, req.version()};
    res.set(http::field::content_type, "application/json");
    res.body() = "{\"order\": " + std::to_string(orders) + ", \"for\": \"" + call.id.tenant + "\"}";
    res.prepare_payload();
    return res;
  };

  net::io_context io;
  tcp::acceptor acceptor(io, {net::ip::make_address("127.0.0.1"), 0});
  std::thread server([&] {  // your server: read a request, let the layer answer it
    for (;;) {
      tcp::socket socket = acceptor.accept();
      boost::beast::flat_buffer buffer;
      idem::http::Request req;
      boost::beast::error_code ec;
      http::read(socket, buffer, req, ec);
      if (ec) return;  // the example's last connection sends nothing: stop
      idem::http::Reply res = layer.handle(req, create_order);
      res.keep_alive(false);
      http::write(socket, res);
    }
  });

  for (int attempt = 1; attempt <= 3; ++attempt) {  // the client retries with one key
    tcp::socket client(io);
    client.connect(acceptor.local_endpoint());
    idem::http::Request req{http::verb::post, "/orders", 11};
    req.set("Idempotency-Key", "\"5b8e0c2a-9d41-4f7e-8a36-1c2d3e4f5a6b\"");
    req.set("X-Customer", "acme");
    req.set(http::field::content_type, "application/json");
    req.body() = R"({"sku": "book-42", "quantity": 1})";
    req.prepare_payload();
    http::write(client, req);
    boost::beast::flat_buffer buffer;
    http::response<http::string_body> res;
    http::read(client, buffer, res);
    std::cout << "attempt " << attempt << ": " << res.result_int() << ' ' << res.body()
              << (res["Idempotent-Replayed"] == "true" ? " (replayed)" : "") << '\n';
  }
  tcp::socket(io).connect(acceptor.local_endpoint());  // wakes the server to stop
  server.join();
  std::cout << "orders created: " << orders << '\n';
  return orders == 1 ? 0 : 1;
}
