#include "idem/sim/provider.hpp"

#include <fmt/format.h>

#include <cstdlib>

#include "idem/asio.hpp"
#include "sqlite_handle.hpp"  // idem's RAII wrappers over sqlite3 (lib/src)

namespace idem::sim {
namespace {

constexpr std::string_view kLedgerSchema = R"sql(
CREATE TABLE IF NOT EXISTS charges (
  seq      INTEGER PRIMARY KEY AUTOINCREMENT,
  order_id TEXT    NOT NULL,
  amount   INTEGER NOT NULL,
  idem_key TEXT    NOT NULL,
  at       INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS charges_by_key ON charges (idem_key);
)sql";

constexpr std::string_view kFindByKey =
    "SELECT seq FROM charges WHERE idem_key = ?1 AND idem_key <> '' ORDER BY seq LIMIT 1";
constexpr std::string_view kInsert =
    "INSERT INTO charges (order_id, amount, idem_key, at) VALUES (?1, ?2, ?3, ?4) RETURNING seq";
constexpr std::string_view kCount = "SELECT count(*) FROM charges";
constexpr std::string_view kAll =
    "SELECT seq, order_id, amount, idem_key, at FROM charges ORDER BY seq";

std::string charge_id(std::int64_t seq) { return fmt::format("ch_{}", seq); }

}  // namespace

struct Provider::Ledger {
  detail::BusyPolicy busy{std::chrono::seconds(30), {}};
  detail::Connection db;
  std::unique_ptr<detail::Statement> begin, commit, rollback, find, insert, count, all;

  explicit Ledger(const std::string& path)
      : db(detail::open_connection(path.empty() ? ":memory:" : path, &busy)) {
    detail::enable_wal(db.get(), busy);
    auto make = [this](std::string_view sql) { return std::make_unique<detail::Statement>(db.get(), sql); };
    begin = make("BEGIN IMMEDIATE");
    commit = make("COMMIT");
    rollback = make("ROLLBACK");
    {
      detail::Transaction tx(*begin, *commit, *rollback);
      detail::exec(db.get(), kLedgerSchema);
      tx.commit();
    }
    find = make(kFindByKey);
    insert = make(kInsert);
    count = make(kCount);
    all = make(kAll);
  }
};

Provider::Provider(std::shared_ptr<Clock> clock, ProviderOptions options)
    : clock_(std::move(clock)),
      options_(std::move(options)),
      ledger_(std::make_unique<Ledger>(options_.ledger_path)) {
  if (!options_.crash) options_.crash = [] { std::_Exit(70); };
}

Provider::~Provider() = default;

void Provider::inject(Fault fault, std::size_t times) {
  std::lock_guard lock(mutex_);
  faults_.insert(faults_.end(), times, fault);
}

void Provider::on_event(std::function<void(TimePoint, const std::string&)> sink) {
  std::lock_guard lock(mutex_);
  sink_ = std::move(sink);
}

std::optional<Fault> Provider::next_fault() {
  std::lock_guard lock(mutex_);
  if (faults_.empty()) return std::nullopt;
  Fault f = faults_.front();
  faults_.pop_front();
  return f;
}

ChargeResult Provider::charge(const std::string& order_id, std::int64_t amount,
                              const std::string& idempotency_key) {
  const std::optional<Fault> fault = next_fault();  // decided when the request arrives
  sleep_until(*clock_, clock_->now() + options_.latency);
  return settle(fault, order_id, amount, idempotency_key);
}

boost::asio::awaitable<ChargeResult> Provider::async_charge(std::string order_id,
                                                            std::int64_t amount,
                                                            std::string idempotency_key) {
  const std::optional<Fault> fault = next_fault();
  co_await async_sleep_until(*clock_, clock_->now() + options_.latency);
  co_return settle(fault, order_id, amount, idempotency_key);
}

ChargeResult Provider::settle(std::optional<Fault> fault, const std::string& order_id,
                              std::int64_t amount, const std::string& idempotency_key) {
  std::unique_lock lock(mutex_);
  auto emit = [&](const std::string& line) {
    if (sink_) sink_(clock_->now(), line);
  };
  if (fault == Fault::timeout) {
    emit(fmt::format("provider: charge for {} timed out, nothing charged", order_id));
    throw ProviderTimeout();
  }
  if (fault == Fault::decline) {
    emit(fmt::format("provider: charge for {} declined (insufficient funds)", order_id));
    return ChargeResult{true, "", "insufficient_funds", false};
  }
  Ledger& l = *ledger_;
  detail::Transaction tx(*l.begin, *l.commit, *l.rollback);
  ChargeResult result;
  if (options_.dedup && !idempotency_key.empty()) {
    detail::ResetGuard reset(*l.find);
    l.find->bind(1, idempotency_key);
    if (l.find->step()) {
      result.charge_id = charge_id(l.find->int64(0));
      result.deduplicated = true;
    }
  }
  if (!result.deduplicated) {
    detail::ResetGuard reset(*l.insert);
    l.insert->bind(1, order_id);
    l.insert->bind(2, amount);
    l.insert->bind(3, idempotency_key);
    l.insert->bind(4, static_cast<std::int64_t>(clock_->now().time_since_epoch().count()));
    l.insert->step();
    result.charge_id = charge_id(l.insert->int64(0));
    l.insert->step();
  }
  tx.commit();
  emit(result.deduplicated
           ? fmt::format("provider: duplicate charge for {} recognised, returned {}", order_id, result.charge_id)
           : fmt::format("provider: charged {} for {}", result.charge_id, order_id));
  if (fault == Fault::crash) {
    lock.unlock();
    options_.crash();
  }
  return result;
}

std::vector<Charge> Provider::charges() const {
  std::lock_guard lock(mutex_);
  detail::Statement& s = *ledger_->all;
  detail::ResetGuard reset(s);
  std::vector<Charge> out;
  while (s.step()) {
    out.push_back(Charge{charge_id(s.int64(0)), s.text(1), s.int64(2), s.text(3),
                         TimePoint(std::chrono::milliseconds(s.int64(4)))});
  }
  return out;
}

std::size_t Provider::charge_count() const {
  std::lock_guard lock(mutex_);
  detail::Statement& s = *ledger_->count;
  detail::ResetGuard reset(s);
  s.step();
  return static_cast<std::size_t>(s.int64(0));
}

std::vector<std::string> Provider::charge_ids() const {
  std::vector<std::string> out;
  for (const Charge& c : charges()) out.push_back(c.id);
  return out;
}

}  // namespace idem::sim
