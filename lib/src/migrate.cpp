#include "idem/migrate.hpp"

#include <fmt/format.h>
#include <sqlite3.h>  // SQLITE_NOTADB only: every call goes through the wrappers

#include <filesystem>
#include <optional>
#include <vector>

#include "idem/errors.hpp"
#include "idem/internal/sqlite.hpp"
#include "pg_import.hpp"
#include "record_codec.hpp"
#include "sql.hpp"
#include "sqlite_migrations.hpp"

namespace idem {
namespace {

using sqlite::ResetGuard;
using sqlite::Statement;

// How long a read of the file waits for a writer's lock (a checkpoint, a migration).
constexpr std::chrono::milliseconds kBusyTimeout{5000};

std::optional<std::string> text_or_null(const Statement& s, int column) {
  if (s.is_null(column)) return std::nullopt;
  return s.text(column);
}

std::optional<std::string> blob_or_null(const Statement& s, int column) {
  if (s.is_null(column)) return std::nullopt;
  return s.blob(column);
}

// The SqliteStore file, opened to be read: checked to be an idem store, and brought to this
// library's schema.
class SqliteSource {
 public:
  explicit SqliteSource(const std::string& path)
      : db_(open(path, busy_)),
        records_(db_.get(), sql::kExportRecords),
        outbox_(db_.get(), sql::kExportOutbox) {}

  // The next `limit` records after `after` (all of them from the first when null), in key
  // order.
  std::vector<detail::RecordRow> records(const KeyId* after, std::size_t limit) {
    static const KeyId kFirst{"", "", ""};
    const KeyId& from = after != nullptr ? *after : kFirst;
    Statement& s = records_;
    ResetGuard reset(s);
    s.bind(1, from.tenant);
    s.bind(2, from.operation);
    s.bind(3, from.key);
    s.bind(4, static_cast<std::int64_t>(limit));
    std::vector<detail::RecordRow> out;
    while (s.step()) {
      detail::RecordRow r;
      r.id = KeyId{s.text(0), s.text(1), s.text(2)};
      r.fingerprint = s.blob(3);
      r.state = s.int64(4);
      r.token = s.int64(5);
      r.lease_until = detail::at_ms(s.int64(6));
      r.created_at = detail::at_ms(s.int64(7));
      r.expires_at = detail::at_ms(s.int64(8));
      if (!s.is_null(9)) r.status = s.int64(9);
      r.headers = text_or_null(s, 10);
      r.body = blob_or_null(s, 11);
      r.body_ref = text_or_null(s, 12);
      r.recovery_point = text_or_null(s, 13);
      r.progress = text_or_null(s, 14);
      r.request = blob_or_null(s, 15);
      if (!s.is_null(16)) r.claim = s.int64(16);
      out.push_back(std::move(r));
    }
    return out;
  }

  // The next `limit` messages not yet delivered after the id `after`, in id order.
  std::vector<detail::MessageRow> messages(const std::string& after, std::size_t limit) {
    Statement& s = outbox_;
    ResetGuard reset(s);
    s.bind(1, after);
    s.bind(2, static_cast<std::int64_t>(limit));
    std::vector<detail::MessageRow> out;
    while (s.step()) {
      out.push_back(detail::MessageRow{s.text(0), s.text(1), s.blob(2), s.text(3), s.int64(4),
                                       s.int64(5), detail::at_ms(s.int64(6)),
                                       detail::at_ms(s.int64(7)), text_or_null(s, 8)});
    }
    return out;
  }

 private:
  static sqlite::Connection open(const std::string& path, sqlite::BusyPolicy& busy) {
    // Opening creates a missing file: look first.
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) {
      throw error(errc::invalid_argument,
                  fmt::format("idem: migrate: {} is not a file (an idem SQLite store)", path));
    }
    sqlite::Connection db = sqlite::open_connection(path, &busy);
    std::int64_t version = 0;
    try {
      Statement s(db.get(), sql::kUserVersion);
      s.step();
      version = s.int64(0);
    } catch (const StoreError& e) {
      if ((e.sqlite_code() & 0xff) != SQLITE_NOTADB) throw;
      throw error(errc::invalid_argument,
                  fmt::format("idem: migrate: {} is not an SQLite database", path));
    }
    const std::int64_t known = detail::schema_version();
    if (version == 0) {
      throw error(errc::invalid_argument,
                  fmt::format("idem: migrate: {} is not an idem store (no schema version)", path));
    }
    if (version > known) {
      throw error(errc::invalid_argument,
                  fmt::format("idem: migrate: {} has schema version {}, newer than this "
                              "library's {}: migrate it with a newer idem",
                              path, version, known));
    }
    if (version < known) {
      sqlite::TransactionStatements tx(db.get());
      detail::migrate(db.get(), tx);
    }
    Statement tables(db.get(), sql::kIdemTables);
    tables.step();
    if (tables.int64(0) != 2) {
      throw error(errc::invalid_argument,
                  fmt::format("idem: migrate: {} is not an idem store (no idem_keys and "
                              "idem_outbox tables)",
                              path));
    }
    return db;
  }

  sqlite::BusyPolicy busy_{kBusyTimeout, {}};  // outlives db_ (declared first)
  sqlite::Connection db_;
  Statement records_, outbox_;
};

// Whether a record no longer counts at the source's `now`, so it is not copied: its expiry
// passed (a completed record's TTL, a released record's retry window, an in-progress
// record's lease). An in-progress record with progress counts whatever its lease: its owner
// died mid-way and the completer (or a retry) resumes it (money may have moved).
bool expired(const detail::RecordRow& row, TimePoint now) {
  const bool resumable = row.state == static_cast<int>(State::in_progress) && row.progress;
  return !resumable && row.expires_at <= now;
}

}  // namespace

MigrationReport migrate_sqlite_to_pg(const std::string& sqlite_file, PgStore& to,
                                     const MigrationOptions& options) {
  if (options.batch == 0)
    throw error(errc::invalid_argument, "idem: MigrationOptions::batch must be positive");
  const std::shared_ptr<Clock> clock =
      options.clock ? options.clock : std::make_shared<SystemClock>();
  SqliteSource from(sqlite_file);
  MigrationReport report;
  const auto batch_done = [&] {
    if (options.on_batch) options.on_batch(report);
  };

  std::optional<KeyId> last;
  for (;;) {
    std::vector<detail::RecordRow> rows = from.records(last ? &*last : nullptr, options.batch);
    if (rows.empty()) break;
    const TimePoint now = clock->now();
    for (detail::RecordRow& row : rows) {
      // Past the token any holder on SQLite has: a holder from before the move is a zombie
      // on PostgreSQL, whose every write is refused.
      row.token += 1;
      row.refresh_only = expired(row, now);
    }
    const std::vector<detail::PgImport::Outcome> outcomes = detail::PgImport::records(to, rows);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      switch (outcomes[i]) {
        case detail::PgImport::Outcome::written:
          ++report.records_copied;
          break;
        case detail::PgImport::Outcome::newer:
          ++report.records_skipped_newer;
          break;
        case detail::PgImport::Outcome::unchanged:
          if (rows[i].refresh_only) {
            ++report.records_expired;
          } else {
            ++report.records_unchanged;
          }
          break;
        case detail::PgImport::Outcome::absent:
          ++report.records_expired;
          break;
      }
    }
    last = rows.back().id;
    batch_done();
    if (rows.size() < options.batch) break;
  }

  std::string last_id;
  for (;;) {
    const std::vector<detail::MessageRow> rows = from.messages(last_id, options.batch);
    if (rows.empty()) break;
    for (const bool inserted : detail::PgImport::messages(to, rows)) {
      ++(inserted ? report.outbox_copied : report.outbox_skipped);
    }
    last_id = rows.back().id;
    batch_done();
    if (rows.size() < options.batch) break;
  }
  return report;
}

}  // namespace idem
