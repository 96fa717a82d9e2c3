// idem — the gRPC guard (target idem::grpc): any unary method of a gRPC C++ service, of the
// synchronous or the callback API, runs at most once per idempotency key, with the decisions
// of Coordinator::call (InFlight::run is refused: a duplicate's own reply could differ from the
// stored one; wait and raise, lease, heartbeat, fencing, fail open or closed).
//
//   grpc::Status Charge(grpc::ServerContext* context, const ChargeRequest* request,
//                       ChargeReply* reply) override {
//     return guard.unary(*context, "/payments.Payments/Charge", *request, *reply,
//                        [&](idem::grpc::Context&) {
//                          reply->set_charge_id(provider.charge(request->amount()));
//                          return grpc::Status::OK;
//                        });
//   }
//
// What the client gets:
//   the method's own status and reply the first time. It is stored when GuardOptions::store
//     says the status is an outcome (by default OK and the business errors: is_outcome()) and
//     replayed to a retry with the same key, with trailing metadata "idempotent-replayed: true";
//     every stored answer carries "idempotency-expires" (RFC 3339, UTC: until when the key is
//     remembered). A status that is not an outcome (UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL,
//     ...) releases the key: a retry runs the method again. A method that throws is answered
//     UNKNOWN (as gRPC answers a thrown exception) and releases the key. So a method answers
//     such a status, or throws, only before any effect; or it makes its effects steps
//     (GuardOptions::steps), whose progress the release keeps and a retry resumes.
//   idem's own answers, each naming itself in trailing metadata "idempotency-error":
//     INVALID_ARGUMENT    idempotency_key_required, idempotency_key_invalid: no key, two, or a
//                         malformed one; nothing ran. Fix the client; do not retry as is.
//     FAILED_PRECONDITION idempotency_key_reused: the key was used with another request (its
//                         fingerprint differs); nothing ran. Do not retry; use a new key for a
//                         new request.
//     ABORTED             idempotency_key_in_progress: another call with this key is running
//                         (InFlight::raise, or a wait that reached the client's deadline or
//                         Options::max_wait); nothing ran. Retry with the same key after
//                         "retry-after-ms" (trailing metadata).
//     ABORTED             lease_lost: the method ran but its lease was taken over, so its
//                         reply is not sent. Retry with the same key.
//     UNAVAILABLE         store_unavailable: the store failed before this call ran anything
//                         (FailureMode::fail_closed; an earlier call with the key may have:
//                         a retry replays or resumes it). Retry with the same key.
//     UNAVAILABLE         outcome_unknown: a multi-step method's step failed after an effect
//                         may have happened. Retry with the same key, never a new one.
//     DATA_LOSS           record_corrupt: the key's record does not decode; nothing ran. An
//                         operator looks at it; do not retry.
//
// The client's deadline bounds any wait for another call with the same key. A call its client
// cancels does not cancel a method that may already have an effect: it runs to its end and its
// outcome is stored, for the retry.
//
// Only gRPC's status header and this one pull in gRPC; protobuf messages are seen through
// google::protobuf::Message.
#pragma once

#include <grpcpp/support/status.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/coordinator.hpp"
#include "idem/steps.hpp"

namespace grpc {
class ClientContext;
class ServerContextBase;
class ServerContext;
class CallbackServerContext;
class ServerUnaryReactor;
}  // namespace grpc

namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace idem::grpc {

// What a guarded method learns about its call.
struct Context {
  KeyId id;                    // the call's key (tenant, operation, key)
  Attempt* attempt = nullptr;  // GuardOptions::steps: the multi-step attempt to run steps on
  // Trailing metadata of the method's answer (lowercase names): sent with it, and stored with
  // it when GuardOptions::stored_trailers names them.
  std::vector<Header> trailers;
};

// The method's body: fills the reply and returns its status.
using Body = std::function<::grpc::Status(Context& context)>;

struct GuardOptions {
  // The metadata entry that carries the key (a lowercase gRPC metadata name). The client sets
  // it once and sends it unchanged with every retry (gRPC's retry policy does so by itself).
  std::string key_metadata = "idempotency-key";
  // The key from the request itself instead (AIP-155's `request_id` field): when set and it
  // gives a non-empty key, the metadata is not read.
  std::function<std::optional<std::string>(const google::protobuf::Message& request)> key_field{};
  // Without a key: true answers INVALID_ARGUMENT; false runs the method unguarded.
  bool key_required = true;
  // The tenant, from the metadata or the auth context; empty (or no callback) is
  // default_tenant.
  std::function<std::string(const ::grpc::ServerContextBase& context)> tenant{};
  std::string default_tenant = "default";
  // The fingerprint of the request. Default: fingerprint_of(request), its deterministic
  // serialization.
  std::function<Fingerprint(const google::protobuf::Message& request)> fingerprint{};
  // Which statuses are outcomes, stored and replayed. Default: is_outcome().
  std::function<bool(::grpc::StatusCode code)> store{};
  // Trailing metadata a method sets (Context::trailers) that is stored and replayed with its
  // answer; none by default. Credentials and session names (authorization, cookie,
  // set-cookie, grpc-*) are refused.
  std::vector<std::string> stored_trailers{};
  // Per-guard override of Options::in_flight (wait or raise).
  std::optional<InFlight> in_flight{};
  // Runs guarded methods as multi-step operations (Coordinator::call_steps): Context::attempt
  // is set, and the request's serialization is stored on the record (Attempt::request()), for
  // Guard::completer to finish an operation its server left.
  bool steps = false;
  // The callback API only: where the guarded call runs. Given, the callback method returns at
  // once and the call (the store's work, a duplicate's wait, the body) runs in a task passed
  // to it, which finishes the reactor; gRPC's callback threads are never held. Default: on
  // the callback thread itself.
  std::function<void(std::function<void()> task)> executor{};
};

// Whether `code` is an outcome (stored and replayed) by default: OK and the business errors
// (INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED, FAILED_PRECONDITION,
// OUT_OF_RANGE, UNIMPLEMENTED). Not an outcome, so the key is released for a retry: CANCELLED,
// UNKNOWN, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, INTERNAL, UNAVAILABLE, DATA_LOSS and
// UNAUTHENTICATED (the client may come back with fresh credentials).
bool is_outcome(::grpc::StatusCode code) noexcept;

// The default fingerprint: SHA-256 of the request's deterministic serialization (fields in
// field-number order, maps sorted), so reordering a message's fields in its .proto, or
// renaming them, keeps the fingerprint; changing a field's number or type does not.
Fingerprint fingerprint_of(const google::protobuf::Message& request);

// Thread-safety: safe for concurrent use once built; the coordinator must outlive it.
class Guard {
 public:
  // Throws idem::error(errc::invalid_argument) for an empty key_metadata or default_tenant, a
  // stored trailer that is a credential or session name, or in_flight (or Options::in_flight)
  // InFlight::run.
  explicit Guard(Coordinator& coordinator, GuardOptions options = {});
  ~Guard();
  Guard(const Guard&) = delete;
  Guard& operator=(const Guard&) = delete;

  // A method of the synchronous API: runs `body` at most once per key and returns what the
  // client gets (above). `method` is the full method name ("/package.Service/Method"), the
  // operation of the key. The reply is filled by `body`, or parsed from the stored answer on a
  // replay. Never throws.
  ::grpc::Status unary(::grpc::ServerContext& context, std::string_view method,
                       const google::protobuf::Message& request, google::protobuf::Message& reply,
                       const Body& body);

  // A method of the callback API: the same, finishing the context's default reactor, which it
  // returns. Without GuardOptions::executor the call runs on the calling (callback) thread, and
  // a duplicate that waits holds that thread for its wait (bounded by the client's deadline
  // and Options::max_wait); with one, it runs there after the method returned: `body` is
  // copied into the task, so it must capture by value (the request and reply pointers, not
  // references to the method's parameters).
  ::grpc::ServerUnaryReactor* unary(::grpc::CallbackServerContext& context, std::string_view method,
                                    const google::protobuf::Message& request,
                                    google::protobuf::Message& reply, const Body& body);

  // For the completer (MaintenanceThread::resume, Completer::on, under the method's full
  // name) of a multi-step method (GuardOptions::steps) whose server left it: parses the
  // request stored on the record into `request`, runs `body` (Context::attempt set; it fills
  // `reply`) and returns its answer in the form unary() stores, for the client's retry to
  // replay. Throws std::runtime_error if the stored request does not parse or the status is
  // not an outcome (the completer counts a failure; the progress stays for the next pass or
  // the retry), and whatever `body` throws.
  Response resume(Attempt& attempt, google::protobuf::Message& request,
                  google::protobuf::Message& reply, const Body& body) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// --- The client side ------------------------------------------------------------------------

// A fresh idempotency key: a random UUID (version 4) from std::random_device. Make one per
// operation, before its first attempt, and send it unchanged with every retry.
std::string new_key();

struct RetryOptions {
  std::string key_metadata = "idempotency-key";  // as GuardOptions::key_metadata
  int max_attempts = 5;                          // the first attempt included
  std::chrono::milliseconds initial_backoff{100};
  std::chrono::milliseconds max_backoff{2000};
  double multiplier = 2;
  // The longest wait before a retry, the server's "retry-after-ms" included: a server that
  // asks for longer (a holder whose lease ends later, a proxy's bad value) gets its answer
  // returned instead of a client asleep for that long.
  std::chrono::milliseconds max_wait{30000};
  // How the helper waits before a retry. Default: std::this_thread::sleep_for.
  std::function<void(std::chrono::milliseconds)> sleep{};
};

// One attempt of a call: makes it on `context` (a fresh one per attempt, the key already in
// its metadata; set its deadline here) and returns its status.
using ClientAttempt = std::function<::grpc::Status(::grpc::ClientContext& context)>;

// Calls `attempt` with `key` in the metadata, and again with the same key after UNAVAILABLE,
// DEADLINE_EXCEEDED or ABORTED: after those a retry with the same key is safe (the guard
// replays the first call's answer, waits for it or runs the method once) and may succeed.
// Before retry n it waits a backoff drawn between half and all of initial_backoff *
// multiplier^(n-1), at most max_backoff, and at least the server's "retry-after-ms"; when the
// server asks for more than max_wait, its answer is returned. Any other status, or the last
// attempt's, is returned. Throws idem::error(errc::invalid_argument) for an empty key or
// key_metadata, max_attempts below 1, a negative backoff or max_wait, or a multiplier below 1;
// the attempt's own exceptions pass through.
::grpc::Status call_with_key(std::string_view key, const ClientAttempt& attempt,
                             const RetryOptions& options = {});

}  // namespace idem::grpc
