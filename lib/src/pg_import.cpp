// migrate_sqlite_to_pg's writes into a PgStore (pg_import.hpp).
#include <libpq-fe.h>

#include <chrono>

#include "idem/errors.hpp"
#include "idem/pg_store.hpp"
#include "pg_import.hpp"
#include "pg_store_impl.hpp"

namespace idem {

using namespace pgstore;

namespace {

// On the database's clock, how far apart an imported time and an earlier copy of it may be and
// still count as the same time (PgImport::records): each run measures the clock's offset anew,
// within half a round trip. A real change moves a time further (a renewal: by a heartbeat) or
// changes another column too (a completion, a release).
constexpr std::chrono::milliseconds kImportClockSlack{1000};

}  // namespace

namespace detail {
namespace {

void optional_text(Params& p, const std::optional<std::string>& v) {
  if (v) {
    p.text(*v);
  } else {
    p.null();
  }
}

}  // namespace

std::vector<PgImport::Outcome> PgImport::records(PgStore& store, std::span<const RecordRow> rows) {
  PgStore::Impl& d = *store.impl_;
  return d.locked([&] {
    const Shift sh = d.shift();
    const std::int64_t slack = d.options.clock == PgClock::caller ? 0 : kImportClockSlack.count();
    std::vector<Outcome> out;
    out.reserve(rows.size());
    pg::Connection::Transaction t(d.connection);
    for (const RecordRow& row : rows) {
      Params p;
      key_params(p, row.id)
          .bytes(row.fingerprint)
          .integer(row.state)
          .integer(row.token)
          .integer(sh.to_db(row.lease_until))
          .integer(sh.to_db(row.created_at))
          .integer(sh.to_db(row.expires_at));
      if (row.status) {
        p.integer(*row.status);
      } else {
        p.null();
      }
      optional_text(p, row.headers);
      optional_text(p, row.body);
      optional_text(p, row.body_ref);
      optional_text(p, row.recovery_point);
      optional_text(p, row.progress);
      optional_text(p, row.request);
      p.integer(slack).integer(row.refresh_only ? 1 : 0);
      if (row.claim) {
        p.integer(*row.claim);
      } else {
        p.null();
      }
      Result r = d.run(kImportRecord, p);
      if (PQntuples(r.get()) != 1) throw StoreError("postgresql: an import returned no row", 0);
      if (pg::int_at(r.get(), 0, 0) == 1) {
        out.push_back(Outcome::written);
      } else if (pg::is_null(r.get(), 0, 1)) {
        out.push_back(Outcome::absent);
      } else {
        out.push_back(pg::int_at(r.get(), 0, 1) > row.token ? Outcome::newer : Outcome::unchanged);
      }
    }
    t.commit();
    return out;
  });
}

std::vector<bool> PgImport::messages(PgStore& store, std::span<const MessageRow> rows) {
  PgStore::Impl& d = *store.impl_;
  return d.locked([&] {
    const Shift sh = d.shift();
    std::vector<bool> out;
    out.reserve(rows.size());
    pg::Connection::Transaction t(d.connection);
    for (const MessageRow& row : rows) {
      Params p;
      p.text(row.id)
          .text(row.topic)
          .bytes(row.payload)
          .text(row.key_hash)
          .integer(row.state)
          .integer(row.attempts)
          .integer(sh.to_db(row.next_at))
          .integer(sh.to_db(row.created_at));
      if (row.last_error) {
        p.text(valid_utf8(*row.last_error));
      } else {
        p.null();
      }
      out.push_back(pg::changed(d.run(kImportMessage, p).get()) == 1);
    }
    t.commit();
    return out;
  });
}

}  // namespace detail

}  // namespace idem
