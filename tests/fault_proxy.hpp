// A TCP proxy for tests that sits between a libpq client and a PostgreSQL server and injects
// network faults on demand: a stall (no byte moves either way, every socket stays open), a cut
// (every connection closed at once) and a lost reply (the server's CommandComplete for a
// statement, and everything after it, dropped with the connection closed). Only POSIX and the
// C++ standard library: no Boost, no libpq, no idem headers.
#pragma once

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace idem::test {

// The Unix socket a libpq conninfo ("host=/dir port=5432 user=...") names:
// "<host>/.s.PGSQL.<port>", from its host= and port= keywords (the last of each wins, as in
// libpq; values may be single-quoted with backslash escapes; port 5432 when absent). Throws
// std::invalid_argument when the conninfo does not parse, or host is absent or not one
// absolute directory path (a TCP host name, a list of hosts), or port is not a number.
inline std::string pg_socket_path(const std::string& conninfo) {
  const auto is_space = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  };
  const auto fail = [&](const std::string& why) {
    throw std::invalid_argument("pg_socket_path: " + why + " in \"" + conninfo + "\"");
  };
  std::optional<std::string> host;
  std::string port = "5432";
  const std::size_t n = conninfo.size();
  std::size_t i = 0;
  while (true) {
    while (i < n && is_space(conninfo[i])) ++i;
    if (i == n) break;
    const std::size_t key_start = i;
    while (i < n && conninfo[i] != '=' && !is_space(conninfo[i])) ++i;
    const std::string key = conninfo.substr(key_start, i - key_start);
    while (i < n && is_space(conninfo[i])) ++i;
    if (i == n || conninfo[i] != '=') fail("no '=' after \"" + key + "\"");
    ++i;
    while (i < n && is_space(conninfo[i])) ++i;
    std::string value;
    if (i < n && conninfo[i] == '\'') {
      ++i;
      bool closed = false;
      while (i < n && !closed) {
        const char c = conninfo[i++];
        if (c == '\\' && i < n) {
          value += conninfo[i++];
        } else if (c == '\'') {
          closed = true;
        } else {
          value += c;
        }
      }
      if (!closed) fail("unterminated quoted value of \"" + key + "\"");
    } else {
      while (i < n && !is_space(conninfo[i])) {
        if (conninfo[i] == '\\' && i + 1 < n) ++i;
        value += conninfo[i++];
      }
    }
    if (key == "host") host = value;
    if (key == "port") port = value;
  }
  if (!host) fail("no host=");
  if (host->empty() || host->front() != '/' || host->find(',') != std::string::npos) {
    fail("host \"" + *host + "\" is not one Unix socket directory");
  }
  if (port.empty() || port.find_first_not_of("0123456789") != std::string::npos) {
    fail("port \"" + port + "\" is not a number");
  }
  return *host + "/.s.PGSQL." + port;
}

namespace fault_proxy_detail {

inline constexpr std::uint32_t kSslRequestCode = 80877103;
inline constexpr std::uint32_t kGssEncRequestCode = 80877104;
// The longest startup packet a PostgreSQL server accepts (MAX_STARTUP_PACKET_LENGTH).
inline constexpr std::uint32_t kMaxStartupLength = 10000;

inline std::uint32_t big_endian_u32(const unsigned char* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
         std::uint32_t{p[3]};
}

// An owned file descriptor, closed on destruction or reset (-1: none).
class Fd {
 public:
  Fd() = default;
  // Takes ownership of `fd` (a negative value: none).
  explicit Fd(int fd) : fd_(fd < 0 ? -1 : fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  // The descriptor (-1: none).
  int get() const { return fd_; }
  // Whether there is a descriptor.
  explicit operator bool() const { return fd_ >= 0; }
  // Closes the descriptor, if any.
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// Follows the server→client byte stream of one PostgreSQL connection from its first byte,
// message by message, fed in pieces of any size: first the one-byte answers to the client's
// SSLRequest and GSSENCRequest messages ('N': refused, then framing goes on; 'S' or 'G':
// encryption starts and the stream can no longer be followed), then framed messages (a type
// byte, an int32 big-endian length that counts itself, the body). It reports the tag of every
// CommandComplete message (type 'C', body a NUL-terminated tag such as "COMMIT").
class ServerStream {
 public:
  // The longest tag prefix reported: a CommandComplete's tag is decided on at most this many
  // bytes, so a proxy holding an undecided message holds at most kTagCap + 5 bytes.
  static constexpr std::size_t kTagCap = 256;

  // The client sent an SSLRequest or GSSENCRequest: the server answers it with one unframed
  // byte before any framed message.
  void expect_answer() { ++answers_due_; }
  // Stops following the stream (it is encrypted, or not PostgreSQL's protocol).
  void make_opaque() { opaque_ = true; }
  // Whether the stream is no longer followed: after an 'S' or 'G' answer, a length no message
  // can have (below 4), or make_opaque().
  bool opaque() const { return opaque_; }
  // Bytes consumed so far (the stream offset of the next byte feed() expects).
  std::uint64_t offset() const { return offset_; }
  // The stream offset where a CommandComplete begins whose tag is not decided yet (its type
  // byte consumed, its tag not complete): nullopt when there is none.
  std::optional<std::uint64_t> undecided_command() const {
    if (opaque_ || header_len_ == 0 || header_[0] != 'C' || reported_) return std::nullopt;
    return start_;
  }

  // Consumes the stream's next `n` bytes. For each CommandComplete whose tag becomes decided
  // (its NUL, the end of its body, or kTagCap bytes reached), calls on_tag(start, tag) with the
  // stream offset of the message's type byte; when on_tag returns false, stops at once (the rest
  // of the bytes unconsumed, the stream no longer usable) and returns false. Returns true when
  // every byte was consumed.
  template <class OnTag>
  bool feed(const char* data, std::size_t n, OnTag&& on_tag) {
    std::size_t i = 0;
    while (i < n) {
      if (opaque_) {
        offset_ += n - i;
        return true;
      }
      const auto byte = static_cast<unsigned char>(data[i]);
      if (header_len_ == 0 && answers_due_ > 0) {
        if (byte == 'N' || byte == 'S' || byte == 'G') {
          --answers_due_;
          opaque_ = byte != 'N';
          ++i;
          ++offset_;
          continue;
        }
        answers_due_ = 0;  // a framed message: a server that did not know the request refused it
      }
      if (header_len_ < 5) {
        if (header_len_ == 0) {
          start_ = offset_;
          reported_ = false;
          tag_complete_ = false;
          tag_.clear();
        }
        header_[header_len_++] = byte;
        ++i;
        ++offset_;
        if (header_len_ < 5) continue;
        const std::uint32_t length = big_endian_u32(header_ + 1);
        if (length < 4) {
          opaque_ = true;
          continue;
        }
        body_left_ = length - 4;
      } else {
        const std::size_t take = std::min<std::size_t>(n - i, body_left_);
        if (header_[0] == 'C' && !reported_) {
          for (std::size_t j = i; j < i + take && !tag_complete_; ++j) {
            if (data[j] == '\0') {
              tag_complete_ = true;
            } else {
              tag_ += data[j];
              tag_complete_ = tag_.size() == kTagCap;
            }
          }
        }
        i += take;
        offset_ += take;
        body_left_ -= static_cast<std::uint32_t>(take);
      }
      // The message's header is complete here, and its body consumed as far as `data` goes.
      if (header_[0] == 'C' && !reported_ && (tag_complete_ || body_left_ == 0)) {
        reported_ = true;
        if (!on_tag(start_, std::as_const(tag_))) return false;
      }
      if (body_left_ == 0) header_len_ = 0;
    }
    return true;
  }

 private:
  std::uint64_t offset_ = 0;
  int answers_due_ = 0;  // one-byte answers the server owes (SSLRequest/GSSENCRequest)
  bool opaque_ = false;
  unsigned char header_[5] = {};
  std::size_t header_len_ = 0;   // bytes of the current message's header consumed (0..5)
  std::uint32_t body_left_ = 0;  // bytes of the current message's body not consumed yet
  std::uint64_t start_ = 0;      // stream offset of the current message's type byte
  bool reported_ = false;        // the current CommandComplete's tag went to on_tag
  bool tag_complete_ = false;    // the current CommandComplete's tag is decided
  std::string tag_;              // the current CommandComplete's tag so far (kTagCap at most)
};

// Follows the client→server byte stream of one PostgreSQL connection while its messages are
// untyped (int32 big-endian length that counts itself, int32 code): every SSLRequest or
// GSSENCRequest tells `server` to expect its one-byte answer; the first other message (the
// StartupMessage, a CancelRequest) ends the untyped part and with it the following. A first
// byte 0x16 (a TLS handshake with no SSLRequest before it) makes `server` opaque.
class ClientStartup {
 public:
  // Whether the untyped part is over (nothing more to follow).
  bool done() const { return done_; }

  // Consumes the stream's next `n` bytes.
  void feed(const char* data, std::size_t n, ServerStream& server) {
    std::size_t i = 0;
    while (i < n && !done_) {
      if (skip_ > 0) {
        const std::size_t take = std::min<std::size_t>(n - i, skip_);
        i += take;
        skip_ -= static_cast<std::uint32_t>(take);
        continue;
      }
      const auto byte = static_cast<unsigned char>(data[i++]);
      if (first_ && byte == 0x16) {
        server.make_opaque();
        done_ = true;
        break;
      }
      first_ = false;
      header_[header_len_++] = byte;
      if (header_len_ < 8) continue;
      header_len_ = 0;
      const std::uint32_t length = big_endian_u32(header_);
      const std::uint32_t code = big_endian_u32(header_ + 4);
      if (length >= 8 && length <= kMaxStartupLength &&
          (code == kSslRequestCode || code == kGssEncRequestCode)) {
        server.expect_answer();
        skip_ = length - 8;
      } else {
        done_ = true;  // the StartupMessage, a CancelRequest, or a packet the server refuses
      }
    }
  }

 private:
  bool first_ = true;
  bool done_ = false;
  unsigned char header_[8] = {};
  std::size_t header_len_ = 0;
  std::uint32_t skip_ = 0;  // bytes of the current message's body still to pass over
};

}  // namespace fault_proxy_detail

// A user-space TCP proxy for tests, between libpq clients and one PostgreSQL server, that
// injects network faults on demand. It listens on 127.0.0.1 only and connects each accepted
// connection to the target (a Unix socket or a TCP address). One background thread of its own
// runs a poll() loop (20 ms timeout) over the listening socket and every connection's two
// sockets; all sockets are non-blocking, and each direction holds at most kDirectionCap bytes
// (reading stops while full). The control methods are thread-safe and return once the loop
// applies them: from then on, every byte the proxy moves obeys the new state.
class FaultProxy {
 public:
  // Bytes held per direction of a connection, at most.
  static constexpr std::size_t kDirectionCap = std::size_t{1} << 20;
  // Connections open at once, at most (beyond that, new ones wait in the listen backlog).
  static constexpr std::size_t kMaxConnections = 256;
  // How long one poll() waits at most, and so how soon the loop sees a control call or stop.
  static constexpr int kPollMs = 20;
  // How long a connection to the target may take before the client side is closed.
  static constexpr std::chrono::seconds kConnectTimeout{5};

  // Listens on 127.0.0.1:`listen_port` (0: a free port) and forwards every accepted
  // connection to `target`: "unix:/path/.s.PGSQL.5432" or "HOST:PORT" (a numeric port; the
  // host resolved once, here). Throws std::invalid_argument for a target that does not parse
  // or resolve, std::system_error when the listening socket cannot be set up.
  explicit FaultProxy(std::string target, std::uint16_t listen_port = 0)
      : target_(parse_target(std::move(target))) {
    listener_ = Fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!listener_) throw_errno("socket");
    const int one = 1;
    ::setsockopt(listener_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(listen_port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(listener_.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
      throw_errno("bind 127.0.0.1:" + std::to_string(listen_port));
    }
    if (::listen(listener_.get(), 128) != 0) throw_errno("listen");
    socklen_t length = sizeof address;
    if (::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      throw_errno("getsockname");
    }
    port_ = ntohs(address.sin_port);
    loop_ = std::thread([this] { run(); });
  }

  // Stops the loop (within one poll timeout), joins it, and closes every socket.
  ~FaultProxy() {
    stop_ = true;
    loop_.join();
  }

  FaultProxy(const FaultProxy&) = delete;
  FaultProxy& operator=(const FaultProxy&) = delete;

  // The port the proxy listens on, on 127.0.0.1.
  std::uint16_t port() const { return port_; }

  // Back to the default: no stall, and no armed drop_reply_after() or stall_after().
  void pass() {
    control([this] {
      stalled_ = false;
      drop_prefix_.reset();
      stall_prefix_.reset();
    });
  }

  // Ends a stall: the bytes held go through in order (an armed drop_reply_after() stays armed).
  void resume() {
    control([this] { stalled_ = false; });
  }

  // Stops moving bytes in both directions on every connection, including those accepted from
  // now on (which get no connection to the target until the stall ends), while keeping every
  // socket open: no FIN, no RST. Bytes are held, in the proxy's buffers or unread in the
  // kernel, never dropped. The model of a stuck connection pooler or a frozen backend.
  void stall() {
    control([this] { stalled_ = true; });
  }

  // Closes every open connection at once, both sides (the client sees its connection end, the
  // server its session's). Connections accepted afterwards are served as usual.
  void cut() {
    control([this] { ++cut_requests_; });
  }

  // One-shot: the next CommandComplete from the server whose tag starts with `tag_prefix`
  // (e.g. "COMMIT"; "" matches any) is dropped, with everything the server sends after it on
  // that connection, and both sides of that connection are closed (after the bytes that came
  // before it reach the client): the statement ran on the server, the client never learns it.
  // Only the first matching connection fires; then the proxy passes again. A connection whose
  // server stream cannot be followed (SSL or GSS encryption accepted) never fires. A new call
  // replaces an armed prefix.
  void drop_reply_after(std::string tag_prefix) {
    control([&] {
      drop_prefix_ = std::move(tag_prefix);
      ++drop_arm_;
    });
  }

  // One-shot: once the next CommandComplete from the server whose tag starts with `tag_prefix`
  // ("" matches any) has been read, the bytes read with it go on to the client, and then the
  // proxy stalls as stall() does, until resume(): the statement's answer arrived, the next one
  // will not. A new call replaces an armed prefix.
  void stall_after(std::string tag_prefix) {
    control([&] {
      stall_prefix_ = std::move(tag_prefix);
      ++stall_arm_;
    });
  }

  // Stalls that stall_after() started so far.
  std::uint64_t stalls_started() const { return stalls_started_; }

  // Connections accepted so far.
  std::uint64_t accepted() const { return accepted_; }
  // Bytes written to the server so far, over all connections.
  std::uint64_t bytes_to_server() const { return bytes_to_server_; }
  // Bytes written to clients so far, over all connections.
  std::uint64_t bytes_to_client() const { return bytes_to_client_; }
  // Replies dropped by drop_reply_after() so far.
  std::uint64_t replies_dropped() const { return replies_dropped_; }
  // Connections open now (accepted and not closed), as of the loop's last iteration.
  std::size_t open_connections() const { return open_; }

 private:
  using Clock = std::chrono::steady_clock;
  using Fd = fault_proxy_detail::Fd;

  // Where connections go: a Unix socket or a TCP address.
  struct Target {
    sockaddr_storage address{};
    socklen_t length = 0;
    int family = AF_UNSPEC;
  };

  // One direction of a connection: the bytes read from its source and not yet written to its
  // destination are data[head..], stream offsets [written, read).
  struct Direction {
    std::string data;
    std::size_t head = 0;
    std::uint64_t read = 0;
    std::uint64_t written = 0;
    bool eof = false;   // the source is no longer read (it ended its side, or the pair is ending)
    bool shut = false;  // the destination's write side is shut down (or no longer written)

    std::size_t held() const { return data.size() - head; }
    std::size_t room() const { return kDirectionCap - held(); }
    // Forgets the first `n` bytes held (they were written).
    void consume(std::size_t n) {
      head += n;
      written += n;
      if (head == data.size()) {
        data.clear();
        head = 0;
      } else if (head >= (std::size_t{1} << 16) && head * 2 >= data.size()) {
        data.erase(0, head);
        head = 0;
      }
    }
  };

  // Where a connection's server side is.
  enum class Upstream {
    none,        // not connected yet (a stall, or a Unix socket backlog full): tried each iteration
    connecting,  // a non-blocking connect is in progress
    connected,   // bytes flow
    dropped,     // closed by drop_reply_after(), never connected again
  };

  // A client connection and its connection to the target. Loop thread only.
  struct Connection {
    Fd client;
    Fd server;
    Upstream upstream = Upstream::none;
    bool dead = false;                     // to be closed at the end of the loop's iteration
    Clock::time_point connect_deadline{};  // set when connecting to the target begins
    Direction up;                          // client → server
    Direction down;                        // server → client
    fault_proxy_detail::ClientStartup startup;
    fault_proxy_detail::ServerStream replies;
  };

  // The control state one loop iteration works with.
  struct Snapshot {
    bool stalled = false;
    std::optional<std::string> drop_prefix;
    std::uint64_t drop_arm = 0;
    std::optional<std::string> stall_prefix;
    std::uint64_t stall_arm = 0;
  };

  // Throws std::system_error for errno, naming `what` failed.
  [[noreturn]] static void throw_errno(const std::string& what) {
    throw std::system_error(errno, std::generic_category(), "FaultProxy: " + what);
  }

  // The address "unix:/path" or "HOST:PORT" names (HOST resolved, the first address taken).
  static Target parse_target(std::string text) {
    Target t;
    if (text.rfind("unix:", 0) == 0) {
      const std::string path = text.substr(5);
      sockaddr_un un{};
      un.sun_family = AF_UNIX;
      if (path.empty() || path.size() >= sizeof un.sun_path) {
        throw std::invalid_argument("FaultProxy: Unix socket path empty or too long: " + text);
      }
      std::memcpy(un.sun_path, path.data(), path.size());
      std::memcpy(&t.address, &un, sizeof un);
      t.length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + 1);
      t.family = AF_UNIX;
      return t;
    }
    const std::size_t colon = text.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) {
      throw std::invalid_argument("FaultProxy: target \"" + text +
                                  "\" is neither unix:/path nor HOST:PORT");
    }
    std::string host = text.substr(0, colon);
    const std::string port = text.substr(colon + 1);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
      host = host.substr(1, host.size() - 2);
    }
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
    if (rc != 0 || found == nullptr) {
      throw std::invalid_argument("FaultProxy: cannot resolve target \"" + text +
                                  "\": " + ::gai_strerror(rc));
    }
    std::memcpy(&t.address, found->ai_addr, found->ai_addrlen);
    t.length = found->ai_addrlen;
    t.family = found->ai_family;
    ::freeaddrinfo(found);
    return t;
  }

  // Sends small writes at once (no Nagle delay) on a TCP socket.
  static void set_nodelay(int fd) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }

  // Whether a failed read or write is to be tried again later.
  static bool transient(int error) {
    return error == EAGAIN || error == EWOULDBLOCK || error == EINTR;
  }

  // Applies `change` to the control state and waits until the loop has taken it in.
  template <class Change>
  void control(Change&& change) {
    std::unique_lock lock(mu_);
    change();
    const std::uint64_t request = ++requests_;
    applied_cv_.wait(lock, [&] { return applied_ >= request || loop_done_; });
  }

  // The loop thread: one iteration per poll(), until stop_.
  void run() {
    Snapshot snapshot;
    std::uint64_t cuts_done = 0;
    bool was_stalled = false;
    std::vector<pollfd> fds;
    std::vector<char> chunk(std::size_t{1} << 16);
    Clock::time_point accept_paused_until{};
    while (!stop_) {
      {
        std::lock_guard lock(mu_);
        snapshot.stalled = stalled_;
        snapshot.drop_prefix = drop_prefix_;
        snapshot.drop_arm = drop_arm_;
        snapshot.stall_prefix = stall_prefix_;
        snapshot.stall_arm = stall_arm_;
        if (cut_requests_ != cuts_done) {
          connections_.clear();
          cuts_done = cut_requests_;
        }
        open_ = connections_.size();
        applied_ = requests_;
      }
      applied_cv_.notify_all();
      Clock::time_point now = Clock::now();
      if (was_stalled && !snapshot.stalled) {
        for (auto& c : connections_) {
          const bool waiting = c->upstream == Upstream::none || c->upstream == Upstream::connecting;
          if (waiting && c->connect_deadline != Clock::time_point{}) {
            c->connect_deadline = now + kConnectTimeout;
          }
        }
      }
      was_stalled = snapshot.stalled;
      if (!snapshot.stalled) {
        for (auto& c : connections_) {
          if (c->upstream == Upstream::none && !c->dead) connect_upstream(*c, now);
        }
      }

      fds.clear();
      const bool accepting = connections_.size() < kMaxConnections && now >= accept_paused_until;
      fds.push_back(pollfd{accepting ? listener_.get() : -1, POLLIN, 0});
      const std::size_t polled = connections_.size();
      for (const auto& c : connections_) {
        short client_events = 0;
        short server_events = 0;
        if (!snapshot.stalled && !c->dead) {
          client_events = wanted_client_events(*c, snapshot);
          server_events = wanted_server_events(*c);
        }
        fds.push_back(pollfd{client_events != 0 ? c->client.get() : -1, client_events, 0});
        fds.push_back(pollfd{server_events != 0 ? c->server.get() : -1, server_events, 0});
      }
      const int ready = ::poll(fds.data(), static_cast<nfds_t>(fds.size()), kPollMs);
      if (ready < 0) {
        if (errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(kPollMs));
        continue;
      }
      now = Clock::now();
      if ((fds[0].revents & POLLIN) != 0) accept_some(snapshot, now, accept_paused_until);
      if (!snapshot.stalled) {
        for (std::size_t k = 0; k < polled; ++k) {
          Connection& c = *connections_[k];
          if (c.dead) continue;
          pump(c, fds[1 + 2 * k].revents, fds[2 + 2 * k].revents, snapshot, chunk);
          const bool waiting = c.upstream == Upstream::none || c.upstream == Upstream::connecting;
          if (waiting && c.connect_deadline != Clock::time_point{} && now >= c.connect_deadline) {
            c.dead = true;
          }
        }
      }
      std::erase_if(connections_, [](const std::unique_ptr<Connection>& c) { return c->dead; });
      open_ = connections_.size();
    }
    connections_.clear();
    open_ = 0;
    {
      std::lock_guard lock(mu_);
      loop_done_ = true;
    }
    applied_cv_.notify_all();
  }

  // Accepts the connections waiting in the backlog (16 at most per call).
  void accept_some(const Snapshot& snapshot, Clock::time_point now,
                   Clock::time_point& accept_paused_until) {
    for (int k = 0; k < 16 && connections_.size() < kMaxConnections; ++k) {
      const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          accept_paused_until = now + std::chrono::milliseconds(100);
        }
        return;
      }
      set_nodelay(fd);
      auto c = std::make_unique<Connection>();
      c->client = Fd(fd);
      ++accepted_;
      if (!snapshot.stalled) connect_upstream(*c, now);
      connections_.push_back(std::move(c));
    }
  }

  // Starts connecting `c` to the target. A Unix socket whose backlog is full (EAGAIN) is tried
  // again on the next iteration, until the connect deadline (kConnectTimeout after the first
  // attempt, or after a stall that came in between ends); any other failure closes `c`.
  void connect_upstream(Connection& c, Clock::time_point now) {
    if (c.connect_deadline == Clock::time_point{}) c.connect_deadline = now + kConnectTimeout;
    Fd fd(::socket(target_.family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd) {
      c.dead = true;
      return;
    }
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&target_.address), target_.length) ==
        0) {
      c.upstream = Upstream::connected;
    } else if (errno == EINPROGRESS || errno == EINTR) {
      c.upstream = Upstream::connecting;
    } else {
      if (errno != EAGAIN) c.dead = true;
      return;
    }
    if (target_.family != AF_UNIX) set_nodelay(fd.get());
    c.server = std::move(fd);
  }

  // The stream offset up to which the server's bytes may go to the client: all that was read,
  // except a CommandComplete held while a drop is armed and its tag is not decided yet.
  static std::uint64_t down_limit(const Connection& c, const Snapshot& snapshot) {
    if (snapshot.drop_prefix && !c.down.eof) {
      if (const auto start = c.replies.undecided_command()) return std::max(*start, c.down.written);
    }
    return c.down.read;
  }

  // The poll() events the loop waits for on `c`'s client socket (0: none, not polled).
  static short wanted_client_events(const Connection& c, const Snapshot& snapshot) {
    short events = 0;
    if (!c.up.eof && c.up.room() > 0) events |= POLLIN;
    if (!c.down.shut && down_limit(c, snapshot) > c.down.written) events |= POLLOUT;
    return events;
  }

  // The poll() events the loop waits for on `c`'s server socket (0: none, not polled).
  static short wanted_server_events(const Connection& c) {
    if (c.upstream == Upstream::connecting) return POLLOUT;
    if (c.upstream != Upstream::connected) return 0;
    short events = 0;
    if (!c.down.eof && c.down.room() > 0) events |= POLLIN;
    if (!c.up.shut && c.up.held() > 0) events |= POLLOUT;
    return events;
  }

  // Reads once from `fd` into `d` (at most its room). Returns false on a hard error.
  static bool read_into(int fd, Direction& d, std::vector<char>& chunk, std::size_t& got) {
    got = 0;
    const ssize_t n = ::recv(fd, chunk.data(), std::min(chunk.size(), d.room()), 0);
    if (n > 0) {
      got = static_cast<std::size_t>(n);
      d.data.append(chunk.data(), got);
      d.read += got;
    } else if (n == 0) {
      d.eof = true;
    } else if (!transient(errno)) {
      return false;
    }
    return true;
  }

  // Writes once to `fd` from `d`, at most up to stream offset `limit`. Returns false on a hard
  // error.
  static bool write_from(int fd, Direction& d, std::uint64_t limit, std::size_t& sent) {
    sent = 0;
    if (limit <= d.written) return true;
    const auto want = static_cast<std::size_t>(limit - d.written);
    const ssize_t n = ::send(fd, d.data.data() + d.head, want, MSG_NOSIGNAL);
    if (n >= 0) {
      sent = static_cast<std::size_t>(n);
      d.consume(sent);
    } else if (!transient(errno)) {
      return false;
    }
    return true;
  }

  // stall_after() fired: this connection's bytes read so far still go to the client in this
  // pump; from the next iteration on, nothing moves until resume().
  void stall_from_now(Snapshot& snapshot) {
    {
      std::lock_guard lock(mu_);
      stalled_ = true;
      if (stall_arm_ == snapshot.stall_arm) stall_prefix_.reset();
    }
    snapshot.stall_prefix.reset();
    ++stalls_started_;
  }

  // Drops the CommandComplete at stream offset `at` and all after it: the server side closes at
  // once, the client gets the bytes before `at` and then its side closes too.
  void drop_reply(Connection& c, std::uint64_t at, Snapshot& snapshot) {
    {
      std::lock_guard lock(mu_);
      if (drop_arm_ == snapshot.drop_arm) drop_prefix_.reset();
    }
    snapshot.drop_prefix.reset();
    ++replies_dropped_;
    c.down.data.resize(c.down.head + static_cast<std::size_t>(at - c.down.written));
    c.down.read = at;
    c.down.eof = true;
    c.server.reset();
    c.upstream = Upstream::dropped;
    c.up.data.clear();
    c.up.head = 0;
    c.up.eof = true;
    c.up.shut = true;
  }

  // Moves what can move on `c` after a poll() that reported `client_revents` and
  // `server_revents`: one read and one write per direction at most, then half-closes.
  void pump(Connection& c, short client_revents, short server_revents, Snapshot& snapshot,
            std::vector<char>& chunk) {
    constexpr short kReadable = POLLIN | POLLHUP | POLLERR;
    bool progress = false;
    if (c.upstream == Upstream::connecting &&
        (server_revents & (POLLOUT | POLLERR | POLLHUP | POLLNVAL)) != 0) {
      int error = 0;
      socklen_t length = sizeof error;
      if (::getsockopt(c.server.get(), SOL_SOCKET, SO_ERROR, &error, &length) != 0 || error != 0) {
        c.dead = true;
        return;
      }
      c.upstream = Upstream::connected;
      server_revents = 0;
      progress = true;
    }
    std::size_t n = 0;
    if ((client_revents & kReadable) != 0 && !c.up.eof && c.up.room() > 0) {
      if (!read_into(c.client.get(), c.up, chunk, n)) {
        c.dead = true;
        return;
      }
      if (n > 0 && !c.startup.done()) c.startup.feed(chunk.data(), n, c.replies);
      progress = progress || n > 0 || c.up.eof;
    }
    if (c.upstream == Upstream::connected && (server_revents & kReadable) != 0 && !c.down.eof &&
        c.down.room() > 0) {
      if (!read_into(c.server.get(), c.down, chunk, n)) {
        c.dead = true;
        return;
      }
      progress = progress || n > 0 || c.down.eof;
      if (n > 0 && !c.replies.opaque()) {
        std::optional<std::uint64_t> drop_at;
        bool stall_now = false;
        c.replies.feed(chunk.data(), n, [&](std::uint64_t start, const std::string& tag) {
          if (snapshot.stall_prefix && start >= c.down.written &&
              tag.starts_with(*snapshot.stall_prefix)) {
            stall_now = true;
          }
          if (!snapshot.drop_prefix || start < c.down.written ||
              !tag.starts_with(*snapshot.drop_prefix)) {
            return true;
          }
          drop_at = start;
          return false;
        });
        if (drop_at) drop_reply(c, *drop_at, snapshot);
        if (stall_now) stall_from_now(snapshot);
      }
    }
    if (c.upstream == Upstream::connected && !c.up.shut) {
      if (!write_from(c.server.get(), c.up, c.up.read, n)) {
        c.dead = true;
        return;
      }
      bytes_to_server_ += n;
      progress = progress || n > 0;
    }
    if (!c.down.shut) {
      if (!write_from(c.client.get(), c.down, down_limit(c, snapshot), n)) {
        c.dead = true;
        return;
      }
      bytes_to_client_ += n;
      progress = progress || n > 0;
    }
    if (c.upstream == Upstream::connected && c.up.eof && c.up.held() == 0 && !c.up.shut) {
      ::shutdown(c.server.get(), SHUT_WR);
      c.up.shut = true;
      progress = true;
    }
    if (c.down.eof && c.down.held() == 0 && !c.down.shut) {
      ::shutdown(c.client.get(), SHUT_WR);
      c.down.shut = true;
      progress = true;
    }
    if (c.up.shut && c.down.shut) c.dead = true;
    // A hang-up or error that moved nothing will be reported again at once: end the pair.
    if (!progress && ((client_revents | server_revents) & (POLLHUP | POLLERR | POLLNVAL)) != 0) {
      c.dead = true;
    }
  }

  const Target target_;     // set in the constructor, read-only afterwards
  std::uint16_t port_ = 0;  // set in the constructor, read-only afterwards
  Fd listener_;             // loop thread only, once the loop runs

  // mu_ guards the control state: stalled_, drop_prefix_, drop_arm_, stall_prefix_,
  // stall_arm_, cut_requests_, requests_,
  // applied_ and loop_done_. The loop reads it once per iteration and sets applied_ (notifying
  // applied_cv_) once it has taken in every request made so far.
  std::mutex mu_;
  std::condition_variable applied_cv_;
  bool stalled_ = false;
  std::optional<std::string> drop_prefix_;   // armed drop_reply_after() prefix
  std::uint64_t drop_arm_ = 0;               // drop_reply_after() calls so far
  std::optional<std::string> stall_prefix_;  // armed stall_after() prefix
  std::uint64_t stall_arm_ = 0;              // stall_after() calls so far
  std::uint64_t cut_requests_ = 0;           // cut() calls so far
  std::uint64_t requests_ = 0;               // control calls so far
  std::uint64_t applied_ = 0;                // control calls the loop has taken in
  bool loop_done_ = false;                   // the loop has exited

  // Counters: written by the loop thread, read by any thread.
  std::atomic<std::uint64_t> accepted_{0};
  std::atomic<std::uint64_t> bytes_to_server_{0};
  std::atomic<std::uint64_t> bytes_to_client_{0};
  std::atomic<std::uint64_t> replies_dropped_{0};
  std::atomic<std::uint64_t> stalls_started_{0};
  std::atomic<std::size_t> open_{0};

  std::vector<std::unique_ptr<Connection>> connections_;  // loop thread only
  std::atomic<bool> stop_{false};
  std::thread loop_;  // started last, in the constructor
};

}  // namespace idem::test
