#include "idem/sim/mail.hpp"

#include "idem/internal/sqlite.hpp"
#include "mail_sql.hpp"

namespace idem::sim {

struct MailSender::Journal {
  sqlite::BusyPolicy busy{std::chrono::seconds(30), {}};
  sqlite::Connection db;
  sqlite::TransactionStatements tx;
  std::unique_ptr<sqlite::Statement> insert, count, all;

  explicit Journal(const std::string& path)
      : db(sqlite::open_connection(path.empty() ? ":memory:" : path, &busy)), tx(db.get()) {
    sqlite::enable_wal(db.get(), busy);
    {
      sqlite::Transaction schema(tx);
      sqlite::exec(db.get(), sql::kMailSchema);
      schema.commit();
    }
    auto make = [this](std::string_view text) {
      return std::make_unique<sqlite::Statement>(db.get(), text);
    };
    insert = make(sql::kMailInsert);
    count = make(sql::kMailCount);
    all = make(sql::kMailAll);
  }
};

MailSender::MailSender(std::shared_ptr<Clock> clock, MailOptions options)
    : clock_(std::move(clock)), journal_(std::make_unique<Journal>(options.journal_path)) {}

MailSender::~MailSender() = default;

void MailSender::fail_next(std::size_t times) {
  std::lock_guard lock(mutex_);
  failures_ += times;
}

bool MailSender::send(const std::string& message_id, const std::string& to,
                      const std::string& text) {
  std::lock_guard lock(mutex_);
  if (failures_ > 0) {
    --failures_;
    throw MailUnavailable();
  }
  sqlite::Statement& s = *journal_->insert;
  sqlite::ResetGuard reset(s);
  s.bind(1, message_id);
  s.bind(2, to);
  s.bind(3, text);
  s.bind(4, static_cast<std::int64_t>(clock_->now().time_since_epoch().count()));
  if (!s.step()) {  // the message id is already journaled: one statement, atomic
    ++duplicates_;
    return false;
  }
  s.step();
  return true;
}

std::size_t MailSender::count() const {
  std::lock_guard lock(mutex_);
  sqlite::Statement& s = *journal_->count;
  sqlite::ResetGuard reset(s);
  s.step();
  return static_cast<std::size_t>(s.int64(0));
}

std::vector<Mail> MailSender::journal() const {
  std::lock_guard lock(mutex_);
  sqlite::Statement& s = *journal_->all;
  sqlite::ResetGuard reset(s);
  std::vector<Mail> out;
  while (s.step()) {
    out.push_back(Mail{s.int64(0), s.text(1), s.text(2), s.text(3),
                       TimePoint(std::chrono::milliseconds(s.int64(4)))});
  }
  return out;
}

std::size_t MailSender::duplicates() const {
  std::lock_guard lock(mutex_);
  return duplicates_;
}

}  // namespace idem::sim
