// PgStore's multi-step operations and outbox (idem::StepStore): progress on the record,
// local steps in the store's transaction, messages queued with them. See pg_store.cpp for the
// rest of the store.
#include <fmt/format.h>
#include <libpq-fe.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <variant>

#include "idem/errors.hpp"
#include "idem/key.hpp"
#include "idem/pg_store.hpp"
#include "pg_sql.hpp"
#include "pg_store_impl.hpp"

namespace idem {

using namespace pgstore;

namespace {

// A list of strings as one parameter: a JSON array, which the statement reads with
// json_array_elements_text.
std::string json_list(std::span<const std::string> items) {
  nlohmann::json list = nlohmann::json::array();
  for (const std::string& item : items) list.push_back(item);
  return list.dump();
}

// A local step's handle on the store's open transaction. Text-format results, decoded by
// type, so any column type comes back readable.
class PgLocal final : public LocalTransaction {
 public:
  PgLocal(pg::Session& session, std::string outbox_insert, const KeyId& id, std::int64_t origin,
          std::string_view step, std::int64_t now_db)
      : session_(session),
        outbox_insert_(std::move(outbox_insert)),
        id_(id),
        origin_(origin),
        step_(step),
        now_db_(now_db) {}

  Dialect dialect() const noexcept override { return Dialect::postgresql; }

  std::vector<Row> execute(std::string_view sql, std::initializer_list<Value> params) override {
    Params p;
    for (const Value& v : params) {
      if (std::holds_alternative<std::nullptr_t>(v)) {
        p.null();
      } else if (const auto* n = std::get_if<std::int64_t>(&v)) {
        p.integer(*n);
      } else if (const auto* d = std::get_if<double>(&v)) {
        p.real(*d);
      } else {
        p.bytes(std::get<std::string>(v));
      }
    }
    const std::string text(sql);
    Result r =
        session_.exec_params(text.c_str(), p.count(), p.values(), p.lengths(), p.formats(), 0);
    const ExecStatusType status = PQresultStatus(r.get());
    if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) {
      throw StoreError(pg::describe("a local step's statement", r.get(), session_.get()), 0);
    }
    // As sqlite3_changes(): rows the last INSERT, UPDATE or DELETE changed (PQcmdTuples also
    // counts the rows of a SELECT, which leaves the count as it was).
    const std::string_view command = PQcmdStatus(r.get());
    if (std::any_of(pg_sql::kWriteCommandTags.begin(), pg_sql::kWriteCommandTags.end(),
                    [&](std::string_view tag) { return command.starts_with(tag); })) {
      const char* n = PQcmdTuples(r.get());
      changes_ = n != nullptr && *n != '\0' ? std::stoll(n) : 0;
    }
    std::vector<Row> rows;
    for (int row = 0; row < PQntuples(r.get()); ++row) {
      Row out;
      for (int col = 0; col < PQnfields(r.get()); ++col) out.push_back(value(r.get(), row, col));
      rows.push_back(std::move(out));
    }
    return rows;
  }

  std::int64_t changes() const override { return changes_; }

  std::string enqueue(std::string_view topic, std::string_view payload) override {
    std::string id = outbox_message_id(id_, origin_, step_, sent_++);
    Params p;
    p.text(id).text(topic).bytes(payload).text(short_hash(id_)).integer(now_db_);
    Result r = session_.exec_prepared(outbox_insert_.c_str(), p.count(), p.values(), p.lengths(),
                                      p.formats(), 1);
    if (PQresultStatus(r.get()) != PGRES_COMMAND_OK)
      throw StoreError(pg::describe("queueing a message", r.get(), session_.get()), 0);
    return id;
  }

 private:
  static Value value(const PGresult* r, int row, int col) {
    if (PQgetisnull(r, row, col)) return nullptr;
    const char* text = PQgetvalue(r, row, col);
    switch (PQftype(r, col)) {
      case pg::kInt2Oid:
      case pg::kInt4Oid:
      case pg::kInt8Oid:
        return std::int64_t{std::stoll(text)};
      case pg::kFloat4Oid:
      case pg::kFloat8Oid:
        return std::stod(text);
      case pg::kBoolOid:
        return std::int64_t{text[0] == 't' ? 1 : 0};
      case pg::kByteaOid: {
        std::size_t n = 0;
        unsigned char* raw = PQunescapeBytea(reinterpret_cast<const unsigned char*>(text), &n);
        if (raw == nullptr) throw StoreError("postgresql: a bytea column does not decode", 0);
        std::string out(reinterpret_cast<const char*>(raw), n);
        PQfreemem(raw);
        return out;
      }
      default:
        return std::string(text, static_cast<std::size_t>(PQgetlength(r, row, col)));
    }
  }

  pg::Session& session_;
  std::string outbox_insert_;  // the prepared statement's name
  const KeyId& id_;
  std::int64_t origin_;
  std::string_view step_;
  std::int64_t now_db_;
  std::size_t sent_ = 0;
  std::int64_t changes_ = 0;
};

}  // namespace

std::optional<ProgressRow> PgStore::Impl::load_progress(const KeyId& id) {
  Params p;
  key_params(p, id);
  Result r = run(kLoadProgress, p);
  if (PQntuples(r.get()) == 0) return std::nullopt;
  return read_progress(r.get());
}

bool PgStore::Impl::write_progress(const KeyId& id, std::int64_t token, const Progress& progress,
                                   const std::string* recovery_point) {
  Params p;
  key_params(p, id).integer(token).text(detail::progress_to_json(progress));
  if (recovery_point != nullptr) {
    p.text(*recovery_point);
  } else {
    p.null();
  }
  return pg::changed(run(kSetProgress, p).get()) == 1;
}

std::optional<Progress> PgStore::begin_steps(const KeyId& id, std::int64_t token,
                                             const std::string& request) {
  Impl& d = *impl_;
  return d.locked([&]() -> std::optional<Progress> {
    Params p;
    key_params(p, id).integer(token).bytes(request);
    Result r = d.run(kBeginSteps, p);
    if (PQntuples(r.get()) == 0) return std::nullopt;
    ProgressRow row = read_progress(r.get());
    if (row.progress) return std::move(row.progress);
    Progress fresh;  // nothing happened yet: this attempt is the operation's origin
    fresh.origin = token;
    fresh.request = request;
    return fresh;
  });
}

bool PgStore::mark_pending(const KeyId& id, std::int64_t token, std::int64_t origin,
                           const std::string& step, const LeaseCheck& lease) {
  Impl& d = *impl_;
  return d.locked([&] {
    pg::Connection::Transaction t(d.connection);
    std::optional<ProgressRow> row = d.load_progress(id);
    if (!row || row->token != token || row->state != State::in_progress) return false;
    Params p;
    key_params(p, id).integer(token).text(
        detail::progress_to_json(detail::with_pending(std::move(row->progress), origin, step)));
    // On the database's clock, the lease is judged (and renewed) when the statement runs.
    if (d.options.clock == PgClock::database) {
      p.null();
    } else {
      p.integer(d.shift().to_db(lease.now));
    }
    p.integer((lease.needed - lease.now).count()).integer((lease.renew_to - lease.now).count());
    if (pg::changed(d.run(kMarkPending, p).get()) != 1) return false;  // the lease ends too soon
    t.commit();
    return true;
  });
}

bool PgStore::commit_step(const KeyId& id, std::int64_t token, std::int64_t origin,
                          const StepCommit& step) {
  Impl& d = *impl_;
  return d.locked([&] {
    pg::Connection::Transaction t(d.connection);
    std::optional<ProgressRow> row = d.load_progress(id);
    if (!row || row->token != token || row->state != State::in_progress)
      return false;  // a zombie: nothing of its step runs
    if (step.local) {
      PgLocal local(d.session(), statement_name(kOutboxInsert), id, origin, step.result.step,
                    d.shift().to_db(step.now));
      step.local(local);
    }
    const Progress p = detail::with_step(std::move(row->progress), origin, step.result);
    if (!d.write_progress(id, token, p, &step.result.step))
      throw StoreError("postgresql: commit_step: record changed inside its transaction", 0);
    t.commit();
    return true;
  });
}

std::vector<AbandonedOperation> PgStore::abandoned(TimePoint idle_before, TimePoint now,
                                                   std::size_t limit,
                                                   std::span<const std::string> operations) {
  Impl& d = *impl_->upkeep;
  return d.locked([&] {
    const Shift sh = d.shift();
    Params p;
    p.integer(sh.to_db(idle_before))
        .integer(sh.to_db(now))
        .integer(static_cast<std::int64_t>(limit))
        .text(json_list(operations));
    Result r = d.run(kAbandoned, p);
    std::vector<AbandonedOperation> out;
    for (int row = 0; row < PQntuples(r.get()); ++row) {
      AbandonedOperation a;
      a.id = KeyId{std::string(pg::bytes_at(r.get(), row, 0)),
                   std::string(pg::bytes_at(r.get(), row, 1)),
                   std::string(pg::bytes_at(r.get(), row, 2))};
      const std::string_view fp = pg::bytes_at(r.get(), row, 3);
      Fingerprint::Bytes bytes{};
      std::copy_n(fp.begin(), std::min(fp.size(), bytes.size()), bytes.begin());
      a.fingerprint = Fingerprint(bytes);
      a.state = static_cast<State>(pg::int_at(r.get(), row, 4));
      a.request = std::string(pg::bytes_at(r.get(), row, 5));
      out.push_back(std::move(a));
    }
    return out;
  });
}

std::vector<OutboxMessage> PgStore::claim_outbox(TimePoint now, TimePoint claim_until,
                                                 std::size_t limit) {
  Impl& d = *impl_->upkeep;
  std::vector<OutboxMessage> out = d.locked([&] {
    const Shift sh = d.shift();
    Params p;
    p.integer(sh.to_db(now))
        .integer(sh.to_db(claim_until))
        .integer(static_cast<std::int64_t>(limit));
    Result r = d.run(kOutboxClaim, p);
    std::vector<OutboxMessage> claimed;
    for (int row = 0; row < PQntuples(r.get()); ++row) {
      claimed.push_back(OutboxMessage{
          std::string(pg::bytes_at(r.get(), row, 0)), std::string(pg::bytes_at(r.get(), row, 1)),
          std::string(pg::bytes_at(r.get(), row, 2)), static_cast<int>(pg::int_at(r.get(), row, 3)),
          sh.from_db(pg::int_at(r.get(), row, 4))});
    }
    return claimed;
  });
  std::stable_sort(out.begin(), out.end(), [](const OutboxMessage& a, const OutboxMessage& b) {
    return a.created_at < b.created_at;
  });
  return out;
}

std::size_t PgStore::outbox_delivered(std::span<const std::string> ids, TimePoint now) {
  if (ids.empty()) return 0;
  Impl& d = *impl_->upkeep;
  return d.locked([&] {
    Params p;
    p.text(json_list(ids)).integer(d.shift().to_db(now));
    return static_cast<std::size_t>(pg::changed(d.run(kOutboxDelivered, p).get()));
  });
}

void PgStore::outbox_failed(const std::string& id, TimePoint retry_at, bool park,
                            const std::string& why) {
  Impl& d = *impl_->upkeep;
  d.locked([&] {
    Params p;
    p.text(id).integer(d.shift().to_db(retry_at)).integer(park ? 1 : 0).text(valid_utf8(why));
    d.run(kOutboxFailed, p);
  });
}

OutboxCounts PgStore::outbox_counts() {
  Impl& d = *impl_->upkeep;
  return d.locked([&] {
    Params none;
    Result r = d.run(kOutboxCounts, none);
    OutboxCounts c;
    for (int row = 0; row < PQntuples(r.get()); ++row) {
      detail::add_outbox_count(c, pg::int_at(r.get(), row, 0),
                               static_cast<std::size_t>(pg::int_at(r.get(), row, 1)));
    }
    return c;
  });
}

std::size_t PgStore::purge_outbox(TimePoint delivered_before, std::size_t limit) {
  Impl& d = *impl_->upkeep;
  return d.locked([&] {
    Params p;
    p.integer(d.shift().to_db(delivered_before)).integer(static_cast<std::int64_t>(limit));
    return static_cast<std::size_t>(pg::changed(d.run(kOutboxPurge, p).get()));
  });
}

}  // namespace idem
