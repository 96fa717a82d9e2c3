// The gRPC guard (idem/grpc.hpp) on real loopback gRPC: a server on 127.0.0.1 and a free port,
// the generated stub of tests/proto/idem_test.proto, a provider that does NOT deduplicate (so
// a second run of a method shows as a second charge), and every rule counted in the method's
// runs and the provider's charges.
#include "idem/grpc.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "idem_test.grpc.pb.h"
#include "idem_test.pb.h"
#include "test_support.hpp"

using namespace std::chrono_literals;

namespace {

using idemtest::ChargeReply;
using idemtest::ChargeRequest;
using idemtest::Payments;

constexpr const char* kMethod = "/idemtest.Payments/Charge";

// What a test's method does on a run, before it is counted: charges, by default.
using Method =
    std::function<grpc::Status(const ChargeRequest&, ChargeReply&, idem::grpc::Context&)>;

struct Counted {
  std::atomic<int> runs{0};
  Method method;
  grpc::Status run(const ChargeRequest& request, ChargeReply& reply, idem::grpc::Context& c) {
    ++runs;
    return method(request, reply, c);
  }
};

class SyncPayments final : public Payments::Service {
 public:
  SyncPayments(idem::grpc::Guard& guard, Counted& counted) : guard_(guard), counted_(counted) {}
  grpc::Status Charge(grpc::ServerContext* context, const ChargeRequest* request,
                      ChargeReply* reply) override {
    return guard_.unary(*context, kMethod, *request, *reply,
                        [&](idem::grpc::Context& c) { return counted_.run(*request, *reply, c); });
  }

 private:
  idem::grpc::Guard& guard_;
  Counted& counted_;
};

class CallbackPayments final : public Payments::CallbackService {
 public:
  CallbackPayments(idem::grpc::Guard& guard, Counted& counted) : guard_(guard), counted_(counted) {}
  grpc::ServerUnaryReactor* Charge(grpc::CallbackServerContext* context,
                                   const ChargeRequest* request, ChargeReply* reply) override {
    return guard_.unary(*context, kMethod, *request, *reply, [this, request, reply](auto& c) {
      return counted_.run(*request, *reply, c);
    });
  }

 private:
  idem::grpc::Guard& guard_;
  Counted& counted_;
};

// A world (store, clock, provider, coordinator), a guard, and a gRPC server on loopback
// running Service over it.
template <class Service = SyncPayments>
struct Served {
  explicit Served(idem::grpc::GuardOptions options = {}, idem::Options coordinator = {})
      : world(std::move(coordinator), idem::sim::ProviderOptions{.latency = 0ms, .dedup = false}),
        guard(*world.idem, std::move(options)),
        service(guard, counted) {
    counted.method = [this](const ChargeRequest& request, ChargeReply& reply,
                            idem::grpc::Context&) {
      const idem::sim::ChargeResult r =
          world.provider->charge(request.order_id(), request.amount(), "");
      reply.set_charge_id(r.charge_id);
      return grpc::Status::OK;
    };
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    REQUIRE(server != nullptr);
    REQUIRE(port > 0);
    stub = Payments::NewStub(
        grpc::CreateChannel(fmt::format("127.0.0.1:{}", port), grpc::InsecureChannelCredentials()));
  }
  ~Served() { server->Shutdown(std::chrono::system_clock::now() + 5s); }

  idem::test::World world;
  Counted counted;
  idem::grpc::Guard guard;
  Service service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<Payments::Stub> stub;
};

struct Answer {
  grpc::Status status;
  ChargeReply reply;
  std::multimap<std::string, std::string> trailers;
  std::string trailer(const std::string& name) const {
    const auto it = trailers.find(name);
    return it == trailers.end() ? std::string() : it->second;
  }
};

ChargeRequest order(std::string id = "A-10023", long long amount = 4990) {
  ChargeRequest r;
  r.set_amount(amount);
  r.set_currency("RUB");
  r.set_order_id(std::move(id));
  return r;
}

// One call, with `keys` as idempotency-key metadata (none, one, or several), every wait
// bounded by a 30 s deadline.
Answer call(Payments::Stub& stub, const ChargeRequest& request,
            const std::vector<std::string>& keys) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 30s);
  for (const std::string& k : keys) context.AddMetadata("idempotency-key", k);
  Answer a;
  a.status = stub.Charge(&context, request, &a.reply);
  for (const auto& [name, value] : context.GetServerTrailingMetadata())
    a.trailers.emplace(std::string(name.data(), name.size()),
                       std::string(value.data(), value.size()));
  return a;
}

Answer call(Payments::Stub& stub, const ChargeRequest& request, const std::string& key) {
  return call(stub, request, std::vector<std::string>{key});
}

TEST_CASE("grpc: a retried call with the same key charges once, and the retry is a replay") {
  Served<> s;
  const Answer first = call(*s.stub, order(), "k1");
  REQUIRE(first.status.ok());
  CHECK(first.reply.charge_id() == "ch_1");
  CHECK(first.trailer("idempotent-replayed").empty());
  CHECK(!first.trailer("idempotency-expires").empty());
  for (int retry = 0; retry < 3; ++retry) {
    const Answer again = call(*s.stub, order(), "k1");
    REQUIRE(again.status.ok());
    CHECK(again.reply.charge_id() == "ch_1");
    CHECK(again.trailer("idempotent-replayed") == "true");
    CHECK(again.trailer("idempotency-expires") == first.trailer("idempotency-expires"));
  }
  CHECK(s.counted.runs == 1);
  CHECK(s.world.charges() == 1);
  // Another key is another operation.
  CHECK(call(*s.stub, order(), "k2").reply.charge_id() == "ch_2");
  CHECK(s.world.charges() == 2);
}

TEST_CASE(
    "grpc: a call without a key, with two keys or a malformed one is refused and nothing runs") {
  Served<> s;
  const Answer none = call(*s.stub, order(), std::vector<std::string>{});
  CHECK(none.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(none.trailer("idempotency-error") == "idempotency_key_required");
  const Answer two = call(*s.stub, order(), std::vector<std::string>{"k1", "k2"});
  CHECK(two.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(two.trailer("idempotency-error") == "idempotency_key_invalid");
  const Answer longer = call(*s.stub, order(), std::string(300, 'k'));
  CHECK(longer.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(longer.trailer("idempotency-error") == "idempotency_key_invalid");
  CHECK(s.counted.runs == 0);
  CHECK(s.world.charges() == 0);
  CHECK(s.world.rows() == 0);
}

TEST_CASE("grpc: without key_required a call without a key runs unguarded") {
  Served<> s(idem::grpc::GuardOptions{.key_required = false});
  CHECK(call(*s.stub, order(), std::vector<std::string>{}).status.ok());
  CHECK(call(*s.stub, order(), std::vector<std::string>{}).status.ok());
  CHECK(s.world.charges() == 2);  // no key, no guarantee: the caller chose so
  CHECK(s.world.rows() == 0);
}

TEST_CASE("grpc: the same key with another request is FAILED_PRECONDITION and charges nothing") {
  Served<> s;
  REQUIRE(call(*s.stub, order("A-1", 4990), "k1").status.ok());
  const Answer other = call(*s.stub, order("A-1", 9990), "k1");
  CHECK(other.status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(other.trailer("idempotency-error") == "idempotency_key_reused");
  CHECK(s.counted.runs == 1);
  CHECK(s.world.charges() == 1);
}

TEST_CASE("grpc: a status that is not an outcome releases the key, a business error is replayed") {
  Served<> s;
  const Method charge = s.counted.method;
  SUBCASE("UNAVAILABLE: not kept, the retry runs again") {
    s.counted.method = [](const ChargeRequest&, ChargeReply&, idem::grpc::Context&) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the bank is down");
    };
    const Answer down = call(*s.stub, order(), "k1");
    CHECK(down.status.error_code() == grpc::StatusCode::UNAVAILABLE);
    CHECK(down.status.error_message() == "the bank is down");
    CHECK(down.trailer("idempotency-error").empty());  // the method's answer, not idem's
    s.counted.method = charge;
    const Answer retry = call(*s.stub, order(), "k1");
    CHECK(retry.status.ok());
    CHECK(retry.trailer("idempotent-replayed").empty());
    CHECK(s.counted.runs == 2);
    CHECK(s.world.charges() == 1);
  }
  SUBCASE("FAILED_PRECONDITION with details: kept and replayed as it was") {
    s.counted.method = [](const ChargeRequest&, ChargeReply&, idem::grpc::Context&) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "insufficient funds",
                          std::string("\x08\x09\x00\x01", 4));
    };
    const Answer declined = call(*s.stub, order(), "k1");
    s.counted.method = charge;
    const Answer again = call(*s.stub, order(), "k1");
    CHECK(again.status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(again.status.error_message() == "insufficient funds");
    CHECK(again.status.error_details() == declined.status.error_details());
    CHECK(again.trailer("idempotent-replayed") == "true");
    CHECK(s.counted.runs == 1);
    CHECK(s.world.charges() == 0);
  }
  SUBCASE("a method that throws: UNKNOWN, the key released") {
    s.counted.method = [](const ChargeRequest&, ChargeReply&,
                          idem::grpc::Context&) -> grpc::Status {
      throw std::runtime_error("order service unreachable");
    };
    const Answer threw = call(*s.stub, order(), "k1");
    CHECK(threw.status.error_code() == grpc::StatusCode::UNKNOWN);
    CHECK(threw.status.error_message() == "order service unreachable");
    s.counted.method = charge;
    CHECK(call(*s.stub, order(), "k1").status.ok());
    CHECK(s.counted.runs == 2);
    CHECK(s.world.charges() == 1);
  }
}

TEST_CASE(
    "grpc: trailers named in stored_trailers are replayed, others go only to the first answer") {
  Served<> s(idem::grpc::GuardOptions{.stored_trailers = {"payment-charge-id"}});
  const Method charge = s.counted.method;
  s.counted.method = [&](const ChargeRequest& r, ChargeReply& reply, idem::grpc::Context& c) {
    const grpc::Status status = charge(r, reply, c);
    c.trailers.push_back({"payment-charge-id", reply.charge_id()});
    c.trailers.push_back({"x-served-by", "node-1"});
    return status;
  };
  const Answer first = call(*s.stub, order(), "k1");
  CHECK(first.trailer("payment-charge-id") == "ch_1");
  CHECK(first.trailer("x-served-by") == "node-1");
  const Answer again = call(*s.stub, order(), "k1");
  CHECK(again.trailer("payment-charge-id") == "ch_1");
  CHECK(again.trailer("x-served-by").empty());
  CHECK(s.world.charges() == 1);
}

TEST_CASE("grpc: a guard refuses to store credentials and refuses InFlight::run") {
  idem::test::World w;
  CHECK_THROWS_AS(idem::grpc::Guard(*w.idem, {.stored_trailers = {"authorization"}}), idem::error);
  CHECK_THROWS_AS(idem::grpc::Guard(*w.idem, {.stored_trailers = {"grpc-status"}}), idem::error);
  CHECK_THROWS_AS(idem::grpc::Guard(*w.idem, {.in_flight = idem::InFlight::run}), idem::error);
  CHECK_THROWS_AS(idem::grpc::Guard(*w.idem, {.key_metadata = ""}), idem::error);
}

TEST_CASE("grpc: the key may come from the request (AIP-155's request_id)") {
  Served<> s(idem::grpc::GuardOptions{
      .key_field = [](const google::protobuf::Message& m) -> std::optional<std::string> {
        return dynamic_cast<const ChargeRequest&>(m).request_id();
      }});
  ChargeRequest r = order();
  r.set_request_id("req-1");
  REQUIRE(call(*s.stub, r, std::vector<std::string>{}).status.ok());
  const Answer again = call(*s.stub, r, std::vector<std::string>{});
  CHECK(again.trailer("idempotent-replayed") == "true");
  CHECK(s.world.charges() == 1);
}

TEST_CASE("grpc: reordering a message's fields in its .proto keeps the request's fingerprint") {
  ChargeRequest a = order("A-7", 1250);
  a.set_request_id("req-7");
  idemtest::ChargeRequestReordered b;
  b.set_request_id("req-7");
  b.set_order_id("A-7");
  b.set_amount(1250);
  b.set_currency("RUB");
  CHECK(idem::grpc::fingerprint_of(a) == idem::grpc::fingerprint_of(b));
  b.set_amount(1251);
  CHECK(idem::grpc::fingerprint_of(a) != idem::grpc::fingerprint_of(b));
}

idem::Options failing_store(idem::FailureMode mode) {
  idem::Options o;
  o.on_store_failure = mode;
  return o;
}

TEST_CASE(
    "grpc: fail closed, a failing store answers UNAVAILABLE store_unavailable and nothing runs") {
  Served<> s({}, failing_store(idem::FailureMode::fail_closed));
  s.world.faulty->fail(idem::sim::Operation::reserve);
  s.world.faulty->fail(idem::sim::Operation::load);
  const Answer a = call(*s.stub, order(), "k1");
  CHECK(a.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(a.trailer("idempotency-error") == "store_unavailable");
  CHECK(s.counted.runs == 0);
  CHECK(s.world.charges() == 0);
}

TEST_CASE("grpc: fail open, a failing store lets the method run unguarded, with no expiry") {
  Served<> s({}, failing_store(idem::FailureMode::fail_open));
  s.world.faulty->fail(idem::sim::Operation::reserve);
  s.world.faulty->fail(idem::sim::Operation::load);
  const Answer a = call(*s.stub, order(), "k1");
  CHECK(a.status.ok());
  CHECK(a.trailer("idempotency-expires").empty());  // nothing was stored
  CHECK(s.counted.runs == 1);
  CHECK(s.world.charges() == 1);
}

// 20 identical calls at once: the method's body holds the key until `ready` says the others
// have met it, so the calls overlap for certain.
template <class Service>
void twenty_at_once(Served<Service>& s, const std::function<bool()>& ready) {
  const Method charge = s.counted.method;
  s.counted.method = [&](const ChargeRequest& r, ChargeReply& reply, idem::grpc::Context& c) {
    const auto give_up = std::chrono::steady_clock::now() + 20s;
    while (!ready() && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
    return charge(r, reply, c);
  };
  std::vector<Answer> answers(20);
  std::vector<std::thread> clients;
  for (std::size_t i = 0; i < answers.size(); ++i)
    clients.emplace_back([&, i] { answers[i] = call(*s.stub, order(), "same-key"); });
  for (std::thread& t : clients) t.join();
  int ok = 0, busy = 0;
  for (const Answer& a : answers) {
    if (a.status.ok()) {
      ++ok;
      CHECK(a.reply.charge_id() == "ch_1");
    } else {
      ++busy;
      CHECK(a.status.error_code() == grpc::StatusCode::ABORTED);
      CHECK(a.trailer("idempotency-error") == "idempotency_key_in_progress");
      CHECK(!a.trailer("retry-after-ms").empty());
    }
  }
  CHECK(ok + busy == 20);
  CHECK(s.counted.runs == 1);
  CHECK(s.world.charges() == 1);
}

TEST_CASE("grpc: 20 parallel identical calls under raise: one charge, the others ABORTED") {
  Served<> s(idem::grpc::GuardOptions{.in_flight = idem::InFlight::raise});
  twenty_at_once(s, [&] { return s.world.idem->metrics().in_progress_conflicts >= 19; });
  CHECK(s.world.idem->metrics().in_progress_conflicts == 19);
}

TEST_CASE("grpc: 20 parallel identical calls under wait: one charge, every call its reply") {
  Served<> s(idem::grpc::GuardOptions{.in_flight = idem::InFlight::wait});
  twenty_at_once(s, [&] { return s.world.idem->metrics().waited >= 19; });
  CHECK(s.world.idem->metrics().waited == 19);
  CHECK(s.world.idem->metrics().replayed == 19);
}

TEST_CASE("grpc: the callback API gets the same guarantee") {
  Served<CallbackPayments> s(idem::grpc::GuardOptions{.in_flight = idem::InFlight::raise});
  REQUIRE(call(*s.stub, order(), "k1").status.ok());
  const Answer again = call(*s.stub, order(), "k1");
  CHECK(again.trailer("idempotent-replayed") == "true");
  CHECK(again.reply.charge_id() == "ch_1");
  CHECK(call(*s.stub, order(), std::vector<std::string>{}).status.error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(s.counted.runs == 1);
  CHECK(s.world.charges() == 1);
}

// --- A call its client gives up on -------------------------------------------------------

// The method's body waits for `go` (bounded), so the client's cancel or deadline certainly
// comes while it runs.
void hold_until(Served<>& s, const std::atomic<bool>& go, std::atomic<bool>* started = nullptr) {
  const Method charge = s.counted.method;
  s.counted.method = [&go, started, charge](const ChargeRequest& r, ChargeReply& reply,
                                            idem::grpc::Context& c) {
    if (started) *started = true;
    REQUIRE(idem::test::eventually([&] { return go.load(); }));
    return charge(r, reply, c);
  };
}

TEST_CASE("grpc: a call its client cancels runs its method to the end, and the retry replays it") {
  Served<> s(idem::grpc::GuardOptions{.in_flight = idem::InFlight::wait});
  std::atomic<bool> started{false}, go{false};
  hold_until(s, go, &started);
  grpc::ClientContext context;
  context.AddMetadata("idempotency-key", "cancelled-1");
  ChargeReply reply;
  std::thread cancel([&] {
    REQUIRE(idem::test::eventually([&] { return started.load(); }));
    context.TryCancel();
  });
  const grpc::Status first = s.stub->Charge(&context, order(), &reply);
  cancel.join();
  CHECK(first.error_code() == grpc::StatusCode::CANCELLED);
  go = true;  // the method goes on after its client left
  // The retry waits for the first run (or finds it stored) and replays its charge.
  const Answer retry = call(*s.stub, order(), "cancelled-1");
  CHECK(retry.status.ok());
  CHECK(retry.trailer("idempotent-replayed") == "true");
  CHECK(retry.reply.charge_id() == "ch_1");
  CHECK(s.counted.runs == 1);
  CHECK(s.world.charges() == 1);
}

// --- The client side -----------------------------------------------------------------------

TEST_CASE("grpc: new_key gives distinct version-4 UUIDs") {
  const std::string a = idem::grpc::new_key(), b = idem::grpc::new_key();
  CHECK(a != b);
  REQUIRE(a.size() == 36);
  CHECK(a[8] == '-');
  CHECK(a[14] == '4');
  CHECK(std::string("89ab").find(a[19]) != std::string::npos);
}

TEST_CASE("grpc: call_with_key retries UNAVAILABLE with the same key and backs off") {
  Served<> s;
  const Method charge = s.counted.method;
  std::vector<std::string> keys;
  s.counted.method = [&](const ChargeRequest& r, ChargeReply& reply, idem::grpc::Context& c) {
    keys.push_back(c.id.key);
    if (s.counted.runs <= 2) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "provider down");
    return charge(r, reply, c);
  };
  std::vector<std::chrono::milliseconds> waits;
  const idem::grpc::RetryOptions retry{
      .initial_backoff = 100ms, .sleep = [&](std::chrono::milliseconds w) { waits.push_back(w); }};
  const std::string key = idem::grpc::new_key();
  ChargeReply reply;
  const auto attempt = [&](grpc::ClientContext& context) {
    context.set_deadline(std::chrono::system_clock::now() + 30s);
    return s.stub->Charge(&context, order(), &reply);
  };
  REQUIRE(idem::grpc::call_with_key(key, attempt, retry).ok());
  CHECK(reply.charge_id() == "ch_1");
  CHECK(keys == std::vector<std::string>{key, key, key});
  CHECK(s.counted.runs == 3);
  CHECK(s.world.charges() == 1);
  REQUIRE(waits.size() == 2);  // a jittered, growing backoff
  CHECK(waits[0] >= 50ms);
  CHECK(waits[0] <= 100ms);
  CHECK(waits[1] >= 100ms);
  CHECK(waits[1] <= 200ms);
  // The same key again is a replay: nothing runs.
  ChargeReply again;
  REQUIRE(
      idem::grpc::call_with_key(
          key,
          [&](grpc::ClientContext& context) { return s.stub->Charge(&context, order(), &again); },
          retry)
          .ok());
  CHECK(again.charge_id() == "ch_1");
  CHECK(s.counted.runs == 3);
  // A status that is not retryable is returned at once; max_attempts bounds the rest.
  s.counted.method = [](const ChargeRequest&, ChargeReply&, idem::grpc::Context&) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "down for good");
  };
  waits.clear();
  CHECK(idem::grpc::call_with_key("other-key", attempt, {.max_attempts = 3, .sleep = retry.sleep})
            .error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(waits.size() == 2);
  CHECK_THROWS_AS(idem::grpc::call_with_key("", attempt), idem::error);
  CHECK_THROWS_AS(idem::grpc::call_with_key("k", attempt, {.max_attempts = 0}), idem::error);
  CHECK_THROWS_AS(idem::grpc::call_with_key("k", attempt, {.max_wait = -1ms}), idem::error);
}

TEST_CASE(
    "grpc: call_with_key waits at least the server's retry-after-ms, and returns the answer of "
    "a server that asks for more than max_wait") {
  Served<> s;
  std::string asked;  // the method's retry-after-ms; it answers UNAVAILABLE while one is set
  const Method charge = s.counted.method;
  s.counted.method = [&](const ChargeRequest& r, ChargeReply& reply, idem::grpc::Context& c) {
    if (asked.empty()) return charge(r, reply, c);
    c.trailers.push_back({"retry-after-ms", std::exchange(asked, "")});
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "busy");
  };
  std::vector<std::chrono::milliseconds> waits;
  const idem::grpc::RetryOptions retry{
      .initial_backoff = 10ms, .max_wait = 5s, .sleep = [&](std::chrono::milliseconds w) {
        waits.push_back(w);
      }};
  ChargeReply reply;
  const auto attempt = [&](grpc::ClientContext& context) {
    context.set_deadline(std::chrono::system_clock::now() + 30s);
    return s.stub->Charge(&context, order(), &reply);
  };
  asked = "1500";
  REQUIRE(idem::grpc::call_with_key(idem::grpc::new_key(), attempt, retry).ok());
  CHECK(waits == std::vector<std::chrono::milliseconds>{1500ms});
  CHECK(s.world.charges() == 1);
  waits.clear();
  asked = "9000000000000000000";  // a server (or a proxy) asking for ever
  const grpc::Status st = idem::grpc::call_with_key(idem::grpc::new_key(), attempt, retry);
  CHECK(st.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(waits.empty());  // returned at once, not asleep
  CHECK(s.world.charges() == 1);
}

TEST_CASE(
    "grpc: call_with_key after a deadline that expired mid-method retries with the same key and "
    "gets the first run's answer") {
  Served<> s(idem::grpc::GuardOptions{.in_flight = idem::InFlight::wait});
  std::atomic<bool> go{false};
  hold_until(s, go);
  int attempts = 0;
  ChargeReply reply;
  const grpc::Status st = idem::grpc::call_with_key(
      "deadline-1",
      [&](grpc::ClientContext& context) {
        ++attempts;  // the first attempt gives up after 200 ms, while the method still runs
        context.set_deadline(std::chrono::system_clock::now() + (attempts == 1 ? 200ms : 30s));
        return s.stub->Charge(&context, order(), &reply);
      },
      {.sleep = [&](std::chrono::milliseconds) { go = true; }});
  CHECK(st.ok());
  CHECK(attempts == 2);
  CHECK(reply.charge_id() == "ch_1");
  CHECK(s.counted.runs == 1);
  CHECK(s.world.charges() == 1);
}

TEST_CASE(
    "grpc: gRPC's own retry policy (a service config) resends the key, and the method charges "
    "once") {
  Served<> s;
  const Method charge = s.counted.method;
  std::vector<std::string> keys;
  s.counted.method = [&](const ChargeRequest& r, ChargeReply& reply, idem::grpc::Context& c) {
    keys.push_back(c.id.key);
    if (s.counted.runs == 1) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "provider down");
    return charge(r, reply, c);
  };
  grpc::ChannelArguments args;
  args.SetServiceConfigJSON(R"({"methodConfig": [{
  "name": [{"service": "idemtest.Payments"}],
  "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.01s", "maxBackoff": "0.1s",
                  "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE", "ABORTED"]}}]})");
  const auto stub = Payments::NewStub(grpc::CreateCustomChannel(
      fmt::format("127.0.0.1:{}", s.port), grpc::InsecureChannelCredentials(), args));
  const Answer a = call(*stub, order(), "config-1");  // one call from the application
  CHECK(a.status.ok());
  CHECK(a.reply.charge_id() == "ch_1");
  CHECK(keys == std::vector<std::string>{"config-1", "config-1"});
  CHECK(s.counted.runs == 2);
  CHECK(s.world.charges() == 1);
}

// --- Multi-step methods -----------------------------------------------------------------------

TEST_CASE(
    "grpc: a multi-step method its server left after the debit is finished by the completer, "
    "and the client's retry replays it with one charge") {
  Served<> s(idem::grpc::GuardOptions{.in_flight = idem::InFlight::raise, .steps = true});
  bool server_dies = true;
  s.counted.method = [&](const ChargeRequest& r, ChargeReply& reply, idem::grpc::Context& c) {
    REQUIRE(c.attempt != nullptr);
    const std::string charge_id =
        c.attempt->external("debited", [&](const std::string& provider_key) {
          return s.world.provider->charge(r.order_id(), r.amount(), provider_key).charge_id;
        });
    if (server_dies) throw std::runtime_error("the server died after the debit");
    reply.set_charge_id(charge_id);
    return grpc::Status::OK;
  };
  const Answer first = call(*s.stub, order(), "steps-1");
  CHECK(first.status.error_code() == grpc::StatusCode::UNKNOWN);
  CHECK(s.world.charges() == 1);
  server_dies = false;

  idem::Completer completer(*s.world.idem, idem::CompleterOptions{.abandoned_after = 60s});
  completer.on(kMethod, [&](idem::Attempt& attempt) {
    ChargeRequest request;
    ChargeReply reply;
    return s.guard.resume(attempt, request, reply,
                          [&](idem::grpc::Context& c) { return s.counted.run(request, reply, c); });
  });
  s.world.clock->advance(120s);  // the lease ended, and the abandoned_after since
  const idem::CompleterReport report = completer.run_once();
  CHECK(report.found == 1);
  CHECK(report.finished == 1);
  CHECK(s.counted.runs == 2);
  CHECK(s.world.charges() == 1);  // the debit was recorded: the completer did not charge again

  const Answer retry = call(*s.stub, order(), "steps-1");
  CHECK(retry.status.ok());
  CHECK(retry.trailer("idempotent-replayed") == "true");
  CHECK(retry.reply.charge_id() == "ch_1");
  CHECK(s.counted.runs == 2);
  CHECK(s.world.charges() == 1);
}

TEST_CASE(
    "grpc: a multi-step method whose debit could not be recorded answers UNAVAILABLE "
    "outcome_unknown, never UNKNOWN, and the retry with the same key charges nothing more") {
  Served<> s(idem::grpc::GuardOptions{.in_flight = idem::InFlight::raise, .steps = true});
  s.counted.method = [&](const ChargeRequest& r, ChargeReply& reply, idem::grpc::Context& c) {
    REQUIRE(c.attempt != nullptr);
    const std::string charge_id =
        c.attempt->external("debited", [&](const std::string& provider_key) {
          const std::string id =
              s.world.provider->charge(r.order_id(), r.amount(), provider_key).charge_id;
          // The charge came back; the commit that records it reaches the store, its reply is
          // lost: the step cannot know it was recorded.
          s.world.faulty->lose_replies(idem::sim::Operation::steps);
          return id;
        });
    reply.set_charge_id(charge_id);
    return grpc::Status::OK;
  };
  const Answer first = call(*s.stub, order(), "unknown-1");
  CHECK(first.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(first.trailer("idempotency-error") == "outcome_unknown");
  CHECK(first.status.error_message().find("never a new one") != std::string::npos);
  CHECK(s.world.charges() == 1);

  s.world.faulty->lose_replies(idem::sim::Operation::steps, false);
  const Answer retry = call(*s.stub, order(), "unknown-1");
  CHECK(retry.status.ok());
  CHECK(retry.reply.charge_id() == "ch_1");
  CHECK(s.counted.runs == 2);
  CHECK(s.world.charges() == 1);  // the debit was recorded: the retry did not charge again
}

TEST_CASE(
    "grpc: a multi-step method paused past its lease before the debit answers ABORTED "
    "lease_lost, never UNKNOWN, and charges nothing") {
  idem::Options o;
  o.heartbeat = 0ms;  // a paused process renews nothing
  o.lease = 10s;
  Served<> s(idem::grpc::GuardOptions{.in_flight = idem::InFlight::raise, .steps = true}, o);
  s.counted.method = [&](const ChargeRequest& r, ChargeReply& reply, idem::grpc::Context& c) {
    REQUIRE(c.attempt != nullptr);
    s.world.clock->advance(11s);  // paused past its 10 s lease
    const std::string charge_id =
        c.attempt->external("debited", [&](const std::string& provider_key) {
          return s.world.provider->charge(r.order_id(), r.amount(), provider_key).charge_id;
        });
    reply.set_charge_id(charge_id);
    return grpc::Status::OK;
  };
  const Answer first = call(*s.stub, order(), "paused-1");
  CHECK(first.status.error_code() == grpc::StatusCode::ABORTED);
  CHECK(first.trailer("idempotency-error") == "lease_lost");
  CHECK(s.world.charges() == 0);
}

TEST_CASE(
    "grpc: the callback API with an executor runs 20 parallel identical calls off gRPC's "
    "threads: one charge, every call its reply") {
  std::mutex m;
  std::vector<std::thread> tasks;
  Served<CallbackPayments> s(idem::grpc::GuardOptions{.in_flight = idem::InFlight::wait,
                                                      .executor = [&](std::function<void()> task) {
                                                        std::lock_guard lock(m);
                                                        tasks.emplace_back(std::move(task));
                                                      }});
  twenty_at_once(s, [&] { return s.world.idem->metrics().waited >= 19; });
  std::lock_guard lock(m);
  CHECK(tasks.size() == 20);
  for (std::thread& t : tasks) t.join();
}

}  // namespace
