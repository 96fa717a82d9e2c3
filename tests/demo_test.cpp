// idem-demo's table, entry by entry, from the provider's charge counts; and its determinism.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "scenarios.hpp"

using idem::FailureMode;
using idem::InFlight;
namespace demo = idem::demo;

using Ids = std::vector<std::string>;

TEST_CASE("demo: in-flight run (a result cache) answers consistently and charges twice") {
  const demo::InFlightRow row = demo::in_flight_row(InFlight::run);
  CHECK(row.responses == Ids{"ch_1", "ch_1"});
  CHECK(row.charges == Ids{"ch_1", "ch_2"});
}

TEST_CASE("demo: in-flight wait replays the first's charge and charges once") {
  const demo::InFlightRow row = demo::in_flight_row(InFlight::wait);
  CHECK(row.responses == Ids{"ch_1", "ch_1"});
  CHECK(row.charges == Ids{"ch_1"});
}

TEST_CASE("demo: in-flight raise answers the duplicate with InProgress and charges once") {
  const demo::InFlightRow row = demo::in_flight_row(InFlight::raise);
  CHECK(row.responses == Ids{"ch_1", "IdempotencyInProgressError"});
  CHECK(row.charges == Ids{"ch_1"});
}

TEST_CASE("demo: key reuse replays the same amount and refuses amount 5, one charge") {
  const demo::KeyReuse k = demo::key_reuse();
  CHECK(k.same_amount == "replayed ch_1");
  CHECK(k.charges_after_same == 1);
  CHECK(k.other_amount == "IdempotencyKeyReuseError");
  CHECK(k.charges_after_other == 1);
}

TEST_CASE("demo: a provider timeout is not cached, the retry charges once") {
  const demo::FailureNotCached f = demo::failure_not_cached();
  CHECK(f.first == "provider timed out");
  CHECK(f.second == "ch_1");
  CHECK(f.charges == 1);
}

TEST_CASE("demo: an unreachable store runs the action under fail_open and not under fail_closed") {
  const demo::StoreUnreachable open = demo::store_unreachable(FailureMode::fail_open);
  CHECK(open.outcome == "ch_1");
  CHECK(open.charges == 1);
  const demo::StoreUnreachable closed = demo::store_unreachable(FailureMode::fail_closed);
  CHECK(closed.outcome == "StoreUnavailable");
  CHECK(closed.charges == 0);
}

TEST_CASE("demo: HTTP view, 20 requests with one key: raise gives one 200 and nineteen 409") {
  const demo::HttpView v = demo::http_view(InFlight::raise);
  std::vector<int> expected(20, 409);
  expected[0] = 200;
  CHECK(v.statuses == expected);
  CHECK(v.charges == 1);
}

TEST_CASE("demo: HTTP view, 20 requests with one key: wait gives twenty 200 with one charge id") {
  const demo::HttpView v = demo::http_view(InFlight::wait);
  CHECK(v.statuses == std::vector<int>(20, 200));
  CHECK(v.charge_ids == Ids{"ch_1"});
  CHECK(v.charges == 1);
}

TEST_CASE("demo: the table holds the article's three lines byte for byte, identically every run") {
  const std::string table = demo::render_table(false, false);
  CHECK(table.find("in_flight='run'    (a result cache)         responses=['ch_1', 'ch_1']         "
                   "            charges made=['ch_1', 'ch_2']\n") != std::string::npos);
  CHECK(table.find("in_flight='wait'   (the default)            responses=['ch_1', 'ch_1']         "
                   "            charges made=['ch_1']\n") != std::string::npos);
  CHECK(table.find("in_flight='raise'  (409 for the second)     responses=['ch_1', "
                   "'IdempotencyInProgressError'] charges made=['ch_1']\n") != std::string::npos);
  CHECK(table.find("same key, same amount     -> replayed ch_1, charges made=1\n") !=
        std::string::npos);
  CHECK(table.find("same key, amount 5        -> IdempotencyKeyReuseError, charges made=1\n") !=
        std::string::npos);
  CHECK(table.find("first call  -> provider timed out\nsecond call -> ch_1, charges made=1\n") !=
        std::string::npos);
  for (int i = 0; i < 20; ++i) REQUIRE(demo::render_table(false, false) == table);
  CHECK(demo::render_table(false, true) == demo::render_table(false, true));  // timelines too
}

TEST_CASE(
    "demo: the owner frozen past its lease before the bank: one charge with the lease check, two "
    "with the check switched off") {
  const demo::PausedOwner checked = demo::paused_owner(true);
  CHECK(checked.responses == Ids{"lease lost", "ch_1"});  // refused before any call
  CHECK(checked.charges == Ids{"ch_1"});
  const demo::PausedOwner unchecked = demo::paused_owner(false);
  CHECK(unchecked.responses == Ids{"lease lost", "ch_2"});  // called late; the retry too
  CHECK(unchecked.charges == Ids{"ch_1", "ch_2"});
  const std::string table = demo::render_table(false, false);
  CHECK(table.find("lease checked before the call        -> responses=['lease lost', 'ch_1']     "
                   "  charges made=['ch_1']\n") != std::string::npos);
  CHECK(table.find("token only (the check switched off)  -> responses=['lease lost', 'ch_2']     "
                   "  charges made=['ch_1', 'ch_2']\n") != std::string::npos);
  const std::string timeline = demo::render_table(false, true);
  CHECK(timeline.find("t=3000 ms  idem   lease_lost key 549e560a61f4: step 'debited': not "
                      "called:") != std::string::npos);
}

TEST_CASE("demo: real-time mode prints the same table as simulated time") {
  CHECK(demo::render_table(true, false) == demo::render_table(false, false));
}

TEST_CASE(
    "demo: seed 000's checkout dies after each step, and the retry or the completer ends 1/1/1") {
  const std::vector<demo::CheckoutCrash> rows = demo::checkout_crashes();
  REQUIRE(rows.size() == 4);
  const char* resumed[] = {"debited", "order_created", "notified", "debited"};
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const demo::CheckoutCrash& c = rows[i];
    CAPTURE(c.point);
    CHECK(c.debits == 1);  // the money moved before the death
    CHECK(c.end_debits == 1);
    CHECK(c.end_orders == 1);
    CHECK(c.end_mails == 1);
    CHECK(c.resumed_from == resumed[i]);
  }
  CHECK_FALSE(rows[3].retried);
  CHECK(demo::render_table(false, false)
            .find("dies after debited       -> debits=1 orders=0 mails=0; no retry, completer -> "
                  "debits=1 orders=1 mails=1 (resumed after 'debited')\n") != std::string::npos);
}
