// The HTTP layer from an installed idem (idem::http): a POST through the layer twice, one
// run, the second answer a replay.
#include <idem/beast.hpp>
#include <idem/sqlite_store.hpp>

#include <iostream>

int main() {
  idem::Coordinator idem(std::make_shared<idem::SqliteStore>(":memory:"), idem::Options{});
  idem::http::Layer layer(idem);
  int runs = 0;
  const idem::http::Handler handler = [&](const idem::http::Request&, const idem::http::Context&) {
    ++runs;
    idem::http::Reply r{boost::beast::http::status::created, 11};
    r.body() = "made";
    return r;
  };
  idem::http::Request req{idem::http::Verb::post, "/things", 11};
  req.set("Idempotency-Key", "\"consumer-1\"");
  req.body() = "{}";
  layer.handle(req, handler);
  const idem::http::Reply again = layer.handle(req, handler);
  std::cout << "runs " << runs << ", replayed " << again["Idempotent-Replayed"] << '\n';
  return runs == 1 && again["Idempotent-Replayed"] == "true" ? 0 : 1;
}
