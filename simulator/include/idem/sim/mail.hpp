// idem::sim — the simulated mail sender: the seed's "mail through a service with no keys".
//
// It takes no idempotency key. The only thing it deduplicates on is the message id the
// caller's outbox gives each mail: a send with a message id already journaled delivers
// nothing and returns false. Its journal counts every mail delivered, the ground truth of
// tests as the provider's ledger is for charges. The journal is an SQLite database: private
// in memory by default, or a file shared by several processes (it may be the provider's
// ledger file; the journal has its own table).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "idem/clock.hpp"

namespace idem::sim {

struct MailOptions {
  // Journal database file shared by processes; empty: private, in memory. Default: empty.
  std::string journal_path{};
};

// An infrastructure failure: the mail service could not be reached. Nothing was sent.
class MailUnavailable : public std::runtime_error {
 public:
  MailUnavailable() : std::runtime_error("mail service unavailable") {}
};

struct Mail {
  std::int64_t seq = 0;
  std::string message_id;
  std::string to;
  std::string text;
  TimePoint at;
};

// Thread-safety: safe for concurrent use.
class MailSender {
 public:
  // Throws std::runtime_error if the journal cannot be opened.
  explicit MailSender(std::shared_ptr<Clock> clock, MailOptions options = {});
  ~MailSender();
  MailSender(const MailSender&) = delete;
  MailSender& operator=(const MailSender&) = delete;

  // Journals the mail at the clock's now and returns true; returns false and journals
  // nothing if a mail with `message_id` already was (a duplicate, in any process sharing
  // the journal). Throws MailUnavailable for an injected failure (nothing journaled);
  // throws StoreError if the journal cannot be written.
  bool send(const std::string& message_id, const std::string& to, const std::string& text);

  // Makes the next `times` sends throw MailUnavailable (added to any still pending).
  void fail_next(std::size_t times);

  // The journal: how many mails were delivered, and each of them in seq order. Throw
  // StoreError if the journal cannot be read.
  std::size_t count() const;
  std::vector<Mail> journal() const;
  // How many sends this object refused as duplicates.
  std::size_t duplicates() const;

 private:
  struct Journal;

  std::shared_ptr<Clock> clock_;
  std::unique_ptr<Journal> journal_;
  mutable std::mutex mutex_;  // guards failures_, duplicates_ and every use of journal_
  std::size_t failures_ = 0;
  std::size_t duplicates_ = 0;
};

}  // namespace idem::sim
