// The Asio front end on simulated time: the in-flight table (Options::in_flight) from coroutines on
// one io_context, with exact simulated timings. Each test counts the provider's charges.
#include "idem/asio.hpp"
#include "idem/internal/store_stats.hpp"
#include "idem/sim/async_provider.hpp"
#include "idem/sqlite_store.hpp"
#include "idem/store_wrapper.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/strand.hpp>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "idem/sim/driver.hpp"
#include "test_support.hpp"

using namespace std::chrono_literals;
namespace net = boost::asio;
using idem::InFlight;
using idem::Outcome;
using idem::Response;
using idem::test::request;
using idem::test::World;

namespace {

struct Reply {
  std::string text;     // the charge id, or the error's name
  long long at_ms = 0;  // simulated time of the reply
  Outcome::Source source = Outcome::Source::executed;
};

// A client that sends `req` at simulated time `at` and waits for its answer; the action
// charges the provider (300 ms of simulated latency unless the world says otherwise).
net::awaitable<void> client(World& w, idem::Coordinator& idem, idem::Request req,
                            std::chrono::milliseconds at, Reply& out,
                            std::function<net::awaitable<Response>()> action = {}) {
  co_await idem::async_sleep_until(*w.clock, idem::sim::kSimulationStart + at);
  if (!action) {
    action = [&w]() -> net::awaitable<Response> {
      const idem::sim::ChargeResult r =
          co_await idem::sim::async_charge(*w.provider, "A-10023", 4990, "");
      co_return Response{200, r.charge_id, {}};
    };
  }
  try {
    const Outcome o = co_await idem::async_call(idem, std::move(req), std::move(action));
    out.text = o.response.body;
    out.source = o.source;
  } catch (const idem::InProgressError&) {
    out.text = "InProgress";
  } catch (const idem::LeaseLostError&) {
    out.text = "LeaseLost";
  } catch (const std::exception& e) {
    out.text = e.what();
  }
  out.at_ms = w.elapsed_ms();
}

void spawn(net::io_context& io, net::awaitable<void> task) {
  net::co_spawn(io, std::move(task), [](std::exception_ptr e) {
    if (e) std::rethrow_exception(e);
  });
}

}  // namespace

TEST_CASE("asio: the in-flight table: run charges twice, wait and raise charge once") {
  // First request at t=0, identical duplicate at t=50 ms, provider latency 300 ms.
  struct Row {
    InFlight policy;
    std::vector<std::string> responses;
    std::vector<std::string> charges;
  };
  const std::vector<Row> rows = {
      {InFlight::run, {"ch_1", "ch_1"}, {"ch_1", "ch_2"}},
      {InFlight::wait, {"ch_1", "ch_1"}, {"ch_1"}},
      {InFlight::raise, {"ch_1", "InProgress"}, {"ch_1"}},
  };
  for (const Row& row : rows) {
    CAPTURE(idem::to_string(row.policy));
    World w({.in_flight = row.policy});
    net::io_context io;
    Reply first, second;
    spawn(io, client(w, *w.idem, request("k1"), 0ms, first));
    spawn(io, client(w, *w.idem, request("k1"), 50ms, second));
    idem::sim::run(io, *w.clock);
    CHECK(std::vector<std::string>{first.text, second.text} == row.responses);
    CHECK(w.provider->charge_ids() == row.charges);
  }
}

TEST_CASE("asio: a waiting duplicate returns the moment the first completes") {
  World w({.in_flight = InFlight::wait});
  net::io_context io;
  Reply first, second;
  spawn(io, client(w, *w.idem, request("k1"), 0ms, first));
  spawn(io, client(w, *w.idem, request("k1"), 50ms, second));
  idem::sim::run(io, *w.clock);
  CHECK(first.at_ms == 300);
  CHECK(second.at_ms == 300);  // woken by the completion: no poll interval, no delay
  CHECK(second.source == Outcome::Source::replayed);
  CHECK(w.idem->metrics().waited == 1);
  CHECK(w.provider->charge_count() == 1);
}

TEST_CASE("asio: when the first fails, the waiting duplicate reserves and runs") {
  World w({.in_flight = InFlight::wait});
  w.provider->inject(idem::sim::Fault::timeout);
  net::io_context io;
  Reply first, second;
  spawn(io, client(w, *w.idem, request("k1"), 0ms, first));
  spawn(io, client(w, *w.idem, request("k1"), 50ms, second));
  idem::sim::run(io, *w.clock);
  CHECK(first.text == "payment provider timed out");
  CHECK(second.text == "ch_1");
  CHECK(second.source == Outcome::Source::executed);
  CHECK(second.at_ms == 600);  // woken at 300 by the release, then charged for 300 ms
  CHECK(w.provider->charge_count() == 1);
}

TEST_CASE(
    "asio: a waiter takes over when the holder's lease expires, the stalled holder is fenced") {
  World w({.in_flight = InFlight::wait, .lease = 1s, .heartbeat = 0ms});
  net::io_context io;
  Reply stalled, waiter;
  spawn(io, client(w, *w.idem, request("k1"), 0ms, stalled, [&w]() -> net::awaitable<Response> {
          co_await idem::async_sleep_until(*w.clock,
                                           w.clock->now() + 5s);  // stuck, charges nothing
          co_return Response{200, "late", {}};
        }));
  spawn(io, client(w, *w.idem, request("k1"), 50ms, waiter));
  idem::sim::run(io, *w.clock);
  CHECK(waiter.text == "ch_1");
  CHECK(waiter.at_ms == 1300);  // lease ended at 1000, charge took 300
  CHECK(stalled.text == "LeaseLost");
  CHECK(w.provider->charge_count() == 1);
  CHECK(w.idem->metrics().taken_over == 1);
}

TEST_CASE("asio: a duplicate gives up after max_wait with InProgress") {
  World w({.in_flight = InFlight::wait, .max_wait = 100ms});
  net::io_context io;
  Reply first, second;
  spawn(io, client(w, *w.idem, request("k1"), 0ms, first));
  spawn(io, client(w, *w.idem, request("k1"), 50ms, second));
  idem::sim::run(io, *w.clock);
  CHECK(first.text == "ch_1");
  CHECK(second.text == "InProgress");
  CHECK(second.at_ms == 150);
  CHECK(w.provider->charge_count() == 1);
  CHECK(w.idem->metrics().in_progress_conflicts == 1);
}

TEST_CASE("asio: a holder in another process is polled with growing, bounded backoff") {
  // Two coordinators on one database file stand for two processes: they share no memory, so
  // the waiter must poll. Polls from t=50: +1, +2, +4, +8, +8 ... ms (poll_max 8 ms).
  World w({.in_flight = InFlight::wait});
  idem::Coordinator other(std::make_shared<idem::SqliteStore>(w.db_path),
                          {.in_flight = InFlight::wait, .clock = w.clock});
  net::io_context io;
  Reply first, second;
  spawn(io, client(w, other, request("k1"), 0ms, first));
  spawn(io, client(w, *w.idem, request("k1"), 50ms, second));
  idem::sim::run(io, *w.clock);
  CHECK(first.at_ms == 300);
  CHECK(second.text == "ch_1");
  CHECK(second.source == Outcome::Source::replayed);
  CHECK(second.at_ms > 300);
  CHECK(second.at_ms <= 308);  // at most one poll_max late
  CHECK(w.provider->charge_count() == 1);
}

TEST_CASE("asio: an unreachable store fails open (the action runs) or closed (it does not)") {
  for (idem::FailureMode mode : {idem::FailureMode::fail_open, idem::FailureMode::fail_closed}) {
    World w({.on_store_failure = mode});
    w.faulty->set_unreachable(true);
    net::io_context io;
    Reply reply;
    spawn(io, client(w, *w.idem, request("k1"), 0ms, reply));
    idem::sim::run(io, *w.clock);
    if (mode == idem::FailureMode::fail_open) {
      CHECK(reply.text == "ch_1");
      CHECK(reply.source == Outcome::Source::unprotected);
      CHECK(w.provider->charge_count() == 1);
    } else {
      CHECK(reply.text.find("unreachable") != std::string::npos);
      CHECK(w.provider->charge_count() == 0);
    }
    CHECK(w.idem->metrics().store_errors == 1);
  }
}

TEST_CASE(
    "asio: group commit: one turn's fresh, replayed and duplicate keys share transactions, each "
    "correct") {
  // 30 keys already completed, 30 fresh keys each sent twice in the same turn: 90 coroutines.
  World w({.in_flight = InFlight::wait});
  net::io_context warm;  // completes the 30 "done" keys first
  std::vector<Reply> warmups(30);
  for (int i = 0; i < 30; ++i) {
    spawn(warm, client(w, *w.idem, request("done" + std::to_string(i)), 0ms,
                       warmups[static_cast<std::size_t>(i)]));
  }
  idem::sim::run(warm, *w.clock);
  const std::size_t charges_before = w.provider->charge_count();
  const auto stats_before = idem::detail::StoreStats::of(*w.sqlite);

  net::io_context io;
  std::vector<Reply> replays(30), firsts(30), seconds(30);
  for (int i = 0; i < 30; ++i) {
    const auto u = static_cast<std::size_t>(i);
    spawn(io, client(w, *w.idem, request("done" + std::to_string(i)), 0ms, replays[u]));
    spawn(io, client(w, *w.idem, request("new" + std::to_string(i)), 0ms, firsts[u]));
    spawn(io, client(w, *w.idem, request("new" + std::to_string(i)), 0ms, seconds[u]));
  }
  idem::sim::run(io, *w.clock);
  for (int i = 0; i < 30; ++i) {
    const auto u = static_cast<std::size_t>(i);
    CHECK(replays[u].source == Outcome::Source::replayed);
    CHECK(replays[u].text == warmups[u].text);
    CHECK(firsts[u].source == Outcome::Source::executed);
    CHECK(seconds[u].source == Outcome::Source::replayed);  // waited, then replayed
    CHECK(seconds[u].text == firsts[u].text);
  }
  CHECK(w.provider->charge_count() - charges_before == 30);  // once per new key
  const auto stats = idem::detail::StoreStats::of(*w.sqlite);
  const auto transactions = stats.transactions - stats_before.transactions;
  const auto ops = stats.ops - stats_before.ops;
  CHECK(ops >= 60);  // 30 reservations that won, 30 completions, and the losers' tries
  CHECK(transactions * 10 <= ops);  // committed together, not one by one
}

TEST_CASE(
    "asio: a look that fails while waiting is logged, the waiter keeps waiting and never runs "
    "unprotected") {
  // The holder is another "process" (its own coordinator): the waiter polls. From t=60 to
  // t=120 ms every look fails; the waiter must neither give up nor run the action.
  std::vector<std::string> events;
  World w({.in_flight = InFlight::wait,
           .log = [&](const idem::LogEvent& e) { events.emplace_back(e.event); }});
  idem::Coordinator other(std::make_shared<idem::SqliteStore>(w.db_path),
                          {.in_flight = InFlight::wait, .clock = w.clock});
  w.clock->call_at(w.t(60), [&] { w.faulty->fail(idem::sim::Operation::load); });
  w.clock->call_at(w.t(120), [&] { w.faulty->fail(idem::sim::Operation::load, false); });
  net::io_context io;
  Reply first, second;
  spawn(io, client(w, other, request("k1"), 0ms, first));
  spawn(io, client(w, *w.idem, request("k1"), 50ms, second));
  idem::sim::run(io, *w.clock);
  CHECK(first.text == "ch_1");
  CHECK(second.text == "ch_1");
  CHECK(second.source == Outcome::Source::replayed);
  CHECK(std::count(events.begin(), events.end(), "wait_poll_failed") >= 2);
  const idem::MetricsSnapshot m = w.idem->metrics();
  CHECK(m.store_errors >= 2);
  CHECK(m.ran_unprotected == 0);
  CHECK(w.provider->charge_count() == 1);
}

TEST_CASE(
    "asio: by default a duplicate waits 10 s (max_wait) for a stuck holder, then InProgress") {
  // The holder reserved from another process and hangs (its lease is the default 30 s).
  World w;
  w.store->reserve({"alpha", "payment.charge", "k1"}, request("k1").fingerprint, w.clock->now(),
                   w.clock->now() + 30s);
  net::io_context io;
  Reply reply;
  spawn(io, client(w, *w.idem, request("k1"), 0ms, reply));
  idem::sim::run(io, *w.clock);
  CHECK(reply.text == "InProgress");
  CHECK(reply.at_ms == 10000);
  CHECK(w.provider->charge_count() == 0);
}

TEST_CASE("asio: looks that keep failing while waiting back off, and the wait ends at max_wait") {
  // The holder (another process) died with a 100 ms lease; from t=50 ms on, every look of
  // the waiter fails. It must not spin: it polls with backoff and gives up at max_wait.
  std::vector<std::string> events;
  World w({.in_flight = InFlight::wait, .max_wait = 1s, .log = [&](const idem::LogEvent& e) {
             events.emplace_back(e.event);
           }});
  w.store->reserve({"alpha", "payment.charge", "k1"}, request("k1").fingerprint, w.clock->now(),
                   w.clock->now() + 100ms);
  w.clock->call_at(w.t(50), [&] { w.faulty->fail(idem::sim::Operation::load); });
  net::io_context io;
  Reply reply;
  spawn(io, client(w, *w.idem, request("k1"), 0ms, reply));
  idem::sim::run(io, *w.clock);
  CHECK(reply.text == "InProgress");
  CHECK(reply.at_ms == 1000);
  const auto failed_looks = std::count(events.begin(), events.end(), "wait_poll_failed");
  CHECK(failed_looks >= 100);  // about one every poll_max (8 ms) for 950 ms...
  CHECK(failed_looks <= 130);  // ...and no more
  CHECK(w.idem->metrics().ran_unprotected == 0);
  CHECK(w.provider->charge_count() == 0);
}

namespace {

// Marks `gone` when the coroutine frame that holds it is destroyed.
struct FrameGuard {
  bool* gone;
  ~FrameGuard() { *gone = true; }
};

net::awaitable<void> sleeper(idem::Clock& clock, idem::TimePoint until, bool* woke, bool* gone) {
  const FrameGuard guard{gone};
  co_await idem::async_sleep_until(clock, until);
  *woke = true;
}

}  // namespace

TEST_CASE(
    "asio: a waiting coroutine keeps its io_context running, one still waiting when the context "
    "ends is destroyed with it, and its late deadline touches nothing") {
  idem::sim::SimulatedClock clock;
  const idem::TimePoint start = clock.now();
  bool woke = false, gone = false, woke_late = false, gone_late = false;
  {
    net::io_context io;
    net::co_spawn(io, sleeper(clock, start + 1s, &woke, &gone), [](std::exception_ptr) {});
    net::co_spawn(io, sleeper(clock, start + 1h, &woke_late, &gone_late),
                  [](std::exception_ptr) {});
    io.poll();
    // Both wait, parked outside any reactor, and are still work of the context, so run()
    // would not return under them (a poll that finds no work left stops the context).
    io.poll();
    CHECK_FALSE(io.stopped());
    CHECK_FALSE(woke);
    clock.advance_to(start + 1s);  // the first one's deadline posts it
    io.restart();
    io.poll();
    CHECK(woke);
    CHECK(gone);
    io.poll();
    CHECK_FALSE(io.stopped());  // the second one still waits
    CHECK_FALSE(gone_late);
  }
  // The context is gone: it destroyed the parked wait and the frame around it.
  CHECK(gone_late);
  CHECK_FALSE(woke_late);
  clock.advance_to(start + 2h);  // the deadline's call finds nothing to wake (ASan watches)
  CHECK_FALSE(woke_late);
}

namespace {

// Counts Store::load_many's batches by size and hands each to the wrapped store whole. With
// `broken` set, the batch goes through load() one key at a time instead, and load() of that
// key throws what no store should: not a StoreError.
class CountedReads final : public idem::StoreWrapper {
 public:
  using StoreWrapper::StoreWrapper;
  std::vector<std::size_t> batches;  // guarded by mutex while the io threads run
  std::mutex mutex;
  std::string broken;

  std::optional<idem::Record> load(const idem::KeyId& id) override {
    if (!broken.empty() && id.key == broken) throw std::logic_error("a bug in the store");
    return StoreWrapper::load(id);
  }
  void load_many(std::span<idem::StoreRead* const> reads) override {
    {
      std::lock_guard lock(mutex);
      batches.push_back(reads.size());
    }
    if (broken.empty()) {
      target().load_many(reads);
    } else {
      StoreWrapper::load_many(reads);  // Store's: load() for each
    }
  }
};

// Replays: `keys` keys completed with "ch_<i>" by blocking calls, then a few more blocking calls
// so the coordinator reads before it reserves (duplicates are common now).
struct ReplayWorld {
  idem::test::TempDir dir;
  std::shared_ptr<CountedReads> reads =
      std::make_shared<CountedReads>(std::make_shared<idem::SqliteStore>(dir.file("keys.db")));
  idem::Coordinator idem{reads, {}};
  int runs = 0;  // the action's, never deduplicated

  explicit ReplayWorld(int keys) {
    for (int i = 0; i < keys; ++i) idem.call(request(key(i)), [&, i] { return charge(i); });
    for (int i = 0; i < 4; ++i) idem.call(request(key(0)), [&] { return charge(0); });
    reads->batches.clear();
  }
  static std::string key(int i) { return "k" + std::to_string(i); }
  Response charge(int i) {
    ++runs;
    return Response{200, "ch_" + std::to_string(i), {}};
  }
  net::awaitable<void> replay(int i, std::optional<Outcome>& out, bool* gone = nullptr) {
    struct Gone {
      bool* flag;
      ~Gone() {
        if (flag != nullptr) *flag = true;
      }
    } guard{gone};
    out = co_await idem::async_call(
        idem, request(key(i)), [this, i]() -> net::awaitable<Response> { co_return charge(i); });
  }
  // Calls keys first, first + 1 and first + 2 at once on a strand, and runs them to the end.
  // The first call's coroutine throws once its call is done, and its completion handler
  // rethrows that out of run(): on a strand, unlike on the io_context's own executor, a
  // handler dispatched in place lets what it throws out to its caller, the handler that
  // resumed it. The calls after it must still resume, each in a handler of its own.
  std::array<std::optional<Outcome>, 3> three_on_a_strand_first_throws(int first) {
    std::array<std::optional<Outcome>, 3> outs;
    // (named: a coroutine lambda's captures live in the lambda, which must outlive the run)
    const auto throws = [&]() -> net::awaitable<void> {
      co_await replay(first, outs[0]);
      throw std::runtime_error("the application's own failure");
    };
    net::io_context io(1);
    const auto strand = net::make_strand(io);
    const auto rethrow = [](std::exception_ptr e) {
      if (e) std::rethrow_exception(e);
    };
    net::co_spawn(strand, throws(), rethrow);
    net::co_spawn(strand, replay(first + 1, outs[1]), rethrow);
    net::co_spawn(strand, replay(first + 2, outs[2]), rethrow);
    CHECK_THROWS_WITH(io.run(), "the application's own failure");
    io.restart();
    io.run();
    return outs;
  }
};

}  // namespace

TEST_CASE(
    "asio: the reads of calls ready in the same turn go to the store in one load_many, each "
    "call with its own record") {
  constexpr int kKeys = 32;
  ReplayWorld w(kKeys);
  REQUIRE(w.runs == kKeys);
  net::io_context io(1);
  std::vector<std::optional<Outcome>> outs(kKeys);
  for (int i = 0; i < kKeys; ++i) spawn(io, w.replay(i, outs[static_cast<std::size_t>(i)]));
  io.run();
  // All 32 started in the first turn: one batch of 32 reads, and nothing ran again.
  CHECK(w.reads->batches == std::vector<std::size_t>{kKeys});
  CHECK(w.runs == kKeys);
  for (int i = 0; i < kKeys; ++i) {
    CAPTURE(i);
    const std::optional<Outcome>& out = outs[static_cast<std::size_t>(i)];
    REQUIRE(out);
    CHECK(out->replayed());
    CHECK(out->response.body == "ch_" + std::to_string(i));
  }
  // A lone call reads alone, in a batch of one.
  std::optional<Outcome> alone;
  spawn(io, w.replay(7, alone));
  io.restart();
  io.run();
  CHECK(w.reads->batches == std::vector<std::size_t>{kKeys, 1});
  CHECK(alone->response.body == "ch_7");
  CHECK(w.runs == kKeys);
}

TEST_CASE("asio: calls whose read is queued when their io_context ends are destroyed with it") {
  ReplayWorld w(2);
  std::optional<Outcome> a, b;
  bool a_gone = false, b_gone = false;
  {
    net::io_context io(1);
    spawn(io, w.replay(0, a, &a_gone));
    spawn(io, w.replay(1, b, &b_gone));
    io.poll_one();  // each starts and queues its read; the batch is posted, not run
    io.poll_one();
    CHECK(w.reads->batches.empty());
    CHECK_FALSE(a_gone);
  }
  CHECK(a_gone);
  CHECK(b_gone);
  CHECK_FALSE(a);
  CHECK_FALSE(b);
  CHECK(w.reads->batches.empty());
  // The coordinator goes on: the next context's reads are its own.
  net::io_context io(1);
  spawn(io, w.replay(1, b));
  io.run();
  CHECK(b->response.body == "ch_1");
  CHECK(w.runs == 2);
}

TEST_CASE(
    "asio: a read that throws something other than a StoreError ends its own call with it, and "
    "the other reads of its batch are answered") {
  ReplayWorld w(3);
  w.reads->broken = "k1";
  net::io_context io(1);
  std::optional<Outcome> a, b, c;
  spawn(io, w.replay(0, a));
  std::string thrown;
  // (named: a coroutine lambda's captures live in the lambda, which must outlive the run)
  const auto second = [&]() -> net::awaitable<void> {
    try {
      co_await w.replay(1, b);
    } catch (const std::logic_error& e) {
      thrown = e.what();
    }
  };
  spawn(io, second());
  spawn(io, w.replay(2, c));
  io.run();
  CHECK(w.reads->batches == std::vector<std::size_t>{3});
  CHECK(thrown == "a bug in the store");  // not a store failure: nothing ran unprotected
  CHECK_FALSE(b);
  CHECK(a->response.body == "ch_0");
  CHECK(c->response.body == "ch_2");
  CHECK(w.runs == 3);
  CHECK(w.idem.metrics().ran_unprotected == 0);
}

TEST_CASE(
    "asio: when a reader's continuation throws out of the batch that resumed it, the readers "
    "after it still resume") {
  ReplayWorld w(3);
  const auto outs = w.three_on_a_strand_first_throws(0);  // out of their read's batch
  CHECK(w.reads->batches == std::vector<std::size_t>{3});
  REQUIRE(outs[1]);
  REQUIRE(outs[2]);
  CHECK(outs[1]->response.body == "ch_1");
  CHECK(outs[2]->response.body == "ch_2");
  CHECK(w.runs == 3);
}

TEST_CASE(
    "asio: a round of the group commit made on its writers' io_context resumes them in it, not "
    "in a handler each") {
  ReplayWorld w(1);  // k1 is fresh: the call reserves, runs and completes
  net::io_context io(1);
  std::optional<Outcome> out;
  spawn(io, w.replay(1, out));
  int handlers = 0;
  while (io.run_one() > 0) ++handlers;
  REQUIRE(out);
  CHECK(out->source == Outcome::Source::executed);
  CHECK(w.runs == 2);  // k0's, made before, and k1's
  // The coroutine's start, its read's batch, and the round of each of its two writes (the
  // reservation, the completion): a turn each, and none more to resume the writer.
  CHECK(handlers == 4);
}

TEST_CASE(
    "asio: when a writer's continuation throws out of the round that committed it, the writers "
    "after it still resume") {
  ReplayWorld w(1);  // k1 to k3 are fresh: each call reserves, runs and completes
  // Out of the round that committed the three completions together.
  const auto outs = w.three_on_a_strand_first_throws(1);
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    REQUIRE(outs[i]);
    CHECK(outs[i]->source == Outcome::Source::executed);
    CHECK(outs[i]->response.body == "ch_" + std::to_string(i + 1));
  }
  CHECK(w.runs == 4);  // k0's, made before, and one a key: the action never deduplicates
}

TEST_CASE(
    "asio race: four threads run one io_context, 16 keys each asked 12 times at once, 10 rounds: "
    "reads batch across the threads, every caller gets its own key's answer, one charge a key") {
  // The provider does not deduplicate: a key charged twice shows as 2. The action yields once
  // while it runs, so that the key's duplicates arrive, wait and read while it is held.
  constexpr int kRounds = 10, kKeys = 16, kCallers = 12, kThreads = 4;
  idem::test::TempDir dir;
  auto reads =
      std::make_shared<CountedReads>(std::make_shared<idem::SqliteStore>(dir.file("keys.db")));
  idem::Coordinator idem{reads, {}};
  std::mutex mutex;  // guards what the callers write
  std::map<std::string, int> charges;
  std::map<std::string, int> executed;
  std::map<std::string, std::vector<std::string>> answers;
  std::set<std::thread::id> resumed_on;
  const auto caller = [&](std::string key) -> net::awaitable<void> {
    idem::Request req = request(key);
    // Named, not a temporary in the co_await (idem/asio.hpp: g++ 12 would destroy it twice).
    idem::AsyncAction charge = [&, key]() -> net::awaitable<Response> {
      {
        std::lock_guard lock(mutex);
        ++charges[key];
      }
      co_await net::post(co_await net::this_coro::executor, net::use_awaitable);
      co_return Response{200, "ch_" + key, {}};
    };
    const Outcome o = co_await idem::async_call(idem, std::move(req), std::move(charge));
    std::lock_guard lock(mutex);
    answers[key].push_back(o.response.body);
    if (o.source == Outcome::Source::executed) ++executed[key];
    resumed_on.insert(std::this_thread::get_id());
  };
  for (int round = 0; round < kRounds; ++round) {
    net::io_context io(kThreads);
    for (int c = 0; c < kCallers; ++c) {
      for (int k = 0; k < kKeys; ++k) {
        net::co_spawn(io, caller("r" + std::to_string(round) + "-k" + std::to_string(k)),
                      [](std::exception_ptr e) {
                        if (e) std::rethrow_exception(e);
                      });
      }
    }
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) threads.emplace_back([&io] { io.run(); });
    for (std::thread& t : threads) t.join();
  }
  REQUIRE(charges.size() == std::size_t{kRounds * kKeys});
  for (const auto& charged : charges) {
    const std::string& key = charged.first;
    const int n = charged.second;
    CAPTURE(key);
    CHECK(n == 1);
    CHECK(executed[key] == 1);
    CHECK(answers[key] == std::vector<std::string>(kCallers, "ch_" + key));
  }
  // The callers overlapped: reads of several calls went in one batch, and the calls came back
  // on more than one of the threads.
  const std::size_t widest = *std::max_element(reads->batches.begin(), reads->batches.end());
  MESSAGE(reads->batches.size() << " read batches, the widest " << widest << ", callers resumed on "
                                << resumed_on.size() << " threads");
  CHECK(widest > 1);
  CHECK(resumed_on.size() > 1);
}

namespace {

// A store whose batches go out on a connection (a pipe) that breaks after the batch's first
// pipeline: the batch goes on on a new connection that got the closed one's descriptor number,
// as a reconnection does, and the new connection's answer comes after the event loop is back
// to waiting. The old connection stays open elsewhere and says nothing. When the answer comes,
// the batch's ops are applied to the real store underneath.
struct Reconnecting final : idem::StoreWrapper {
  struct Pending final : idem::PendingApply {
    Pending(Reconnecting& s, std::span<idem::StoreOp* const> o)
        : store(s), ops(o.begin(), o.end()) {}
    int descriptor() const noexcept override { return done_ ? -1 : store.read_fd; }
    std::chrono::steady_clock::time_point deadline() const noexcept override { return at; }
    bool done() const noexcept override { return done_; }
    void advance() noexcept override {
      char byte = 0;
      if (::read(store.read_fd, &byte, 1) != 1) return;  // nothing arrived
      if (!store.reconnected) {
        // The first pipeline ended and its connection broke: a new one, same number.
        store.reconnected = true;
        int fresh[2];
        if (::pipe2(fresh, O_NONBLOCK) != 0) return fail(std::make_exception_ptr(std::bad_alloc()));
        store.stale_write_fd = store.write_fd;  // the old peer: open, silent
        ::dup2(fresh[0], store.read_fd);
        ::close(fresh[0]);
        store.write_fd = fresh[1];
        net::post(*store.io, [fd = store.write_fd] { CHECK(::write(fd, "b", 1) == 1); });
        return;
      }
      store.StoreWrapper::apply(ops);
      done_ = true;
    }
    void fail(std::exception_ptr why) noexcept override {
      for (idem::StoreOp* op : ops) op->error = why;
      done_ = true;
      store.failed = true;
    }
    Reconnecting& store;
    std::vector<idem::StoreOp*> ops;
    std::chrono::steady_clock::time_point at = std::chrono::steady_clock::now() + 30s;
    bool done_ = false;
  };

  Reconnecting(std::shared_ptr<idem::Store> inner, net::io_context& context)
      : StoreWrapper(std::move(inner)), io(&context) {
    int fds[2];
    REQUIRE(::pipe2(fds, O_NONBLOCK) == 0);
    read_fd = fds[0];
    write_fd = fds[1];
  }
  ~Reconnecting() override {
    for (int fd : {read_fd, write_fd, stale_write_fd})
      if (fd >= 0) ::close(fd);
  }
  std::unique_ptr<idem::PendingApply> start_apply(std::span<idem::StoreOp* const> ops) override {
    if (started++ > 0) return nullptr;      // one batch goes through the pipes; later ones apply()
    CHECK(::write(write_fd, "a", 1) == 1);  // the first pipeline's answer is there at once
    return std::make_unique<Pending>(*this, ops);
  }
  net::io_context* io;
  int read_fd = -1, write_fd = -1, stale_write_fd = -1;
  int started = 0;
  bool reconnected = false;
  bool failed = false;  // the batch was failed (its deadline passed): the call retried its write
};

}  // namespace

TEST_CASE(
    "asio: a batch that moves to a new connection under the old one's descriptor number is "
    "waited for on the new one") {
  net::io_context io;
  auto store = std::make_shared<Reconnecting>(std::make_shared<idem::SqliteStore>(":memory:"), io);
  idem::Coordinator idem(store, idem::Options{});
  int charges = 0;
  std::optional<Outcome> answer;
  std::string error;
  net::co_spawn(
      io,
      [&]() -> net::awaitable<void> {
        try {
          answer =
              co_await idem::async_call(idem, request("k1"), [&]() -> net::awaitable<Response> {
                ++charges;
                co_return Response{200, "ch_1", {}};
              });
        } catch (const std::exception& e) {
          error = e.what();
        }
      },
      net::detached);
  io.run();  // bounded: the batch's deadline is 30 s away
  CHECK(store->reconnected);
  CHECK_FALSE(store->failed);
  CHECK(error == "");
  REQUIRE(answer);
  CHECK(answer->response.body == "ch_1");
  CHECK(charges == 1);
}

namespace {

// A coordinator on a SQLite file whose actions count every run (the count is the effect: no
// downstream here deduplicates), and a coroutine call on it that records its outcome.
struct TwoLoops {
  idem::test::TempDir dir;
  std::shared_ptr<idem::SqliteStore> store = std::make_shared<idem::SqliteStore>(dir.file("l.db"));
  idem::Coordinator idem{store, {}};
  int runs = 0;

  net::awaitable<void> call(std::string key, std::optional<Outcome>& out) {
    out = co_await idem::async_call(idem, request(std::move(key)),
                                    [this]() -> net::awaitable<Response> {
                                      ++runs;
                                      co_return Response{200, "ch_" + std::to_string(runs), {}};
                                    });
  }
  // Steps `io` until the call's action has run: its completion is then queued in the group
  // commit and its round posted to `io`, not run.
  void until_completion_posted(net::io_context& io, int runs_before) {
    while (runs == runs_before) REQUIRE(io.run_one() == 1);
    REQUIRE(idem::detail::StoreStats::of(*store).ops == static_cast<std::uint64_t>(runs) * 2 - 1);
  }
};

}  // namespace

TEST_CASE(
    "asio: a coroutine's write does not wait for a round posted to another io_context that was "
    "stopped") {
  TwoLoops w;
  net::io_context stopped(1), live(1);
  std::optional<Outcome> a, b;
  spawn(stopped, w.call("k-a", a));
  w.until_completion_posted(stopped, 0);
  stopped.stop();  // as a server's forced shutdown does; the context is not destroyed
  spawn(live, w.call("k-b", b));
  live.run_for(30s);  // a bound, not a synchronisation: with the fix it returns when b is done
  REQUIRE(b);         // b's rounds ran on its own loop, and took a's completion with them
  CHECK(b->source == Outcome::Source::executed);
  CHECK(idem::detail::StoreStats::of(*w.store).ops == 4);
  stopped.restart();
  stopped.run();  // a resumes: its completion was committed by b's round
  REQUIRE(a);
  CHECK(a->source == Outcome::Source::executed);
  CHECK(w.runs == 2);
  std::optional<Outcome> again;
  spawn(live, w.call("k-a", again));
  live.restart();
  live.run();
  REQUIRE(again);
  CHECK(again->replayed());
  CHECK(again->response.body == a->response.body);
  CHECK(w.runs == 2);  // each key charged once
}

TEST_CASE(
    "asio: a round that was posted to an io_context destroyed before it ran does not hold up "
    "the next io_context") {
  TwoLoops w;
  std::optional<net::io_context> io;  // the next context is built in the same storage
  std::optional<Outcome> a, c;
  io.emplace(1);
  spawn(*io, w.call("k-a", a));
  w.until_completion_posted(*io, 0);
  io->stop();
  // A blocking caller leads at once; its round commits a's completion too.
  const Outcome t = w.idem.call(request("k-t"), [&w] {
    ++w.runs;
    return Response{200, "ch_t", {}};
  });
  CHECK(t.source == Outcome::Source::executed);
  CHECK(idem::detail::StoreStats::of(*w.store).ops == 4);
  io.reset();  // destroys a's resumption and the round posted to it, neither run
  CHECK_FALSE(a);
  io.emplace(1);
  spawn(*io, w.call("k-c", c));
  io->run_for(30s);  // a bound, not a synchronisation
  REQUIRE(c);
  CHECK(c->source == Outcome::Source::executed);
  CHECK(w.runs == 3);
  std::optional<Outcome> again;
  spawn(*io, w.call("k-a", again));
  io->restart();
  io->run();
  REQUIRE(again);
  CHECK(again->replayed());  // a's completion was committed, though a never heard
  CHECK(w.runs == 3);
}

namespace {

// A store that says it may wait on a network, as PgStore does (its batches then answer on
// the event loop that waits for them), and notes the thread that applies each release.
struct RemoteStore final : idem::StoreWrapper {
  using StoreWrapper::StoreWrapper;
  bool remote() const noexcept override { return true; }
  void apply(std::span<idem::StoreOp* const> ops) override {
    for (const idem::StoreOp* op : ops) {
      if (op->kind != idem::StoreOp::Kind::release) continue;
      std::lock_guard lock(mutex);
      release_threads.push_back(std::this_thread::get_id());
    }
    StoreWrapper::apply(ops);
  }
  std::mutex mutex;
  std::vector<std::thread::id> release_threads;  // guarded by mutex
};

}  // namespace

TEST_CASE(
    "asio: Maintenance releases a remote store's lost reservations on the coordinator's store "
    "threads, never on its executor's thread") {
  World w({}, idem::sim::ProviderOptions{.latency = 0ms});
  auto remote = std::make_shared<RemoteStore>(w.faulty);
  idem::Coordinator node(remote, {.in_flight = InFlight::raise,
                                  .lease = 30s,
                                  .heartbeat = 0ms,
                                  .on_store_failure = idem::FailureMode::fail_closed,
                                  .clock = w.clock});
  // The reservation commits, its answer is lost and the look after it fails: lost.
  w.faulty->lose_replies(idem::sim::Operation::reserve);
  w.faulty->fail(idem::sim::Operation::load);
  CHECK_THROWS_AS(node.call(request("k1"), w.charge_action(0ms)), idem::StoreError);
  w.faulty->lose_replies(idem::sim::Operation::reserve, false);
  w.faulty->fail(idem::sim::Operation::load, false);
  idem::Maintenance maintenance(node, {});
  net::io_context io(1);
  std::optional<idem::MaintenanceReport> report;
  // (named: a coroutine lambda's captures live in the lambda, which must outlive the run)
  const auto once = [&]() -> net::awaitable<void> { report = co_await maintenance.run_once(); };
  spawn(io, once());
  io.run();
  REQUIRE(report);
  CHECK(report->lost_released == 1);
  {
    std::lock_guard lock(remote->mutex);
    REQUIRE(remote->release_threads.size() == 1);
    // The executor's thread is this one: a release made here would wait for the group
    // commit while a round of the executor's own may wait for this thread.
    CHECK(remote->release_threads[0] != std::this_thread::get_id());
  }
  CHECK(node.call(request("k1"), w.charge_action(0ms)).source == Outcome::Source::executed);
  CHECK(w.charges() == 1);
}
