#include "scenarios.hpp"

#include <utility>  // before Asio (Boost 1.74)

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <nlohmann/json.hpp>

#include <stdlib.h>
#include <filesystem>
#include <fstream>

#include "checkout.hpp"
#include "idem/asio.hpp"
#include "idem/http.hpp"
#include "idem/sim/async_provider.hpp"
#include "idem/sim/driver.hpp"
#include "idem/sim/faulty_store.hpp"
#include "idem/sim/mail.hpp"
#include "idem/sqlite_store.hpp"
#include "idem/steps.hpp"
#include "idem/store_wrapper.hpp"

namespace idem::demo {
namespace {

namespace net = boost::asio;
using namespace std::chrono_literals;
using sim::Mark;

constexpr auto kLatency = 300ms;

// The table's seed-000 rows: where the checkout dies, and whether a retry comes (false: the
// completer finishes it).
constexpr std::pair<const char*, bool> kCheckoutRows[] = {{"after debited", true},
                                                          {"after order_created", true},
                                                          {"after notified", true},
                                                          {"after debited", false}};

// How the SVG draws a coordinator log event (lib/src logs these names): its mark and a
// short label.
std::pair<Mark, std::string> drawn(const LogEvent& e) {
  struct Kind {
    std::string_view event;
    Mark mark;
    std::string_view label;  // empty: the event's message
  };
  static constexpr Kind kinds[] = {
      {"reserved", Mark::reserve, "reserved"},
      {"taken_over", Mark::takeover, "took over (lease over)"},
      {"waiting", Mark::wait, "waits"},
      {"replayed", Mark::replay, "replays"},
      {"in_progress", Mark::conflict, "409 in progress"},
      {"key_reuse", Mark::reuse, "422 key reuse"},
      {"released", Mark::release, "released (failed)"},
      {"completed", Mark::complete, "completed"},
      {"store_race_lost", Mark::note, "lost store race"},
      {"cache_miss", Mark::note, "no result: runs"},
      {"store_unavailable", Mark::error, "store unreachable"},
      {"release_failed", Mark::error, "release failed"},
      {"complete_failed", Mark::error, "complete failed"},
      {"interrupted", Mark::error, "interrupted"},
      {"lease_lost", Mark::lease_lost, "lease lost"},
      {"step_recorded", Mark::note, ""},
      {"step_reconciled", Mark::note, ""},
      {"resumed", Mark::note, ""},
      {"completed_abandoned", Mark::note, "finished abandoned op"},
  };
  for (const Kind& k : kinds)
    if (k.event == e.event) return {k.mark, std::string(k.label.empty() ? e.message : k.label)};
  return {Mark::note, std::string(e.event)};
}

// How the SVG draws a line of the simulated provider (simulator/src/provider.cpp).
std::pair<Mark, std::string> drawn_provider(const std::string& line) {
  constexpr std::string_view charged = "provider: charged ";
  if (line.starts_with(charged)) {
    const std::string id =
        line.substr(charged.size(), line.find(' ', charged.size()) - charged.size());
    return {Mark::charge, line.find("answer lost") != std::string::npos
                              ? "charged " + id + ", answer lost"
                              : "charged " + id};
  }
  if (line.find("timed out") != std::string::npos) return {Mark::error, "timed out, no charge"};
  if (line.find("declined") != std::string::npos) return {Mark::note, "declined"};
  if (line.find("duplicate") != std::string::npos) return {Mark::note, "duplicate recognised"};
  return {Mark::note, line};
}

// A client's answer as the SVG labels it: "ch_1", "409 in progress", ...
std::string short_answer(const std::string& text) {
  if (text == "IdempotencyInProgressError") return "409 in progress";
  if (text == "IdempotencyKeyReuseError") return "422 key reuse";
  if (text == "StoreUnavailable") return "503 store unavailable";
  if (text == "provider timed out") return "504 timed out";
  return text;
}
std::string answer_label(const std::string& text) { return "<- " + short_answer(text); }
std::vector<std::string> answers(const std::vector<std::string>& texts) {
  std::vector<std::string> out;
  for (const std::string& t : texts) out.push_back(short_answer(t));
  return out;
}

// For the table's paused-owner row only: a store whose pending mark checks the token and
// not the lease (nor renews it), as a store that trusts the caller's own view of its lease
// would. It shows what the lease check in StepStore::mark_pending prevents.
class TokenOnlyMarks : public StoreWrapper {
 public:
  using StoreWrapper::StoreWrapper;
  bool mark_pending(const KeyId& id, std::int64_t token, std::int64_t origin,
                    const std::string& step, const LeaseCheck& lease) override {
    return StoreWrapper::mark_pending(id, token, origin, step,
                                      LeaseCheck{lease.now, TimePoint{}, TimePoint{}});
  }
};

// One scenario's world: a clock, one store, one provider, one coordinator.
struct Scenario {
  const RunOptions& run;
  std::shared_ptr<sim::SimulatedClock> sim;
  std::shared_ptr<Clock> clock;
  TimePoint start;
  std::shared_ptr<sim::FaultyStore> store;
  std::shared_ptr<sim::Provider> provider;
  std::unique_ptr<Coordinator> idem;
  net::io_context io;

  Scenario(const RunOptions& r, Options options, bool lease_checked = true)
      : run(r),
        sim(r.real_time ? nullptr : std::make_shared<sim::SimulatedClock>()),
        clock(r.real_time ? std::shared_ptr<Clock>(std::make_shared<SystemClock>()) : sim),
        start(clock->now()),
        store(std::make_shared<sim::FaultyStore>(std::make_shared<SqliteStore>(":memory:"))) {
    // The provider does not deduplicate here: the table shows what idem alone prevents.
    provider = std::make_shared<sim::Provider>(
        clock, sim::ProviderOptions{.latency = kLatency, .dedup = false});
    options.clock = clock;
    if (run.timeline != nullptr) {
      options.log = [this](const LogEvent& e) {
        auto [mark, label] = drawn(e);
        run.timeline->add(ms(e.at), "idem",
                          fmt::format("{} key {}{}{}", e.event, e.key_hash,
                                      e.message.empty() ? "" : ": ", e.message),
                          mark, std::move(label));
      };
      provider->on_event([this](TimePoint at, const std::string& line) {
        auto [mark, label] = drawn_provider(line);
        run.timeline->add(ms(at), "bank", line, mark, std::move(label));
      });
    }
    std::shared_ptr<Store> used = store;
    if (!lease_checked) used = std::make_shared<TokenOnlyMarks>(store);
    idem = std::make_unique<Coordinator>(std::move(used), std::move(options));
  }

  long long ms(TimePoint t) const { return (t - start).count(); }

  void note(const std::string& who, const std::string& what, Mark mark, std::string label) {
    if (run.timeline != nullptr)
      run.timeline->add(ms(clock->now()), who, what, mark, std::move(label));
  }

  void drive() {
    if (sim) {
      sim::run(io, *sim);
    } else {
      io.run();
    }
  }
};

Request charge_request(long long amount) {
  Request r;
  r.tenant = "alpha";
  r.operation = "payment.charge";
  r.key = "7f3c1e8a-4b2d-4e91-a5f6-9c0d3b7e2a41";
  r.fingerprint = Fingerprint::of(nlohmann::json{{"amount", amount}, {"order_id", "A-10023"}});
  return r;
}

struct Answer {
  std::string text;  // charge id, or the name of the error
  int status = 0;    // as HTTP would say it
};

// A charge's outcome as a client of the table reports it: the charge id ("replayed ch_1" for a
// replay) and the HTTP status.
Answer answer_of(const Outcome& o) {
  std::string id = nlohmann::json::parse(o.response.body).at("charge_id").get<std::string>();
  return Answer{o.replayed() ? "replayed " + id : id, to_http(o).status};
}

// A client sending a charge of `amount` at `at` after the start, always with the same key.
// The action charges the provider.
net::awaitable<void> client(Scenario& s, std::string label, long long amount,
                            std::chrono::milliseconds at, Answer& out) {
  co_await async_sleep_until(*s.clock, s.start + at);
  s.note(label, "sends the request", Mark::send, "sends");
  // Named locals, not temporaries, in a co_await expression: g++ 12 can destroy such
  // temporaries twice.
  Request request = charge_request(amount);
  AsyncAction action = [&s, amount]() -> net::awaitable<Response> {
    const sim::ChargeResult r = co_await sim::async_charge(*s.provider, "A-10023", amount, "");
    co_return Response{200, nlohmann::json{{"charge_id", r.charge_id}}.dump(), {}};
  };
  try {
    const Outcome o = co_await async_call(*s.idem, std::move(request), std::move(action));
    out = answer_of(o);
  } catch (const InProgressError& e) {
    out = {"IdempotencyInProgressError", to_http(e).status};
  } catch (const KeyReuseError& e) {
    out = {"IdempotencyKeyReuseError", to_http(e).status};
  } catch (const StoreError& e) {
    out = {"StoreUnavailable", to_http(e).status};
  } catch (const sim::ProviderTimeout& e) {
    out = {"provider timed out", 504};
  }
  s.note(label, "<- " + out.text, Mark::answer, answer_label(out.text));
}

// A client sending the charge as a one-step operation (the debit is an external step, called
// with its derived key) at `at`; its owner freezes for `pause` before the step.
net::awaitable<void> stepped_client(Scenario& s, std::string label, std::chrono::milliseconds at,
                                    std::chrono::milliseconds pause, Answer& out) {
  co_await async_sleep_until(*s.clock, s.start + at);
  s.note(label, "sends the request", Mark::send, "sends");
  Request request = charge_request(4990);
  AsyncStepsAction action = [&s, label, pause](Attempt& a) -> net::awaitable<Response> {
    if (pause > 0ms) {
      s.note(label,
             fmt::format("the owner freezes for {} ms before calling the bank (no heartbeat runs)",
                         pause.count()),
             Mark::pause, fmt::format("freezes {} s", pause.count() / 1000));
      const TimePoint wake = s.clock->now() + pause;
      co_await async_sleep_until(*s.clock, wake);
      s.note(label, "the owner wakes and goes on to the debit", Mark::note, "wakes");
    }
    const AsyncExternalCall call = [&s](const std::string& key) -> net::awaitable<std::string> {
      const sim::ChargeResult r = co_await sim::async_charge(*s.provider, "A-10023", 4990, key);
      co_return r.charge_id;
    };
    const AsyncLookup lookup =
        [&s](const std::string& key) -> net::awaitable<std::optional<std::string>> {
      std::optional<sim::Charge> c = s.provider->find(key);
      co_return c ? std::optional<std::string>(c->id) : std::nullopt;
    };
    const std::string charge = co_await async_external(a, "debited", call, lookup);
    co_return Response{200, nlohmann::json{{"charge_id", charge}}.dump(), {}};
  };
  try {
    const Outcome o = co_await async_call_steps(*s.idem, std::move(request), std::move(action));
    out = answer_of(o);
  } catch (const LeaseLostError& e) {
    out = {"lease lost", to_http(e).status};
  } catch (const OutcomeUnknownError& e) {
    out = {"outcome unknown", to_http(e).status};
  } catch (const InProgressError& e) {
    out = {"IdempotencyInProgressError", to_http(e).status};
  }
  s.note(label, "<- " + out.text, Mark::answer, answer_label(out.text));
}

// Clients one after another, each sending when the previous one has its answer. (A named
// coroutine, not a capturing lambda: the lambda object would die before its frame.)
net::awaitable<void> in_sequence(Scenario& s, std::vector<std::pair<long long, Answer*>> calls) {
  int n = 0;
  for (auto& [amount, answer] : calls) {
    std::string label = fmt::format("req{}", ++n);
    co_await client(s, std::move(label), amount, std::chrono::milliseconds(0), *answer);
  }
}

void spawn(Scenario& s, net::awaitable<void> task) {
  net::co_spawn(s.io, std::move(task), [](std::exception_ptr e) {
    if (e) std::rethrow_exception(e);
  });
}

std::string strip_replayed(const std::string& text) {
  return text.starts_with("replayed ") ? text.substr(9) : text;
}

std::string py_list(const std::vector<std::string>& items) {
  std::vector<std::string> quoted;
  for (const auto& i : items) quoted.push_back(fmt::format("'{}'", i));
  return fmt::format("[{}]", fmt::join(quoted, ", "));
}

}  // namespace

void Timeline::add(long long at_ms, std::string who, std::string what, Mark mark,
                   std::string label) {
  if (label.empty()) label = what;
  events_.push_back({at_ms, std::move(who), std::move(what), mark, std::move(label)});
}

std::vector<std::string> Timeline::lines() const {
  std::vector<Event> sorted = events_;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const Event& a, const Event& b) { return a.at_ms < b.at_ms; });
  std::vector<std::string> out;
  for (const Event& e : sorted)
    out.push_back(fmt::format("    t={:>4} ms  {:<6} {}", e.at_ms, e.who, e.what));
  return out;
}

sim::TimelinePanel Timeline::panel(std::string title, std::string caption) const {
  sim::TimelinePanel p;
  p.title = std::move(title);
  p.caption = std::move(caption);
  for (const Event& e : events_) {
    if (std::find(p.lanes.begin(), p.lanes.end(), e.who) == p.lanes.end()) p.lanes.push_back(e.who);
    p.events.push_back(sim::TimelineEvent{e.at_ms, e.who, e.mark, e.label, e.what});
  }
  auto rank = [](const std::string& lane) {
    return lane == "idem" ? 1 : lane == "bank" ? 2 : lane == "mail" ? 3 : 0;
  };
  std::stable_sort(p.lanes.begin(), p.lanes.end(),
                   [&](const std::string& a, const std::string& b) { return rank(a) < rank(b); });
  return p;
}

InFlightRow in_flight_row(InFlight policy, const RunOptions& run) {
  Scenario s(run, Options{.in_flight = policy});
  std::vector<Answer> answers(2);
  spawn(s, client(s, "req1", 4990, 0ms, answers[0]));
  spawn(s, client(s, "req2", 4990, 50ms, answers[1]));
  s.drive();
  InFlightRow row;
  for (const Answer& a : answers) row.responses.push_back(strip_replayed(a.text));
  row.charges = s.provider->charge_ids();
  return row;
}

KeyReuse key_reuse(const RunOptions& run) {
  Scenario s(run, Options{});
  Answer first, same, other;
  spawn(s, in_sequence(s, {{4990, &first}, {4990, &same}, {5, &other}}));
  KeyReuse out;
  s.drive();
  out.same_amount = same.text;
  out.other_amount = other.text;
  out.charges_after_same = out.charges_after_other = s.provider->charge_count();
  return out;
}

FailureNotCached failure_not_cached(const RunOptions& run) {
  Scenario s(run, Options{});
  s.provider->inject(sim::Fault::timeout);
  Answer first, second;
  spawn(s, in_sequence(s, {{4990, &first}, {4990, &second}}));
  s.drive();
  return FailureNotCached{first.text, second.text, s.provider->charge_count()};
}

StoreUnreachable store_unreachable(FailureMode mode, const RunOptions& run) {
  Scenario s(run, Options{.on_store_failure = mode});
  s.store->set_unreachable(true);
  Answer answer;
  spawn(s, client(s, "req1", 4990, 0ms, answer));
  s.drive();
  return StoreUnreachable{answer.text, s.provider->charge_count()};
}

HttpView http_view(InFlight policy, const RunOptions& run) {
  Scenario s(run, Options{.in_flight = policy});
  std::vector<Answer> answers(20);
  for (std::size_t i = 0; i < answers.size(); ++i) {
    spawn(s, client(s, fmt::format("req{}", i + 1), 4990, 0ms, answers[i]));
  }
  s.drive();
  HttpView view;
  for (const Answer& a : answers) {
    view.statuses.push_back(a.status);
    if (a.status == 200) {
      const std::string id = strip_replayed(a.text);
      if (std::find(view.charge_ids.begin(), view.charge_ids.end(), id) == view.charge_ids.end()) {
        view.charge_ids.push_back(id);
      }
    }
  }
  std::sort(view.statuses.begin(), view.statuses.end());
  view.charges = s.provider->charge_count();
  return view;
}

PausedOwner paused_owner(bool lease_checked, const RunOptions& run) {
  Scenario s(run, Options{.lease = 2s, .heartbeat = 0ms}, lease_checked);
  std::vector<Answer> answers(2);
  spawn(s, stepped_client(s, "req1", 0ms, 3s, answers[0]));
  spawn(s, stepped_client(s, "req2", 3100ms, 0ms, answers[1]));
  s.drive();
  PausedOwner out;
  for (const Answer& a : answers) out.responses.push_back(strip_replayed(a.text));
  out.charges = s.provider->charge_ids();
  return out;
}

namespace {

// A directory for one scenario's database file (local steps share the keys' file), removed
// with everything in it.
struct ScratchDir {
  ScratchDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "idem-demo-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::filesystem::path path;
};

struct Died {};  // the first attempt's process dies here

CheckoutCrash one_checkout_crash(const std::string& point, bool retried, Timeline* timeline) {
  ScratchDir dir;
  const std::string db = (dir.path / "shop.db").string();
  auto clock = std::make_shared<sim::SimulatedClock>();
  const TimePoint start = clock->now();
  auto at_ms = [start](TimePoint t) { return (t - start).count(); };
  auto store = std::make_shared<sim::FaultyStore>(std::make_shared<SqliteStore>(db));
  // Instant charges (the blocking flow on a simulated clock); no provider deduplication: a
  // blind second call would show as a second debit.
  sim::Provider provider(clock, {.latency = 0ms, .dedup = false});
  sim::MailSender mail(clock);
  Options options;
  options.clock = clock;
  options.lease = 10s;
  options.heartbeat = 0ms;
  if (timeline != nullptr) {
    options.log = [&](const LogEvent& e) {
      auto [mark, label] = drawn(e);
      timeline->add(at_ms(e.at), "idem",
                    fmt::format("{}{}{}", e.event, e.message.empty() ? "" : ": ", e.message), mark,
                    std::move(label));
    };
    provider.on_event([&](TimePoint t, const std::string& line) {
      auto [mark, label] = drawn_provider(line);
      timeline->add(at_ms(t), "bank", line, mark, std::move(label));
    });
  }
  Coordinator idem(store, options);
  create_orders_table(db);
  Dispatcher dispatcher(idem, [&](const OutboxMessage& m) {
    mail_delivery(mail)(m);
    if (timeline != nullptr)
      timeline->add(at_ms(clock->now()), "mail", "receipt delivered " + m.id, Mark::note,
                    "receipt delivered");
  });
  const CheckoutRequest order{"alpha", "A-10023", 4990, "RUB", "buyer@example.com"};
  Request request;
  request.tenant = "alpha";
  request.operation = "checkout";
  request.key = "order-A-10023";
  request.fingerprint = Fingerprint::of(nlohmann::json{{"order_id", "A-10023"}, {"amount", 4990}});
  request.in_flight = InFlight::raise;
  request.payload = to_payload(order);
  auto flow = [&](const CrashHook& crash) {
    return [&provider, crash](Attempt& a) {
      return checkout(a, provider, checkout_from_payload(a.request()), crash);
    };
  };
  std::string resumed_from = "-";
  auto noting = [&](Attempt& a) {
    if (a.recovery_point()) resumed_from = *a.recovery_point();
    return flow({})(a);
  };

  CheckoutCrash row;
  row.point = point;
  row.retried = retried;
  store->fail(sim::Operation::release);  // a dead process releases nothing
  try {
    idem.call_steps(request, flow([&](std::string_view at) {
                      if (at == point) {
                        if (timeline != nullptr)
                          timeline->add(at_ms(clock->now()), "shop", "the process dies " + point,
                                        Mark::crash, "dies " + point);
                        throw Died{};
                      }
                    }));
  } catch (const Died&) {
  }
  store->fail(sim::Operation::release, false);
  dispatcher.run_once();
  row.debits = provider.charge_count();
  row.orders = count_orders(db);
  row.mails = mail.count();
  clock->advance(retried ? 11s : 45s);
  if (retried) {
    if (timeline != nullptr)
      timeline->add(at_ms(clock->now()), "client", "retries with the same key", Mark::send,
                    "retries, same key");
    idem.call_steps(request, noting);
  } else {
    Completer completer(idem, CompleterOptions{.abandoned_after = 30s});
    completer.on("checkout", noting);
    if (timeline != nullptr)
      timeline->add(at_ms(clock->now()), "completer", "looks for abandoned operations", Mark::send,
                    "looks for abandoned ops");
    completer.run_once();
  }
  dispatcher.run_once();
  row.end_debits = provider.charge_count();
  row.end_orders = count_orders(db);
  row.end_mails = mail.count();
  row.resumed_from = resumed_from;
  return row;
}

}  // namespace

CheckoutCrash checkout_crash(const std::string& point, bool retried, const RunOptions& run) {
  return one_checkout_crash(point, retried, run.timeline);
}

std::vector<CheckoutCrash> checkout_crashes() {
  std::vector<CheckoutCrash> rows;
  for (const auto& [point, retried] : kCheckoutRows) rows.push_back(checkout_crash(point, retried));
  return rows;
}

std::string render_table(bool real_time, bool with_timeline) {
  std::string out;
  auto put = [&out](const std::string& line) { out += line + '\n'; };
  auto timeline_of = [&](Timeline& t) {
    if (!with_timeline) return;
    for (const std::string& line : t.lines()) put(line);
  };

  put("in-flight duplicate: request at t=0, identical retry at t=50 ms, provider latency 300 ms");
  const struct {
    InFlight policy;
    const char* label;
  } rows[] = {{InFlight::run, "(a result cache)"},
              {InFlight::wait, "(the default)"},
              {InFlight::raise, "(409 for the second)"}};
  for (const auto& r : rows) {
    Timeline t;
    const InFlightRow row = in_flight_row(r.policy, {real_time, &t});
    put(fmt::format("in_flight={:<8} {:<24} responses={:<36} charges made={}",
                    fmt::format("'{}'", to_string(r.policy)), r.label, py_list(row.responses),
                    py_list(row.charges)));
    timeline_of(t);
  }

  put("");
  put("key reuse: the same key with the same amount, then with amount 5");
  {
    Timeline t;
    const KeyReuse k = key_reuse({real_time, &t});
    put(fmt::format("{:<25} -> {}, charges made={}", "same key, same amount", k.same_amount,
                    k.charges_after_same));
    put(fmt::format("{:<25} -> {}, charges made={}", "same key, amount 5", k.other_amount,
                    k.charges_after_other));
    timeline_of(t);
  }

  put("");
  put("failures are not cached: the provider times out, the client retries");
  {
    Timeline t;
    const FailureNotCached f = failure_not_cached({real_time, &t});
    put(fmt::format("{:<11} -> {}", "first call", f.first));
    put(fmt::format("{:<11} -> {}, charges made={}", "second call", f.second, f.charges));
    timeline_of(t);
  }

  put("");
  put("the idempotency store is unreachable");
  {
    Timeline t;
    const StoreUnreachable open = store_unreachable(FailureMode::fail_open, {real_time, &t});
    put(
        fmt::format("fail_open:   store unreachable -> the action ran anyway: {}, charges made={}  "
                    "(availability over exactly-once, by design)",
                    open.outcome, open.charges));
    timeline_of(t);
    Timeline t2;
    const StoreUnreachable closed = store_unreachable(FailureMode::fail_closed, {real_time, &t2});
    put(fmt::format(
        "fail_closed: store unreachable -> {}, the action did not run: charges made={}  "
        "(exactly-once over availability)",
        closed.outcome, closed.charges));
    timeline_of(t2);
  }

  put("");
  put("HTTP view: 20 identical requests with one Idempotency-Key, all at once");
  for (InFlight policy : {InFlight::raise, InFlight::wait}) {
    Timeline t;
    const HttpView v = http_view(policy, {real_time, &t});
    const auto n200 = std::count(v.statuses.begin(), v.statuses.end(), 200);
    const auto n409 = std::count(v.statuses.begin(), v.statuses.end(), 409);
    put(fmt::format("in_flight={:<8} -> {}, charges made={}",
                    fmt::format("'{}'", to_string(policy)),
                    n409 > 0 ? fmt::format("{} x 200, {} x 409", n200, n409)
                             : fmt::format("{} x 200, all {}", n200, fmt::join(v.charge_ids, ", ")),
                    v.charges));
    put(fmt::format("    sorted statuses: {}", v.statuses));
    timeline_of(t);
  }

  put("");
  put("the owner freezes past its lease (2 s) for 3 s just before calling the bank; the retry "
      "comes at t=3100 ms");
  for (bool checked : {true, false}) {
    Timeline t;
    const PausedOwner p = paused_owner(checked, {false, &t});  // seconds of pause: simulated
    put(fmt::format(
        "{:<36} -> responses={:<28} charges made={}",
        checked ? "lease checked before the call" : "token only (the check switched off)",
        py_list(p.responses), py_list(p.charges)));
    timeline_of(t);
  }

  put("");
  put("seed 000: one key covers debit -> order -> mail; the process dies after a step");
  {
    for (const auto& [point, retried] : kCheckoutRows) {
      Timeline t;
      const CheckoutCrash c = checkout_crash(point, retried, {false, &t});
      put(
          fmt::format("dies {:<19} -> debits={} orders={} mails={}; {:<19} -> debits={} "
                      "orders={} mails={} (resumed after '{}')",
                      c.point, c.debits, c.orders, c.mails,
                      c.retried ? "the client retries" : "no retry, completer", c.end_debits,
                      c.end_orders, c.end_mails, c.resumed_from));
      timeline_of(t);
    }
  }
  return out;
}

std::vector<Figure> table_figures() {
  std::vector<Figure> figures;
  auto figure = [&figures](std::string file, std::string_view title,
                           const std::vector<sim::TimelinePanel>& panels) {
    figures.push_back(Figure{std::move(file), sim::timeline_svg(title, panels)});
  };
  {
    std::vector<sim::TimelinePanel> panels;
    const std::pair<InFlight, const char*> rows[] = {{InFlight::run, "a result cache"},
                                                     {InFlight::wait, "the default"},
                                                     {InFlight::raise, "409 for the second"}};
    for (const auto& [policy, label] : rows) {
      Timeline t;
      const InFlightRow row = in_flight_row(policy, {false, &t});
      panels.push_back(
          t.panel(fmt::format("in_flight='{}' ({})", to_string(policy), label),
                  fmt::format("answers: {}; charges: {}", fmt::join(answers(row.responses), ", "),
                              fmt::join(row.charges, ", "))));
    }
    figure("in-flight.svg",
           "In-flight duplicate: req1 at t=0, the same request again at t=50 ms, provider "
           "latency 300 ms",
           panels);
  }
  {
    Timeline t;
    const KeyReuse k = key_reuse({false, &t});
    figure("key-reuse.svg", "Key reuse: the same key with the same amount, then with amount 5",
           {t.panel("same key: replay, then 422",
                    fmt::format("{}; then {}", k.same_amount, k.other_amount))});
  }
  {
    Timeline t;
    const FailureNotCached f = failure_not_cached({false, &t});
    figure("failure-not-cached.svg",
           "Failures are not cached: the provider times out, the client retries",
           {t.panel("released on failure, charged on retry",
                    fmt::format("first: {}; second: {}", f.first, f.second))});
  }
  {
    std::vector<sim::TimelinePanel> panels;
    for (FailureMode mode : {FailureMode::fail_open, FailureMode::fail_closed}) {
      Timeline t;
      const StoreUnreachable u = store_unreachable(mode, {false, &t});
      panels.push_back(t.panel(mode == FailureMode::fail_open ? "fail_open" : "fail_closed",
                               fmt::format("outcome: {}", u.outcome)));
    }
    figure("store-unreachable.svg", "The idempotency store is unreachable", panels);
  }
  for (InFlight policy : {InFlight::raise, InFlight::wait}) {
    Timeline t;
    const HttpView v = http_view(policy, {false, &t});
    const auto n200 = std::count(v.statuses.begin(), v.statuses.end(), 200);
    figure(fmt::format("http-view-{}.svg", to_string(policy)),
           "HTTP view: 20 identical requests with one Idempotency-Key, all at once",
           {t.panel(fmt::format("in_flight='{}'", to_string(policy)),
                    fmt::format("{} x 200, {} other", n200,
                                static_cast<long>(v.statuses.size()) - n200))});
  }
  {
    std::vector<sim::TimelinePanel> panels;
    for (bool checked : {true, false}) {
      Timeline t;
      const PausedOwner p = paused_owner(checked, {false, &t});
      panels.push_back(
          t.panel(checked ? "lease checked before the call" : "token only (the check switched off)",
                  fmt::format("answers: {}; charges: {}", fmt::join(answers(p.responses), ", "),
                              fmt::join(p.charges, ", "))));
    }
    figure("paused-owner.svg",
           "The owner freezes past its 2 s lease just before calling the bank; the retry comes "
           "at t=3100 ms",
           panels);
  }
  for (const auto& [point, retried] : kCheckoutRows) {
    Timeline t;
    const CheckoutCrash c = checkout_crash(point, retried, {false, &t});
    std::string name = c.point.substr(c.point.find(' ') + 1);
    std::replace(name.begin(), name.end(), '_', '-');
    figure(fmt::format("checkout-dies-after-{}{}.svg", name, retried ? "" : "-completer"),
           fmt::format("Seed 000's checkout (debit, order, mail) dies {}; {}", c.point,
                       retried ? "the client retries" : "no retry: the completer finishes it"),
           {t.panel(fmt::format("dies {}", c.point),
                    fmt::format("end: debits={} orders={} mails={} (resumed after '{}')",
                                c.end_debits, c.end_orders, c.end_mails, c.resumed_from))});
  }
  return figures;
}

std::vector<std::filesystem::path> write_table_figures(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  std::vector<std::filesystem::path> written;
  for (const Figure& f : table_figures()) {
    const std::filesystem::path path = dir / f.file;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << f.svg;
    out.close();
    if (!out) throw std::runtime_error("cannot write " + path.string());
    written.push_back(path);
  }
  return written;
}

}  // namespace idem::demo
