#include "idem/sim/simulation.hpp"

#include <utility>  // before Asio (Boost 1.74)

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <cerrno>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <system_error>

#include <sys/eventfd.h>
#include <unistd.h>

#include "idem/asio.hpp"
#include "idem/errors.hpp"
#include "idem/internal/sqlite.hpp"
#include "idem/sim/async_provider.hpp"
#include "idem/sim/driver.hpp"
#include "idem/sim/faulty_store.hpp"
#include "idem/sim/provider.hpp"
#include "idem/sim/simulated_clock.hpp"
#include "idem/sqlite_store.hpp"
#include "idem/steps.hpp"
#include "idem/store_wrapper.hpp"
#include "simulation_sql.hpp"

namespace idem::sim {

const char* to_string(Invariant i) noexcept {
  switch (i) {
    case Invariant::at_most_once:
      return "at_most_once";
    case Invariant::success_charged:
      return "success_charged";
    case Invariant::same_answer:
      return "same_answer";
    case Invariant::right_payload:
      return "right_payload";
    case Invariant::tokens_grow:
      return "tokens_grow";
    case Invariant::fencing:
      return "fencing";
    case Invariant::lease_bounded:
      return "lease_bounded";
    case Invariant::waiters_wake:
      return "waiters_wake";
    case Invariant::finished:
      return "finished";
    case Invariant::called_in_lease:
      return "called_in_lease";
  }
  return "?";
}

namespace {

namespace net = boost::asio;
using std::chrono::milliseconds;
using namespace std::chrono_literals;

// ---- the plan: everything a seed decides, before anything runs -----------------------------

struct Config {
  InFlight policy = InFlight::wait;
  FailureMode mode = FailureMode::fail_closed;
  int processes = 1;
  milliseconds lease{1000};
  milliseconds heartbeat{0};  // 0: none
  milliseconds latency{100};  // the provider's
  milliseconds max_wait{5000};
  milliseconds reap_after{500};
  milliseconds reap_every{2000};
  int tenants = 1;
  int keys = 1;
  // Whether the multi-step operation's provider deduplicates on the derived key. Without it
  // only idem keeps the charge single, but for a pause during the call itself (after the lease
  // was confirmed), which no owner can see.
  bool psp_dedup = true;
};

// Where an owner is frozen (a GC pause, a stopped process) or its store's reply is held, on
// its first attempt: the faults that are not crashes.
enum class Pause {
  none,
  late_reservation,  // the reservation commits; its reply reaches the owner `pause_for` later
  lost_reservation,  // the reservation commits; `pause_for` later the owner hears an error
  before_step,       // multi-step: the owner freezes after it began, before its external step
  in_call,           // the owner freezes after its lease was confirmed, before the charge lands
};

struct PlannedRequest {
  int id = 0;
  milliseconds at{0};
  int process = 0;  // where the client sends first
  int tenant = 0;
  int operation = 0;
  int key = 0;
  long long amount = 0;
  int retries = 0;
  std::uint64_t seed = 0;     // its own randomness: faults per attempt, jitter
  milliseconds stall{0};      // a pause after the charge (GC, swap): the lease may end meanwhile
  bool faults = true;         // the provider may time out or decline its charges
  Pause pause = Pause::none;  // on the first attempt
  milliseconds pause_for{0};
};

struct PlannedCrash {
  milliseconds at{0};
  int process = 0;
  milliseconds restart_after{0};
};

struct PlannedFault {
  milliseconds at{0};
  int process = 0;
  Operation operation = Operation::reserve;
  milliseconds lasts{0};
  bool lose = false;  // the operation's writes take effect and their replies are lost
};

struct Plan {
  std::uint64_t seed = 0;
  Config config;
  std::vector<PlannedRequest> requests;
  std::vector<PlannedCrash> crashes;
  std::vector<PlannedFault> faults;
};

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : engine_(seed) {}
  // Uniform enough for a simulator, and the same on every platform (the engine's output is
  // specified by the standard; the distributions are not, so none is used).
  std::uint64_t below(std::uint64_t n) { return n == 0 ? 0 : engine_() % n; }
  long long range(long long lo, long long hi) {
    return lo + static_cast<long long>(below(static_cast<std::uint64_t>(hi - lo + 1)));
  }
  bool percent(unsigned p) { return below(100) < p; }
  std::uint64_t next() { return engine_(); }

 private:
  std::mt19937_64 engine_;
};

constexpr const char* kTenants[] = {"alpha", "beta"};
// The last is a multi-step operation (Coordinator::call_steps): charge, then an order row.
constexpr const char* kOperations[] = {"payment.charge", "payment.refund", "order.checkout"};
constexpr int kCheckout = 2;

Plan make_plan(std::uint64_t seed, const ScenarioOptions& options) {
  Rng rng(seed);
  Plan p;
  p.seed = seed;
  Config& c = p.config;
  const auto pick_policy = rng.below(10);
  c.policy = pick_policy < 6 ? InFlight::wait : pick_policy < 9 ? InFlight::raise : InFlight::run;
  c.mode = rng.percent(70) ? FailureMode::fail_closed : FailureMode::fail_open;
  c.processes = static_cast<int>(rng.range(1, 3));
  c.lease = milliseconds(rng.range(4, 20) * 100);
  c.heartbeat = rng.percent(50) ? c.lease / 3 : 0ms;
  c.latency = milliseconds(rng.range(0, 8) * 50);
  c.tenants = static_cast<int>(rng.range(1, 2));
  c.keys = static_cast<int>(rng.range(1, 3));
  c.psp_dedup = rng.percent(50);
  const std::size_t n =
      options.requests != 0 ? options.requests : static_cast<std::size_t>(rng.range(2, 6));
  const bool reuse = rng.percent(20);
  for (std::size_t i = 0; i < n; ++i) {
    PlannedRequest r;
    r.id = static_cast<int>(i) + 1;
    r.at = milliseconds(rng.range(0, 40) * 25);
    r.process = static_cast<int>(rng.below(static_cast<std::uint64_t>(c.processes)));
    r.tenant = static_cast<int>(rng.below(static_cast<std::uint64_t>(c.tenants)));
    r.operation = static_cast<int>(rng.below(3));
    r.key = static_cast<int>(rng.below(static_cast<std::uint64_t>(c.keys)));
    // A key's amount is fixed by the key; a reused key sometimes comes with another amount.
    r.amount = 100 * (r.key + 1) + ((reuse && rng.percent(30)) ? 5 : 0);
    r.retries = static_cast<int>(rng.range(0, 4));
    r.seed = rng.next();
    r.faults = rng.percent(40);
    if (rng.percent(8)) r.stall = c.lease * rng.range(1, 3) + 1ms;
    if (rng.percent(20)) {
      constexpr Pause kPauses[] = {Pause::late_reservation, Pause::lost_reservation,
                                   Pause::before_step, Pause::in_call};
      r.pause = kPauses[rng.below(std::size(kPauses))];
      // Half a lease (the owner goes on in time) to three leases (another may take over).
      r.pause_for = c.lease * rng.range(1, 6) / 2 + 1ms;
    }
    p.requests.push_back(r);
  }
  if (rng.percent(25)) {
    const auto crashes = rng.range(1, 2);
    for (long long i = 0; i < crashes; ++i) {
      p.crashes.push_back({milliseconds(rng.range(0, 1500)),
                           static_cast<int>(rng.below(static_cast<std::uint64_t>(c.processes))),
                           milliseconds(rng.range(0, 20) * 50)});
    }
  }
  if (rng.percent(20)) {
    constexpr Operation kOps[] = {
        Operation::reserve, Operation::complete,     Operation::release,
        Operation::renew,   Operation::load,         Operation::purge,
        Operation::steps,   Operation::mark_pending, Operation::store_if_absent,
        Operation::reap};
    const auto faults = rng.range(1, 2);
    for (long long i = 0; i < faults; ++i) {
      PlannedFault f{milliseconds(rng.range(0, 40) * 25),
                     static_cast<int>(rng.below(static_cast<std::uint64_t>(c.processes))),
                     kOps[rng.below(std::size(kOps))], milliseconds(rng.range(1, 20) * 50)};
      // Writes whose replies are lost, a third of the time (a read's lost reply is a failure).
      f.lose = f.operation != Operation::load && rng.percent(33);
      p.faults.push_back(f);
    }
  }
  return p;
}

const char* operation_name(Operation op) {
  switch (op) {
    case Operation::reserve:
      return "reserve";
    case Operation::complete:
      return "complete";
    case Operation::release:
      return "release";
    case Operation::renew:
      return "renew (the heartbeat)";
    case Operation::load:
      return "load";
    case Operation::purge:
      return "purge";
    case Operation::steps:
      return "a step's write";
    case Operation::mark_pending:
      return "mark_pending";
    case Operation::store_if_absent:
      return "store_if_absent";
    case Operation::reap:
      return "reap";
    default:
      return "other";
  }
}

std::string key_name(const Plan& p, const PlannedRequest& r) {
  (void)p;
  return fmt::format("{}/{}/k{}", kTenants[r.tenant], kOperations[r.operation], r.key);
}

const char* pause_name(Pause pause) {
  switch (pause) {
    case Pause::late_reservation:
      return "its reservation's reply comes late by";
    case Pause::lost_reservation:
      return "its reservation's reply is lost after";
    case Pause::before_step:
      return "it freezes before its external step for";
    case Pause::in_call:
      return "it freezes in its call, after the lease check, for";
    case Pause::none:
      break;
  }
  return "";
}

std::string describe_plan(const Plan& p) {
  const Config& c = p.config;
  std::string out = fmt::format(
      "config: in_flight={} {} processes={} lease={}ms heartbeat={}ms provider_latency={}ms "
      "max_wait={}ms reap_after={}ms multi-step provider {}\n",
      to_string(c.policy), c.mode == FailureMode::fail_open ? "fail_open" : "fail_closed",
      c.processes, c.lease.count(), c.heartbeat.count(), c.latency.count(), c.max_wait.count(),
      c.reap_after.count(), c.psp_dedup ? "deduplicates" : "does not deduplicate");
  for (const auto& r : p.requests) {
    out += fmt::format(
        "request c{}: t={}ms to p{} key {} amount {} retries {}{}{}{}\n", r.id, r.at.count(),
        r.process, key_name(p, r), r.amount, r.retries, r.faults ? " provider-faults" : "",
        r.stall.count() ? fmt::format(" stall {}ms after charging", r.stall.count()) : "",
        r.pause != Pause::none
            ? fmt::format("; first attempt: {} {}ms", pause_name(r.pause), r.pause_for.count())
            : "");
  }
  for (const auto& c2 : p.crashes) {
    out += fmt::format("crash: p{} at t={}ms, restarts {}ms later\n", c2.process, c2.at.count(),
                       c2.restart_after.count());
  }
  for (const auto& f : p.faults) {
    out += fmt::format("store fault: p{} {} {} from t={}ms for {}ms\n", f.process,
                       operation_name(f.operation), f.lose ? "loses its replies" : "fails",
                       f.at.count(), f.lasts.count());
  }
  return out;
}

// ---- the run ---------------------------------------------------------------------------------

// How a timeline draws a trace line, from who said it and what.
Mark classify(const std::string& who, const std::string& what) {
  auto starts = [&](std::string_view p) { return what.starts_with(p); };
  if (who == "check") return Mark::error;
  if (who.starts_with("idem@")) {
    static const std::map<std::string, Mark, std::less<>> kEvents = {
        {"reserved", Mark::reserve},      {"taken_over", Mark::takeover},
        {"completed", Mark::complete},    {"released", Mark::release},
        {"replayed", Mark::replay},       {"in_progress", Mark::conflict},
        {"waiting", Mark::wait},          {"key_reuse", Mark::reuse},
        {"lease_lost", Mark::lease_lost}, {"store_unavailable", Mark::error},
        {"complete_failed", Mark::error}, {"release_failed", Mark::error}};
    const auto it = kEvents.find(what.substr(0, what.find(' ')));
    return it == kEvents.end() ? Mark::note : it->second;
  }
  if (who == "bank" || who == "psp")
    return what.find("charged") != std::string::npos ? Mark::charge : Mark::error;
  if (who.starts_with("p")) return starts("crashes") ? Mark::crash : Mark::note;
  if (who.starts_with("c")) {
    if (starts("sends")) return Mark::send;
    if (starts("<- 200") || starts("<- 402"))
      return what.ends_with("(replayed)") ? Mark::replay : Mark::answer;
    if (starts("<- 409")) return Mark::conflict;
    if (starts("<- 422")) return Mark::reuse;
    if (starts("<-") || starts("gets no answer")) return Mark::error;
  }
  return Mark::note;
}

// What scenarios on one thread share, so a scenario costs what it does and not what opening
// databases costs: one database in SQLite's memdb VFS (connections opening the same name share
// it, as processes share a file; file I/O faults are the fault VFS's tests'), the store
// connections the scenarios' processes take one each, and the provider, emptied before each
// scenario. A crashed process never gets its connection back within the scenario: its
// restart takes the next one.
class Pool {
 public:
  static Pool& mine() {
    thread_local Pool pool;
    return pool;
  }

  // Empties the database and the ledger, and points the provider at `clock`.
  void begin(SimulatedClock& clock) {
    clock_.target = &clock;
    sqlite::Transaction tx(janitor_tx_);  // one commit for the three
    for (auto* clear : {&clear_keys_, &clear_due_, &clear_outbox_, &clear_orders_}) {
      sqlite::ResetGuard reset(**clear);
      (*clear)->step();
    }
    tx.commit();
    bank_->clear();
    psp_->clear();
    plain_->clear();
    taken_ = 0;
  }

  // Every order row: (operation key, charge id).
  std::vector<std::pair<std::string, std::string>> orders() {
    sqlite::ResetGuard reset(*orders_);
    std::vector<std::pair<std::string, std::string>> out;
    while (orders_->step()) out.emplace_back(orders_->text(0), orders_->text(1));
    return out;
  }

  // The in-progress reservation with the oldest lease, but for `operation`'s: its key
  // ("tenant/operation/key"), token and lease.
  struct Reserved {
    std::string key;
    std::int64_t token = 0;
    TimePoint lease_until;
  };
  std::optional<Reserved> oldest_reservation(std::string_view except_operation) {
    sqlite::ResetGuard reset(*oldest_);
    oldest_->bind(1, except_operation);
    if (!oldest_->step() || oldest_->is_null(4)) return std::nullopt;
    return Reserved{fmt::format("{}/{}/{}", oldest_->text(0), oldest_->text(1), oldest_->text(2)),
                    oldest_->int64(3), TimePoint(milliseconds(oldest_->int64(4)))};
  }

  // The scenario is over: nothing of the pool points into it any more (its charges stay
  // until the next begin()).
  void end() {
    bank_->on_event(nullptr);
    psp_->on_event(nullptr);
    plain_->on_event(nullptr);
    clock_.target = nullptr;
  }

  // A connection no process of this scenario has had.
  std::shared_ptr<SqliteStore> take() {
    if (taken_ == stores_.size())
      stores_.push_back(
          std::make_shared<SqliteStore>(name_, SqliteOptions{.background_checkpoint = false}));
    return stores_[taken_++];
  }

  Provider& bank() { return *bank_; }
  Provider& psp() { return *psp_; }
  Provider& plain() { return *plain_; }

 private:
  // The provider's clock: the current scenario's.
  struct SwitchedClock final : Clock {
    SimulatedClock* target = nullptr;
    TimePoint now() const override { return target->now(); }
    TimerId call_at(TimePoint at, std::function<void()> fn) override {
      return target->call_at(at, std::move(fn));
    }
    void cancel(TimerId id) override { target->cancel(id); }
  };

  Pool()
      : name_(fmt::format("file:/idem-sim-{}-{}?vfs=memdb", getpid(),
                          counter().fetch_add(1, std::memory_order_relaxed))),
        janitor_(sqlite::open_connection(name_, &busy_)),
        janitor_tx_(janitor_.get()),
        clock_ptr_(std::shared_ptr<SwitchedClock>(std::shared_ptr<SwitchedClock>{}, &clock_)) {
    // The janitor writes the database first, so the database gets its page size.
    sqlite::exec(janitor_.get(), sql::kPageSize);
    sqlite::exec(janitor_.get(), sql::kCreateOrders);
    stores_.push_back(
        std::make_shared<SqliteStore>(name_, SqliteOptions{.background_checkpoint = false}));
    // The latency is the action's to wait (half before the charge, half after), so one
    // provider serves every scenario.
    bank_ = std::make_unique<Provider>(clock_ptr_, ProviderOptions{.latency = 0ms, .dedup = false});
    // The multi-step operation pays through a provider that honours idempotency keys, as
    // seed 000's design requires of every external step (the derived key).
    psp_ = std::make_unique<Provider>(clock_ptr_, ProviderOptions{.latency = 0ms, .dedup = true});
    // Or through one that does not (a legacy bank API), where only idem keeps it single.
    plain_ =
        std::make_unique<Provider>(clock_ptr_, ProviderOptions{.latency = 0ms, .dedup = false});
    clear_keys_.emplace(janitor_.get(), sql::kClearKeys);
    clear_due_.emplace(janitor_.get(), sql::kClearDue);
    clear_outbox_.emplace(janitor_.get(), sql::kClearOutbox);
    clear_orders_.emplace(janitor_.get(), sql::kClearOrders);
    orders_.emplace(janitor_.get(), sql::kOrders);
    oldest_.emplace(janitor_.get(), sql::kOldestReservation);
  }
  static std::atomic<std::uint64_t>& counter() {
    static std::atomic<std::uint64_t> n{0};
    return n;
  }

  sqlite::BusyPolicy busy_{std::chrono::seconds(5), {}};
  std::string name_;
  sqlite::Connection janitor_;  // keeps the memdb database alive between scenarios
  sqlite::TransactionStatements janitor_tx_;
  SwitchedClock clock_;
  std::shared_ptr<Clock> clock_ptr_;  // not owning: the clock lives in the pool
  std::vector<std::shared_ptr<SqliteStore>> stores_;
  std::size_t taken_ = 0;
  std::unique_ptr<Provider> bank_, psp_, plain_;
  std::optional<sqlite::Statement> clear_keys_, clear_due_, clear_outbox_, clear_orders_, orders_,
      oldest_;
};

struct World;
struct KeyLog;

// Sees every write that reached the database: the tokens granted and the completions and
// releases that were applied (tokens_grow, fencing).
class Recorder final : public StoreWrapper {
 public:
  Recorder(std::shared_ptr<Store> target, World& world)
      : StoreWrapper(std::move(target)), w_(world) {}
  void apply(std::span<StoreOp* const> ops) override;
  bool renew(const KeyId& id, std::int64_t token, TimePoint lease_until) override;
  bool mark_pending(const KeyId& id, std::int64_t token, std::int64_t origin,
                    const std::string& step, const LeaseCheck& lease) override;
  bool commit_step(const KeyId& id, std::int64_t token, std::int64_t origin,
                   const StepCommit& step) override;
  std::vector<ReapedRecord> reap(TimePoint lease_ended_before, std::size_t limit) override;

 private:
  void seen(const StoreOp& op);
  // A token-checked write other than complete and release was applied under `token`; returns
  // the key's log.
  KeyLog& applied_under(const KeyId& id, std::int64_t token, std::string_view what);
  World& w_;
};

// A process's view of time: the world's clock until the process dies; then nothing it
// scheduled ever runs (its waits, heartbeats and sleeps stop where they were, as in a process
// that was killed). While it is frozen (a GC pause, a stopped process), what falls due waits
// for the freeze to end.
class ProcessClock final : public Clock {
 public:
  explicit ProcessClock(std::shared_ptr<SimulatedClock> world) : world_(std::move(world)) {}
  TimePoint now() const override { return world_->now(); }
  TimerId call_at(TimePoint at, std::function<void()> fn) override {
    return schedule(state_, world_, 0, at, std::move(fn));
  }
  void cancel(TimerId id) override {
    // A timer put off by a freeze runs under another id of the world's.
    for (auto it = state_->moved.find(id); it != state_->moved.end(); it = state_->moved.find(id)) {
      id = it->second;
      state_->moved.erase(it);
    }
    world_->cancel(id);
  }
  void stop() { state_->alive = false; }
  // Nothing of this process runs before `until` (its timers wait; see the action's pauses).
  void freeze_until(TimePoint until) {
    state_->frozen_until = std::max(state_->frozen_until, until);
  }
  bool frozen() const { return world_->now() < state_->frozen_until; }

 private:
  struct State {
    bool alive = true;
    TimePoint frozen_until{};
    std::map<TimerId, TimerId> moved;  // a timer's first id to the id it was put off to
  };
  // Schedules `fn` at `at` on the world's clock; `first` is the id callers know it by (0: this
  // is that id). Returns the world's id.
  static TimerId schedule(const std::shared_ptr<State>& state,
                          const std::shared_ptr<SimulatedClock>& world, TimerId first, TimePoint at,
                          std::function<void()> fn) {
    auto self = std::make_shared<TimerId>(first);
    const TimerId id = world->call_at(at, [state, world, self, fn = std::move(fn)]() mutable {
      if (!state->alive) return;
      if (world->now() < state->frozen_until) {
        state->moved[*self] = schedule(state, world, *self, state->frozen_until, std::move(fn));
        return;
      }
      if (*self != 0) state->moved.erase(*self);
      fn();
    });
    if (first == 0) *self = id;
    return id;
  }
  std::shared_ptr<SimulatedClock> world_;
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

// What a client waits on while a process serves its request: the answer, or the process's
// death (then the client hears nothing, as over a connection that was reset).
//
// The client sleeps in idem's own coroutine wait (async_sleep_until) on a clock of the
// reply's, whose one deadline is "never" and which ring() fires at once: no I/O reactor
// takes part, and a wait still parked when the world ends goes with the io_context.
class Doorbell final : public Clock {
 public:
  TimePoint now() const override { return TimePoint{}; }
  TimerId call_at(TimePoint, std::function<void()> fn) override {
    ring_ = std::move(fn);
    return 1;
  }
  void cancel(TimerId) override { ring_ = nullptr; }
  void ring() {
    if (auto fn = std::exchange(ring_, nullptr)) fn();
  }

 private:
  std::function<void()> ring_;
};

struct Reply {
  Doorbell bell;  // rung when the answer comes or the process dies
  bool done = false;
  std::optional<Outcome> outcome;
  std::exception_ptr error;
};

class Wire;

struct Process {
  int slot = 0;
  int generation = 0;
  bool alive = true;
  std::shared_ptr<ProcessClock> clock;
  std::shared_ptr<SqliteStore> sqlite;
  std::shared_ptr<FaultyStore> faulty;
  std::shared_ptr<Wire> wire;  // between the coordinator and `faulty`
  std::unique_ptr<Coordinator> coordinator;
  std::vector<Reply*> waiting;  // the replies its clients wait for, in the order they began
  // The reservation token the last reply of each key carried to this process, and when: the
  // action that runs on it starts at that instant.
  std::map<std::string, std::pair<std::int64_t, TimePoint>> replies;
  // The executions (indexes) inside their calls now, lease confirmed and charge not landed: a
  // freeze of the process pauses each of them during its call.
  std::set<std::size_t> in_call;
};

// A reservation's reply the wire holds back: it comes `delay` late, or an error comes instead
// (the write committed all the same), as a stalled connection or one cut after the COMMIT would.
struct HeldReply {
  milliseconds delay{0};
  bool lost = false;
};

// A batch whose reply is held: it committed when it was sent; its results reach the
// coordinator when the world's clock signals an eventfd, so the coordinator waits for it as for
// a real database's socket (Store::start_apply).
class HeldPending final : public PendingApply {
 public:
  HeldPending(SimulatedClock& clock, TimePoint due, std::function<void()> deliver)
      : clock_(clock), fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)), deliver_(std::move(deliver)) {
    if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
    timer_ = clock_.call_at(due, [fd = fd_] {
      const std::uint64_t one = 1;
      [[maybe_unused]] const ssize_t n = ::write(fd, &one, sizeof one);
    });
  }
  ~HeldPending() override {
    clock_.cancel(timer_);
    ::close(fd_);
  }
  HeldPending(const HeldPending&) = delete;
  HeldPending& operator=(const HeldPending&) = delete;

  int descriptor() const noexcept override { return done_ ? -1 : fd_; }
  std::chrono::steady_clock::time_point deadline() const noexcept override {
    return std::chrono::steady_clock::time_point::max();  // simulated time decides
  }
  bool done() const noexcept override { return done_; }
  void advance() noexcept override {
    std::uint64_t n = 0;
    if (done_ || ::read(fd_, &n, sizeof n) != sizeof n) return;
    done_ = true;
    deliver_();
  }
  void fail(std::exception_ptr) noexcept override { done_ = true; }

 private:
  SimulatedClock& clock_;
  int fd_;
  std::function<void()> deliver_;
  Clock::TimerId timer_ = 0;
  bool done_ = false;
};

struct Answer {
  int request = 0;
  std::string key;
  int status = 0;
  std::string body;
  Outcome::Source source = Outcome::Source::executed;
  bool stored = false;  // executed and stored, or replayed
};

// One run of the action.
struct Execution {
  std::string key;
  bool charged = false;
  bool clean = false;  // its call answered with its stored result, in a live process
  // It froze during its call, after the lease was confirmed (Pause::in_call): the window no
  // owner can close, which only a downstream that deduplicates does.
  bool paused_in_call = false;
};

class ProcessDied : public std::runtime_error {
 public:
  ProcessDied() : std::runtime_error("the process died") {}
};

struct KeyLog {
  std::int64_t newest_token = 0;
  // The newest reservation's lease as granted or last renewed; min() once it was completed,
  // released or reaped. Nobody may take the key over before it ends.
  TimePoint lease_until = TimePoint::min();
  std::int64_t freed_token = 0;  // the token of the last completion or release applied
};

// A call of a key that has begun and neither ran its action nor answered (a waiter, or one
// on its way to reserve).
struct Pending {
  int call = 0;
  bool progressed = false;
};

// The wire between a process's coordinator and its store: it notes the reservation token each
// reply carries to the process (for called_in_lease), and holds back the replies of the
// reservations planned to come late or be lost (HeldReply).
class Wire final : public StoreWrapper {
 public:
  Wire(std::shared_ptr<Store> target, World& w, Process& p)
      : StoreWrapper(std::move(target)), w_(w), p_(p) {}
  // The next reservation of `key` through this wire: its batch's reply is held.
  void hold_next_reservation(const std::string& key, HeldReply held) { held_[key] = held; }
  void apply(std::span<StoreOp* const> ops) override;
  std::unique_ptr<PendingApply> start_apply(std::span<StoreOp* const> ops) override;
  // A look after a lost reply that finds the reservation is how the owner learns its token.
  std::optional<Record> load(const KeyId& id) override;

 private:
  // The batch's reply reaches the process: the tokens of the reservations it granted.
  void heard(std::span<StoreOp* const> ops);
  World& w_;
  Process& p_;
  std::map<std::string, HeldReply> held_;
  std::map<std::string, std::int64_t> lost_;  // reservations whose reply was lost, by key
};

struct World {
  const Plan& plan;
  bool tracing;
  std::vector<TraceEvent> trace;
  std::vector<Violation> violations;

  std::shared_ptr<SimulatedClock> clock = std::make_shared<SimulatedClock>();
  TimePoint start = clock->now();
  std::optional<net::io_context> io{std::in_place, 1};
  Pool& pool = Pool::mine();
  Provider* bank = &pool.bank();
  Provider* psp = &pool.psp();
  Provider* plain = &pool.plain();
  Provider* shop = plan.config.psp_dedup ? psp : plain;  // the multi-step operation's
  std::vector<std::unique_ptr<Process>> incarnations;    // every process that ever ran
  std::vector<Process*> slots;                           // the current one of each slot
  std::deque<Execution> executions;
  std::vector<Answer> answers;
  std::map<std::string, KeyLog> keys;
  std::map<std::string, std::vector<std::shared_ptr<Pending>>> pending;
  int next_call = 0;
  std::size_t finished_clients = 0, attempts = 0, crashes = 0, faults = 0, events = 0;
  std::size_t pauses = 0;
  bool store_trouble = false;           // a planned store fault or a crash happened
  std::optional<TimePoint> last_round;  // when the reaper last ran a whole round
  bool stalls = false;

  explicit World(const Plan& p, bool t) : plan(p), tracing(t) {
    // The provider does not deduplicate: what idem alone prevents is what is counted.
    pool.begin(*clock);
    if (tracing) {
      bank->on_event([this](TimePoint at, const std::string& line) { note_at(at, "bank", line); });
      psp->on_event([this](TimePoint at, const std::string& line) { note_at(at, "psp", line); });
      plain->on_event([this](TimePoint at, const std::string& line) { note_at(at, "psp", line); });
    }
    for (int i = 0; i < plan.config.processes; ++i) slots.push_back(boot(i, 0));
    stalls = std::any_of(p.requests.begin(), p.requests.end(), [](const PlannedRequest& r) {
      return r.stall.count() > 0 || r.pause != Pause::none;
    });
    store_trouble = !p.crashes.empty() || !p.faults.empty();
  }

  ~World() {
    // Coroutines still suspended (a dead process's) go with the io_context, before the
    // coordinators they refer to; their destructors may still log, so tracing stops first.
    tracing = false;
    io.reset();
    pool.end();
  }

  long long ms(TimePoint t) const { return (t - start).count(); }
  void note_at(TimePoint at, std::string who, std::string what) {
    if (!tracing) return;
    const Mark mark = classify(who, what);
    trace.push_back({ms(at), std::move(who), std::move(what), mark});
  }
  void note(std::string who, std::string what) {
    note_at(clock->now(), std::move(who), std::move(what));
  }
  std::array<std::size_t, kInvariantCount> checked{};
  void judged(Invariant i, std::size_t n = 1) { checked[static_cast<std::size_t>(i)] += n; }
  void violate(Invariant i, std::string detail) {
    note("check", fmt::format("VIOLATION {}: {}", to_string(i), detail));
    violations.push_back({i, std::move(detail)});
  }

  Process* boot(int slot, int generation) {
    auto p = std::make_unique<Process>();
    p->slot = slot;
    p->generation = generation;
    p->sqlite = pool.take();
    p->faulty = std::make_shared<FaultyStore>(std::make_shared<Recorder>(p->sqlite, *this));
    p->wire = std::make_shared<Wire>(p->faulty, *this, *p);
    Options o;
    o.in_flight = plan.config.policy;
    o.on_store_failure = plan.config.mode;
    o.lease = plan.config.lease;
    o.heartbeat = plan.config.heartbeat;
    o.max_wait = plan.config.max_wait;
    o.reap_after = plan.config.reap_after;
    o.ttl = std::chrono::hours(1);
    p->clock = std::make_shared<ProcessClock>(clock);
    o.clock = p->clock;
    if (tracing) {
      std::string who = fmt::format("idem@p{}", slot);
      o.log = [this, who](const LogEvent& e) {
        note_at(e.at, who,
                fmt::format("{} {} token {}{}{}", e.event, e.key_hash, e.token,
                            e.message.empty() ? "" : ": ", e.message));
      };
    }
    p->coordinator = std::make_unique<Coordinator>(p->wire, std::move(o));
    incarnations.push_back(std::move(p));
    return incarnations.back().get();
  }

  // The process a client reaches: its planned one if alive, else the next alive one.
  Process* reach(int preferred) {
    for (int i = 0; i < plan.config.processes; ++i) {
      Process* p = slots[static_cast<std::size_t>((preferred + i) % plan.config.processes)];
      if (p->alive) return p;
    }
    return nullptr;
  }

  // A waiting (or reserving) call of `key` made progress: it ran its action or answered.
  void progressed(const std::string& key, int call) {
    auto& list = pending[key];
    for (auto it = list.begin(); it != list.end(); ++it) {
      if ((*it)->call == call) {
        (*it)->progressed = true;
        list.erase(it);
        return;
      }
    }
  }

  // The holder of `key` freed it: under InFlight::wait, the calls waiting then must go on
  // within the polling bound (at once in this process, within poll_max from another). Every
  // one of them once the answer is stored (`stored`: each gets the replay); after a release,
  // at least one, unless a call that came later took the key first (the waiters then wait
  // for that one, whose end is judged in turn).
  void freed(const std::string& key, bool stored) {
    if (plan.config.policy != InFlight::wait || store_trouble || stalls) return;
    auto& list = pending[key];
    if (list.empty()) return;
    std::vector<std::shared_ptr<Pending>> waiting = list;
    judged(Invariant::waiters_wake);
    const TimePoint freed_at = clock->now();
    const TimePoint deadline = freed_at + Options{}.poll_max + 1ms;
    const std::int64_t freed_token = keys[key].freed_token;
    clock->call_at(deadline, [this, key, waiting, freed_at, stored, freed_token] {
      const auto went_on = static_cast<std::size_t>(std::count_if(
          waiting.begin(), waiting.end(), [](const auto& p) { return p->progressed; }));
      const bool taken_again = keys[key].newest_token > freed_token;
      if (stored ? went_on < waiting.size() : went_on == 0 && !taken_again) {
        violate(Invariant::waiters_wake,
                fmt::format("{}: {} at t={}ms, {} of its {} waiting calls went on by t={}ms", key,
                            stored ? "answered" : "released", ms(freed_at), went_on, waiting.size(),
                            ms(clock->now())));
      }
    });
  }

  void crash(const PlannedCrash& c) {
    Process* p = slots[static_cast<std::size_t>(c.process)];
    if (!p->alive) return;
    ++crashes;
    note(fmt::format("p{}", c.process), "crashes (its coordinator and connection are gone)");
    p->alive = false;
    p->clock->stop();
    p->faulty->set_unreachable(true);                    // a dead process writes nothing more
    for (Reply* reply : p->waiting) reply->bell.ring();  // its clients hear nothing
    clock->call_at(clock->now() + c.restart_after, [this, slot = c.process] {
      Process* old = slots[static_cast<std::size_t>(slot)];
      slots[static_cast<std::size_t>(slot)] = boot(slot, old->generation + 1);
      note(fmt::format("p{}", slot), "restarts with a new coordinator and connection");
    });
  }

  void fault(const PlannedFault& f) {
    Process* p = slots[static_cast<std::size_t>(f.process)];
    if (!p->alive) return;
    ++faults;
    note(fmt::format("p{}", f.process),
         fmt::format("store {} starts {}", operation_name(f.operation),
                     f.lose ? "losing its replies" : "failing"));
    if (f.lose) {
      p->faulty->lose_replies(f.operation, true);
    } else {
      p->faulty->fail(f.operation, true);
    }
    clock->call_at(clock->now() + f.lasts, [this, p, f] {
      if (!p->alive) return;
      if (f.lose) {
        p->faulty->lose_replies(f.operation, false);
      } else {
        p->faulty->fail(f.operation, false);
      }
      note(fmt::format("p{}", f.process),
           fmt::format("store {} works again", operation_name(f.operation)));
    });
  }

  // An action (a single-step call's) or an external step's call starts under `token`: the
  // token must hold the key, and its lease (as granted or renewed) must still run.
  void check_call(const std::string& key, std::int64_t token, std::string_view what) {
    judged(Invariant::called_in_lease);
    const KeyLog& k = keys[key];
    const TimePoint now = clock->now();
    if (token == k.newest_token && now < k.lease_until) return;
    violate(
        Invariant::called_in_lease,
        fmt::format("{}: {} started under token {} at t={}ms, but {}", key, what, token, ms(now),
                    token != k.newest_token ? fmt::format("token {} holds the key", k.newest_token)
                    : k.lease_until == TimePoint::min()
                        ? std::string("the key holds no lease (completed or released)")
                        : fmt::format("its lease ended at t={}ms", ms(k.lease_until))));
  }

  // Execution `e` of `p` is in its call (the lease confirmed, the charge not landed); if `p` is
  // frozen, it is paused there already.
  void entered_call(Process& p, std::size_t e) {
    p.in_call.insert(e);
    if (p.clock->frozen()) executions[e].paused_in_call = true;
  }

  // The owner of `p` freezes for `d` (its process's timers wait; its caller's coroutine
  // sleeps): every call of that process under way is paused in its call.
  net::awaitable<void> freeze(Process& p, const PlannedRequest& r, milliseconds d) {
    if (tracing) note(fmt::format("c{}", r.id), fmt::format("freezes {}ms", d.count()));
    ++pauses;
    for (std::size_t e : p.in_call) executions[e].paused_in_call = true;
    const TimePoint until = clock->now() + d;
    p.clock->freeze_until(until);
    co_await async_sleep_until(*clock, until);
  }

  // One round of the reaper, on the first live process. A reservation that was already overdue
  // (its lease ended more than reap_after before) at the last round that ran should not be
  // there; the reaper then clears those overdue now, and none may be left.
  void reap_round() {
    Process* p = reach(0);
    if (p == nullptr) return;
    const TimePoint now = clock->now();
    // A multi-step operation's reservation may have made progress: it is the completer's,
    // not the reaper's, so the checkout's keys are left out.
    auto oldest = [&] { return pool.oldest_reservation(kOperations[kCheckout]); };
    auto overdue = [&](const auto& r, milliseconds grace) {
      return r && r->lease_until + grace < now;
    };
    auto report = [&](const Pool::Reserved& left, const char* when) {
      violate(Invariant::lease_bounded,
              fmt::format("{}: reservation token {} whose lease ended at t={}ms is still there "
                          "{} at t={}ms",
                          left.key, left.token, ms(left.lease_until), when, ms(now)));
    };
    auto left = oldest();
    if (left) judged(Invariant::lease_bounded);
    // Overdue already at the last round that ran: that round should have cleared it.
    if (last_round &&
        overdue(left, plan.config.reap_after +
                          std::chrono::duration_cast<milliseconds>(now - *last_round)))
      report(*left, "though the reaper ran after it was due");
    if (overdue(left, plan.config.reap_after)) {
      try {
        p->coordinator->reap();
      } catch (const StoreError&) {
        return;
      }
      left = oldest();
      if (overdue(left, plan.config.reap_after)) report(*left, "after the reaper ran");
    }
    last_round = now;
  }

  void run();
  void check();
};

void Wire::heard(std::span<StoreOp* const> ops) {
  for (const StoreOp* op : ops) {
    if (op->kind != StoreOp::Kind::reserve || op->error ||
        op->reservation.kind == Reservation::Kind::existing)
      continue;
    p_.replies[fmt::format("{}/{}/{}", op->id->tenant, op->id->operation, op->id->key)] = {
        op->reservation.token, w_.clock->now()};
  }
}

std::optional<Record> Wire::load(const KeyId& id) {
  std::optional<Record> r = StoreWrapper::load(id);
  if (lost_.empty() || !r) return r;
  const std::string key = fmt::format("{}/{}/{}", id.tenant, id.operation, id.key);
  const auto it = lost_.find(key);
  // (the coordinator goes on with it only if it is still live)
  if (it != lost_.end() && it->second == r->token && r->state == State::in_progress &&
      r->live_at(w_.clock->now()))
    p_.replies[key] = {r->token, w_.clock->now()};
  if (it != lost_.end()) lost_.erase(it);
  return r;
}

void Wire::apply(std::span<StoreOp* const> ops) {
  StoreWrapper::apply(ops);
  heard(ops);
}

std::unique_ptr<PendingApply> Wire::start_apply(std::span<StoreOp* const> ops) {
  if (held_.empty()) return nullptr;  // the reply comes at once: apply()
  std::optional<HeldReply> held;
  std::vector<StoreOp*> reservations;
  for (StoreOp* op : ops) {
    if (op->kind != StoreOp::Kind::reserve) continue;
    const auto it =
        held_.find(fmt::format("{}/{}/{}", op->id->tenant, op->id->operation, op->id->key));
    if (it == held_.end()) continue;
    held = it->second;
    held_.erase(it);
    reservations.push_back(op);
  }
  if (!held) return nullptr;
  ++w_.pauses;
  StoreWrapper::apply(ops);  // the batch commits now; its reply is what comes late
  std::vector<StoreOp*> batch(ops.begin(), ops.end());
  // The owner learns the token all the same (a lost reply's owner finds it by its claim): a
  // call that runs on it starts when the reply, or the error, arrives.
  const auto deliver = [this, batch, reservations, lost = held->lost] {
    if (!lost) return heard(batch);
    for (StoreOp* op : reservations) {
      if (op->error) continue;
      if (op->reservation.kind != Reservation::Kind::existing) {
        lost_[fmt::format("{}/{}/{}", op->id->tenant, op->id->operation, op->id->key)] =
            op->reservation.token;
      }
      op->reservation = {};
      op->error = std::make_exception_ptr(
          StoreError("simulated lost reply: the reservation committed, its answer never came", 0));
    }
    std::vector<StoreOp*> rest;
    for (StoreOp* op : batch) {
      if (std::find(reservations.begin(), reservations.end(), op) == reservations.end())
        rest.push_back(op);
    }
    heard(rest);
  };
  if (w_.tracing) {
    w_.note(fmt::format("p{}", p_.slot),
            fmt::format("holds a batch's reply for {}ms{}", held->delay.count(),
                        held->lost ? ", then loses it" : ""));
  }
  return std::make_unique<HeldPending>(*w_.clock, w_.clock->now() + held->delay, deliver);
}

net::awaitable<void> maintenance(World& w) {
  const Config& c = w.plan.config;
  while (w.finished_clients < w.plan.requests.size()) {
    co_await async_sleep_until(*w.clock, w.clock->now() + c.reap_every);
    w.reap_round();
  }
  // Once the clients are done, a reservation left behind (a crashed holder's) must still be
  // cleared: the rounds go on until every lease (at most two rounds long) and the reaper's
  // delay have passed.
  for (int round = 0; round < 3; ++round) {
    co_await async_sleep_until(*w.clock, w.clock->now() + c.reap_every);
    w.reap_round();
  }
}

Response answer_of(const PlannedRequest& r, const std::string& key, const ChargeResult& c) {
  nlohmann::json body{{"tenant", kTenants[r.tenant]}, {"key", key}, {"amount", r.amount}};
  if (c.declined) {
    body["declined"] = c.reason;
    return Response{402, body.dump(), {}};
  }
  body["charge_id"] = c.charge_id;
  return Response{200, body.dump(), {}};
}

void spawn(World& w, net::awaitable<void> task) {
  net::co_spawn(*w.io, std::move(task), [](std::exception_ptr e) {
    if (e) std::rethrow_exception(e);
  });
}

// A process serving one request: the answer goes to `reply`, unless the process died first
// (then the coroutine stays suspended where it was, with its clock, until the world ends).
net::awaitable<void> serve(Process& p, Request request, bool steps, AsyncAction action,
                           AsyncStepsAction steps_action, std::shared_ptr<Reply> reply) {
  try {
    if (steps) {
      reply->outcome =
          co_await async_call_steps(*p.coordinator, std::move(request), std::move(steps_action));
    } else {
      reply->outcome = co_await async_call(*p.coordinator, std::move(request), std::move(action));
    }
  } catch (...) {
    reply->error = std::current_exception();
  }
  reply->done = true;
  reply->bell.ring();
}

// One attempt of a request on process `p`. Returns true when the client has its final
// answer.
net::awaitable<bool> attempt(World& w, const PlannedRequest& r, Process& p, Rng& rng, bool first) {
  const std::string key = key_name(w.plan, r);
  const int call = ++w.next_call;
  ++w.attempts;
  auto me = std::make_shared<Pending>();
  me->call = call;
  w.pending[key].push_back(me);
  std::optional<Fault> fault;
  if (r.faults) {
    const auto roll = rng.below(10);
    if (roll == 0) fault = Fault::timeout;
    if (roll == 1) fault = Fault::decline;
    if (roll == 2) fault = Fault::charged_then_timeout;
  }
  const std::size_t exec = w.executions.size();
  w.executions.push_back({key});
  const std::string who = w.tracing ? fmt::format("c{}", r.id) : std::string();
  if (w.tracing) w.note(who, fmt::format("sends {} amount {} to p{}", key, r.amount, p.slot));

  Request request;
  request.tenant = kTenants[r.tenant];
  request.operation = kOperations[r.operation];
  request.key = fmt::format("k{}", r.key);
  request.fingerprint = Fingerprint::of(nlohmann::json{{"amount", r.amount}});
  // The pause planned for this attempt, if it is the first.
  const Pause pause = first ? r.pause : Pause::none;
  if (pause == Pause::late_reservation || pause == Pause::lost_reservation) {
    p.wire->hold_next_reservation(key, HeldReply{r.pause_for, pause == Pause::lost_reservation});
  }
  AsyncAction action = [&w, &r, &p, exec, call, key, fault, pause]() -> net::awaitable<Response> {
    Execution& e = w.executions[exec];
    if (!p.alive) throw ProcessDied();
    w.progressed(key, call);
    if (w.tracing) w.note(fmt::format("c{}", r.id), fmt::format("runs the action on p{}", p.slot));
    // It runs on the reservation whose reply just reached the process (none under
    // InFlight::run, or unprotected under fail_open).
    if (const auto it = p.replies.find(key);
        it != p.replies.end() && it->second.second == w.clock->now())
      w.check_call(key, it->second.first, "the action");
    // A pause of a single-step call before its charge is a pause during its call: the lease was
    // confirmed before the action began.
    w.entered_call(p, exec);
    if (pause == Pause::in_call || pause == Pause::before_step)
      co_await w.freeze(p, r, r.pause_for);
    // The request travels to the bank for half the latency, is charged there, and the answer
    // travels back for the other half (a process that dies meanwhile was charged).
    const milliseconds half = w.plan.config.latency / 2;
    const TimePoint there = w.clock->now() + half;
    co_await async_sleep_until(*p.clock, there);
    ChargeResult c;
    std::exception_ptr timed_out;
    if (fault) w.bank->inject(*fault);  // for this charge: the next one the provider starts
    try {
      c = co_await async_charge(*w.bank, key, r.amount, "");
      e.charged = !c.declined;
    } catch (const ProviderTimeout&) {
      if (fault == Fault::charged_then_timeout) e.charged = true;
      timed_out = std::current_exception();
    }
    p.in_call.erase(exec);  // the charge has landed (or not at all)
    const TimePoint back = w.clock->now() + half;
    co_await async_sleep_until(*p.clock, back);
    if (timed_out) std::rethrow_exception(timed_out);
    if (r.stall.count() > 0) {
      if (w.tracing) w.note(fmt::format("c{}", r.id), fmt::format("stalls {}ms", r.stall.count()));
      const TimePoint until = w.clock->now() + r.stall;
      co_await async_sleep_until(*p.clock, until);
    }
    co_return answer_of(r, key, c);
  };

  // The multi-step operation: the charge is an external step (derived key, looked up after an
  // unknown outcome), the order a local step in the store's transaction.
  AsyncStepsAction steps = [&w, &r, &p, exec, call, key, fault,
                            pause](Attempt& a) -> net::awaitable<Response> {
    if (!p.alive) throw ProcessDied();
    w.progressed(key, call);
    if (w.tracing) w.note(fmt::format("c{}", r.id), fmt::format("runs the steps on p{}", p.slot));
    // Frozen between its reservation and its external step: the lease may end, and the step's
    // pending mark must then refuse it.
    if (pause == Pause::before_step) co_await w.freeze(p, r, r.pause_for);
    if (!p.alive) throw ProcessDied();
    AsyncExternalCall pay = [&w, &r, &p, &a, key, fault, exec,
                             pause](const std::string& derived) -> net::awaitable<std::string> {
      w.check_call(key, a.token(), "the external step");
      w.entered_call(p, exec);
      if (pause == Pause::in_call) co_await w.freeze(p, r, r.pause_for);
      const milliseconds half = w.plan.config.latency / 2;
      const TimePoint there = w.clock->now() + half;
      co_await async_sleep_until(*p.clock, there);
      if (fault) w.shop->inject(*fault);
      ChargeResult c;
      std::exception_ptr timed_out;
      try {
        c = co_await async_charge(*w.shop, key, r.amount, derived);
        w.executions[exec].charged = !c.declined && !c.deduplicated;
      } catch (const ProviderTimeout&) {
        timed_out = std::current_exception();
      }
      p.in_call.erase(exec);  // the charge has landed (or not at all)
      const TimePoint back = w.clock->now() + half;
      co_await async_sleep_until(*p.clock, back);
      if (timed_out) std::rethrow_exception(timed_out);
      co_return c.declined ? std::string("declined") : c.charge_id;
    };
    AsyncLookup lookup =
        [&w](const std::string& derived) -> net::awaitable<std::optional<std::string>> {
      const std::optional<Charge> found = w.shop->find(derived);
      co_return found ? std::optional<std::string>(found->id) : std::nullopt;
    };
    std::string step = "charge";
    const std::string charge_id =
        co_await async_external(a, std::move(step), std::move(pay), std::move(lookup));
    ChargeResult c;
    if (charge_id == "declined") {
      c.declined = true;
      c.reason = "insufficient_funds";
      co_return answer_of(r, key, c);
    }
    if (!p.alive) throw ProcessDied();
    a.local("order", [&](LocalTransaction& tx) {
      tx.execute(sql::kInsertOrder, {key, charge_id});
      return charge_id;
    });
    c.charge_id = charge_id;
    co_return answer_of(r, key, c);
  };

  const int generation = p.generation;
  auto lost = [&] { return !p.alive || p.generation != generation; };
  bool final = false;
  std::string said;
  if (r.operation == kCheckout) {
    // A multi-step operation never runs unreserved: under InFlight::run it waits.
    if (w.plan.config.policy == InFlight::run) request.in_flight = InFlight::wait;
    request.payload = fmt::format("{}", r.amount);
  }
  // The process serves the request in a coroutine of its own; the client waits for the answer
  // or the process's death.
  auto reply = std::make_shared<Reply>();
  p.waiting.push_back(reply.get());
  spawn(w, serve(p, std::move(request), r.operation == kCheckout, std::move(action),
                 std::move(steps), reply));
  // An answer that came before the wait began (a spawn that ran inline) is not waited for.
  if (!reply->done) co_await async_sleep_until(reply->bell, TimePoint::max());
  std::erase(p.waiting, reply.get());
  try {
    if (!reply->done) throw ProcessDied();
    if (reply->error) std::rethrow_exception(reply->error);
    const Outcome& o = *reply->outcome;
    if (lost()) {
      said = "gets no answer: its process died";
    } else {
      const bool stored = o.source == Outcome::Source::replayed ||
                          (o.source == Outcome::Source::executed && o.expires_at != TimePoint{});
      if (o.source == Outcome::Source::executed && stored) w.executions[exec].clean = true;
      w.answers.push_back({r.id, key, o.response.status, o.response.body, o.source, stored});
      if (w.tracing)
        said = fmt::format("<- {} {}{}", o.response.status, o.response.body,
                           o.replayed() ? " (replayed)" : "");
      final = true;
      if (o.source == Outcome::Source::executed && stored) w.freed(key, true);
    }
  } catch (const InProgressError&) {
    said = "<- 409 in progress";
    if (!lost() && w.plan.config.policy == InFlight::wait && !w.store_trouble && !w.stalls) {
      w.violate(Invariant::waiters_wake,
                fmt::format("c{} ({}) gave up waiting under InFlight::wait", r.id, key));
    }
  } catch (const KeyReuseError&) {
    said = "<- 422 key reused with another payload";
    final = !lost();
  } catch (const LeaseLostError&) {
    said = "<- 500 lease lost";
  } catch (const OutcomeUnknownError& e) {
    if (w.tracing) said = fmt::format("<- 503 outcome unknown: {}", e.what());
  } catch (const StoreError& e) {
    if (w.tracing) said = fmt::format("<- 503 {}", e.what());
  } catch (const ProviderTimeout&) {
    said = "<- 504 provider timed out";
    if (!lost()) w.freed(key, false);
  } catch (const ProcessDied&) {
    said = "gets no answer: its process died";
  } catch (const std::exception& e) {
    // Anything else is a contract error of its own: the client is told nothing it expects.
    said = fmt::format("<- unexpected error: {}", e.what());
    w.violate(Invariant::finished,
              fmt::format("c{} ({}) got an unexpected error: {}", r.id, key, e.what()));
    final = true;
  }
  w.progressed(key, call);
  if (w.tracing) w.note(who, said);
  co_return final;
}

net::awaitable<void> client(World& w, const PlannedRequest& r) {
  co_await async_sleep_until(*w.clock, w.start + r.at);
  Rng rng(r.seed);
  for (int tries = 0;;) {
    Process* p = w.reach(r.process);
    if (p != nullptr) {
      const bool final = co_await attempt(w, r, *p, rng, tries == 0);
      if (final || ++tries > r.retries) break;
    }
    // Backoff with jitter, as a careful client retries.
    const milliseconds backoff =
        milliseconds(50 << std::min(tries, 5)) + milliseconds(rng.range(0, 50));
    const TimePoint until = w.clock->now() + backoff;
    co_await async_sleep_until(*w.clock, until);
  }
  ++w.finished_clients;
}

void World::run() {
  for (const auto& c : plan.crashes) clock->call_at(start + c.at, [this, c] { crash(c); });
  for (const auto& f : plan.faults) clock->call_at(start + f.at, [this, f] { fault(f); });
  for (const auto& r : plan.requests) spawn(*this, client(*this, r));
  spawn(*this, maintenance(*this));
  events = sim::run(*io, *clock);
  check();
}

void World::check() {
  judged(Invariant::finished, plan.requests.size());
  if (finished_clients != plan.requests.size()) {
    violate(Invariant::finished,
            fmt::format("{} of {} clients never got a final answer or gave up",
                        plan.requests.size() - finished_clients, plan.requests.size()));
  }
  const std::vector<Charge> ledger = bank->charges();
  std::map<std::string, std::vector<std::string>> charges_of;
  for (const auto& c : ledger) charges_of[c.order_id].push_back(c.id);
  std::map<std::string, std::size_t> unclean;
  for (const auto& e : executions) {
    if (e.charged && !e.clean) ++unclean[e.key];
  }
  // The multi-step operation: one charge and one order per key, whatever happened, but for a
  // pause during a call through a provider that does not deduplicate.
  for (const auto& c : shop->charges()) charges_of[c.order_id].push_back(c.id);
  std::map<std::string, std::size_t> paused_in_call;
  for (const auto& e : executions) {
    if (e.paused_in_call) ++paused_in_call[e.key];
  }
  std::map<std::string, std::vector<std::string>> orders_of;
  for (auto& [key, charge] : pool.orders()) orders_of[key].push_back(charge);
  for (const auto& [key, ids] : orders_of) {
    judged(Invariant::at_most_once);
    if (ids.size() > 1) {
      violate(Invariant::at_most_once, fmt::format("{}: {} orders ({})", key, ids.size(),
                                                   fmt::format("{}", fmt::join(ids, ", "))));
    }
  }
  for (const auto& [key, ids] : charges_of) {
    judged(Invariant::at_most_once);
    const std::size_t allowed = plan.config.psp_dedup ? 1 : 1 + paused_in_call[key];
    if (key.find(kOperations[kCheckout]) != std::string::npos && ids.size() > allowed) {
      violate(Invariant::at_most_once,
              fmt::format("{}: the multi-step operation charged {} times ({}), {} allowed", key,
                          ids.size(), fmt::format("{}", fmt::join(ids, ", ")), allowed));
    }
  }
  if (plan.config.policy != InFlight::run) {
    for (const auto& [key, ids] : charges_of) {
      if (key.find(kOperations[kCheckout]) != std::string::npos) continue;  // its own rule above
      if (ids.size() > 1 + unclean[key]) {
        violate(
            Invariant::at_most_once,
            fmt::format("{} charged {} times ({}); attempts that charged and did not end "
                        "cleanly: {}",
                        key, ids.size(), fmt::format("{}", fmt::join(ids, ", ")), unclean[key]));
      }
    }
  }
  std::map<std::string, const Answer*> first_stored;
  for (const auto& a : answers) {
    const PlannedRequest& r = plan.requests[static_cast<std::size_t>(a.request - 1)];
    nlohmann::json body = nlohmann::json::parse(a.body, nullptr, false);
    judged(Invariant::right_payload);
    if (body.is_discarded() || body.value("tenant", "") != kTenants[r.tenant] ||
        body.value("key", "") != a.key || body.value("amount", -1LL) != r.amount) {
      violate(Invariant::right_payload, fmt::format("c{} ({} amount {}) was answered {}", a.request,
                                                    a.key, r.amount, a.body));
    }
    if (a.status == 200) {
      judged(Invariant::success_charged);
      const std::string id = body.is_discarded() ? "" : body.value("charge_id", "");
      const auto& ids = charges_of[a.key];
      if (std::find(ids.begin(), ids.end(), id) == ids.end()) {
        violate(Invariant::success_charged,
                fmt::format("c{} was answered charge {} that the ledger has no record of for {}",
                            a.request, id, a.key));
      }
      const auto& orders = orders_of[a.key];
      if (r.operation == kCheckout && std::find(orders.begin(), orders.end(), id) == orders.end()) {
        violate(Invariant::success_charged,
                fmt::format("c{} was answered charge {} but no order of {} was paid with it",
                            a.request, id, a.key));
      }
    }
    if (!a.stored) continue;
    auto [it, fresh] = first_stored.emplace(a.key, &a);
    if (!fresh) judged(Invariant::same_answer);
    if (!fresh && (it->second->status != a.status || it->second->body != a.body)) {
      violate(Invariant::same_answer,
              fmt::format("{}: c{} got {} {} but c{} got {} {}", a.key, it->second->request,
                          it->second->status, it->second->body, a.request, a.status, a.body));
    }
  }
}

void Recorder::apply(std::span<StoreOp* const> ops) {
  StoreWrapper::apply(ops);
  for (StoreOp* op : ops) {
    if (!op->error) seen(*op);
  }
}

void Recorder::seen(const StoreOp& op) {
  const std::string key = fmt::format("{}/{}/{}", op.id->tenant, op.id->operation, op.id->key);
  KeyLog& k = w_.keys[key];
  switch (op.kind) {
    case StoreOp::Kind::reserve:
      if (op.reservation.kind == Reservation::Kind::existing) return;
      w_.judged(Invariant::tokens_grow);
      if (op.reservation.kind == Reservation::Kind::taken_over) w_.judged(Invariant::fencing);
      if (op.reservation.token <= k.newest_token) {
        w_.violate(Invariant::tokens_grow,
                   fmt::format("{}: a reservation got token {} after token {}", key,
                               op.reservation.token, k.newest_token));
      }
      if (op.reservation.kind == Reservation::Kind::taken_over && op.now < k.lease_until) {
        w_.violate(Invariant::fencing,
                   fmt::format("{}: taken over with token {} at t={}ms while token {}'s lease "
                               "ran until t={}ms",
                               key, op.reservation.token, w_.ms(op.now), k.newest_token,
                               w_.ms(k.lease_until)));
      }
      k.newest_token = std::max(k.newest_token, op.reservation.token);
      k.lease_until = op.lease_until;
      if (w_.tracing)
        w_.note("store", fmt::format("{} reserved with token {}", key, op.reservation.token));
      return;
    case StoreOp::Kind::complete:
    case StoreOp::Kind::release:
      if (op.applied) w_.judged(Invariant::fencing);
      if (op.applied && op.token != k.newest_token) {
        w_.violate(Invariant::fencing,
                   fmt::format("{}: a {} under token {} was applied, but token {} holds the key",
                               key, op.kind == StoreOp::Kind::complete ? "completion" : "release",
                               op.token, k.newest_token));
      }
      if (op.applied) {
        k.lease_until = TimePoint::min();
        k.freed_token = op.token;
      }
      return;
    case StoreOp::Kind::store_if_absent:
      return;
  }
}

KeyLog& Recorder::applied_under(const KeyId& id, std::int64_t token, std::string_view what) {
  const std::string key = fmt::format("{}/{}/{}", id.tenant, id.operation, id.key);
  KeyLog& k = w_.keys[key];
  w_.judged(Invariant::fencing);
  if (token != k.newest_token) {
    w_.violate(Invariant::fencing,
               fmt::format("{}: {} under token {} was applied, but token {} holds the key", key,
                           what, token, k.newest_token));
  }
  return k;
}

bool Recorder::renew(const KeyId& id, std::int64_t token, TimePoint lease_until) {
  if (!StoreWrapper::renew(id, token, lease_until)) return false;
  KeyLog& k = applied_under(id, token, "a lease renewal");
  if (token == k.newest_token) k.lease_until = std::max(k.lease_until, lease_until);
  return true;
}

bool Recorder::mark_pending(const KeyId& id, std::int64_t token, std::int64_t origin,
                            const std::string& step, const LeaseCheck& lease) {
  if (!StoreWrapper::mark_pending(id, token, origin, step, lease)) return false;
  KeyLog& k = applied_under(id, token, fmt::format("step '{}' marked pending", step));
  if (token == k.newest_token) k.lease_until = std::max(k.lease_until, lease.renew_to);
  return true;
}

bool Recorder::commit_step(const KeyId& id, std::int64_t token, std::int64_t origin,
                           const StepCommit& step) {
  if (!StoreWrapper::commit_step(id, token, origin, step)) return false;
  applied_under(id, token, fmt::format("step '{}' committed", step.result.step));
  return true;
}

std::vector<ReapedRecord> Recorder::reap(TimePoint lease_ended_before, std::size_t limit) {
  std::vector<ReapedRecord> reaped = StoreWrapper::reap(lease_ended_before, limit);
  // The reaper names keys by their hash only: a reaped reservation is found by its
  // operation and token (tokens of one key never repeat).
  for (const ReapedRecord& r : reaped) {
    for (auto& [key, k] : w_.keys) {
      if (k.newest_token == r.token &&
          key.find(fmt::format("/{}/", r.operation)) != std::string::npos)
        k.lease_until = TimePoint::min();
    }
  }
  return reaped;
}

ScenarioResult run_plan(const Plan& plan, bool tracing) {
  ScenarioResult out;
  out.seed = plan.seed;
  out.plan = describe_plan(plan);
  World w(plan, tracing);
  w.run();
  out.violations = std::move(w.violations);
  out.trace = std::move(w.trace);
  out.requests = plan.requests.size();
  out.attempts = w.attempts;
  out.processes = static_cast<std::size_t>(plan.config.processes);
  out.crashes = w.crashes;
  out.faults = w.faults;
  out.pauses = w.pauses;
  out.charges = w.bank->charge_count();
  out.events = w.events;
  out.simulated_ms = w.ms(w.clock->now());
  out.checked = w.checked;
  return out;
}

// Drops parts of a failing plan while it still fails with the same invariant.
Plan shrink(Plan plan, Invariant broken) {
  auto still_fails = [broken](const Plan& p) {
    const ScenarioResult r = run_plan(p, false);
    return std::any_of(r.violations.begin(), r.violations.end(),
                       [broken](const Violation& v) { return v.invariant == broken; });
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (std::size_t i = 0; i < plan.crashes.size(); ++i) {
      Plan p = plan;
      p.crashes.erase(p.crashes.begin() + static_cast<std::ptrdiff_t>(i));
      if (still_fails(p)) {
        plan = std::move(p);
        changed = true;
        break;
      }
    }
    for (std::size_t i = 0; i < plan.faults.size(); ++i) {
      Plan p = plan;
      p.faults.erase(p.faults.begin() + static_cast<std::ptrdiff_t>(i));
      if (still_fails(p)) {
        plan = std::move(p);
        changed = true;
        break;
      }
    }
    for (std::size_t i = 0; i < plan.requests.size() && plan.requests.size() > 1; ++i) {
      Plan p = plan;
      p.requests.erase(p.requests.begin() + static_cast<std::ptrdiff_t>(i));
      for (std::size_t j = 0; j < p.requests.size(); ++j)
        p.requests[j].id = static_cast<int>(j) + 1;
      if (still_fails(p)) {
        plan = std::move(p);
        changed = true;
        break;
      }
    }
    for (std::size_t i = 0; i < plan.requests.size(); ++i) {
      for (int what = 0; what < 3; ++what) {
        Plan p = plan;
        PlannedRequest& q = p.requests[i];
        if (what == 0 && q.faults)
          q.faults = false;
        else if (what == 1 && q.stall.count() > 0)
          q.stall = 0ms;
        else if (what == 2 && q.retries > 0)
          q.retries = 0;
        else
          continue;
        if (still_fails(p)) {
          plan = std::move(p);
          changed = true;
        }
      }
    }
  }
  return plan;
}

}  // namespace

ScenarioResult simulate(std::uint64_t seed, const ScenarioOptions& options) {
  const Plan plan = make_plan(seed, options);
  ScenarioResult r = run_plan(plan, options.trace);
  if (r.ok() || !options.shrink) return r;
  Invariant keep = r.violations.front().invariant;
  if (options.shrink_for &&
      std::any_of(r.violations.begin(), r.violations.end(),
                  [&](const Violation& v) { return v.invariant == *options.shrink_for; }))
    keep = *options.shrink_for;
  const Plan minimal = shrink(plan, keep);
  ScenarioResult small = run_plan(minimal, true);
  if (small.ok()) return r;  // cannot happen: shrink keeps only plans that fail
  return small;
}

std::string describe(const ScenarioResult& r) {
  std::string out = fmt::format("seed {}: {}\n", r.seed, r.ok() ? "ok" : "FAILED");
  for (const auto& v : r.violations)
    out += fmt::format("  violated {}: {}\n", to_string(v.invariant), v.detail);
  out += "plan:\n";
  out += r.plan;
  if (!r.trace.empty()) {
    out += "trace:\n";
    for (const auto& e : r.trace)
      out += fmt::format("  t={:>6}ms  {:<8} {}\n", e.at_ms, e.who, e.what);
  }
  return out;
}

namespace {

// A trace line in a few words, for a mark's label (the whole line is its tooltip).
std::string short_label(const TraceEvent& e) {
  const std::string& w = e.what;
  auto charge_id = [&]() -> std::string {
    const auto at = w.find("\"charge_id\":\"");
    if (at == std::string::npos) return "";
    const auto from = at + 13;
    return " " + w.substr(from, w.find('"', from) - from);
  };
  std::string out;
  if (e.who.starts_with("idem@")) {
    out = w.substr(0, w.find(' '));
  } else if (e.who == "bank" || e.who == "psp") {
    out = w.starts_with("provider: ") ? w.substr(10) : w;
    out = out.substr(0, out.find(" for "));
  } else if (e.who == "check") {
    out = w.substr(0, w.find(':'));
  } else if (w.starts_with("sends ") && w.find(" amount ") != std::string::npos) {
    out = "sends" + w.substr(w.find(" amount ") + 7);
  } else if (w.starts_with("<- ")) {
    out = w.substr(0, 6) + charge_id() + (w.ends_with("(replayed)") ? " replayed" : "");
    if (charge_id().empty()) out = w;
  } else {
    out = w;
  }
  return out.size() > 26 ? out.substr(0, 25) + "…" : out;
}

}  // namespace

TimelinePanel timeline_of(const ScenarioResult& r) {
  TimelinePanel panel;
  panel.title = fmt::format("seed {}{}", r.seed, r.ok() ? "" : " (failed)");
  if (!r.violations.empty())
    panel.caption = fmt::format("violated {}", to_string(r.violations.front().invariant));
  std::set<std::string> clients, idems;
  for (const auto& e : r.trace) {
    if (e.who == "store") continue;  // the recorder's view repeats idem's
    if (e.who.starts_with("c") && e.who != "check") clients.insert(e.who);
    if (e.who.starts_with("idem@")) idems.insert(e.who);
  }
  // c1, c2, ..., c10 in number order.
  std::vector<std::string> ordered(clients.begin(), clients.end());
  std::sort(ordered.begin(), ordered.end(), [](const std::string& a, const std::string& b) {
    return a.size() != b.size() ? a.size() < b.size() : a < b;
  });
  panel.lanes = ordered;
  panel.lanes.insert(panel.lanes.end(), idems.begin(), idems.end());
  for (const char* provider : {"bank", "psp"}) {
    if (std::any_of(r.trace.begin(), r.trace.end(),
                    [&](const auto& e) { return e.who == provider; }))
      panel.lanes.push_back(provider);
  }
  for (const auto& e : r.trace) {
    if (e.who == "store") continue;
    panel.events.push_back({e.at_ms, e.who, e.mark, short_label(e), e.what});
  }
  return panel;
}

}  // namespace idem::sim
