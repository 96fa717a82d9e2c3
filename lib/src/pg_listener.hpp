// PgStore's wake-ups from other nodes: a connection of its own that LISTENs on the store's
// channel, on a thread of its own, and hands each notification's payload to a callback.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <string_view>
#include <thread>

#include "idem/internal/pg.hpp"

namespace idem::detail {

// Thread-safety: constructed and destroyed by one thread; the callback runs on the
// listener's thread.
class PgListener {
 public:
  // A notification's payload and the backend pid of the session that sent it.
  using Notify = std::function<void(std::string_view payload, int sender_pid)>;
  // Called on the listener's thread each time LISTEN takes effect (first and after a
  // reconnect): notifications committed from then on reach `notify`.
  using Listening = std::function<void()>;

  // Starts the thread, which connects with `connect` (its waits bounded, as every session's)
  // and runs `listen`, the LISTEN statement. A lost connection is opened again after
  // reconnect_min, doubling up to reconnect_max; notifications sent meanwhile are lost
  // (waiters poll the store all the same). A connection that stays open and says nothing for
  // the session's Timeouts::reply() (a frozen backend, a stuck pooler: TCP keepalives do not
  // see them) is sent an empty statement; no answer within reply() more, and it is dropped
  // and opened again, so notifications do not stop for good behind a silent connection.
  // Throws std::system_error if the thread cannot start.
  PgListener(pg::Parameters connect, std::string listen, Notify notify, Listening listening,
             std::chrono::milliseconds reconnect_min, std::chrono::milliseconds reconnect_max);
  // Stops the thread: after it returns, the callback is not running and never runs again.
  // A connection attempt, a LISTEN or a silent connection's question in progress ends at once
  // (pg::Session::interrupt_on); only a callback in progress is waited for.
  ~PgListener();
  PgListener(const PgListener&) = delete;
  PgListener& operator=(const PgListener&) = delete;

 private:
  void run();
  // Connects and listens; false if it could not.
  bool open(pg::Session& session);
  // Whether the server answers an empty statement within the session's reply deadline.
  static bool answers(pg::Session& session);
  // Waits up to `d` for stop; returns true if stopping.
  bool stopping_within(std::chrono::milliseconds d) const;

  pg::Parameters connect_;
  std::string listen_;
  Notify notify_;
  Listening listening_;
  std::chrono::milliseconds reconnect_min_, reconnect_max_;
  int stop_fd_;  // an eventfd: readable once the destructor asks the thread to stop
  std::thread thread_;
};

}  // namespace idem::detail
