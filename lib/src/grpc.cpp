#include "idem/grpc.hpp"

#include <fmt/format.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/message.h>
#include <grpcpp/client_context.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <exception>
#include <random>
#include <stdexcept>
#include <thread>
#include <utility>

#include "core.hpp"
#include "idem/errors.hpp"

namespace idem::grpc {
namespace {

using ::grpc::Status;
using ::grpc::StatusCode;

// Thrown out of the coordinator's action when the method's status is not an outcome: the
// coordinator releases the key and rethrows it; the guard then answers the method's status.
struct Unstored {};

// Carries the method's exception through the coordinator (which releases the key).
struct BodyThrew {
  std::exception_ptr error;
};

// Where the stored answer keeps its status message and details: names no metadata can have
// (a gRPC metadata name never starts with ':').
constexpr std::string_view kMessage = ":message";
constexpr std::string_view kDetails = ":details";

constexpr std::string_view kReplayed = "idempotent-replayed";
constexpr std::string_view kExpires = "idempotency-expires";
constexpr std::string_view kError = "idempotency-error";
constexpr std::string_view kRetryAfter = "retry-after-ms";

bool credential(std::string_view name) {
  for (std::string_view n : {"authorization", "cookie", "set-cookie", "proxy-authorization"}) {
    if (name == n) return true;
  }
  return name.starts_with("grpc-") || name.starts_with(":");
}

std::string rfc3339(TimePoint t) {
  const auto day = std::chrono::floor<std::chrono::days>(t);
  const std::chrono::year_month_day date{day};
  const std::chrono::hh_mm_ss time{std::chrono::floor<std::chrono::seconds>(t - day)};
  return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z", static_cast<int>(date.year()),
                     static_cast<unsigned>(date.month()), static_cast<unsigned>(date.day()),
                     time.hours().count(), time.minutes().count(), time.seconds().count());
}

std::string_view sv(::grpc::string_ref s) { return {s.data(), s.size()}; }

void add_trailer(::grpc::ServerContextBase& context, std::string_view name,
                 std::string_view value) {
  context.AddTrailingMetadata(std::string(name), std::string(value));
}

// What a method that threw gets, as gRPC answers a thrown exception: UNKNOWN.
Status threw(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return Status(StatusCode::UNKNOWN, e.what());
  } catch (...) {
    return Status(StatusCode::UNKNOWN, "the method threw");
  }
}

// One of idem's own answers (the header's table).
Status refused(::grpc::ServerContextBase& context, StatusCode code, std::string_view error,
               std::string message) {
  add_trailer(context, kError, error);
  return Status(code, std::move(message));
}

}  // namespace

bool is_outcome(StatusCode code) noexcept {
  switch (code) {
    case StatusCode::OK:
    case StatusCode::INVALID_ARGUMENT:
    case StatusCode::NOT_FOUND:
    case StatusCode::ALREADY_EXISTS:
    case StatusCode::PERMISSION_DENIED:
    case StatusCode::FAILED_PRECONDITION:
    case StatusCode::OUT_OF_RANGE:
    case StatusCode::UNIMPLEMENTED:
      return true;
    default:
      return false;
  }
}

Fingerprint fingerprint_of(const google::protobuf::Message& request) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream out(&bytes);
    google::protobuf::io::CodedOutputStream coded(&out);
    coded.SetSerializationDeterministic(true);
    request.SerializeToCodedStream(&coded);
  }
  return Fingerprint::of_bytes(bytes);
}

struct Guard::Impl {
  Impl(Coordinator& c, GuardOptions options) : coordinator(c), o(std::move(options)) {
    const auto check = [](bool ok, std::string_view what) {
      detail::check(ok, fmt::format("grpc guard: {}", what));
    };
    check(!o.key_metadata.empty(), "key_metadata is empty");
    check(!o.default_tenant.empty(), "default_tenant is empty");
    for (const std::string& name : o.stored_trailers) {
      check(!credential(name),
            fmt::format("stored_trailers names '{}', a credential or session field, which is "
                        "never stored",
                        name));
    }
    check(o.in_flight.value_or(c.options().in_flight) != InFlight::run,
          "InFlight::run cannot guard a method: a duplicate's own reply would differ from the "
          "stored one; use raise or wait");
  }

  Coordinator& coordinator;
  const GuardOptions o;

  bool outcome(StatusCode code) const { return o.store ? o.store(code) : is_outcome(code); }

  // The key of the call: from the request's field, else the metadata. An answer when there is
  // none (and one is required) or it is malformed.
  struct Key {
    std::optional<std::string> key;
    std::optional<Status> answer;
  };
  Key key_of(::grpc::ServerContextBase& context, const google::protobuf::Message& request) const {
    if (o.key_field) {
      if (std::optional<std::string> k = o.key_field(request); k && !k->empty()) return {k, {}};
    }
    const auto [first, last] = context.client_metadata().equal_range(o.key_metadata);
    const auto entries = std::distance(first, last);
    if (entries == 0) {
      if (!o.key_required) return {};
      return {{},
              refused(context, StatusCode::INVALID_ARGUMENT, "idempotency_key_required",
                      fmt::format("this method needs an idempotency key in the '{}' metadata: a "
                                  "client-generated key (a UUID) sent unchanged with every retry",
                                  o.key_metadata))};
    }
    if (entries > 1) {
      return {{},
              refused(context, StatusCode::INVALID_ARGUMENT, "idempotency_key_invalid",
                      fmt::format("'{}' was sent {} times; a call carries exactly one key",
                                  o.key_metadata, entries))};
    }
    return {std::string(sv(first->second)), {}};
  }

  // The answer the record keeps: the status, its message and details, the reply's bytes (OK
  // only: gRPC sends no reply with an error) and the trailers named in stored_trailers.
  Response stored_form(const Status& s, const google::protobuf::Message& reply,
                       const std::vector<Header>& trailers) const {
    Response r;
    r.status = static_cast<int>(s.error_code());
    if (s.ok()) r.body = reply.SerializeAsString();
    r.headers.push_back({std::string(kMessage), s.error_message()});
    r.headers.push_back({std::string(kDetails), s.error_details()});
    for (const Header& h : trailers) {
      if (std::find(o.stored_trailers.begin(), o.stored_trailers.end(), h.name) !=
          o.stored_trailers.end())
        r.headers.push_back(h);
    }
    return r;
  }

  // A stored answer, replayed: the reply parsed back, the trailers it kept.
  Status replay(::grpc::ServerContextBase& context, const Response& stored,
                google::protobuf::Message& reply) const {
    std::string message, details;
    for (const Header& h : stored.headers) {
      if (h.name == kMessage) {
        message = h.value;
      } else if (h.name == kDetails) {
        details = h.value;
      } else {
        add_trailer(context, h.name, h.value);
      }
    }
    const auto code = static_cast<StatusCode>(stored.status);
    if (code == StatusCode::OK && !reply.ParseFromString(stored.body)) {
      return refused(context, StatusCode::DATA_LOSS, "record_corrupt",
                     fmt::format("the stored reply does not parse as {}; the key's answer is left "
                                 "for an operator",
                                 reply.GetTypeName()));
    }
    add_trailer(context, kReplayed, "true");
    return Status(code, message, details);
  }

  Status serve(::grpc::ServerContextBase& context, std::string_view method,
               const google::protobuf::Message& request, google::protobuf::Message& reply,
               const Body& body) {
    Key key = key_of(context, request);
    if (key.answer) return *key.answer;
    Context call;
    if (!key.key) return run_unguarded(context, call, body);
    // The coordinator validates the key (InvalidKeyError, answered by conclude()).
    Request r;
    r.tenant = o.tenant ? o.tenant(context) : std::string();
    if (r.tenant.empty()) r.tenant = o.default_tenant;
    r.operation = std::string(method);
    r.key = *key.key;
    r.fingerprint = o.fingerprint ? o.fingerprint(request) : fingerprint_of(request);
    r.in_flight = o.in_flight;
    // The client's deadline bounds a wait for another call with this key.
    const auto deadline = context.deadline();
    if (deadline != std::chrono::system_clock::time_point::max()) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::system_clock::now());
      r.max_wait = std::max(left, std::chrono::milliseconds(0));
    }
    call.id = KeyId{r.tenant, r.operation, *r.key};

    std::optional<Status> ran;  // the method's own status, when it ran in this call
    const auto run = [&](Context& c) -> Response {
      Status s;
      try {
        s = body(c);
      } catch (...) {
        throw BodyThrew{std::current_exception()};
      }
      ran = s;
      call.trailers = c.trailers;
      if (!outcome(s.error_code())) throw Unstored{};
      return stored_form(s, reply, c.trailers);
    };
    std::optional<Outcome> out;
    std::exception_ptr failure;
    try {
      if (o.steps) {
        r.payload = request.SerializeAsString();
        out = coordinator.call_steps(r, [&](Attempt& attempt) {
          Context c{call.id, &attempt, {}};
          return run(c);
        });
      } else {
        out = coordinator.call(r, [&] {
          Context c{call.id, nullptr, {}};
          return run(c);
        });
      }
    } catch (...) {
      failure = std::current_exception();
    }
    return conclude(context, failure, out, ran, call.trailers, reply);
  }

  Status run_unguarded(::grpc::ServerContextBase& context, Context& call, const Body& body) {
    Status s;
    try {
      s = body(call);
    } catch (...) {
      return threw(std::current_exception());
    }
    for (const Header& h : call.trailers) add_trailer(context, h.name, h.value);
    return s;
  }

  // What the client gets once the coordinator returned `out` or threw `failure`.
  Status conclude(::grpc::ServerContextBase& context, const std::exception_ptr& failure,
                  const std::optional<Outcome>& out, const std::optional<Status>& ran,
                  const std::vector<Header>& trailers, google::protobuf::Message& reply) const {
    const auto send_trailers = [&] {
      for (const Header& h : trailers) add_trailer(context, h.name, h.value);
    };
    if (!failure) {
      if (out->replayed()) {
        add_trailer(context, kExpires, rfc3339(out->expires_at));
        return replay(context, out->response, reply);
      }
      send_trailers();
      if (out->expires_at != TimePoint{}) add_trailer(context, kExpires, rfc3339(out->expires_at));
      return *ran;
    }
    try {
      std::rethrow_exception(failure);
    } catch (const Unstored&) {
      send_trailers();  // the method's own answer, not kept: the key is free for a retry
      return *ran;
    } catch (const BodyThrew& body_threw) {
      // A step's own errors (GuardOptions::steps: Attempt::external) are idem's answers to
      // give: the call lost its key, or an effect may have happened. "The method threw" would
      // tell the client the key was released for a new run.
      try {
        std::rethrow_exception(body_threw.error);
      } catch (const LeaseLostError&) {
        return conclude(context, body_threw.error, out, ran, trailers, reply);
      } catch (const OutcomeUnknownError&) {
        return conclude(context, body_threw.error, out, ran, trailers, reply);
      } catch (...) {
        return threw(body_threw.error);
      }
    } catch (const InvalidKeyError& e) {
      return refused(context, StatusCode::INVALID_ARGUMENT, "idempotency_key_invalid", e.what());
    } catch (const KeyReuseError&) {
      return refused(context, StatusCode::FAILED_PRECONDITION, "idempotency_key_reused",
                     "this idempotency key was used with another request; use a new key for a "
                     "new request");
    } catch (const InProgressError& e) {
      add_trailer(context, kRetryAfter, std::to_string(e.retry_after().count()));
      return refused(context, StatusCode::ABORTED, "idempotency_key_in_progress",
                     fmt::format("a call with this idempotency key is in progress; retry with "
                                 "the same key after {} ms",
                                 e.retry_after().count()));
    } catch (const LeaseLostError&) {
      return refused(context, StatusCode::ABORTED, "lease_lost",
                     "the method ran but another call took its key over; retry with the same "
                     "key");
    } catch (const OutcomeUnknownError& e) {
      return refused(context, StatusCode::UNAVAILABLE, "outcome_unknown",
                     fmt::format("step '{}' may have had its effect and could not be recorded; "
                                 "retry with the same key, never a new one",
                                 e.step()));
    } catch (const CorruptRecordError& e) {
      return refused(context, StatusCode::DATA_LOSS, "record_corrupt", e.what());
    } catch (const StoreError& e) {
      return refused(context, StatusCode::UNAVAILABLE, "store_unavailable",
                     fmt::format("the idempotency store is unavailable, this call ran nothing "
                                 "({}); retry with the same key",
                                 e.what()));
    } catch (const std::exception& e) {
      return Status(StatusCode::INTERNAL, e.what());
    } catch (...) {
      return Status(StatusCode::INTERNAL, "idem: unknown error");
    }
  }
};

Guard::Guard(Coordinator& coordinator, GuardOptions options)
    : impl_(std::make_unique<Impl>(coordinator, std::move(options))) {}
Guard::~Guard() = default;

Status Guard::unary(::grpc::ServerContext& context, std::string_view method,
                    const google::protobuf::Message& request, google::protobuf::Message& reply,
                    const Body& body) {
  return impl_->serve(context, method, request, reply, body);
}

::grpc::ServerUnaryReactor* Guard::unary(::grpc::CallbackServerContext& context,
                                         std::string_view method,
                                         const google::protobuf::Message& request,
                                         google::protobuf::Message& reply, const Body& body) {
  ::grpc::ServerUnaryReactor* reactor = context.DefaultReactor();
  if (!impl_->o.executor) {
    reactor->Finish(impl_->serve(context, method, request, reply, body));
    return reactor;
  }
  // gRPC keeps the context, the request and the reply until the reactor is finished.
  impl_->o.executor(
      [this, &context, reactor, method = std::string(method), &request, &reply, body] {
        reactor->Finish(impl_->serve(context, method, request, reply, body));
      });
  return reactor;
}

Response Guard::resume(Attempt& attempt, google::protobuf::Message& request,
                       google::protobuf::Message& reply, const Body& body) const {
  detail::check(impl_->o.steps, "grpc guard: resume() needs GuardOptions::steps");
  if (!request.ParseFromString(attempt.request())) {
    throw std::runtime_error(
        fmt::format("grpc guard: the stored request does not parse as {}", request.GetTypeName()));
  }
  Context c{attempt.id(), &attempt, {}};
  const Status s = body(c);
  if (!impl_->outcome(s.error_code())) {
    throw std::runtime_error(fmt::format(
        "grpc guard: the resumed method answered {} ({}), not an outcome; its progress is kept",
        static_cast<int>(s.error_code()), s.error_message()));
  }
  return impl_->stored_form(s, reply, c.trailers);
}

std::string new_key() {
  std::random_device random;
  std::array<std::uint32_t, 4> w{random(), random(), random(), random()};
  w[1] = (w[1] & 0xffff0fffu) | 0x00004000u;  // version 4
  w[2] = (w[2] & 0x3fffffffu) | 0x80000000u;  // variant 1 (RFC 4122)
  return fmt::format("{:08x}-{:04x}-{:04x}-{:04x}-{:04x}{:08x}", w[0], w[1] >> 16, w[1] & 0xffffu,
                     w[2] >> 16, w[2] & 0xffffu, w[3]);
}

Status call_with_key(std::string_view key, const ClientAttempt& attempt,
                     const RetryOptions& options) {
  const auto check = [](bool ok, std::string_view what) {
    detail::check(ok, fmt::format("grpc call_with_key: {}", what));
  };
  check(!key.empty(), "the key is empty");
  check(!options.key_metadata.empty(), "key_metadata is empty");
  check(options.max_attempts >= 1, "max_attempts is below 1");
  check(options.initial_backoff.count() >= 0 && options.max_backoff.count() >= 0,
        "a backoff is negative");
  check(options.max_wait.count() >= 0, "max_wait is negative");
  check(options.multiplier >= 1, "multiplier is below 1");
  check(static_cast<bool>(attempt), "no attempt");
  std::mt19937_64 jitter{std::random_device{}()};
  double backoff_ms = static_cast<double>(options.initial_backoff.count());
  for (int n = 1;; ++n) {
    ::grpc::ClientContext context;
    context.AddMetadata(options.key_metadata, std::string(key));
    const Status s = attempt(context);
    const bool retryable = s.error_code() == StatusCode::UNAVAILABLE ||
                           s.error_code() == StatusCode::DEADLINE_EXCEEDED ||
                           s.error_code() == StatusCode::ABORTED;
    if (!retryable || n >= options.max_attempts) return s;
    const double cap = std::min(backoff_ms, static_cast<double>(options.max_backoff.count()));
    auto wait = std::chrono::milliseconds(
        static_cast<long long>(std::uniform_real_distribution<double>(cap / 2, cap)(jitter)));
    const auto& trailers = context.GetServerTrailingMetadata();
    if (const auto it = trailers.find(std::string(kRetryAfter)); it != trailers.end()) {
      try {
        wait = std::max(wait, std::chrono::milliseconds(std::stoll(std::string(sv(it->second)))));
      } catch (const std::exception&) {
        // a malformed retry-after is ignored: the backoff stands
      }
    }
    if (wait > options.max_wait) return s;  // the caller decides whether to wait that long
    if (options.sleep) {
      options.sleep(wait);
    } else {
      std::this_thread::sleep_for(wait);
    }
    backoff_ms *= options.multiplier;
  }
}

}  // namespace idem::grpc
