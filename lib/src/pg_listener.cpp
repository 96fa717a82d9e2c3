#include "pg_listener.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <system_error>

namespace idem::detail {

PgListener::PgListener(pg::Parameters connect, std::string listen, Notify notify,
                       Listening listening, std::chrono::milliseconds reconnect_min,
                       std::chrono::milliseconds reconnect_max)
    : connect_(std::move(connect)),
      listen_(std::move(listen)),
      notify_(std::move(notify)),
      listening_(std::move(listening)),
      reconnect_min_(reconnect_min),
      reconnect_max_(reconnect_max),
      stop_fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  if (stop_fd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
  thread_ = std::thread([this] { run(); });
}

PgListener::~PgListener() {
  const std::uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(stop_fd_, &one, sizeof one);
  thread_.join();
  ::close(stop_fd_);
}

bool PgListener::stopping_within(std::chrono::milliseconds d) const {
  pollfd p{stop_fd_, POLLIN, 0};
  return ::poll(&p, 1, static_cast<int>(d.count())) > 0;
}

bool PgListener::open(pg::Session& session) {
  try {
    session.open(connect_);
    return PQresultStatus(session.exec(listen_).get()) == PGRES_COMMAND_OK;
  } catch (const std::exception&) {  // StoreError: the server cannot be reached (yet)
    session.close();
    return false;
  }
}

bool PgListener::answers(pg::Session& session) {
  try {
    // An empty statement: the server answers EmptyQueryResponse, within the session's reply
    // deadline or not at all. Notifications that arrive with the answer wait in libpq's queue.
    return PQresultStatus(session.exec("").get()) == PGRES_EMPTY_QUERY;
  } catch (const std::exception&) {  // StoreError: no answer within reply(), or the link broke
    return false;
  }
}

void PgListener::run() {
  std::chrono::milliseconds backoff = reconnect_min_;
  pg::Session session;
  session.interrupt_on(stop_fd_);  // stopping ends a connect, a LISTEN or a probe at once
  for (;;) {
    if (!session.connected()) {
      if (!open(session)) {
        if (stopping_within(backoff)) break;
        backoff = std::min(backoff * 2, reconnect_max_);
        continue;
      }
      backoff = reconnect_min_;
      listening_();
    }
    PGconn* const c = session.get();
    pollfd fds[2] = {{PQsocket(c), POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    const auto quiet = session.timeouts().reply();
    if (::poll(fds, 2, static_cast<int>(quiet.count())) < 0) continue;  // EINTR
    if (fds[1].revents != 0) break;
    const bool heard = fds[0].revents != 0
                           ? PQconsumeInput(c) != 0 && PQstatus(c) == CONNECTION_OK
                           : answers(session);  // silent for reply(): is anyone there?
    if (!heard) {                               // lost, or silent: open another
      session.close();
      continue;
    }
    while (PGnotify* n = PQnotifies(c)) {
      notify_(n->extra != nullptr ? std::string_view(n->extra) : std::string_view(), n->be_pid);
      PQfreemem(n);
    }
  }
}

}  // namespace idem::detail
