// idem-demo run as a child process, for the tests that drive its commands without an HTTP
// server in this process (no Asio or Beast here: the migration tests include it).
#pragma once

#include <doctest/doctest.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "test_support.hpp"

extern char** environ;

namespace idem::test {

#ifdef IDEM_DEMO  // the idem-demo binary: whole-suite builds only (tests/CMakeLists.txt)
// Runs idem-demo with `args`; returns its exit status and its stdout.
inline int run_demo(const TempDir& dir, std::vector<std::string> args, std::string& out) {
  const std::string out_file = dir.file("demo.out");
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
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  std::ifstream in(out_file);
  std::stringstream text;
  text << in.rdbuf();
  out = text.str();
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
#endif

}  // namespace idem::test
