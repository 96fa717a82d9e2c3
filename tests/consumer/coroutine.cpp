// Built against an installed idem (find_package(idem CONFIG), idem::asio): a duplicate
// coroutine waits for the first and replays its answer; the action runs once.
#include <utility>  // Boost 1.74's awaitable.hpp needs std::exchange declared first

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <idem/asio.hpp>
#include <idem/sqlite_store.hpp>
#include <iostream>
#include <nlohmann/json.hpp>

namespace net = boost::asio;

int main() {
  auto clock = std::make_shared<idem::SystemClock>();
  idem::Coordinator idem(std::make_shared<idem::SqliteStore>(":memory:"),
                         idem::Options{.clock = clock});
  net::io_context io;
  int charges = 0;
  std::vector<std::string> answers;
  for (int i = 0; i < 2; ++i) {
    net::co_spawn(
        io,
        [&]() -> net::awaitable<void> {
          idem::Request request{
              .tenant = "alpha",
              .operation = "payment.charge",
              .key = "consumer-2",
              .fingerprint = idem::Fingerprint::of(nlohmann::json{{"amount", 10}})};
          idem::AsyncAction action = [&]() -> net::awaitable<idem::Response> {
            ++charges;
            co_await idem::async_sleep_until(*clock, clock->now() + std::chrono::milliseconds(20));
            co_return idem::Response{200, "ch_1", {}};
          };
          const idem::Outcome out =
              co_await idem::async_call(idem, std::move(request), std::move(action));
          answers.push_back(out.response.body);
        },
        net::detached);
  }
  io.run();
  std::cout << "coroutine consumer: charges made: " << charges << '\n';
  return charges == 1 && answers == std::vector<std::string>{"ch_1", "ch_1"} ? 0 : 1;
}
