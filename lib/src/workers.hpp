// The coordinator's own threads for calls into a store that may wait on a network
// (Store::remote()): the coroutine front end runs those calls here, so an io_context's thread
// never waits on a database server.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace idem::detail {

// A few threads and a queue of tasks. The threads start with the first post() and are joined by
// the destructor, after every task posted before it has run.
// Thread-safety: safe for concurrent use.
class Workers {
 public:
  explicit Workers(std::size_t threads) : size_(threads) {}
  ~Workers();
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;

  // Runs `task` on one of the threads, soon. A task must not throw.
  void post(std::function<void()> task);

 private:
  void run();

  const std::size_t size_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> tasks_;  // guarded by mutex_
  std::size_t idle_ = 0;                     // guarded by mutex_: threads waiting for a task
  bool stopping_ = false;                    // guarded by mutex_
  std::vector<std::thread> threads_;         // guarded by mutex_
};

}  // namespace idem::detail
