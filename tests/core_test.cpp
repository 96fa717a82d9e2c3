// White-box tests of lib/src units that no public call shows one by one: the decision table
// (decide.hpp), the group commit (group_commit.hpp), and the benchmark floor's SQL against
// idem's. (The one test file allowed to include lib/src headers.)
#include <doctest/doctest.h>

#include <fmt/format.h>

#include <unistd.h>

#include <atomic>
#include <functional>
#include <future>
#include <latch>
#include <system_error>
#include <thread>

#include "../lib/src/attempt.hpp"
#include "../lib/src/decide.hpp"
#include "../lib/src/drive.hpp"
#include "../lib/src/fair_mutex.hpp"
#include "../lib/src/group_commit.hpp"
#include "../lib/src/pg_sql.hpp"
#include "../lib/src/read_first.hpp"
#include "../lib/src/record_codec.hpp"
#include "../lib/src/sql.hpp"
#include "bench/floor_sql.hpp"
#include "idem/internal/store_stats.hpp"
#include "idem/store_wrapper.hpp"
#include "test_support.hpp"

using namespace std::chrono_literals;
using idem::FailureMode;
using idem::InFlight;
using idem::detail::decide;
using idem::detail::Decision;
using idem::detail::Found;

namespace {

const idem::TimePoint kNow = idem::sim::kSimulationStart;

idem::detail::Call call_with(InFlight policy, long long amount = 4990) {
  idem::detail::Call c;
  c.id = {"alpha", "payment.charge", "k1"};
  c.fingerprint = idem::test::request("k1", amount).fingerprint;
  c.policy = policy;
  return c;
}

idem::Record record(idem::State state) {
  idem::Record r;
  r.fingerprint = idem::test::request("k1").fingerprint;
  r.state = state;
  r.token = 7;
  r.lease_until = kNow + 30s;
  r.expires_at = kNow + 30s;
  return r;
}

Decision on(const Found& f, InFlight policy, FailureMode mode = FailureMode::fail_open,
            idem::TimePoint give_up = kNow + 10s, long long amount = 4990) {
  return decide(f, call_with(policy, amount), mode, kNow, give_up);
}

}  // namespace

TEST_CASE("decide: the in-flight rules, row by row") {
  const idem::Record running = record(idem::State::in_progress);
  const idem::Record done = record(idem::State::completed);
  const Found live_running{Found::Kind::live, &running};
  const Found live_done{Found::Kind::live, &done};
  for (InFlight p : {InFlight::run, InFlight::wait, InFlight::raise}) {
    CAPTURE(idem::to_string(p));
    // Nothing live: the cache runs bare, the others reserve.
    CHECK(on({Found::Kind::nothing_live}, p) ==
          (p == InFlight::run ? Decision::run_unreserved : Decision::reserve));
    // A completed record replays under every policy; another fingerprint is KeyReuse first.
    CHECK(on(live_done, p) == Decision::replay);
    CHECK(on(live_done, p, FailureMode::fail_open, kNow + 10s, 5) == Decision::key_reuse);
    CHECK(on(live_running, p, FailureMode::fail_open, kNow + 10s, 5) == Decision::key_reuse);
    // The reservation was written: run holding the key.
    CHECK(on({Found::Kind::owned}, p) == Decision::run_reserved);
    // No key: run without the store. The store failed: as configured.
    CHECK(on({Found::Kind::no_key}, p) == Decision::run_unprotected);
    CHECK(on({Found::Kind::store_failed}, p) == Decision::run_unprotected);
    CHECK(on({Found::Kind::store_failed}, p, FailureMode::fail_closed) ==
          Decision::store_unavailable);
  }
  // In progress: the table's three rows.
  CHECK(on(live_running, InFlight::run) == Decision::run_unreserved);
  CHECK(on(live_running, InFlight::wait) == Decision::wait);
  CHECK(on(live_running, InFlight::raise) == Decision::in_progress);
  // A wait that has run out.
  CHECK(on(live_running, InFlight::wait, FailureMode::fail_open, kNow) == Decision::in_progress);
}

namespace {

// Counts apply() calls and the ops they carried, and reads; can run a hook inside the first
// apply().
struct CountingStore final : idem::StoreWrapper {
  using StoreWrapper::StoreWrapper;
  std::atomic<int> applies{0}, ops{0}, loads{0};
  std::function<void()> during_first_apply;
  void apply(std::span<idem::StoreOp* const> batch) override {
    if (applies.fetch_add(1) == 0 && during_first_apply) during_first_apply();
    ops += static_cast<int>(batch.size());
    StoreWrapper::apply(batch);
  }
  std::optional<idem::Record> load(const idem::KeyId& id) override {
    ++loads;
    return StoreWrapper::load(id);
  }
};

// A writer's notify that notes what the writer hears in `heard`: "NAME committed" or
// "NAME leads".
idem::detail::GroupCommit::Notify noting(std::vector<std::string>& heard, std::string name) {
  return [&heard, name = std::move(name)](idem::detail::GroupCommit::Signal s) {
    heard.push_back(name +
                    (s == idem::detail::GroupCommit::Signal::committed ? " committed" : " leads"));
  };
}

}  // namespace

TEST_CASE(
    "group commit: writes queued together commit in one apply, the next leader is told first") {
  auto sqlite = std::make_shared<idem::SqliteStore>(":memory:");
  auto store = std::make_shared<CountingStore>(sqlite);
  idem::detail::GroupCommit commits(*store);
  const idem::Fingerprint fp = idem::test::request("k").fingerprint;
  std::vector<idem::KeyId> ids;
  for (int i = 0; i < 6; ++i) ids.push_back({"alpha", "op", "k" + std::to_string(i)});
  std::vector<idem::StoreOp> ops(6);
  for (int i = 0; i < 6; ++i) {
    ops[static_cast<std::size_t>(i)] = idem::StoreOp{.kind = idem::StoreOp::Kind::reserve,
                                                     .id = &ids[static_cast<std::size_t>(i)],
                                                     .fingerprint = &fp,
                                                     .now = kNow,
                                                     .lease_until = kNow + 30s};
  }
  std::vector<std::string> heard;
  const auto listener = [&heard](std::string name) { return noting(heard, std::move(name)); };
  CHECK(commits.enqueue(ops[0], listener("w0")));  // nobody leads: w0 will
  for (int i = 1; i < 5; ++i)
    CHECK_FALSE(
        commits.enqueue(ops[static_cast<std::size_t>(i)], listener("w" + std::to_string(i))));
  // A write that arrives while the batch commits waits for the next one, led by its writer.
  store->during_first_apply = [&] { CHECK_FALSE(commits.enqueue(ops[5], listener("w5"))); };
  commits.lead();
  CHECK(store->applies == 1);
  CHECK(store->ops == 5);
  // The next leader hears first, so its round never waits for the others' wake-ups.
  CHECK(heard == std::vector<std::string>{"w5 leads", "w0 committed", "w1 committed",
                                          "w2 committed", "w3 committed", "w4 committed"});
  for (int i = 0; i < 5; ++i) {
    CHECK_FALSE(ops[static_cast<std::size_t>(i)].error);
    CHECK(ops[static_cast<std::size_t>(i)].reservation.kind == idem::Reservation::Kind::reserved);
  }
  commits.lead();  // w5's turn: one batch of its own, and nobody is left to lead
  CHECK(store->applies == 2);
  CHECK(heard.back() == "w5 committed");
  CHECK(commits.enqueue(ops[0], listener("again")));  // the lead is free again
}

namespace {

// A store that can keep two batches in flight (as PgStore's batch connections): each
// started batch is held until the test lets it go (advance()), and then applied to SQLite.
struct TwoInFlight final : idem::StoreWrapper {
  struct Held final : idem::PendingApply {
    Held(idem::Store& s, std::span<idem::StoreOp* const> o) : store(s), ops(o.begin(), o.end()) {}
    int descriptor() const noexcept override { return done_ ? -1 : 0; }
    std::chrono::steady_clock::time_point deadline() const noexcept override {
      return std::chrono::steady_clock::time_point::max();
    }
    bool done() const noexcept override { return done_; }
    void advance() noexcept override {
      store.apply(ops);
      done_ = true;
    }
    void fail(std::exception_ptr why) noexcept override {
      for (idem::StoreOp* op : ops) op->error = why;
      done_ = true;
    }
    idem::Store& store;
    std::vector<idem::StoreOp*> ops;
    bool done_ = false;
  };

  using StoreWrapper::StoreWrapper;
  std::size_t concurrent_applies() const noexcept override { return 2; }
  bool remote() const noexcept override { return network; }
  std::unique_ptr<idem::PendingApply> start_apply(std::span<idem::StoreOp* const> ops) override {
    auto held = std::make_unique<Held>(target(), ops);
    started.push_back(held.get());
    return held;
  }
  std::vector<Held*> started;
  bool network = false;  // remote(): as PgStore, a store that waits on a network peer
};

}  // namespace

TEST_CASE(
    "fair mutex: a waiter that gives up at its deadline leaves the line wherever it stood, and "
    "those before and after it are still served (x20)") {
  for (int trial = 0; trial < 20; ++trial) {
    CAPTURE(trial);
    idem::detail::FairMutex m;
    m.lock();
    std::atomic<int> served{0};
    const auto serve = [&] {
      m.lock();
      ++served;
      m.unlock();
    };
    // B joins the line between A and C, or before or after both (the threads' order varies).
    std::thread a(serve);
    bool b_got = true;
    std::thread b([&] {
      b_got = m.try_lock_until(std::chrono::steady_clock::now() + std::chrono::milliseconds(5));
    });
    std::thread c(serve);
    b.join();  // the lock stayed held: B gave up
    CHECK_FALSE(b_got);
    m.unlock();
    a.join();
    c.join();
    CHECK(served == 2);
    CHECK(m.try_lock());  // free, nobody left in line
    m.unlock();
  }
}

TEST_CASE("group commit: two batches in flight, each round its share, answers in any order") {
  auto store = std::make_shared<TwoInFlight>(std::make_shared<idem::SqliteStore>(":memory:"));
  idem::detail::GroupCommit commits(*store);
  const idem::Fingerprint fp = idem::test::request("k").fingerprint;
  std::vector<idem::KeyId> ids;
  for (int i = 0; i < 7; ++i) ids.push_back({"alpha", "op", "k" + std::to_string(i)});
  std::vector<idem::StoreOp> ops(7);
  for (std::size_t i = 0; i < 7; ++i) {
    ops[i] = idem::StoreOp{.kind = idem::StoreOp::Kind::reserve,
                           .id = &ids[i],
                           .fingerprint = &fp,
                           .now = kNow,
                           .lease_until = kNow + 30s};
  }
  std::vector<std::string> heard;
  const auto listener = [&heard](std::size_t i) { return noting(heard, fmt::format("w{}", i)); };
  // The event loop's wait, held by the test: each started batch and what ends its round.
  std::vector<std::function<void()>> finishers;
  const idem::detail::GroupCommit::Drive drive = [&](idem::PendingApply&,
                                                     std::function<void()> finished) {
    finishers.push_back(std::move(finished));
  };
  CHECK(commits.enqueue(ops[0], listener(0)));
  for (std::size_t i = 1; i < 6; ++i) CHECK_FALSE(commits.enqueue(ops[i], listener(i)));
  // Two connections free: the round takes half the queue, and the next leader is told at once.
  commits.lead(drive);
  REQUIRE(store->started.size() == 1);
  CHECK(store->started[0]->ops.size() == 3);
  CHECK(heard == std::vector<std::string>{"w3 leads"});
  commits.lead(drive);  // w3's round: the last free connection takes what is left
  REQUIRE(store->started.size() == 2);
  CHECK(store->started[1]->ops.size() == 3);
  // Both in flight: a new write waits, and nobody is told to lead.
  CHECK_FALSE(commits.enqueue(ops[6], listener(6)));
  commits.lead(drive);
  CHECK(store->started.size() == 2);
  // The second batch answers first: its round ends, w6 leads the next, then its writers hear.
  store->started[1]->advance();
  finishers[1]();
  CHECK(heard == std::vector<std::string>{"w3 leads", "w6 leads", "w3 committed", "w4 committed",
                                          "w5 committed"});
  store->started[0]->advance();
  finishers[0]();
  CHECK(heard.size() == 8);
  CHECK(heard.back() == "w2 committed");
  commits.lead(drive);  // w6's round
  REQUIRE(store->started.size() == 3);
  CHECK(store->started[2]->ops.size() == 1);
  store->started[2]->advance();
  finishers[2]();
  CHECK(heard.back() == "w6 committed");
  for (const idem::StoreOp& op : ops) {
    CHECK_FALSE(op.error);
    CHECK(op.reservation.kind == idem::Reservation::Kind::reserved);
  }
  CHECK(commits.enqueue(ops[0], listener(0)));  // nobody leads or is posted: the lead is free
}

TEST_CASE(
    "group commit: a round that waits on its event loop for a network store takes only that "
    "loop's writes, so a loop that stops holds no other loop's write nor a thread's") {
  const idem::Fingerprint fp = idem::test::request("k").fingerprint;
  const std::vector<idem::KeyId> ids = {
      {"alpha", "op", "w0"}, {"alpha", "op", "w1"}, {"alpha", "op", "w2"}, {"alpha", "op", "w3"}};
  const auto reserve = [&](std::size_t i) {
    return idem::StoreOp{.kind = idem::StoreOp::Kind::reserve,
                         .id = &ids[i],
                         .fingerprint = &fp,
                         .now = kNow,
                         .lease_until = kNow + 30s};
  };
  std::vector<std::string> heard;
  const auto listener = [&heard](std::string name) { return noting(heard, std::move(name)); };
  // Two event loops, as the group commit knows them (their addresses), and what each loop's
  // wait for a started batch would run when the batch is done.
  const int loop_a = 0, loop_b = 0;
  std::vector<std::function<void()>> waits_a, waits_b;
  const idem::detail::GroupCommit::Drive drive_a = [&](idem::PendingApply&,
                                                       std::function<void()> finished) {
    waits_a.push_back(std::move(finished));
  };
  const idem::detail::GroupCommit::Drive drive_b = [&](idem::PendingApply&,
                                                       std::function<void()> finished) {
    waits_b.push_back(std::move(finished));
  };

  SUBCASE("a network store: loop A's round carries A's write only") {
    auto store = std::make_shared<TwoInFlight>(std::make_shared<idem::SqliteStore>(":memory:"));
    store->network = true;
    idem::detail::GroupCommit commits(*store);
    idem::StoreOp a0 = reserve(0), b0 = reserve(1), b1 = reserve(2), t0 = reserve(3);
    CHECK(commits.enqueue(a0, listener("a0"), &loop_a));
    CHECK(commits.enqueue(b0, listener("b0"), &loop_b));  // B posts a round of its own
    CHECK_FALSE(commits.enqueue(b1, listener("b1"), &loop_b));
    commits.lead(drive_a, &loop_a);  // its share would be two of three: it takes one, its own
    REQUIRE(store->started.size() == 1);
    CHECK(store->started[0]->ops == std::vector<idem::StoreOp*>{&a0});
    // Loop A stops here: its wait never runs. B's round commits B's writes all the same.
    commits.lead(drive_b, &loop_b);
    REQUIRE(store->started.size() == 2);
    CHECK(store->started[1]->ops == std::vector<idem::StoreOp*>{&b0, &b1});
    store->started[1]->advance();
    waits_b.at(0)();
    CHECK(heard == std::vector<std::string>{"b0 committed", "b1 committed"});
    for (const idem::StoreOp* op : {&b0, &b1}) {
      CHECK_FALSE(op->error);
      CHECK(op->reservation.kind == idem::Reservation::Kind::reserved);
    }
    // So does a thread: it leads a round of its own on the free connection.
    commits.commit(t0);
    CHECK_FALSE(t0.error);
    CHECK(t0.reservation.kind == idem::Reservation::Kind::reserved);
    CHECK(heard.size() == 2);      // A's write is still in flight, untold
    store->started[0]->advance();  // loop A runs again
    waits_a.at(0)();
    CHECK(heard.back() == "a0 committed");
    CHECK(a0.reservation.kind == idem::Reservation::Kind::reserved);
  }
  SUBCASE("a store that waits for nothing but its disk: a round takes any loop's writes") {
    auto store = std::make_shared<TwoInFlight>(std::make_shared<idem::SqliteStore>(":memory:"));
    idem::detail::GroupCommit commits(*store);
    idem::StoreOp a0 = reserve(0), b0 = reserve(1), b1 = reserve(2);
    CHECK(commits.enqueue(a0, listener("a0"), &loop_a));
    CHECK(commits.enqueue(b0, listener("b0"), &loop_b));
    CHECK_FALSE(commits.enqueue(b1, listener("b1"), &loop_b));
    commits.lead(drive_a, &loop_a);  // its share of two free connections: two of three
    REQUIRE(store->started.size() == 1);
    CHECK(store->started[0]->ops == std::vector<idem::StoreOp*>{&a0, &b0});
    commits.lead(drive_b, &loop_b);
    REQUIRE(store->started.size() == 2);
    CHECK(store->started[1]->ops == std::vector<idem::StoreOp*>{&b1});
    for (std::size_t i = 0; i < 2; ++i) store->started[i]->advance();
    waits_a.at(0)();
    waits_b.at(0)();
    CHECK(heard == std::vector<std::string>{"a0 committed", "b0 committed", "b1 committed"});
  }
}

namespace {

// A store whose batches go to a connection that stays open and says nothing (a pipe nobody
// writes), with a deadline 50 ms away.
struct Silent final : idem::StoreWrapper {
  struct Pending final : idem::PendingApply {
    Pending(int read_end, std::span<idem::StoreOp* const> o)
        : fd(read_end), ops(o.begin(), o.end()) {}
    int descriptor() const noexcept override { return done_ ? -1 : fd; }
    std::chrono::steady_clock::time_point deadline() const noexcept override { return at; }
    bool done() const noexcept override { return done_; }
    void advance() noexcept override { done_ = true; }  // an answer came: nothing failed
    void fail(std::exception_ptr why) noexcept override {
      for (idem::StoreOp* op : ops) op->error = why;
      done_ = true;
    }
    int fd;
    std::vector<idem::StoreOp*> ops;
    std::chrono::steady_clock::time_point at = std::chrono::steady_clock::now() + 50ms;
    bool done_ = false;
  };

  using StoreWrapper::StoreWrapper;
  std::unique_ptr<idem::PendingApply> start_apply(std::span<idem::StoreOp* const> ops) override {
    return std::make_unique<Pending>(pipe_fds[0], ops);
  }
  int pipe_fds[2] = {-1, -1};
};

}  // namespace

TEST_CASE(
    "group commit: a round that cannot wait on the event loop waits for its batch only until "
    "the batch's deadline, then fails it") {
  auto store = std::make_shared<Silent>(std::make_shared<idem::SqliteStore>(":memory:"));
  REQUIRE(::pipe(store->pipe_fds) == 0);
  idem::detail::GroupCommit commits(*store);
  const idem::Fingerprint fp = idem::test::request("k").fingerprint;
  const idem::KeyId id{"alpha", "op", "k"};
  idem::StoreOp op{.kind = idem::StoreOp::Kind::reserve,
                   .id = &id,
                   .fingerprint = &fp,
                   .now = kNow,
                   .lease_until = kNow + 30s};
  std::atomic<bool> committed{false};
  CHECK(commits.enqueue(op, [&](idem::detail::GroupCommit::Signal s) {
    committed = s == idem::detail::GroupCommit::Signal::committed;
  }));
  // The event loop cannot watch the connection (SocketWait::start threw): the round waits here.
  const idem::detail::GroupCommit::Drive cannot = [](idem::PendingApply&, std::function<void()>) {
    throw std::system_error(EMFILE, std::generic_category(), "dup");
  };
  auto round = std::async(std::launch::async, [&] { commits.lead(cannot); });
  if (round.wait_for(30s) != std::future_status::ready) {
    FAIL_CHECK("the round still waits on a silent connection 30 s after its 50 ms deadline");
    const char byte = 0;
    CHECK(::write(store->pipe_fds[1], &byte, 1) == 1);  // let it go, to end the test
  }
  round.get();
  CHECK(committed);  // its writer is told, with the batch's error
  REQUIRE(op.error);
  CHECK_THROWS_WITH_AS(std::rethrow_exception(op.error),
                       doctest::Contains("did not answer a batch by its deadline"),
                       idem::StoreError);
  ::close(store->pipe_fds[0]);
  ::close(store->pipe_fds[1]);
}

namespace {

// The blocking driver's effects, but the way back from the store's first call (begin_external,
// which marks the step pending) takes `hop` of simulated time: as when the mark is made on a
// store thread and the event loop that resumes the call is busy.
struct SlowWayBack : idem::detail::BlockingEffects {
  idem::sim::SimulatedClock* clock = nullptr;
  std::chrono::milliseconds hop{};
  int calls = 0;
  template <class F>
  idem::detail::Now<std::invoke_result_t<F&>> store(F f) {
    auto r = f();
    if (++calls == 1) clock->advance(hop);
    return {std::move(r)};
  }
};

}  // namespace

TEST_CASE(
    "steps: an external step whose way back from its pending mark outlasts the lease is not "
    "called: the lease is checked again on the thread that calls") {
  idem::Options o;
  o.heartbeat = 0ms;  // nothing renews the lease meanwhile
  o.lease = 10s;
  idem::sim::ProviderOptions instant;
  instant.latency = 0ms;  // a call made by mistake charges at once
  idem::test::World w(o, instant);
  bool called = false;
  const auto action = [&](idem::Attempt& attempt) -> idem::Response {
    SlowWayBack slow{{{}, idem::AttemptAccess::core(attempt)}, w.clock.get(), 11s};
    const std::string charge = idem::detail::external_step(
                                   attempt, "debited",
                                   [&](const std::string& key) {
                                     called = true;
                                     return w.provider->charge("A-10023", 4990, key).charge_id;
                                   },
                                   idem::Attempt::Lookup{}, slow)
                                   .get();
    return idem::Response{200, charge, {}};
  };
  CHECK_THROWS_AS(w.idem->call_steps(idem::test::request("k1"), action), idem::LeaseLostError);
  CHECK_FALSE(called);
  CHECK(w.charges() == 0);
}

TEST_CASE("group commit: a thread handed a round leads it once, whatever ends meanwhile") {
  // Two rounds in flight and a thread waiting for a free one: both rounds end back to back.
  // The first hands its place to the thread; the second must not hand it another (a round
  // counted and never run would leave the queue with a place short, for good).
  auto store = std::make_shared<TwoInFlight>(std::make_shared<idem::SqliteStore>(":memory:"));
  idem::detail::GroupCommit commits(*store);
  const idem::Fingerprint fp = idem::test::request("k").fingerprint;
  const idem::KeyId a{"alpha", "op", "a"}, b{"alpha", "op", "b"}, t{"alpha", "op", "t"};
  const auto reserve = [&](const idem::KeyId& id) {
    return idem::StoreOp{.kind = idem::StoreOp::Kind::reserve,
                         .id = &id,
                         .fingerprint = &fp,
                         .now = kNow,
                         .lease_until = kNow + 30s};
  };
  idem::StoreOp op_a = reserve(a), op_b = reserve(b), op_t = reserve(t);
  std::vector<std::function<void()>> finishers;
  const idem::detail::GroupCommit::Drive drive = [&](idem::PendingApply&,
                                                     std::function<void()> finished) {
    finishers.push_back(std::move(finished));
  };
  const auto quiet = [](idem::detail::GroupCommit::Signal) {};
  for (int rep = 0; rep < 50; ++rep) {
    op_a = reserve(a), op_b = reserve(b), op_t = reserve(t);
    store->started.clear();
    finishers.clear();
    CHECK(commits.enqueue(op_a, quiet));
    commits.lead(drive);
    CHECK(commits.enqueue(op_b, quiet));
    commits.lead(drive);
    REQUIRE(store->started.size() == 2);
    REQUIRE(commits.rounds_running() == 2);
    std::thread writer([&] { commits.commit(op_t); });
    REQUIRE(idem::test::eventually([&] { return commits.queued() == 1; }));
    store->started[0]->advance();
    finishers[0]();
    store->started[1]->advance();
    finishers[1]();
    writer.join();
    REQUIRE_FALSE(op_t.error);
    REQUIRE(commits.rounds_running() == 0);
    REQUIRE(commits.queued() == 0);
  }
}

TEST_CASE("group commit: a blocking writer never waits on a coroutine's round that does not run") {
  // A coroutine's round is posted to its executor; that executor is stopped (or is the very
  // thread now blocking). A blocking writer leads at once and commits both writes.
  auto sqlite = std::make_shared<idem::SqliteStore>(":memory:");
  auto store = std::make_shared<CountingStore>(sqlite);
  idem::detail::GroupCommit commits(*store);
  const idem::Fingerprint fp = idem::test::request("k").fingerprint;
  const idem::KeyId a{"alpha", "op", "a"}, b{"alpha", "op", "b"};
  idem::StoreOp posted{.kind = idem::StoreOp::Kind::reserve,
                       .id = &a,
                       .fingerprint = &fp,
                       .now = kNow,
                       .lease_until = kNow + 30s};
  idem::StoreOp blocking{.kind = idem::StoreOp::Kind::reserve,
                         .id = &b,
                         .fingerprint = &fp,
                         .now = kNow,
                         .lease_until = kNow + 30s};
  bool posted_committed = false;
  CHECK(commits.enqueue(posted, [&](idem::detail::GroupCommit::Signal s) {
    posted_committed = s == idem::detail::GroupCommit::Signal::committed;
  }));                       // its round is "posted": lead() is never called
  commits.commit(blocking);  // returns: it did not wait for the posted round
  CHECK(store->applies == 1);
  CHECK(store->ops == 2);
  CHECK(posted_committed);
  CHECK(posted.reservation.kind == idem::Reservation::Kind::reserved);
  CHECK(blocking.reservation.kind == idem::Reservation::Kind::reserved);
  commits.lead();  // the posted round, late: nothing left to do
  CHECK(store->applies == 1);
}

TEST_CASE("group commit: threads that write at once share transactions, each op applied once") {
  idem::test::TempDir dir;
  auto sqlite = std::make_shared<idem::SqliteStore>(dir.file("g.db"));
  idem::detail::GroupCommit commits(*sqlite);
  const idem::Fingerprint fp = idem::test::request("k").fingerprint;
  constexpr int kThreads = 8, kEach = 50;
  // On two loaded cores the threads may run one after another in a round; repeat until
  // a round shows them overlapping (batched), as race tests do.
  int rounds = 0;
  for (; rounds < 20; ++rounds) {
    const auto before = idem::detail::StoreStats::of(*sqlite);
    std::latch start(kThreads);
    std::atomic<int> reserved{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        start.arrive_and_wait();
        for (int i = 0; i < kEach; ++i) {
          const idem::KeyId id{"alpha", "op", fmt::format("{}-{}-{}", rounds, t, i)};
          idem::StoreOp op{.kind = idem::StoreOp::Kind::reserve,
                           .id = &id,
                           .fingerprint = &fp,
                           .now = kNow,
                           .lease_until = kNow + 30s};
          commits.commit(op);
          if (!op.error && op.reservation.kind == idem::Reservation::Kind::reserved) ++reserved;
        }
      });
    }
    for (auto& t : threads) t.join();
    REQUIRE(reserved == kThreads * kEach);  // each op applied once
    const auto stats = idem::detail::StoreStats::of(*sqlite);
    REQUIRE(stats.ops - before.ops == static_cast<decltype(stats.ops)>(kThreads * kEach));
    if (stats.transactions - before.transactions < stats.ops - before.ops) break;
  }
  CHECK(rounds < 20);  // writers overlapped and were batched
  idem::test::RawDb raw(dir.file("g.db"));
  CHECK(raw.rows() == (rounds + 1) * kThreads * kEach);
}

TEST_CASE("read first: reserve at once while few calls find a record, read first while many do") {
  idem::detail::ReadFirst rule;
  CHECK_FALSE(rule.now());  // a new coordinator reserves at once
  // One call in sixteen finds a record (a few client retries): never worth a read first.
  for (int i = 0; i < 400; ++i) {
    if (i % 16 == 0)
      rule.found();
    else
      rule.fresh();
    CHECK_FALSE(rule.now());
  }
  // One in three (a retry storm): reads first within a few calls, and stays so.
  int reading = 0;
  for (int i = 0; i < 400; ++i) {
    if (i % 3 == 0)
      rule.found();
    else
      rule.fresh();
    if (i >= 30) reading += rule.now() ? 1 : 0;
  }
  CHECK(reading == 370);
  // The storm ends: back to reserving at once within a few dozen calls.
  for (int i = 0; i < 40; ++i) rule.fresh();
  CHECK_FALSE(rule.now());
}

TEST_CASE(
    "read first: a fresh key costs no read, a duplicate found by the reservation is "
    "answered alike, and duplicates bring the read back") {
  auto sqlite = std::make_shared<idem::SqliteStore>(":memory:");
  auto store = std::make_shared<CountingStore>(sqlite);
  idem::Coordinator idem(store, idem::Options{});
  int charges = 0;
  const auto charge = [&charges] {
    ++charges;
    return idem::Response{200, fmt::format(R"({{"charge_id":"ch_{}"}})", charges), {}};
  };
  const idem::Outcome first = idem.call(idem::test::request("k1"), charge);
  CHECK(store->loads == 0);  // reserved, ran, completed: two writes, no read
  CHECK(store->applies == 2);
  CHECK(charges == 1);
  // The duplicate's reservation finds the completed record: the same replay a read gives.
  const idem::Outcome again = idem.call(idem::test::request("k1"), charge);
  CHECK(again.replayed());
  CHECK(again.response == first.response);
  CHECK(store->loads == 0);
  CHECK(store->applies == 3);
  // Another payload under the key: 422 all the same, and the record is untouched.
  CHECK_THROWS_AS(idem.call(idem::test::request("k1", 100), charge), idem::KeyReuseError);
  CHECK(store->load({"alpha", "payment.charge", "k1"})->response == first.response);
  store->loads = 0;
  // Duplicates keep coming: calls read first, and a replay then takes no write at all.
  for (int i = 0; i < 5; ++i) CHECK(idem.call(idem::test::request("k1"), charge).replayed());
  CHECK(store->loads > 0);
  const int applies = store->applies;
  const int loads = store->loads;
  CHECK(idem.call(idem::test::request("k1"), charge).replayed());
  CHECK(store->applies == applies);
  CHECK(store->loads == loads + 1);
  CHECK(charges == 1);
  // Fresh keys again: after a while, no reads.
  for (int i = 0; i < 40; ++i) idem.call(idem::test::request(fmt::format("n{}", i)), charge);
  CHECK(charges == 41);
  const int settled = store->loads;
  idem.call(idem::test::request("last"), charge);
  CHECK(store->loads == settled);
  CHECK(charges == 42);
}

namespace {

// Every write comes back marked as having waited for another writer's lock.
struct ContendedStore final : idem::StoreWrapper {
  using StoreWrapper::StoreWrapper;
  std::atomic<int> loads{0};
  void apply(std::span<idem::StoreOp* const> batch) override {
    StoreWrapper::apply(batch);
    for (idem::StoreOp* op : batch) op->contended = true;
  }
  std::optional<idem::Record> load(const idem::KeyId& id) override {
    ++loads;
    return StoreWrapper::load(id);
  }
};

}  // namespace

TEST_CASE("read first: while writes wait for another writer's lock, fresh keys are read first") {
  // Back-to-back write transactions leave another process no gap to take the lock in.
  auto store = std::make_shared<ContendedStore>(std::make_shared<idem::SqliteStore>(":memory:"));
  idem::Coordinator idem(store, idem::Options{});
  int charges = 0;
  const auto charge = [&charges] {
    ++charges;
    return idem::Response{200, R"({"charge_id":"ch"})", {}};
  };
  for (int i = 0; i < 10; ++i) idem.call(idem::test::request(fmt::format("k{}", i)), charge);
  CHECK(charges == 10);
  CHECK(store->loads > 0);
  const int loads = store->loads;
  idem.call(idem::test::request("fresh"), charge);
  CHECK(store->loads == loads + 1);
  CHECK(charges == 11);
}

TEST_CASE("bench: the floor runs idem's own statements") {
  CHECK(idem::bench::sql::kReserve == idem::sql::kReserve);
  CHECK(idem::bench::sql::kComplete == idem::sql::kComplete);
  CHECK(idem::bench::sql::kLoad == idem::sql::kLoad);
  CHECK(idem::bench::sql::kSynchronousNormal == idem::sql::kSynchronousNormal);
  CHECK(idem::bench::sql::kSynchronousFull == idem::sql::kSynchronousFull);
  CHECK(idem::bench::sql::kPgReserve == idem::pg_sql::kReserve);
  CHECK(idem::bench::sql::kPgComplete == idem::pg_sql::kComplete);
  CHECK(idem::bench::sql::kPgLoad == idem::pg_sql::kLoad);
}

TEST_CASE(
    "record codec: stored headers decode as [name, value] pairs, and any other shape is a corrupt "
    "record") {
  using idem::detail::headers_from_json;
  using idem::detail::headers_to_json;
  const std::vector<idem::Header> headers = {
      {"Content-Type", "application/json"}, {"X-Quote", "a \"b\" \\ \u00e9"}, {"Empty", ""}};
  const std::vector<idem::Header> back = headers_from_json(headers_to_json(headers));
  REQUIRE(back.size() == headers.size());
  for (std::size_t i = 0; i < headers.size(); ++i) {
    CHECK(back[i].name == headers[i].name);
    CHECK(back[i].value == headers[i].value);
  }
  CHECK(headers_from_json("").empty());
  CHECK(headers_from_json("[]").empty());
  for (const char* bad : {"not json", "{}", "\"a\"", "1", "[\"a\"]", "[[\"a\"]]",
                          "[[\"a\", \"b\", \"c\"]]", "[[\"a\", 1]]", "[[[\"a\", \"b\"]]]",
                          "[[\"a\", \"b\"]", "[[\"a\", null]]", "[[\"a\", \"b\"]] x"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(headers_from_json(bad), idem::CorruptRecordError);
  }
}

TEST_CASE(
    "record codec: a thread keeps the last headers it encoded or decoded, and other headers or "
    "another text are never answered from them") {
  using idem::detail::headers_from_json;
  using idem::detail::headers_to_json;
  using Headers = std::vector<idem::Header>;
  // Sets whose texts have the same length and differ in one character, a set of two, and one
  // too long to be kept: each must answer only for itself, in either direction.
  const Headers a = {{"Content-Type", "application/json"}};
  const Headers b = {{"Content-Type", "application/jsoN"}};
  const Headers c = {{"Content-Type", "text/plain"}, {"X-Id", "7"}};
  const Headers big = {{"X-Long", std::string(2000, 'v')}};
  const std::string a_text = R"([["Content-Type","application/json"]])";
  const std::string b_text = R"([["Content-Type","application/jsoN"]])";
  const std::string c_text = R"([["Content-Type","text/plain"],["X-Id","7"]])";
  const std::string big_text = R"([["X-Long",")" + std::string(2000, 'v') + R"("]])";
  const std::pair<const Headers*, const std::string*> sets[] = {
      {&a, &a_text}, {&b, &b_text}, {&c, &c_text}, {&big, &big_text}};
  for (const int i : {0, 0, 1, 0, 2, 3, 3, 2, 1, 1, 0, 3, 0}) {
    const auto [headers, text] = sets[i];
    CAPTURE(i);
    CHECK(headers_to_json(*headers) == *text);
    CHECK(headers_from_json(*text) == *headers);
    CHECK(headers_from_json(*text) == *headers);
    CHECK(headers_to_json(*headers) == *text);
  }
  for (const int i : {1, 0, 1, 2, 0}) {  // decoding first, then encoding
    const auto [headers, text] = sets[i];
    CAPTURE(i);
    CHECK(headers_from_json(*text) == *headers);
    CHECK(headers_to_json(*sets[(i + 1) % 3].first) == *sets[(i + 1) % 3].second);
  }
  // A text that does not decode is refused every time, whatever was decoded before it, and a
  // set that does not encode (not UTF-8) too.
  CHECK(headers_from_json(a_text) == a);
  const std::string broken = a_text.substr(0, a_text.size() - 1);
  CHECK_THROWS_AS(headers_from_json(broken), idem::CorruptRecordError);
  CHECK_THROWS_AS(headers_from_json(broken), idem::CorruptRecordError);
  const Headers not_utf8 = {{"Content-Type", "\xff"}};
  CHECK_THROWS_AS(headers_to_json(not_utf8), idem::StoreError);
  CHECK_THROWS_AS(headers_to_json(not_utf8), idem::StoreError);
  CHECK(headers_from_json(b_text) == b);
  CHECK(headers_to_json(a) == a_text);
}
