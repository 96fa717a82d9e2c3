#include "idem/file_payload_store.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "idem/errors.hpp"
#include "sha256.hpp"

namespace idem {
namespace {

[[noreturn]] void fail(const std::string& what, int error = errno) {
  throw StoreError(fmt::format("payload store: {}: {}", what, std::strerror(error)), 0);
}

// Removes the temporary file and fails with the error that came before the removal.
[[noreturn]] void abandon(const std::string& temp, const std::string& what, int error) {
  ::unlink(temp.c_str());
  fail(what, error);
}

// Closes a descriptor on every path out.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void sync_directory(const std::string& dir) {
  Fd d{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (d.fd < 0 || ::fsync(d.fd) != 0) fail("cannot sync " + dir);
}

}  // namespace

FilePayloadStore::FilePayloadStore(std::string directory) : directory_(std::move(directory)) {
  std::error_code ec;
  std::filesystem::create_directories(directory_, ec);
  if (ec || !std::filesystem::is_directory(directory_)) {
    throw StoreError(fmt::format("payload store: cannot create directory {}: {}", directory_,
                                 ec ? ec.message() : "not a directory"),
                     0);
  }
}

std::string FilePayloadStore::put(const KeyId& id, const std::string& body) {
  const std::string ref =
      fmt::format("{}-{}", short_hash(id), detail::hex(detail::sha256({body}), 16));
  const std::string path = directory_ + "/" + ref;
  static std::atomic<unsigned long> sequence{0};
  const std::string temp =
      fmt::format("{}.tmp.{}.{}", path, static_cast<long>(::getpid()), ++sequence);
  {
    Fd f{::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644)};
    if (f.fd < 0) fail("cannot create " + temp);
    for (std::size_t done = 0; done < body.size();) {
      const ssize_t n = ::write(f.fd, body.data() + done, body.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) abandon(temp, "cannot write " + temp, n == 0 ? EIO : errno);
      done += static_cast<std::size_t>(n);
    }
    if (::fsync(f.fd) != 0) abandon(temp, "cannot sync " + temp, errno);
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) abandon(temp, "cannot rename " + temp, errno);
  sync_directory(directory_);
  return ref;
}

std::string FilePayloadStore::get(const std::string& ref) {
  const bool ours =
      !ref.empty() && ref.size() < 64 && std::all_of(ref.begin(), ref.end(), [](char c) {
        return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || c == '-';
      });
  if (!ours)
    throw StoreError(
        fmt::format("payload store: not a reference of this store: {}", ref.substr(0, 64)), 0);
  const std::string path = directory_ + "/" + ref;
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) fail("cannot open " + path);
  std::string body;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(f.fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("cannot read " + path);
    if (n == 0) break;
    body.append(buf, static_cast<std::size_t>(n));
  }
  return body;
}

}  // namespace idem
