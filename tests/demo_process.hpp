// idem-demo run as a child process, for the tests that drive its commands or its servers
// (serve, grpc-serve) without a server in this process (no Asio or Beast here: the migration
// and gRPC tests include it).
#pragma once

#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>

#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "test_support.hpp"

extern char** environ;

namespace idem::test {

#ifdef IDEM_DEMO  // the idem-demo binary: whole-suite builds only (tests/CMakeLists.txt)
// Starts idem-demo with `args` in the background, its stdout into `out_file`; returns its pid.
inline pid_t start_demo(std::vector<std::string> args, const std::string& out_file) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  args.insert(args.begin(), IDEM_DEMO);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  REQUIRE(posix_spawn(&pid, IDEM_DEMO, &actions, nullptr, argv.data(), environ) == 0);
  posix_spawn_file_actions_destroy(&actions);
  return pid;
}

// Runs idem-demo with `args`; returns its exit status and its stdout.
inline int run_demo(const TempDir& dir, std::vector<std::string> args, std::string& out) {
  const std::string out_file = dir.file("demo.out");
  const pid_t pid = start_demo(std::move(args), out_file);
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  std::ifstream in(out_file);
  std::stringstream text;
  text << in.rdbuf();
  out = text.str();
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
#endif

// The exit status of child `pid` (or 128 + signal), waiting at most `bound` (a failure
// bound, not a measurement); a child still running then is killed and -1 returned.
inline int wait_bounded(pid_t pid, std::chrono::seconds bound) {
  // A pidfd becomes readable when the child exits: poll(2) waits for that event itself.
  // (the raw syscall: glibc 2.36's <sys/pidfd.h> lacks extern "C" for C++)
  const int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  REQUIRE(fd >= 0);
  pollfd p{fd, POLLIN, 0};
  const int ready = ::poll(&p, 1, static_cast<int>(bound.count() * 1000));
  ::close(fd);
  if (ready <= 0) ::kill(pid, SIGKILL);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  if (ready <= 0) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

#ifdef IDEM_DEMO  // the idem-demo binary: whole-suite builds only (tests/CMakeLists.txt)
// `idem-demo serve ...` (or grpc-serve: `command`) as a child process (through /bin/sh, for
// `ulimit`), its stderr on a pipe; the constructor returns once the child printed the port it
// serves on.
struct ServeProcess {
  pid_t pid = 0;
  int err = -1;
  unsigned short port = 0;
  std::string log;

  ServeProcess(const std::string& shell_prefix, const std::vector<std::string>& args,
               const std::string& subcommand = "serve") {
    std::string command = shell_prefix + " exec \"$0\" " + subcommand + " --port 0";
    for (const std::string& a : args) command += " '" + a + "'";
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    std::vector<std::string> argv_s = {"/bin/sh", "-c", command, IDEM_DEMO};
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    REQUIRE(posix_spawn(&pid, "/bin/sh", &actions, nullptr, argv.data(), environ) == 0);
    posix_spawn_file_actions_destroy(&actions);
    ::close(fds[1]);
    err = fds[0];
    // "idem-demo: serving payments on http://127.0.0.1:PORT (...)" (gRPC: "on 127.0.0.1:PORT")
    while (port == 0) {
      char buf[256];
      const ssize_t n = ::read(err, buf, sizeof buf);
      if (n <= 0) break;
      log.append(buf, static_cast<std::size_t>(n));
      if (const auto at = log.find("127.0.0.1:"); at != std::string::npos) {
        const auto end = log.find(' ', at);
        if (end != std::string::npos)
          port = static_cast<unsigned short>(std::stoi(log.substr(at + 10, end - at - 10)));
      }
    }
    REQUIRE_MESSAGE(port != 0, log);
  }

  // The child's exit status, waiting at most `bound` (wait_bounded).
  int wait(std::chrono::seconds bound) {
    const int status = wait_bounded(pid, bound);
    pid = 0;
    return status;
  }

  std::string stderr_text() {
    char buf[4096];
    ::fcntl(err, F_SETFL, O_NONBLOCK);
    for (ssize_t n; (n = ::read(err, buf, sizeof buf)) > 0;)
      log.append(buf, static_cast<std::size_t>(n));
    return log;
  }

  ~ServeProcess() {
    if (pid != 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    ::close(err);
  }
};

#endif

}  // namespace idem::test
