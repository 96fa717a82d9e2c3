// Multi-step operations on the simulated clock: seed 000's checkout (debit, order,
// mail) crashed at every point, resumed, finished by the completer, fenced against zombies,
// reconciled after unknown outcomes; the outbox and maintenance. Every test counts the
// effects themselves: the provider's charges, the orders table's rows, the mail journal.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <utility>  // Boost 1.74's awaitable.hpp needs std::exchange declared first

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>
#include <map>
#include <thread>

#include "checkout.hpp"
#include "idem/asio.hpp"
#include "idem/beast.hpp"
#include "idem/maintenance.hpp"
#include "idem/sim/mail.hpp"
#include "idem/steps.hpp"
#include "payments_api.hpp"
#include "test_support.hpp"

namespace {

using namespace idem;
using namespace std::chrono_literals;
using idem::test::RawDb;

// A process dying at a point of the flow: the action stops there, and the store refuses the
// release (as a dead process never releases), so the key stays reserved until its lease ends.
struct Crash {
  std::string point;
};

const std::vector<std::string> kCrashPoints = {
    "before debited",      "debited: charged, not recorded",
    "after debited",       "order_created: inside its transaction",
    "after order_created", "notified: inside its transaction",
    "after notified",
};

Options step_options() {
  Options o;
  o.heartbeat = 0ms;  // the tests move the clock past leases on purpose
  o.lease = 10s;
  return o;
}

// Seed 000's world: keys, orders and the outbox in one database; a provider that does NOT
// deduplicate (so a blind second call would show as a second charge); a mail sender that
// deduplicates only by message id.
struct Shop {
  explicit Shop(Options options = step_options())
      : world(std::move(options), sim::ProviderOptions{.latency = 0ms, .dedup = false}),
        mail(world.clock) {
    demo::create_orders_table(world.db_path);
  }

  test::World world;
  sim::MailSender mail;
  Dispatcher dispatcher{*world.idem, demo::mail_delivery(mail)};

  demo::CheckoutRequest order(std::string order_id = "A-10023") const {
    return demo::CheckoutRequest{"alpha", std::move(order_id), 4990, "RUB", "buyer@example.com"};
  }
  Request request(const std::string& key, const demo::CheckoutRequest& o) const {
    Request r;
    r.tenant = o.tenant;
    r.operation = "checkout";
    r.key = key;
    r.fingerprint = Fingerprint::of(nlohmann::json{{"order_id", o.order_id}, {"amount", o.amount}});
    r.in_flight = InFlight::raise;
    r.payload = demo::to_payload(o);
    return r;
  }
  Outcome checkout(const std::string& key, const demo::CheckoutRequest& o,
                   const demo::CrashHook& crash = {}) {
    return world.idem->call_steps(request(key, o), [&](Attempt& a) {
      return demo::checkout(a, *world.provider, demo::checkout_from_payload(a.request()), crash);
    });
  }
  // One attempt that dies at `point`.
  void crash_at(const std::string& key, const demo::CheckoutRequest& o, const std::string& point) {
    world.faulty->fail(sim::Operation::release);
    CHECK_THROWS_AS(checkout(key, o,
                             [&](std::string_view at) {
                               if (at == point) throw Crash{point};
                             }),
                    Crash);
    world.faulty->fail(sim::Operation::release, false);
  }
  std::size_t debits() const { return world.provider->charge_count(); }
  std::size_t orders() const { return demo::count_orders(world.db_path); }
  std::size_t mails() const { return mail.count(); }
  MetricsSnapshot metrics() const { return world.idem->metrics(); }
};

template <class T>
T run_coroutine(boost::asio::awaitable<T> a) {
  boost::asio::io_context io;
  std::future<T> f = boost::asio::co_spawn(io, std::move(a), boost::asio::use_future);
  io.run();
  return f.get();
}

TEST_CASE("steps: a crash at every point, then a retry: one debit, one order, one mail") {
  for (const std::string& point : kCrashPoints) {
    CAPTURE(point);
    Shop shop;
    const demo::CheckoutRequest order = shop.order();
    shop.crash_at("k1", order, point);
    shop.dispatcher.run_once();      // whatever the dead attempt queued is not delivered twice
    shop.world.clock->advance(11s);  // the dead owner's lease ends
    const Outcome retry = shop.checkout("k1", order);
    CHECK(retry.response.status == 200);
    CHECK(retry.source == Outcome::Source::executed);
    shop.dispatcher.run_once();
    CHECK(shop.debits() == 1);
    CHECK(shop.orders() == 1);
    CHECK(shop.mails() == 1);
    const MetricsSnapshot m = shop.metrics();
    CHECK(m.taken_over == 1);
    // Progress recorded before the crash is resumed, not redone; a charge made but not
    // recorded is looked up, never made again.
    CHECK(m.resumed == (point == "before debited" ? 0u : 1u));
    CHECK(m.reconciled == (point == "debited: charged, not recorded" ? 1u : 0u));
    // A duplicate now replays the stored answer and changes nothing.
    const Outcome again = shop.checkout("k1", order);
    CHECK(again.replayed());
    CHECK(again.response.body == retry.response.body);
    shop.dispatcher.run_once();
    CHECK(shop.debits() == 1);
    CHECK(shop.orders() == 1);
    CHECK(shop.mails() == 1);
  }
}

TEST_CASE("steps: a step that throws releases the key, keeps the progress, and the retry resumes") {
  Shop shop;
  const demo::CheckoutRequest order = shop.order();
  CHECK_THROWS_AS(shop.checkout("k1", order,
                                [](std::string_view at) {
                                  if (at == "after order_created") throw std::runtime_error("x");
                                }),
                  std::runtime_error);
  CHECK(shop.metrics().released == 1);
  CHECK(shop.metrics().interrupted == 1);
  const std::optional<Record> kept = shop.world.store->load(KeyId{"alpha", "checkout", "k1"});
  REQUIRE(kept);
  CHECK(kept->state == State::released);
  CHECK(kept->recovery_point == std::optional<std::string>("order_created"));
  // No wait for a lease: the retry resumes at once, after order_created.
  const Outcome retry = shop.checkout("k1", order);
  CHECK(retry.response.status == 200);
  CHECK(shop.metrics().resumed == 1);
  shop.dispatcher.run_once();
  CHECK(shop.debits() == 1);
  CHECK(shop.orders() == 1);
  CHECK(shop.mails() == 1);
  // Another request under this key while the progress is kept is a reuse, not a fresh start.
  CHECK_THROWS_AS(shop.checkout("k1", shop.order("B-1")), KeyReuseError);
}

TEST_CASE("steps: a released operation with progress refuses another request under its key") {
  Shop shop;
  CHECK_THROWS_AS(shop.checkout("k1", shop.order(),
                                [](std::string_view at) {
                                  if (at == "after debited") throw std::runtime_error("x");
                                }),
                  std::runtime_error);
  // Money moved under the first request: a different one must not take the key over.
  CHECK_THROWS_AS(shop.checkout("k1", shop.order("B-1")), KeyReuseError);
  CHECK(shop.debits() == 1);
  CHECK(shop.orders() == 0);
}

TEST_CASE("steps: a crashed operation with progress refuses another request after its lease") {
  Shop shop;
  shop.crash_at("k1", shop.order(), "after debited");
  shop.world.clock->advance(11s);  // the dead owner's lease is over
  // Another body under the key must not take it over: that would orphan the charge.
  CHECK_THROWS_AS(shop.checkout("k1", shop.order("B-1")), KeyReuseError);
  CHECK(shop.checkout("k1", shop.order()).response.status == 200);  // the owner's retry resumes
  shop.dispatcher.run_once();
  CHECK(shop.debits() == 1);
  CHECK(shop.orders() == 1);
  CHECK(shop.mails() == 1);
}

TEST_CASE("steps: an attempt that fails before its first step leaves nothing behind") {
  Shop shop;
  CHECK_THROWS_AS(shop.checkout("k1", shop.order(),
                                [](std::string_view at) {
                                  if (at == "before debited") throw std::runtime_error("x");
                                }),
                  std::runtime_error);
  CHECK(shop.metrics().interrupted == 0);
  // Nothing happened, so the key is free for any request, and no completer picks it up.
  CHECK(shop.world.idem->abandoned(0ms, 10, {"checkout"}).empty());
  CHECK(shop.checkout("k1", shop.order("B-1")).response.status == 200);
  CHECK(shop.debits() == 1);
}

TEST_CASE("steps: failing again never keeps progress past the TTL from the operation's start") {
  Options o = step_options();
  o.ttl = 2min;
  Shop shop(o);
  const auto fail_after_debit = [](std::string_view at) {
    if (at == "after debited") throw std::runtime_error("order service down");
  };
  CHECK_THROWS_AS(shop.checkout("k1", shop.order(), fail_after_debit), std::runtime_error);
  for (int i = 0; i < 2; ++i) {  // retries keep failing, 50 s apart, and resume each time
    shop.world.clock->advance(50s);
    CHECK_THROWS_AS(shop.checkout("k1", shop.order(), fail_after_debit), std::runtime_error);
  }
  CHECK(shop.metrics().resumed == 2);
  CHECK(shop.debits() == 1);
  // 125 s after the start, past the 2-minute TTL counted from the start (not from the last
  // failure, which would keep it until 220 s): the record is purged.
  shop.world.clock->advance(25s);
  CHECK(shop.world.idem->purge_expired() == 1);
}

TEST_CASE("steps: the completer asks only for operations it has handlers for") {
  Shop shop;
  // Abandoned operations of another service's operation, older than ours, fill a batch.
  for (int i = 0; i < 3; ++i) {
    Request other = shop.request(fmt::format("other-{}", i), shop.order(fmt::format("X-{}", i)));
    other.operation = "refund";
    shop.world.faulty->fail(sim::Operation::release);
    CHECK_THROWS_AS(shop.world.idem->call_steps(other,
                                                [&](Attempt& a) -> Response {
                                                  a.local("started", [](LocalTransaction&) {
                                                    return std::string("x");
                                                  });
                                                  throw Crash{"x"};
                                                }),
                    Crash);
    shop.world.faulty->fail(sim::Operation::release, false);
  }
  shop.world.clock->advance(1s);
  shop.crash_at("k1", shop.order(), "after debited");
  shop.world.clock->advance(2min);
  Completer completer(*shop.world.idem, CompleterOptions{.abandoned_after = 30s, .batch = 2});
  completer.on("checkout", [&](Attempt& a) {
    return demo::checkout(a, *shop.world.provider, demo::checkout_from_payload(a.request()));
  });
  const CompleterReport report = completer.run_once();
  CHECK(report.found == 1);
  CHECK(report.finished == 1);
  CHECK(shop.orders() == 1);
}

TEST_CASE("steps: an unknown outcome is looked up by the derived key, never blindly re-run") {
  SUBCASE("charged, then timed out: the lookup finds the charge") {
    Shop shop;
    shop.world.provider->inject(sim::Fault::charged_then_timeout);
    CHECK_THROWS_AS(shop.checkout("k1", shop.order()), sim::ProviderTimeout);
    CHECK(shop.debits() == 1);
    const Outcome retry = shop.checkout("k1", shop.order());
    CHECK(retry.response.status == 200);
    CHECK(shop.debits() == 1);  // the provider does not deduplicate: only the lookup saved it
    CHECK(shop.metrics().reconciled == 1);
    CHECK(nlohmann::json::parse(retry.response.body).at("charge_id") ==
          shop.world.provider->charge_ids().at(0));
  }
  SUBCASE("timed out before charging: the lookup finds nothing and the charge is made once") {
    Shop shop;
    shop.world.provider->inject(sim::Fault::timeout);
    CHECK_THROWS_AS(shop.checkout("k1", shop.order()), sim::ProviderTimeout);
    CHECK(shop.debits() == 0);
    CHECK(shop.checkout("k1", shop.order()).response.status == 200);
    CHECK(shop.debits() == 1);
    CHECK(shop.metrics().reconciled == 0);
  }
}

TEST_CASE("steps: the completer finishes an abandoned operation without any client retry") {
  Shop shop;
  const demo::CheckoutRequest order = shop.order();
  shop.crash_at("k1", order, "after debited");
  Completer completer(*shop.world.idem, CompleterOptions{.abandoned_after = 60s});
  completer.on("checkout", [&](Attempt& a) {
    return demo::checkout(a, *shop.world.provider, demo::checkout_from_payload(a.request()));
  });
  shop.world.clock->advance(30s);  // the lease ended, but not long enough ago
  CHECK(completer.run_once().found == 0);
  shop.world.clock->advance(45s);
  const CompleterReport report = completer.run_once();
  CHECK(report.found == 1);
  CHECK(report.finished == 1);
  CHECK(shop.metrics().completer_finished == 1);
  shop.dispatcher.run_once();
  CHECK(shop.debits() == 1);
  CHECK(shop.orders() == 1);
  CHECK(shop.mails() == 1);
  // The client's late retry gets the completer's answer.
  const Outcome late = shop.checkout("k1", order);
  CHECK(late.replayed());
  CHECK(late.response.status == 200);
  CHECK(completer.run_once().found == 0);
  CHECK(shop.debits() == 1);
}

TEST_CASE("steps: a zombie can neither advance the recovery point nor commit a local step") {
  Shop shop;
  const demo::CheckoutRequest order = shop.order();
  std::vector<std::string> zombie_points;
  // The first owner stalls after the debit; meanwhile its lease ends and a retry takes over
  // and finishes the whole operation.
  const auto zombie = [&](std::string_view at) {
    zombie_points.emplace_back(at);
    if (at != "after debited") return;
    shop.world.clock->advance(11s);
    std::thread retry([&] { CHECK(shop.checkout("k1", order).response.status == 200); });
    retry.join();
  };
  CHECK_THROWS_AS(shop.checkout("k1", order, zombie), LeaseLostError);
  // The zombie's order step was refused before its work ran: it never reached the inside of
  // its transaction, and the record is the new owner's.
  CHECK(std::find(zombie_points.begin(), zombie_points.end(),
                  "order_created: inside its transaction") == zombie_points.end());
  const std::optional<Record> r = shop.world.store->load(KeyId{"alpha", "checkout", "k1"});
  REQUIRE(r);
  CHECK(r->state == State::completed);
  CHECK(r->recovery_point == std::optional<std::string>("notified"));
  shop.dispatcher.run_once();
  CHECK(shop.debits() == 1);
  CHECK(shop.orders() == 1);
  CHECK(shop.mails() == 1);
  CHECK(shop.metrics().lease_lost >= 1);
}

TEST_CASE("steps: a zombie's local step rolls back whole when refused") {
  // Direct on the store: a stale token runs no local work and writes nothing.
  Shop shop;
  const KeyId id{"alpha", "checkout", "k1"};
  const Reservation r = shop.world.store->reserve(
      id, Fingerprint::of_bytes("x"), shop.world.clock->now(), shop.world.clock->now() + 10s);
  REQUIRE(idem::steps_of(*shop.world.store).begin_steps(id, r.token, "{}"));
  bool ran = false;
  StepCommit stale{StepResult{"order_created", "pay_1", false}, shop.world.clock->now(),
                   [&](LocalTransaction&) { ran = true; }};
  CHECK_FALSE(idem::steps_of(*shop.world.store).commit_step(id, r.token - 1, r.token, stale));
  CHECK_FALSE(ran);
  // The current token commits the work and the recovery point together; a failure inside
  // the work rolls both back.
  StepCommit failing{
      StepResult{"order_created", "pay_1", false}, shop.world.clock->now(),
      [&](LocalTransaction& tx) {
        tx.execute(
            "INSERT INTO demo_orders (tenant, order_id, charge_id, body, created_at) "
            "VALUES ('alpha', 'A-1', 'ch_1', '{}', 0)");
        tx.enqueue("mail", "{}");
        throw std::runtime_error("disk full in the middle");
      }};
  CHECK_THROWS_AS(idem::steps_of(*shop.world.store).commit_step(id, r.token, r.token, failing),
                  std::runtime_error);
  CHECK(shop.orders() == 0);
  CHECK(idem::steps_of(*shop.world.store).outbox_counts().pending == 0);
  CHECK_FALSE(shop.world.store->load(id)->recovery_point);
}

TEST_CASE("steps: derived keys and message ids are stable, distinct per step and keyless") {
  const KeyId id{"alpha", "checkout", "client-key-123"};
  CHECK(derived_key(id, 7, "debited") == derived_key(id, 7, "debited"));
  CHECK(derived_key(id, 7, "debited") != derived_key(id, 7, "refund"));
  CHECK(derived_key(id, 7, "debited") != derived_key(id, 8, "debited"));
  CHECK(derived_key(id, 7, "debited").find("client-key-123") == std::string::npos);
  CHECK(outbox_message_id(id, 7, "notified", 0) == outbox_message_id(id, 7, "notified", 0));
  CHECK(outbox_message_id(id, 7, "notified", 0) != outbox_message_id(id, 7, "notified", 1));
  CHECK(outbox_message_id(id, 7, "notified", 0).find("client-key") == std::string::npos);
  // Across a crash and a takeover (a new token) the operation keeps its derived key.
  Shop shop;
  shop.crash_at("k1", shop.order(), "after debited");
  const std::string first_key = shop.world.provider->charges().at(0).idempotency_key;
  shop.world.clock->advance(11s);
  shop.checkout("k1", shop.order());
  CHECK(first_key.starts_with("idem_"));
  CHECK(first_key.ends_with(":debited"));
  CHECK(first_key.find("k1") == std::string::npos);
  // The retry (another token) looked the charge up under the same key and found it.
  CHECK(shop.world.provider->charges().size() == 1);
  CHECK(shop.world.provider->find(first_key).has_value());
}

TEST_CASE(
    "steps: an owner paused past its lease before an external step does not call it, so a "
    "retry during what would have been its call charges once") {
  Shop shop;  // the provider does not deduplicate
  const demo::CheckoutRequest order = shop.order();
  Options o = step_options();
  o.clock = shop.world.clock;
  Coordinator other(shop.world.faulty, o);  // a second node
  const auto retry = [&] {
    return other.call_steps(shop.request("k1", order), [&](Attempt& a) {
      return demo::checkout(a, *shop.world.provider, demo::checkout_from_payload(a.request()));
    });
  };
  std::optional<Outcome> during;
  const auto paused = [&](Attempt& a) -> Response {
    shop.world.clock->advance(11s);  // paused past its 10 s lease; nobody took the key over yet
    const std::string charge = a.external(
        "debited",
        [&](const std::string& key) {
          // The retry comes while this call would be on its way: the lease is over, it takes
          // the key over and looks the charge up by the derived key, which has none yet.
          during = retry();
          return shop.world.provider->charge(order.order_id, order.amount, key).charge_id;
        },
        [&](const std::string& key) -> std::optional<std::string> {
          const auto c = shop.world.provider->find(key);
          return c ? std::optional<std::string>(c->id) : std::nullopt;
        });
    return Response{200, charge, {}};
  };
  CHECK_THROWS_AS(shop.world.idem->call_steps(shop.request("k1", order), paused), LeaseLostError);
  CHECK_FALSE(during);  // the paused owner never called, so nothing ran meanwhile
  CHECK(shop.debits() == 0);
  CHECK(shop.metrics().lease_lost == 1);
  // The retry takes the key over and charges once.
  CHECK(retry().response.status == 200);
  CHECK(shop.debits() == 1);
  CHECK(shop.orders() == 1);
}

TEST_CASE(
    "steps: a pending mark whose reply was lost is not called, and the retry looks the step up "
    "first and charges once") {
  Shop shop;
  const demo::CheckoutRequest order = shop.order();
  shop.world.faulty->lose_replies(sim::Operation::mark_pending);
  CHECK_THROWS_AS(shop.checkout("k1", order), StoreError);  // nothing recorded yet: no effect
  shop.world.faulty->lose_replies(sim::Operation::mark_pending, false);
  CHECK(shop.debits() == 0);
  CHECK(shop.checkout("k1", order).response.status == 200);
  CHECK(shop.metrics().resumed == 1);  // the mark had committed: the retry found it pending
  CHECK(shop.debits() == 1);
  CHECK(shop.orders() == 1);
}

TEST_CASE(
    "steps: the debit's record whose reply was lost answers outcome unknown with the charge id, "
    "and the retry ends with one debit") {
  Shop shop;
  const demo::CheckoutRequest order = shop.order();
  try {
    shop.checkout("k1", order, [&](std::string_view at) {
      // The charge came back; the commit that records it reaches the store, its reply is lost.
      if (at == "debited: charged, not recorded")
        shop.world.faulty->lose_replies(sim::Operation::steps);
    });
    FAIL("the checkout did not fail");
  } catch (const OutcomeUnknownError& e) {
    CHECK(e.step() == "debited");
    CHECK(e.result() == std::optional<std::string>("ch_1"));
    CHECK(std::string(e.what()).find("never with a new one") != std::string::npos);
  }
  shop.world.faulty->lose_replies(sim::Operation::steps, false);
  CHECK(shop.debits() == 1);
  CHECK(shop.checkout("k1", order).response.status == 200);
  CHECK(shop.debits() == 1);
  CHECK(shop.orders() == 1);
}

TEST_CASE(
    "steps: on a remote store, a call that the store failed after the debit is answered without "
    "another write, and the key is released with its progress once the store answers") {
  // A database that stalls fails the debit's record at its deadline; a release sent then would
  // wait out a deadline of its own before the client hears "outcome unknown". So nothing more
  // is written: the key stays reserved (in_progress), and release_lost_reservations frees it,
  // progress kept, once the store works again. The retry then resumes and finds the charge by
  // the step's derived key.
  Shop shop;
  shop.world.faulty->act_remote();
  const demo::CheckoutRequest order = shop.order();
  const KeyId id{"alpha", "checkout", "k1"};
  CHECK_THROWS_AS(shop.checkout("k1", order,
                                [&](std::string_view at) {
                                  if (at == "debited: charged, not recorded")
                                    shop.world.faulty->fail(sim::Operation::steps);
                                }),
                  OutcomeUnknownError);
  CHECK(shop.debits() == 1);
  std::optional<Record> left = shop.world.idem->store().load(id);
  REQUIRE(left);
  CHECK(left->state == State::in_progress);  // no release was written after the failure
  shop.world.faulty->fail(sim::Operation::steps, false);
  CHECK(shop.world.idem->release_lost_reservations() == 1);  // the store answers again
  left = shop.world.idem->store().load(id);
  REQUIRE(left);
  CHECK(left->state == State::released);
  CHECK(shop.checkout("k1", order).response.status == 200);  // resumes with the progress
  CHECK(shop.debits() == 1);
  CHECK(shop.metrics().reconciled == 1);
  CHECK(shop.orders() == 1);
}

TEST_CASE("steps: a store failure after the debit keeps the key and the retry resumes") {
  // Never "nothing happened" after money moved: the order step cannot be recorded (disk
  // full), the attempt fails with what it knows, and the retry finishes it with one charge.
  Shop shop;
  const demo::CheckoutRequest order = shop.order();
  shop.world.faulty->fail(sim::Operation::steps);
  CHECK_THROWS_AS(shop.checkout("k1", order), StoreError);
  CHECK(shop.debits() == 0);  // begin_steps failed: nothing ran
  shop.world.faulty->fail(sim::Operation::steps, false);
  // Now fail only after the debit is recorded: the error says an effect may have happened
  // (the client must retry with the same key), naming the step that stopped, with the
  // store's error nested.
  try {
    shop.checkout("k1", order, [&](std::string_view at) {
      if (at == "after debited") shop.world.faulty->fail(sim::Operation::steps);
    });
    FAIL("the checkout did not fail");
  } catch (const OutcomeUnknownError& e) {
    CHECK(e.code() == errc::outcome_unknown);
    CHECK(e.step() == "order_created");
    CHECK_FALSE(e.result());  // a local step: no call's result to tell
    CHECK_THROWS_AS(std::rethrow_if_nested(e), StoreError);
  }
  shop.world.faulty->fail(sim::Operation::steps, false);
  CHECK(shop.debits() == 1);
  CHECK(shop.metrics().interrupted == 1);
  CHECK(shop.checkout("k1", order).response.status == 200);
  shop.dispatcher.run_once();
  CHECK(shop.debits() == 1);
  CHECK(shop.orders() == 1);
  CHECK(shop.mails() == 1);
}

TEST_CASE("steps: call_steps never runs unprotected, even under fail_open") {
  Options o = step_options();
  o.on_store_failure = FailureMode::fail_open;
  Shop shop(o);
  shop.world.faulty->set_unreachable(true);
  CHECK_THROWS_AS(shop.checkout("k1", shop.order()), StoreError);
  shop.world.faulty->set_unreachable(false);
  CHECK(shop.debits() == 0);
  CHECK(shop.metrics().ran_unprotected == 0);
  Request no_key = shop.request("k1", shop.order());
  no_key.key.reset();
  CHECK_THROWS_AS(shop.world.idem->call_steps(no_key, [](Attempt&) { return Response{}; }),
                  InvalidKeyError);
  Request run = shop.request("k1", shop.order());
  run.in_flight = InFlight::run;
  CHECK_THROWS_AS(shop.world.idem->call_steps(run, [](Attempt&) { return Response{}; }), error);
  CHECK(shop.debits() == 0);
}

TEST_CASE("outbox: delivered at least once, deduplicated by message id, backoff, parking") {
  Shop shop;
  shop.checkout("k1", shop.order());
  CHECK(idem::steps_of(*shop.world.store).outbox_counts().pending == 1);
  SUBCASE("delivered, then the mark is lost: delivered again, the journal keeps one") {
    int tries = 0;
    Dispatcher lossy(*shop.world.idem, [&](const OutboxMessage& m) {
      demo::mail_delivery(shop.mail)(m);
      if (++tries == 1) throw std::runtime_error("connection reset before the answer");
    });
    CHECK(lossy.run_once().retried == 1);
    CHECK(shop.mails() == 1);
    shop.world.clock->advance(1s);
    CHECK(lossy.run_once().delivered == 1);
    CHECK(tries == 2);
    CHECK(shop.mails() == 1);
    CHECK(shop.mail.duplicates() == 1);
  }
  SUBCASE(
      "messages enqueued while a run delivers wait for the next run: an inflow cannot keep "
      "it running") {
    int inflow = 0;  // each delivery brings another order, hence another message (50 at most)
    Dispatcher d(
        *shop.world.idem,
        [&](const OutboxMessage& m) {
          demo::mail_delivery(shop.mail)(m);
          if (++inflow > 50) return;
          shop.world.clock->advance(1ms);
          shop.checkout(fmt::format("inflow-{}", inflow), shop.order(fmt::format("B-{}", inflow)));
        },
        OutboxOptions{.batch = 1});
    CHECK(d.run_once().delivered == 1);  // the one due when it began
    CHECK(idem::steps_of(*shop.world.store).outbox_counts().pending == 1);
    CHECK(d.run_once().delivered == 1);
    CHECK(shop.mails() == 2);
    CHECK(shop.debits() == 3);
  }
  SUBCASE("failures back off, doubling; a poisoned message is parked after max_attempts") {
    shop.mail.fail_next(100);
    Dispatcher d(*shop.world.idem, demo::mail_delivery(shop.mail),
                 OutboxOptions{.max_attempts = 4, .first_retry = 1s, .max_retry = 3s});
    CHECK(d.run_once().retried == 1);  // attempt 1; due again in 1 s
    shop.world.clock->advance(999ms);
    CHECK(d.run_once().retried == 0);  // not due yet
    shop.world.clock->advance(1ms);
    CHECK(d.run_once().retried == 1);  // attempt 2; due in 2 s
    shop.world.clock->advance(1999ms);
    CHECK(d.run_once().retried == 0);
    shop.world.clock->advance(1ms);
    CHECK(d.run_once().retried == 1);  // attempt 3; due in 3 s (the cap)
    shop.world.clock->advance(3s);
    CHECK(d.run_once().parked == 1);  // attempt 4
    shop.world.clock->advance(1h);
    const DispatchReport later = d.run_once();
    CHECK(later.delivered + later.retried + later.parked == 0);
    CHECK(idem::steps_of(*shop.world.store).outbox_counts().parked == 1);
    CHECK(shop.metrics().outbox_parked == 1);
    CHECK(shop.mails() == 0);
  }
}

// The store under a dispatcher, telling its outbox writes in order ("delivered N": one
// transaction marking N messages; "failed"), and failing them on demand (nothing written).
struct TellingOutbox final : idem::StoreWrapper {
  using StoreWrapper::StoreWrapper;
  std::vector<std::string> writes;
  bool fail_marks = false, fail_failures = false;
  std::size_t outbox_delivered(std::span<const std::string> ids, TimePoint now) override {
    writes.push_back(fmt::format("delivered {}", ids.size()));
    if (fail_marks) throw StoreError("disk full", 13);
    return StoreWrapper::outbox_delivered(ids, now);
  }
  void outbox_failed(const std::string& id, TimePoint retry_at, bool park,
                     const std::string& why) override {
    writes.push_back("failed");
    if (fail_failures) throw StoreError("disk full", 13);
    StoreWrapper::outbox_failed(id, retry_at, park, why);
  }
};

TEST_CASE(
    "outbox: a dispatcher marks what a batch delivered in one transaction, and before it records "
    "a failure or gives the rest back, so a store error then loses no mark") {
  Shop shop;
  for (int i = 0; i < 5; ++i) {
    shop.world.clock->advance(1ms);
    shop.checkout(fmt::format("k{}", i), shop.order(fmt::format("A-{}", i)));
  }
  idem::StepStore& outbox = idem::steps_of(*shop.world.store);
  REQUIRE(outbox.outbox_counts().pending == 5);
  const auto store = std::make_shared<TellingOutbox>(shop.world.store);
  Options o = step_options();
  o.clock = shop.world.clock;
  Coordinator idem(store, o);
  std::map<std::string, int> handed;  // no receiver deduplicates here
  int deliveries = 0, fail_at = 0;
  const Delivery count = [&](const OutboxMessage& m) {
    ++handed[m.id];
    if (++deliveries == fail_at) throw std::runtime_error("receiver down");
  };
  const auto handed_again = [&] {  // messages handed over more than once
    int n = 0;
    for (const auto& entry : handed) n += entry.second > 1 ? 1 : 0;
    return n;
  };
  SUBCASE("one batch: one mark") {
    CHECK(Dispatcher(idem, count).run_once().delivered == 5);
    CHECK(store->writes == std::vector<std::string>{"delivered 5"});
    CHECK(outbox.outbox_counts().delivered == 5);
    CHECK(idem.metrics().outbox_delivered == 5);
  }
  SUBCASE("batches of two: a mark each") {
    CHECK(Dispatcher(idem, count, OutboxOptions{.batch = 2}).run_once().delivered == 5);
    CHECK(store->writes == std::vector<std::string>{"delivered 2", "delivered 2", "delivered 1"});
    CHECK(outbox.outbox_counts().delivered == 5);
  }
  SUBCASE("a failure: what came before it is marked first") {
    fail_at = 3;
    const DispatchReport r = Dispatcher(idem, count).run_once();
    CHECK(r.delivered == 4);
    CHECK(r.retried == 1);
    CHECK(store->writes == std::vector<std::string>{"delivered 2", "failed", "delivered 2"});
    CHECK(outbox.outbox_counts().pending == 1);
    CHECK(outbox.outbox_counts().delivered == 4);
  }
  SUBCASE("recording the failure fails: the two delivered before it stay delivered") {
    fail_at = 3;
    store->fail_failures = true;
    CHECK_THROWS_AS(Dispatcher(idem, count).run_once(), StoreError);
    CHECK(store->writes == std::vector<std::string>{"delivered 2", "failed"});
    CHECK(outbox.outbox_counts().delivered == 2);
    // The failed one and the two not tried are claimed until the claim ends; then only those
    // three are handed over again.
    shop.world.clock->advance(31s);
    store->fail_failures = false;
    CHECK(Dispatcher(idem, count).run_once().delivered == 3);
    CHECK(outbox.outbox_counts().delivered == 5);
    CHECK(handed_again() == 1);  // the one whose failure was not recorded
  }
  SUBCASE("the claim runs short after two: they are marked, then the other three given back") {
    // claim_for 30 s, deliver_margin 1 s (the defaults): the second delivery takes 29.5 s.
    const Delivery slow = [&](const OutboxMessage& m) {
      ++handed[m.id];
      if (++deliveries == 2) shop.world.clock->advance(29500ms);
    };
    const DispatchReport r = Dispatcher(idem, slow).run_once();
    CHECK(r.delivered == 2);
    CHECK(r.given_back == 3);
    CHECK(store->writes == std::vector<std::string>{"delivered 2"});
    CHECK(outbox.outbox_counts().delivered == 2);
    shop.world.clock->advance(500ms);  // the claim ends: the three are due again
    CHECK(Dispatcher(idem, count).run_once().delivered == 3);
    CHECK(handed_again() == 0);
  }
  SUBCASE("the mark fails: nothing is counted, and the batch is delivered again after its claim") {
    store->fail_marks = true;
    CHECK_THROWS_AS(Dispatcher(idem, count).run_once(), StoreError);
    CHECK(store->writes == std::vector<std::string>{"delivered 5"});
    CHECK(outbox.outbox_counts().delivered == 0);
    CHECK(idem.metrics().outbox_delivered == 0);
    CHECK(Dispatcher(idem, count).run_once().delivered == 0);  // still claimed
    store->fail_marks = false;
    shop.world.clock->advance(31s);
    CHECK(Dispatcher(idem, count).run_once().delivered == 5);
    CHECK(idem.metrics().outbox_delivered == 5);
    CHECK(handed_again() == 5);  // at least once: the receiver deduplicates on the id
  }
  CHECK(handed.size() == 5);
}

TEST_CASE(
    "outbox: a dispatcher paused past its claim delivers nothing more of its batch: the other "
    "dispatcher that claimed it meanwhile delivers each message, once") {
  Shop shop;
  shop.checkout("k1", shop.order("A-1"));
  shop.world.clock->advance(1ms);
  shop.checkout("k2", shop.order("A-2"));
  REQUIRE(idem::steps_of(*shop.world.store).outbox_counts().pending == 2);
  // Every hand-over counted by message id: no receiver deduplicates here.
  std::map<std::string, int> handed;
  std::vector<std::string> order;
  Dispatcher other(*shop.world.idem, [&](const OutboxMessage& m) { ++handed[m.id]; });
  SUBCASE("paused mid-batch, past claim_for (30 s)") {
    bool paused = false;
    Dispatcher first(*shop.world.idem, [&](const OutboxMessage& m) {
      ++handed[m.id];
      order.push_back(m.id);
      if (std::exchange(paused, true)) return;
      // The process stops here (a pause, a slow receiver) for longer than its claim. Meanwhile
      // the other dispatcher finds both claims ended and delivers both: the first message a
      // second time (it was not marked yet: at least once), the second for the first time.
      shop.world.clock->advance(31s);
      CHECK(other.run_once().delivered == 2);
    });
    const DispatchReport r = first.run_once();
    REQUIRE_FALSE(order.empty());
    REQUIRE(handed.size() == 2);
    for (const auto& entry : handed) {
      const std::string& id = entry.first;  // (not a structured binding: clang 14 cannot
      CAPTURE(id);                          // capture one in CAPTURE's lambda)
      CHECK(entry.second == (id == order[0] ? 2 : 1));  // the second message: once, by the other
    }
    CHECK(order.size() == 1);
    CHECK(r.delivered == 1);
    CHECK(r.given_back == 1);
  }
  SUBCASE("held up by slow deliveries until the claim has less than deliver_margin left") {
    // claim_for 30 s, deliver_margin 1 s (the default): the first delivery takes 29.5 s.
    Dispatcher slow(*shop.world.idem, [&](const OutboxMessage& m) {
      ++handed[m.id];
      order.push_back(m.id);
      shop.world.clock->advance(29500ms);
    });
    const DispatchReport r = slow.run_once();
    CHECK(r.delivered == 1);
    CHECK(r.given_back == 1);
    CHECK(idem::steps_of(*shop.world.store).outbox_counts().pending == 1);
    CHECK(other.run_once().delivered == 0);  // still claimed, for half a second
    shop.world.clock->advance(500ms);
    CHECK(other.run_once().delivered == 1);  // the claim ended: due again
    REQUIRE(handed.size() == 2);
    for (const auto& [id, times] : handed) CHECK(times == 1);
  }
  CHECK(idem::steps_of(*shop.world.store).outbox_counts().pending == 0);
  CHECK(shop.metrics().outbox_given_back == 1);  // also idem_outbox_given_back_total
  const OutboxOptions too_long{.claim_for = 30s, .deliver_margin = 30s};
  const OutboxOptions negative{.deliver_margin = -1ms};
  CHECK_THROWS_AS(Dispatcher(
                      *shop.world.idem, [](const OutboxMessage&) {}, too_long),
                  error);
  CHECK_THROWS_AS(Dispatcher(
                      *shop.world.idem, [](const OutboxMessage&) {}, negative),
                  error);
}

TEST_CASE("maintenance: under a load of new keys the database stays bounded once keys expire") {
  Options o = step_options();
  o.ttl = std::chrono::minutes(2);
  Shop shop(o);
  Maintenance maintenance(*shop.world.idem, MaintenanceOptions{.outbox = {.keep_delivered = 1min}});
  maintenance.deliver(demo::mail_delivery(shop.mail));
  RawDb raw(shop.world.db_path);
  long long most_rows = 0;
  for (int minute = 0; minute < 10; ++minute) {
    for (int i = 0; i < 20; ++i) {
      const std::string key = fmt::format("m{}-{}", minute, i);
      shop.checkout(key, shop.order(key));
    }
    shop.world.clock->advance(1min);
    run_coroutine(maintenance.run_once());
    most_rows = std::max(most_rows, raw.rows());
    CHECK(idem::steps_of(*shop.world.store).outbox_counts().pending ==
          0);  // the outbox drains every round
  }
  // Two minutes of keys at most (the TTL), however long the load runs.
  CHECK(most_rows <= 3 * 20);
  CHECK(raw.scalar("SELECT count(*) FROM idem_outbox") <= 3 * 20);
  const MaintenanceReport totals = maintenance.totals();
  CHECK(totals.purged >= 7 * 20);
  CHECK(totals.outbox.delivered == 200);
  CHECK(shop.mails() == 200);
  CHECK(shop.debits() == 200);
}

TEST_CASE(
    "maintenance: with keep_delivered left unset, delivered messages live no longer than the key "
    "TTL, so under steady load the keys and the outbox level off") {
  Options o = step_options();
  o.ttl = std::chrono::minutes(1);
  Shop shop(o);
  Maintenance maintenance(*shop.world.idem);  // every job on its own default
  maintenance.deliver(demo::mail_delivery(shop.mail));
  RawDb raw(shop.world.db_path);
  const auto now_ms = [&] { return shop.world.clock->now().time_since_epoch().count(); };
  std::vector<long long> keys_rows, outbox_rows;
  long long oldest_delivered_ms = 0;
  // Five minutes at three new keys a second; maintenance every 10 s (its purge period).
  for (int second = 1; second <= 300; ++second) {
    for (int i = 0; i < 3; ++i) {
      const std::string key = fmt::format("s{}-{}", second, i);
      shop.checkout(key, shop.order(key));
    }
    shop.world.clock->advance(1s);
    if (second % 10 != 0) continue;
    run_coroutine(maintenance.run_once());
    keys_rows.push_back(raw.rows());
    outbox_rows.push_back(raw.scalar("SELECT count(*) FROM idem_outbox"));
    const long long first = raw.scalar("SELECT min(next_at) FROM idem_outbox WHERE state = 1");
    if (first > 0) oldest_delivered_ms = std::max(oldest_delivered_ms, now_ms() - first);
  }
  // From the second minute on, each table holds at most a TTL and a maintenance period of keys.
  for (std::size_t i = 9; i < keys_rows.size(); ++i) {
    CAPTURE(i);
    CHECK(keys_rows[i] <= 3 * (60 + 10));
    CHECK(outbox_rows[i] <= 3 * (60 + 10));
  }
  CHECK(oldest_delivered_ms <= (60 + 10) * 1000);  // the TTL plus one maintenance period
  CHECK(outbox_rows.back() > 0);                   // the load goes on: nothing is lost early
  CHECK(shop.mails() == 900);
  CHECK(shop.debits() == 900);
}

TEST_CASE("maintenance: the loop runs the completer and the outbox on the clock until stopped") {
  Shop shop;
  shop.crash_at("k1", shop.order(), "after order_created");
  Maintenance maintenance(*shop.world.idem,
                          MaintenanceOptions{.completer = {.abandoned_after = 20s}});
  maintenance.deliver(demo::mail_delivery(shop.mail));
  maintenance.resume("checkout", [&](Attempt& a) {
    return demo::async_checkout(a, *shop.world.provider, demo::checkout_from_payload(a.request()));
  });
  boost::asio::io_context io;
  maintenance.start(io.get_executor());
  io.poll();  // the first round: nothing abandoned yet (the lease is still on)
  CHECK(maintenance.totals().completer.finished == 0);
  for (int s = 0; s < 60 && maintenance.totals().outbox.delivered == 0; ++s) {
    shop.world.clock->advance(1s);
    io.poll();
  }
  CHECK(maintenance.totals().completer.finished == 1);
  CHECK(maintenance.totals().outbox.delivered == 1);
  maintenance.stop();
  io.run();  // the loop ends
  CHECK(shop.debits() == 1);
  CHECK(shop.orders() == 1);
  CHECK(shop.mails() == 1);
}

// A store whose purge takes `took` of simulated time and notes when each batch began.
class SlowPurge final : public StoreWrapper {
 public:
  SlowPurge(std::shared_ptr<Store> inner, std::shared_ptr<sim::SimulatedClock> clock,
            std::chrono::milliseconds took)
      : StoreWrapper(std::move(inner)), clock_(std::move(clock)), took_(took) {}
  std::vector<TimePoint> began;

  std::size_t purge_expired(TimePoint now, std::size_t limit) override {
    began.push_back(clock_->now());
    clock_->advance(took_);
    return StoreWrapper::purge_expired(now, limit);
  }

 private:
  std::shared_ptr<sim::SimulatedClock> clock_;
  std::chrono::milliseconds took_;
};

TEST_CASE(
    "maintenance: the schedule purges a backlog one batch per turn, each batch followed by a "
    "pause three times as long as it took") {
  idem::test::TempDir dir;
  auto clock = std::make_shared<sim::SimulatedClock>();
  auto slow =
      std::make_shared<SlowPurge>(std::make_shared<SqliteStore>(dir.file("keys.db")), clock, 20ms);
  Options options;
  options.ttl = 1min;
  options.clock = clock;
  Coordinator coordinator(slow, std::move(options));
  for (int i = 0; i < 45; ++i) {
    coordinator.call(idem::test::request(fmt::format("k{}", i)), [] {
      return Response{200, "ok", {}};
    });
  }
  clock->advance(2min);  // all 45 expired: a backlog of four full batches and one of 5
  Maintenance maintenance(coordinator, MaintenanceOptions{.batch = 10});
  boost::asio::io_context io;
  maintenance.start(io.get_executor());
  io.poll();
  clock->advance(10s);  // purge_every: the first batch
  io.poll();
  for (int step = 0; step < 100 && slow->began.size() < 5; ++step) {
    clock->advance(5ms);
    io.poll();
  }
  REQUIRE(slow->began.size() == 5);
  for (std::size_t i = 1; i < slow->began.size(); ++i) {
    CAPTURE(i);
    // The batch's 20 ms, then a pause of 60 ms, not one of purge_every (10 s).
    CHECK(slow->began[i] - slow->began[i - 1] == 80ms);
  }
  // The last batch was not full: the backlog is done; the next purge is purge_every later.
  const TimePoint last_ended = slow->began.back() + 20ms;
  for (int step = 0; step < 3000 && slow->began.size() == 5; ++step) {
    clock->advance(5ms);
    io.poll();
  }
  REQUIRE(slow->began.size() == 6);
  CHECK(slow->began.back() - last_ended == 10s);
  CHECK(maintenance.totals().purged == 45);
  CHECK(coordinator.metrics().purged == 45);
  maintenance.stop();
  io.run();
}

// The shop's outbox and its checkouts (blocking), for the completer of `m`.
void serve_checkouts(MaintenanceThread& m, Shop& shop) {
  m.deliver(demo::mail_delivery(shop.mail));
  m.resume("checkout", [&shop](Attempt& a) {
    return demo::checkout(a, *shop.world.provider, demo::checkout_from_payload(a.request()));
  });
}

// Waits (a bounded spin, not a sleep) until `m` has run more than `rounds` rounds and sleeps
// again: its wake-up is on `clock` (so the clock's next move wakes it).
bool rounds_pass(const MaintenanceThread& m, const sim::SimulatedClock& clock, std::size_t rounds) {
  const auto give_up = std::chrono::steady_clock::now() + 30s;
  while (m.totals().rounds <= rounds || clock.idle()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::yield();
  }
  return true;
}

TEST_CASE(
    "maintenance: the blocking thread runs the same schedule (the completer, then the outbox) on "
    "the clock until stopped") {
  Shop shop;
  shop.crash_at("k1", shop.order(), "after order_created");
  MaintenanceThread maintenance(*shop.world.idem,
                                MaintenanceOptions{.completer = {.abandoned_after = 20s}});
  serve_checkouts(maintenance, shop);
  CHECK_THROWS_AS(maintenance.resume("checkout", {}), idem::error);  // bad input, nothing changes
  maintenance.start();
  CHECK_THROWS_AS(maintenance.start(), std::logic_error);
  REQUIRE(rounds_pass(maintenance, *shop.world.clock, 0));  // the first round: nothing is due yet
  CHECK(maintenance.totals().completer.found == 0);
  int seconds = 0;
  for (; seconds < 60 && maintenance.totals().outbox.delivered == 0; ++seconds) {
    const std::size_t before = maintenance.totals().rounds;
    shop.world.clock->advance(1s);  // the dispatcher is due every second: one more round
    REQUIRE(rounds_pass(maintenance, *shop.world.clock, before));
  }
  const MaintenanceReport totals = maintenance.totals();
  CHECK(totals.completer.finished == 1);
  CHECK(totals.outbox.delivered == 1);
  // The completer first runs complete_every (10 s) after the start, and finds the operation
  // once it has been abandoned 20 s (its lease of 10 s ended, then abandoned_after): at 30 s.
  CHECK(seconds >= 30);
  maintenance.stop();  // wakes the sleeping thread and joins it
  const std::size_t rounds = maintenance.totals().rounds;
  shop.world.clock->advance(1min);
  CHECK(maintenance.totals().rounds == rounds);  // stopped: no round after
  CHECK(shop.debits() == 1);
  CHECK(shop.orders() == 1);
  CHECK(shop.mails() == 1);
}

TEST_CASE("maintenance: the blocking run_once runs every job once, on the calling thread") {
  Shop shop;
  shop.crash_at("k1", shop.order(), "after order_created");
  MaintenanceThread maintenance(*shop.world.idem,
                                MaintenanceOptions{.completer = {.abandoned_after = 20s}});
  serve_checkouts(maintenance, shop);
  CHECK(maintenance.run_once().completer.found == 0);  // still within its lease
  shop.world.clock->advance(1min);
  const MaintenanceReport first = maintenance.run_once();
  CHECK(first.completer.finished == 1);
  CHECK(first.outbox.delivered == 0);  // the dispatcher ran before the completer queued the mail
  const MaintenanceReport second = maintenance.run_once();
  CHECK(second.outbox.delivered == 1);
  CHECK(maintenance.totals().rounds == 3);
  CHECK(shop.debits() == 1);
  CHECK(shop.mails() == 1);
  CHECK_THROWS_AS(MaintenanceThread(*shop.world.idem, MaintenanceOptions{.batch = 0}), idem::error);
}

}  // namespace

namespace {

// One request to the payments API of `idem-demo serve`, handled in this thread.
http::Reply post_payment(demo::PaymentsApi& api, const std::string& key,
                         const std::string& order_id) {
  http::Request req{http::Verb::post, "/v1/payments", 11};
  req.set("Authorization", "Bearer sk_test_alpha");
  req.set("Idempotency-Key", key);
  req.set("Content-Type", "application/json");
  req.body() = fmt::format(R"({{"amount": 4990, "currency": "RUB", "order_id": "{}"}})", order_id);
  req.prepare_payload();
  return run_coroutine(api.handle(std::move(req), demo::Peer{"127.0.0.1"}));
}

TEST_CASE(
    "serve's payments API: with a short TTL the database stays bounded, the outbox drains, and "
    "the completer finishes a payment its client abandoned") {
  test::TempDir dir;
  auto clock = std::make_shared<sim::SimulatedClock>();
  demo::ApiOptions o;
  o.db = dir.file("api.db");
  o.provider_latency = 0ms;
  o.ttl = 2min;
  o.clock = clock;
  o.maintenance_loop = false;  // this test runs the rounds itself, on the simulated clock
  o.maintenance.completer.abandoned_after = 1min;
  o.maintenance.outbox.keep_delivered = 1min;
  demo::PaymentsApi api(o);
  RawDb raw(o.db);
  long long most_keys = 0, most_outbox = 0;
  for (int minute = 0; minute < 8; ++minute) {
    for (int i = 0; i < 25; ++i) {
      const std::string order = fmt::format("O-{}-{}", minute, i);
      REQUIRE(post_payment(api, "k-" + order, order).result_int() == 200);
    }
    clock->advance(1min);
    const MaintenanceReport round = run_coroutine(api.maintenance().run_once());
    CHECK(round.failures == 0);
    CHECK(idem::steps_of(api.coordinator().store()).outbox_counts().pending == 0);
    most_keys = std::max(most_keys, raw.rows());
    most_outbox = std::max(most_outbox, raw.scalar("SELECT count(*) FROM idem_outbox"));
  }
  CHECK(most_keys <= 3 * 25);  // the TTL's worth of keys, not the whole run's 200
  CHECK(most_outbox <= 2 * 25);
  CHECK(api.mail().count() == 200);
  CHECK(api.provider().charge_count() == 200);

  // A payment whose provider call timed out (504, key released with its progress) and whose
  // client never came back: the completer resumes it from the stored request.
  api.provider().inject(sim::Fault::timeout);
  const http::Reply first = post_payment(api, "k-abandoned", "O-abandoned");
  CHECK(first.result_int() == 504);
  clock->advance(61s);
  const MaintenanceReport round = run_coroutine(api.maintenance().run_once());
  CHECK(round.completer.finished == 1);
  CHECK(api.provider().charge_count() == 201);
  const http::Reply late = post_payment(api, "k-abandoned", "O-abandoned");
  CHECK(late.result_int() == 200);
  CHECK(late["Idempotent-Replayed"] == "true");
  clock->advance(2s);
  run_coroutine(api.maintenance().run_once());
  CHECK(api.mail().count() == 201);
  CHECK(api.provider().charge_count() == 201);
}

}  // namespace
