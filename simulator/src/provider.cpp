#include "idem/sim/provider.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <optional>

#include "idem/internal/sqlite.hpp"
#include "ledger_sql.hpp"

namespace idem::sim {
namespace {

std::string charge_id(std::int64_t seq) { return fmt::format("ch_{}", seq); }

}  // namespace

struct Provider::Ledger {
  sqlite::BusyPolicy busy{std::chrono::seconds(30), {}};
  sqlite::Connection db;
  sqlite::TransactionStatements tx;
  std::unique_ptr<sqlite::Statement> find, by_key, insert, count, all, page, clear_charges;

  explicit Ledger(const std::string& path)
      : db(sqlite::open_connection(path.empty() ? ":memory:" : path, &busy)), tx(db.get()) {
    if (path.empty()) sqlite::exec(db.get(), sql::kMemoryPageSize);  // before the schema
    sqlite::enable_wal(db.get(), busy);
    {
      sqlite::Transaction schema(tx);
      sqlite::exec(db.get(), sql::kLedgerSchema);
      schema.commit();
    }
    auto make = [this](std::string_view text) {
      return std::make_unique<sqlite::Statement>(db.get(), text);
    };
    find = make(sql::kFindByKey);
    by_key = make(sql::kChargeByKey);
    insert = make(sql::kInsert);
    count = make(sql::kCount);
    all = make(sql::kAll);
    page = make(sql::kPage);
    clear_charges = make(sql::kClearCharges);
  }
};

Provider::Provider(std::shared_ptr<Clock> clock, ProviderOptions options)
    : clock_(std::move(clock)),
      options_(std::move(options)),
      ledger_(std::make_unique<Ledger>(options_.ledger_path)) {
  if (!options_.crash) options_.crash = [] { std::_Exit(70); };
}

Provider::~Provider() = default;

void Provider::clear() {
  std::lock_guard lock(mutex_);
  faults_.clear();
  sink_ = nullptr;
  {
    // An empty ledger has nothing to forget, and a read costs no write transaction.
    sqlite::ResetGuard reset(*ledger_->count);
    if (ledger_->count->step() && ledger_->count->int64(0) == 0) return;
  }
  sqlite::ResetGuard reset(*ledger_->clear_charges);
  ledger_->clear_charges->step();
}

void Provider::inject(Fault fault, std::size_t times) {
  std::lock_guard lock(mutex_);
  faults_.insert(faults_.end(), times, fault);
}

void Provider::on_event(std::function<void(TimePoint, const std::string&)> sink) {
  std::lock_guard lock(mutex_);
  sink_ = std::move(sink);
}

PendingCharge Provider::start(std::string order_id, std::int64_t amount,
                              std::string idempotency_key) {
  PendingCharge p{std::nullopt, std::move(order_id), amount, std::move(idempotency_key),
                  clock_->now() + options_.latency};
  std::lock_guard lock(mutex_);
  if (!faults_.empty()) {  // decided when the request arrives
    p.fault = faults_.front();
    faults_.pop_front();
  }
  return p;
}

ChargeResult Provider::charge(const std::string& order_id, std::int64_t amount,
                              const std::string& idempotency_key) {
  const PendingCharge pending = start(order_id, amount, idempotency_key);
  sleep_until(*clock_, pending.due);
  return finish(pending);
}

ChargeResult Provider::finish(const PendingCharge& p) {
  std::unique_lock lock(mutex_);
  // An event line is formatted only for a listener.
  auto emit = [&]<typename... Args>(fmt::format_string<Args...> line, Args&&... args) {
    if (sink_) sink_(clock_->now(), fmt::format(line, std::forward<Args>(args)...));
  };
  if (p.fault == Fault::timeout) {
    emit("provider: charge for {} timed out, nothing charged", p.order_id);
    throw ProviderTimeout();
  }
  if (p.fault == Fault::decline) {
    emit("provider: charge for {} declined (insufficient funds)", p.order_id);
    return ChargeResult{true, "", "insufficient_funds", false};
  }
  Ledger& l = *ledger_;
  // A look-up and an insert must be one transaction (another process may charge the same
  // key between them); a lone insert is atomic by itself.
  const bool look_up = options_.dedup && !p.idempotency_key.empty();
  std::optional<sqlite::Transaction> tx;
  if (look_up) tx.emplace(l.tx);
  ChargeResult result;
  if (look_up) {
    sqlite::ResetGuard reset(*l.find);
    l.find->bind(1, p.idempotency_key);
    if (l.find->step()) {
      result.charge_id = charge_id(l.find->int64(0));
      result.deduplicated = true;
    }
  }
  if (!result.deduplicated) {
    sqlite::ResetGuard reset(*l.insert);
    l.insert->bind(1, p.order_id);
    l.insert->bind(2, p.amount);
    l.insert->bind(3, p.idempotency_key);
    l.insert->bind(4, static_cast<std::int64_t>(clock_->now().time_since_epoch().count()));
    l.insert->step();
    result.charge_id = charge_id(l.insert->last_insert_rowid());
  }
  if (tx) tx->commit();
  if (p.fault == Fault::charged_then_timeout) {
    if (result.deduplicated) {
      emit("provider: duplicate charge for {} recognised as {}, answer lost (timed out)",
           p.order_id, result.charge_id);
    } else {
      emit("provider: charged {} for {}, answer lost (timed out)", result.charge_id, p.order_id);
    }
    throw ProviderTimeout();
  }
  if (result.deduplicated) {
    emit("provider: duplicate charge for {} recognised, returned {}", p.order_id, result.charge_id);
  } else {
    emit("provider: charged {} for {}", result.charge_id, p.order_id);
  }
  if (p.fault == Fault::crash) {
    lock.unlock();
    options_.crash();
  }
  return result;
}

namespace {

std::vector<Charge> read_charges(sqlite::Statement& s) {
  std::vector<Charge> out;
  while (s.step()) {
    out.push_back(Charge{charge_id(s.int64(0)), s.text(1), s.int64(2), s.text(3),
                         TimePoint(std::chrono::milliseconds(s.int64(4)))});
  }
  return out;
}

}  // namespace

std::vector<Charge> Provider::charges() const {
  std::lock_guard lock(mutex_);
  sqlite::ResetGuard reset(*ledger_->all);
  return read_charges(*ledger_->all);
}

std::vector<Charge> Provider::charges_after(std::int64_t after, std::size_t limit) const {
  std::lock_guard lock(mutex_);
  sqlite::Statement& s = *ledger_->page;
  sqlite::ResetGuard reset(s);
  s.bind(1, after);
  s.bind(2, static_cast<std::int64_t>(limit));
  return read_charges(s);
}

std::size_t Provider::charge_count() const {
  std::lock_guard lock(mutex_);
  sqlite::Statement& s = *ledger_->count;
  sqlite::ResetGuard reset(s);
  s.step();
  return static_cast<std::size_t>(s.int64(0));
}

std::optional<Charge> Provider::find(const std::string& idempotency_key) const {
  std::lock_guard lock(mutex_);
  sqlite::Statement& s = *ledger_->by_key;
  sqlite::ResetGuard reset(s);
  s.bind(1, idempotency_key);
  std::vector<Charge> found = read_charges(s);
  if (found.empty()) return std::nullopt;
  return std::move(found.front());
}

std::vector<std::string> Provider::charge_ids() const {
  std::vector<std::string> out;
  for (const Charge& c : charges()) out.push_back(c.id);
  return out;
}

}  // namespace idem::sim
