// fault_proxy: FaultProxy (fault_proxy.hpp) as a process, for shell scripts.
//   fault_proxy --target unix:/path/.s.PGSQL.5432 | --target HOST:PORT [--listen 127.0.0.1:PORT]
// Listens on 127.0.0.1 only (port 0, the default: a free one), prints "listening
// 127.0.0.1:PORT" on stdout once it listens, then reads one command a line on stdin and answers
// each with one line, "ok ..." or "error ...":
//   stall              hold every byte both ways, sockets open
//   resume             end a stall
//   pass               back to the default: no stall, no armed drop
//   cut                close every open connection, both sides
//   drop-reply TAG     one-shot: drop the next CommandComplete whose tag starts with TAG (the
//                      rest of the line: inner spaces kept, trailing ones trimmed as on every
//                      line) and close its connection
//   stats              the counters
//   quit               exit (so does EOF on stdin)
// Exits 0 after quit or EOF, 2 on bad arguments, 1 when the proxy cannot start.
#include <cstdint>
#include <exception>
#include <iostream>
#include <string>

#include "fault_proxy.hpp"

namespace {

constexpr const char* kUsage =
    "usage: fault_proxy --target unix:/path/.s.PGSQL.5432|HOST:PORT [--listen 127.0.0.1:PORT]";

// The port of a --listen value, which must be 127.0.0.1:PORT; false when it is not.
bool parse_listen(const std::string& value, std::uint16_t& port) {
  const std::string host = "127.0.0.1:";
  if (value.rfind(host, 0) != 0) return false;
  const std::string digits = value.substr(host.size());
  if (digits.empty() || digits.size() > 5 ||
      digits.find_first_not_of("0123456789") != std::string::npos) {
    return false;
  }
  const unsigned long number = std::stoul(digits);
  if (number > 65535) return false;
  port = static_cast<std::uint16_t>(number);
  return true;
}

// The answer to one command line.
std::string answer(idem::test::FaultProxy& proxy, const std::string& line, bool& quit) {
  const std::size_t space = line.find(' ');
  const std::string command = line.substr(0, space);
  const std::string argument = space == std::string::npos ? "" : line.substr(space + 1);
  if (command == "drop-reply") {
    if (argument.empty()) return "error drop-reply needs a TAG";
    proxy.drop_reply_after(argument);
    return "ok drop-reply armed for " + argument;
  }
  if (!argument.empty()) return "error " + command + " takes no argument";
  if (command == "stall") {
    proxy.stall();
    return "ok stalled";
  }
  if (command == "resume") {
    proxy.resume();
    return "ok resumed";
  }
  if (command == "pass") {
    proxy.pass();
    return "ok passing";
  }
  if (command == "cut") {
    proxy.cut();
    return "ok cut";
  }
  if (command == "stats") {
    return "ok accepted=" + std::to_string(proxy.accepted()) +
           " open=" + std::to_string(proxy.open_connections()) +
           " bytes_to_server=" + std::to_string(proxy.bytes_to_server()) +
           " bytes_to_client=" + std::to_string(proxy.bytes_to_client()) +
           " replies_dropped=" + std::to_string(proxy.replies_dropped());
  }
  if (command == "quit") {
    quit = true;
    return "ok bye";
  }
  return "error unknown command \"" + command +
         "\" (stall, resume, pass, cut, drop-reply TAG, stats, quit)";
}

}  // namespace

int main(int argc, char** argv) {
  std::string target;
  std::uint16_t port = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--target" || arg == "--listen") && i + 1 < argc) {
      const std::string value = argv[++i];
      if (arg == "--target") {
        target = value;
      } else if (!parse_listen(value, port)) {
        std::cerr << "fault_proxy: --listen must be 127.0.0.1:PORT (loopback only), not " << value
                  << "\n";
        return 2;
      }
    } else {
      std::cerr << kUsage << "\n";
      return 2;
    }
  }
  if (target.empty()) {
    std::cerr << kUsage << "\n";
    return 2;
  }
  try {
    idem::test::FaultProxy proxy(target, port);
    std::cout << "listening 127.0.0.1:" << proxy.port() << std::endl;
    bool quit = false;
    std::string line;
    while (!quit && std::getline(std::cin, line)) {
      while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
      std::cout << (line.empty() ? std::string("error empty command") : answer(proxy, line, quit))
                << std::endl;
    }
  } catch (const std::exception& e) {
    std::cerr << "fault_proxy: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
