#include "grpc_demo.hpp"

#include <fmt/format.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "checkout.hpp"
#include "database.hpp"
#include "idem/coordinator.hpp"
#include "idem/grpc.hpp"
#include "idem/maintenance.hpp"
#include "idem/sim/mail.hpp"
#include "idem/sim/provider.hpp"
#include "payments.grpc.pb.h"

#include <pthread.h>

namespace idem::demo {
namespace {

using ::grpc::Status;
using ::grpc::StatusCode;
using nlohmann::json;

constexpr const char* kCharge = "/payments.Payments/Charge";
constexpr const char* kCheckout = "/payments.Payments/Checkout";

// The demo's API keys, as `idem-demo serve` has them: the key names the tenant.
const std::map<std::string, std::string, std::less<>> kApiKeys = {{"sk_test_alpha", "alpha"},
                                                                  {"sk_test_beta", "beta"}};

// The tenant of the call's one "authorization: Bearer KEY", or empty.
std::string tenant_of(const ::grpc::ServerContextBase& context) {
  const auto [first, last] = context.client_metadata().equal_range("authorization");
  if (first == last || std::next(first) != last) return {};
  const std::string_view value(first->second.data(), first->second.size());
  if (!value.starts_with("Bearer ")) return {};
  const auto it = kApiKeys.find(value.substr(7));
  return it == kApiKeys.end() ? std::string() : it->second;
}

// What is checked before idem sees the call: a request that fails here changes nothing and
// keeps no key.
std::optional<Status> refuse(const ::grpc::ServerContextBase& context, std::int64_t amount,
                             const std::string& currency, const std::string& order_id) {
  if (tenant_of(context).empty()) {
    return Status(StatusCode::UNAUTHENTICATED,
                  "send \"authorization: Bearer <API key>\" (demo keys: sk_test_alpha, "
                  "sk_test_beta)");
  }
  const bool currency_ok =
      currency.size() == 3 &&
      std::all_of(currency.begin(), currency.end(), [](char c) { return c >= 'A' && c <= 'Z'; });
  if (amount <= 0 || !currency_ok || order_id.empty() || order_id.size() > 64) {
    return Status(StatusCode::INVALID_ARGUMENT,
                  "amount must be more than 0, currency three capital letters, order_id 1 to "
                  "64 bytes");
  }
  return std::nullopt;
}

InFlight policy_of(const std::string& name) {
  return name == "raise" ? InFlight::raise : InFlight::wait;
}

class PaymentsService final : public payments::Payments::Service {
 public:
  explicit PaymentsService(const GrpcServeArgs& a)
      : clock_(std::make_shared<SystemClock>()),
        db_(a.db, {.clock = clock_}),
        provider_(clock_, {.latency = std::chrono::milliseconds(a.provider_latency_ms),
                           .dedup = a.provider_dedup,
                           .ledger_path = a.ledger}),
        mail_(clock_, {.journal_path = a.ledger}),
        idem_(db_.store(), options(a, clock_)),
        charge_guard_(idem_, guard_options(a, false)),
        checkout_guard_(idem_, guard_options(a, true)),
        maintenance_(idem_) {
    // A checkout its server left midway is finished here once its lease is long over, or by
    // the client's retry, whichever comes first; the receipts go to the mail journal.
    maintenance_.resume(kCheckout, [this](Attempt& attempt) {
      payments::CheckoutRequest request;
      payments::CheckoutReply reply;
      return checkout_guard_.resume(attempt, request, reply, [&](idem::grpc::Context& c) {
        return checkout(c, request, reply);
      });
    });
    maintenance_.deliver(mail_delivery(mail_));
    maintenance_.start();
  }
  ~PaymentsService() override { maintenance_.stop(); }

  Status Charge(::grpc::ServerContext* context, const payments::ChargeRequest* request,
                payments::ChargeReply* reply) override {
    if (auto no = refuse(*context, request->amount(), request->currency(), request->order_id()))
      return *no;
    return charge_guard_.unary(*context, kCharge, *request, *reply, [&](idem::grpc::Context& c) {
      // The provider gets a key derived from the record: the same on every retry, on every
      // server, never the client's own.
      const sim::ChargeResult r =
          provider_.charge(request->order_id(), request->amount(), derived_key(c.id, "charge"));
      if (r.declined) return Status(StatusCode::FAILED_PRECONDITION, "declined: " + r.reason);
      reply->set_charge_id(r.charge_id);
      reply->set_amount(request->amount());
      reply->set_currency(request->currency());
      reply->set_order_id(request->order_id());
      return Status::OK;
    });
  }

  Status Checkout(::grpc::ServerContext* context, const payments::CheckoutRequest* request,
                  payments::CheckoutReply* reply) override {
    if (auto no = refuse(*context, request->amount(), request->currency(), request->order_id()))
      return *no;
    return checkout_guard_.unary(
        *context, kCheckout, *request, *reply,
        [&](idem::grpc::Context& c) { return checkout(c, *request, *reply); });
  }

 private:
  static Options options(const GrpcServeArgs& a, std::shared_ptr<Clock> clock) {
    Options o;
    o.in_flight = policy_of(a.policy);
    o.lease = std::chrono::milliseconds(a.lease_ms);
    o.heartbeat = o.lease / 3;
    o.on_store_failure = a.fail_closed ? FailureMode::fail_closed : FailureMode::fail_open;
    o.clock = std::move(clock);
    return o;
  }

  static idem::grpc::GuardOptions guard_options(const GrpcServeArgs& a, bool steps) {
    idem::grpc::GuardOptions o;
    o.tenant = tenant_of;
    o.in_flight = policy_of(a.policy);
    o.steps = steps;
    return o;
  }

  // Seed 000's checkout (demo/checkout.hpp) on the call's attempt; its JSON answer as the
  // reply, a declined card as FAILED_PRECONDITION. The tenant is the key's (a resumed call
  // has no metadata).
  Status checkout(idem::grpc::Context& c, const payments::CheckoutRequest& request,
                  payments::CheckoutReply& reply) {
    const CheckoutRequest order{c.id.tenant, request.order_id(), request.amount(),
                                request.currency(),
                                request.email().empty() ? "buyer@example.com" : request.email()};
    const Response r = demo::checkout(*c.attempt, provider_, order);
    const json body = json::parse(r.body);
    if (r.status != 200) {
      return Status(StatusCode::FAILED_PRECONDITION, body.value("detail", "payment declined"));
    }
    reply.set_payment_id(body.at("id").get<std::string>());
    reply.set_charge_id(body.at("charge_id").get<std::string>());
    reply.set_amount(body.at("amount").get<std::int64_t>());
    reply.set_currency(body.at("currency").get<std::string>());
    reply.set_order_id(body.at("order_id").get<std::string>());
    reply.set_status(body.at("status").get<std::string>());
    return Status::OK;
  }

  std::shared_ptr<SystemClock> clock_;
  Database db_;
  sim::Provider provider_;
  sim::MailSender mail_;
  Coordinator idem_;
  idem::grpc::Guard charge_guard_;
  idem::grpc::Guard checkout_guard_;
  MaintenanceThread maintenance_;
};

std::string_view sv(::grpc::string_ref s) { return {s.data(), s.size()}; }

const char* code_name(StatusCode code) {
  switch (code) {
    case StatusCode::OK:
      return "OK";
    case StatusCode::CANCELLED:
      return "CANCELLED";
    case StatusCode::UNKNOWN:
      return "UNKNOWN";
    case StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case StatusCode::ABORTED:
      return "ABORTED";
    case StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case StatusCode::INTERNAL:
      return "INTERNAL";
    case StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "?";
  }
}

// One call (with its retries), as the JSON line grpc-call prints.
json call_once(payments::Payments::Stub& stub, const GrpcCallArgs& a, const std::string& key) {
  std::unique_ptr<google::protobuf::Message> reply;
  json trailers = json::object();
  int attempts = 0;
  const auto attempt = [&](::grpc::ClientContext& context) {
    ++attempts;
    context.AddMetadata("authorization", "Bearer " + a.api_key);
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(a.deadline_ms));
    // The same order as either method's request; the reply kept for the printed line.
    const auto send = [&](auto request, auto answer, const auto& rpc) {
      request.set_order_id(a.order_id);
      request.set_amount(a.amount);
      request.set_currency(a.currency);
      const Status s = rpc(request, answer);
      reply = std::make_unique<decltype(answer)>(std::move(answer));
      return s;
    };
    const Status s =
        a.method == "checkout"
            ? send(payments::CheckoutRequest{}, payments::CheckoutReply{},
                   [&](const auto& q, auto& r) { return stub.Checkout(&context, q, &r); })
            : send(payments::ChargeRequest{}, payments::ChargeReply{},
                   [&](const auto& q, auto& r) { return stub.Charge(&context, q, &r); });
    trailers = json::object();
    for (const auto& [name, value] : context.GetServerTrailingMetadata())
      trailers[std::string(sv(name))] = std::string(sv(value));
    return s;
  };
  const Status s = idem::grpc::call_with_key(key, attempt, {.max_attempts = a.attempts});
  json line = {{"key", key},
               {"attempts", attempts},
               {"code", code_name(s.error_code())},
               {"message", s.error_message()},
               {"trailers", trailers}};
  if (s.ok()) {
    std::string text;
    google::protobuf::util::JsonPrintOptions print;
    print.preserve_proto_field_names = true;
    (void)google::protobuf::util::MessageToJsonString(*reply, &text, print);
    line["reply"] = json::parse(text);
  }
  return line;
}

}  // namespace

int run_grpc_serve(const GrpcServeArgs& a) {
  // SIGINT and SIGTERM are taken by this thread alone (sigwait below): block them before gRPC
  // starts its threads, which inherit the mask.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);

  PaymentsService service(a);
  int port = 0;
  ::grpc::ServerBuilder builder;
  builder.AddListeningPort(fmt::format("{}:{}", a.host, a.port),
                           ::grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<::grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::cerr << "idem-demo: cannot listen on " << a.host << ':' << a.port << '\n';
    return 1;
  }
  std::cerr << "idem-demo: serving gRPC payments on " << a.host << ':' << port << " (policy "
            << a.policy << "; Ctrl-C stops)" << std::endl;
  int signal = 0;
  sigwait(&stop, &signal);
  // Calls in flight get 10 s to finish; a method that has begun is never cut short by idem.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(10));
  std::cerr << "idem-demo: stopped" << std::endl;
  return 0;
}

int run_grpc_call(const GrpcCallArgs& a) {
  const std::string key = a.key.empty() ? idem::grpc::new_key() : a.key;
  auto stub = payments::Payments::NewStub(
      ::grpc::CreateChannel(a.target, ::grpc::InsecureChannelCredentials()));
  std::vector<json> lines(static_cast<std::size_t>(std::max(a.parallel, 1)));
  {
    std::vector<std::thread> calls;
    for (std::size_t i = 0; i < lines.size(); ++i)
      calls.emplace_back([&, i] { lines[i] = call_once(*stub, a, key); });
    for (std::thread& t : calls) t.join();
  }
  int ok = 0;
  std::set<std::string> charges;
  for (const json& line : lines) {
    std::cout << line.dump() << '\n';
    if (line["code"] == "OK") {
      ++ok;
      charges.insert(line["reply"].value("charge_id", ""));
    }
  }
  if (lines.size() > 1) {
    std::cout << json{{"calls", lines.size()}, {"ok", ok}, {"charge_ids", charges}}.dump() << '\n';
  }
  std::cout.flush();
  return ok == static_cast<int>(lines.size()) ? 0 : 1;
}

}  // namespace idem::demo
