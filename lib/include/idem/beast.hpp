// idem — the HTTP layer: idempotency keys (draft-ietf-httpapi-idempotency-key-header) in
// front of any Boost.Beast request handler, plain or coroutine (target idem::http).
//
//   idem::http::Layer layer(coordinator);                   // POST and PATCH protected
//   Reply r = layer.handle(request, [&](const Request& req, const Context& call) {
//     return create_order(req, derived_key(call.id, "order"));  // runs once per key
//   });
//
// For each request the layer decides whether it is protected (by method, per layer), reads
// the key (one Idempotency-Key field: an RFC 8941 sf-string or a bare key), the tenant, the
// operation and the fingerprint, and runs the handler through the coordinator. What the
// client sees (docs/http.md):
//   400 idempotency_key_required / idempotency_key_invalid - no key (when required), a
//       malformed one, or the field sent twice; the handler does not run, nothing is stored;
//   409 idempotency_key_in_use with Retry-After (whole seconds, >= 1) - the key is held by
//       a request still running (InFlight::raise, or a wait that ran out);
//   422 idempotency_key_reuse - a live key with another fingerprint; the record is untouched;
//   503 store_unavailable - the store failed under FailureMode::fail_closed;
//   409 lease_lost - the handler ran but its lease was taken over (its reply is not sent);
//   503 outcome_unknown - a multi-step handler's step failed after an effect may have happened
//       (OutcomeUnknownError): retry with the same key, never a new one;
//   the handler's reply otherwise: stored when LayerOptions::store says so (2xx, 3xx and
//   4xx but 408/425/429 by default) and then replayed to every duplicate with status, the headers
//   the handler set (never session_fields() nor LayerOptions::unstored_headers) and the body
//   bytes, plus "Idempotent-Replayed: true" and "Idempotency-Key-Expires"; a reply that is
//   not stored (5xx by default, or a body over LayerOptions::max_stored_body, marked
//   "Idempotent-Not-Stored") releases the key, so the retry runs again: a handler answers a
//   5xx (or throws) only before any effect, or makes its effects steps (LayerOptions::steps),
//   whose progress the release keeps and the retry resumes.
// Errors are application/problem+json (RFC 9457) with a stable "error" member (idem/http.hpp).
//
// This header brings Beast and Asio; the rest of idem needs neither.
#pragma once

#include <utility>  // Boost 1.74's awaitable.hpp needs std::exchange declared first

#include <boost/asio/awaitable.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/verb.hpp>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/coordinator.hpp"
#include "idem/http.hpp"
#include "idem/steps.hpp"

namespace idem::http {

using Request = boost::beast::http::request<boost::beast::http::string_body>;
using Reply = boost::beast::http::response<boost::beast::http::string_body>;
using Verb = boost::beast::http::verb;

// What a handler learns about its call.
struct Context {
  // The record's identity (for derived_key()). Empty parts when the request is not
  // protected: a method the layer passes through, or no key under key_required = false.
  KeyId id;
  bool protected_call = false;
  // LayerOptions::steps: the multi-step attempt the handler runs its steps on
  // (idem/steps.hpp); null otherwise.
  Attempt* attempt = nullptr;
};

// Response fields that carry a session or credentials: Set-Cookie, Set-Cookie2,
// Authentication-Info, Proxy-Authentication-Info. The layer never stores or replays them,
// whatever its options say (LayerOptions::unstored_headers adds the service's own): the first
// caller gets them from its own handler run; a duplicate, perhaps another person behind the
// same tenant, never gets the first one's session.
std::vector<std::string> session_fields();

// The two shapes of handler the layer runs. A handler's exception propagates out of the
// layer unchanged after the key is released (the retry runs again), but for idem's own errors
// from its steps, which the layer answers: LeaseLostError as 409 lease_lost, OutcomeUnknownError
// as 503 outcome_unknown (neither stored).
using Handler = std::function<Reply(const Request&, const Context&)>;
using AsyncHandler = std::function<boost::asio::awaitable<Reply>(const Request&, const Context&)>;

// The field on a reply that was an outcome but was not kept (LayerOptions::max_stored_body):
// its value says why ("body-too-large"); the key is free and a retry runs again.
inline constexpr std::string_view kNotStoredHeader = "Idempotent-Not-Stored";

struct LayerOptions {
  // The methods this layer protects; any other method passes through to the handler
  // untouched even with a key (a GET is never replayed). One layer per route gives each
  // route its own set. Default: POST and PATCH.
  std::vector<Verb> methods{Verb::post, Verb::patch};

  // The key's header field, matched case-insensitively. Default: Idempotency-Key.
  std::string key_header = "Idempotency-Key";

  // true: a protected request without a key is 400 idempotency_key_required and nothing
  // runs. false: it runs once, unprotected (Context::protected_call false). Default: true.
  bool key_required = true;

  // The tenant of a request (e.g. from its credentials), or empty for default_tenant. Runs
  // only for protected requests with a key. May throw idem::error (mapped like idem's own)
  // or anything else (propagates).
  std::function<std::string(const Request&)> tenant{};
  std::string default_tenant = "default";

  // The operation, or empty for "<METHOD> <path>" (the target without its query).
  std::function<std::string(const Request&)> operation{};

  // The request's fingerprint, or empty for the default: a digest of the target (path and
  // query), the Content-Type field value and the body bytes. json_fields() builds one from
  // named JSON fields.
  std::function<Fingerprint(const Request&)> fingerprint{};

  // Validation that runs after the key is read and before anything is stored: a reply it
  // returns is sent as it is, nothing is stored and the key stays free. Default: none.
  std::function<std::optional<Reply>(const Request&)> check{};

  // Which replies are outcomes, stored and replayed. Default: is_outcome(status): 2xx, 3xx
  // and 4xx such as a 402 decline are outcomes; a 5xx is a failure and 408, 425 and 429 say
  // "not now": the key is released.
  std::function<bool(const Reply&)> store{};

  // Response fields neither stored nor replayed besides session_fields(), which never are,
  // matched case-insensitively: the caller whose request ran gets them, a duplicate never
  // does. The service's own session or credential fields (an X-Session-Token). Default: none.
  std::vector<std::string> unstored_headers{};
  // If not empty, the only response fields stored and replayed (an allow-list, matched
  // case-insensitively; unstored_headers still apply). Default: empty, every field but those.
  std::vector<std::string> stored_headers{};

  // Replies with a body over large_body bytes are large. The coordinator keeps bodies
  // over Options::inline_body_limit in its PayloadStore by reference; with
  // replay_large_bodies = false a large body is not kept at all, and a replay carries
  // status and headers, an empty body and "Idempotent-Body-Omitted: <bytes>" (the key stays
  // taken: a retry is answered, never run again). Defaults: 1 MiB, true.
  std::size_t large_body = std::size_t{1} << 20;
  bool replay_large_bodies = true;

  // The largest body, in bytes, of a reply kept for replay. A reply the storage policy calls
  // an outcome but whose body is larger is kept not at all (neither status, headers nor
  // body): its caller gets it whole, with "Idempotent-Not-Stored: body-too-large"
  // (kNotStoredHeader), and the key is released as after a 5xx, so a retry runs the handler
  // again. Where large_body with replay_large_bodies = false keeps the outcome and drops
  // only its body, this keeps nothing and frees the key; checked first, it wins when both
  // apply. With steps, the progress stays for the retry, and resume() throws as for a reply
  // that is not an outcome. Default: nullopt, no limit.
  std::optional<std::size_t> max_stored_body{};

  // Retry-After of a 409: the holder's remaining lease, capped by how long this layer's
  // runs of the operation usually take (a moving average), or by expected_duration before
  // the first run finished; rounded up to whole seconds, at least 1.
  std::chrono::milliseconds expected_duration{std::chrono::seconds(1)};

  // Where the service documents its idempotency policy (which routes need a key, how long
  // keys live): sent as Link: <url>; rel="describedby" on the layer's 400 and 422 answers,
  // as the draft asks. Default: none.
  std::string documentation{};

  // The duplicate of a request in flight: raise (409, as the draft asks) or wait (it gets
  // the first's answer); nullopt: the coordinator's Options::in_flight. InFlight::run is
  // refused (the layer could not answer every duplicate with the stored reply). Default:
  // raise.
  std::optional<InFlight> in_flight{InFlight::raise};

  // The header that marks a replay ("true"); no name is standard yet (Stripe's spelling is
  // the default; some clients expect "Idempotency-Replayed").
  std::string replayed_header{kReplayedHeader};
  // Runs protected requests as multi-step operations (Coordinator::call_steps): the handler
  // gets Context::attempt, a 5xx or an exception keeps the progress for the retry, and the
  // request is stored on the record (method, target, Content-Type and body; never other
  // fields, so no credentials: take the tenant from Context::id) so that resume() can
  // finish it without its client. Needs a store with progress (SqliteStore, PgStore). Default:
  // false.
  bool steps = false;
};

// The default storage policy: true for a status below 500 other than 408, 425 and 429.
bool is_outcome(unsigned status);

// A fingerprint of the named top-level fields of a JSON body (Fingerprint::of). A body
// that is not JSON is 400 invalid_request, nothing stored.
std::function<Fingerprint(const Request&)> json_fields(std::vector<std::string> fields);

// Thread-safety: one Layer may serve many threads and io_contexts at once.
class Layer {
 public:
  // Throws idem::error(errc::invalid_argument) for an empty key_header, default_tenant or
  // replayed_header, a non-positive expected_duration, or InFlight::run.
  // `coordinator` must outlive the layer.
  explicit Layer(Coordinator& coordinator, LayerOptions options = {});
  ~Layer();
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  // The reply for `request`, running `handler` at most once per key (blocking handlers,
  // Coordinator::call). Never throws for a bad request; rethrows the handler's exceptions.
  Reply handle(const Request& request, const Handler& handler);

  // The same for coroutine handlers (async_call). `request` and `handler` must live until
  // the returned awaitable completes: co_await it at once.
  boost::asio::awaitable<Reply> async_handle(const Request& request, const AsyncHandler& handler);

  // For the completer (Completer, Maintenance::resume) of a layer with steps: runs `handler`
  // again on the request stored on the record, with Context::attempt, and returns the reply
  // in its stored form. Throws std::runtime_error if the reply is not an outcome (a 5xx) or
  // the stored request does not parse, and whatever the handler throws.
  boost::asio::awaitable<Response> resume(Attempt& attempt, const AsyncHandler& handler);

  // The layer's idempotency policy as JSON, for the service to publish (the draft asks every
  // resource to): header, protected methods, whether the key is required, its format,
  // scope, fingerprint, expiry (the coordinator's TTL), in-flight behaviour, what is stored.
  std::string policy() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// idem's error as a reply (problem+json; InProgressError with Retry-After from the lease).
Reply to_reply(const error& e);

// A Response (idem/response.hpp, idem/http.hpp's problem()) as a reply: status, headers in
// order, body, Content-Length.
Reply to_reply(const Response& r);

}  // namespace idem::http
