#include "idem/beast.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <boost/asio/buffer.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/http/field.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/write.hpp>
#include <cctype>
#include <cmath>
#include <exception>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "awaiting.hpp"
#include "drive.hpp"
#include "idem/asio.hpp"
#include "idem/http.hpp"
#include "sha256.hpp"

namespace idem::http {
namespace {

// Thrown out of the coordinator's action when the handler's reply is not kept: the storage
// policy says it is not an outcome, or its body is over LayerOptions::max_stored_body
// (too_large). The coordinator releases the key and rethrows it; the layer then sends the
// reply it kept, marked with kNotStoredHeader when too large.
struct Unstored {
  bool too_large = false;
};

// Carries the handler's own exception through the coordinator (which releases the key), so
// that an idem::error the handler threw is not mistaken for the layer's.
struct HandlerThrew {
  std::exception_ptr error;
};

// How many operations' usual durations are remembered for Retry-After.
constexpr std::size_t kTimedOperations = 1024;

std::string_view sv(boost::beast::string_view s) { return {s.data(), s.size()}; }

// Fields about this connection or this message's framing: never stored, never replayed
// (the server that sends the replay writes its own).
bool per_message(std::string_view name) {
  for (std::string_view f : {"Connection", "Keep-Alive", "Transfer-Encoding", "Content-Length",
                             "TE", "Trailer", "Upgrade", "Proxy-Connection", "Date", "Server"}) {
    if (boost::beast::iequals({name.data(), name.size()}, {f.data(), f.size()})) return true;
  }
  return false;
}

// Fields that carry a session or credentials (session_fields()): never stored, never
// replayed, whatever LayerOptions say.
constexpr std::array<std::string_view, 4> kSessionFields{
    "Set-Cookie", "Set-Cookie2", "Authentication-Info", "Proxy-Authentication-Info"};

// Whether `name` is one of `names`, case-insensitively.
template <class Names>
bool named(std::string_view name, const Names& names) {
  return std::any_of(names.begin(), names.end(), [name](std::string_view n) {
    return boost::beast::iequals({name.data(), name.size()}, {n.data(), n.size()});
  });
}

std::string_view path_of(const Request& req) {
  const std::string_view target = sv(req.target());
  return target.substr(0, target.find('?'));
}

std::string default_operation(const Request& req) {
  std::string op = fmt::format("{} {}", sv(req.method_string()), path_of(req));
  if (op.size() <= kMaxKeyBytes) return op;
  // A path too long for an operation name: its start and a digest of the whole.
  return fmt::format("{}#{}", op.substr(0, 200), detail::hex(detail::sha256({op}), 16));
}

Fingerprint default_fingerprint(const Request& req) {
  // Neither a target nor a field value holds a line break, so
  // "<target>\n<content type>\n<body>" is unambiguous. The target carries the query: the
  // same key with ?amount=100 and ?amount=999 is two requests.
  const auto type = req.find(boost::beast::http::field::content_type);
  std::string canonical(sv(req.target()));
  canonical += '\n';
  if (type != req.end()) canonical += sv(type->value());
  canonical += '\n';
  canonical += req.body();
  return Fingerprint::of_bytes(canonical);
}

}  // namespace

std::function<Fingerprint(const Request&)> json_fields(std::vector<std::string> fields) {
  return [fields = std::move(fields)](const Request& req) {
    const nlohmann::json body = nlohmann::json::parse(req.body(), nullptr, false);
    if (body.is_discarded()) throw error(errc::invalid_argument, "the body is not valid JSON");
    if (!body.is_object()) throw error(errc::invalid_argument, "the body must be a JSON object");
    return Fingerprint::of(body, fields);
  };
}

std::vector<std::string> session_fields() { return {kSessionFields.begin(), kSessionFields.end()}; }

bool is_outcome(unsigned status) {
  // 408, 425 and 429 say "not now" (timeout, too early, rate limited): stored, they would
  // refuse the key for its whole TTL.
  return status < 500 && status != 408 && status != 425 && status != 429;
}

Reply to_reply(const Response& r) {
  Reply out;
  out.version(11);
  out.result(static_cast<unsigned>(r.status));
  for (const Header& h : r.headers) out.insert(h.name, h.value);
  out.body() = r.body;
  out.prepare_payload();
  return out;
}

Reply to_reply(const error& e) { return to_reply(to_http(e)); }

namespace {

// The request as a multi-step operation stores it for its completer: method, target,
// Content-Type and body, as an HTTP/1.1 message (Beast writes and parses it). No other field
// is kept: credentials never reach the store.
std::string stored_request(const Request& req) {
  Request kept{req.method(), req.target(), 11};
  if (const auto it = req.find(boost::beast::http::field::content_type); it != req.end())
    kept.set(boost::beast::http::field::content_type, it->value());
  kept.body() = req.body();
  kept.prepare_payload();
  std::ostringstream out;
  out << kept;
  return out.str();
}

Request parse_stored_request(const std::string& text) {
  boost::beast::http::request_parser<boost::beast::http::string_body> parser;
  parser.eager(true);
  parser.body_limit(text.size());
  boost::beast::error_code ec;
  parser.put(boost::asio::buffer(text), ec);
  if (ec || !parser.is_done()) {
    throw std::runtime_error(fmt::format("idem: the stored request does not parse: {}",
                                         ec ? ec.message() : std::string("incomplete")));
  }
  return parser.release();
}

}  // namespace

struct Layer::Impl {
  Coordinator& coordinator;
  LayerOptions o;
  std::mutex mutex;
  std::unordered_map<std::string, double> usual_ms;  // operation -> moving average of runs

  Impl(Coordinator& c, LayerOptions options) : coordinator(c), o(std::move(options)) {
    if (o.key_header.empty())
      throw error(errc::invalid_argument, "LayerOptions::key_header is empty");
    if (o.default_tenant.empty())
      throw error(errc::invalid_argument, "LayerOptions::default_tenant is empty");
    if (o.expected_duration.count() <= 0)
      throw error(errc::invalid_argument, "LayerOptions::expected_duration must be positive");
    if (o.in_flight.value_or(c.options().in_flight) == InFlight::run) {
      throw error(errc::invalid_argument,
                  "InFlight::run cannot serve HTTP: a duplicate's own reply would differ from "
                  "the stored one; use raise or wait");
    }
    if (o.replayed_header.empty())
      throw error(errc::invalid_argument, "LayerOptions::replayed_header is empty");
  }

  // What prepare() decided.
  struct Prepared {
    std::optional<Reply> answer;  // sent at once; the handler does not run
    bool protect = false;         // false (and no answer): pass through to the handler
    idem::Request call;
    Context context;
  };

  Reply key_problem(std::string_view code, std::string_view title, std::string detail) const {
    return documented(to_reply(problem(400, code, title, detail)));
  }

  // The draft asks 400 and 422 answers to point at the service's documentation.
  Reply documented(Reply r) const {
    const unsigned status = r.result_int();
    if (!o.documentation.empty() && (status == 400 || status == 422))
      r.set(boost::beast::http::field::link,
            fmt::format("<{}>; rel=\"describedby\"", o.documentation));
    return r;
  }

  Prepared prepare(const Request& req) {
    Prepared p;
    if (std::find(o.methods.begin(), o.methods.end(), req.method()) == o.methods.end()) return p;
    const auto [first, last] = req.equal_range(o.key_header);
    const auto fields = std::distance(first, last);
    if (fields == 0) {
      if (!o.key_required) return p;
      p.answer = key_problem(
          "idempotency_key_required", "Idempotency key required",
          fmt::format("{} {} needs an {} header: a client-generated key (a UUID) sent unchanged "
                      "with every retry of this request",
                      sv(req.method_string()), path_of(req), o.key_header));
      return p;
    }
    if (fields > 1) {
      p.answer = key_problem("idempotency_key_invalid", "Invalid idempotency key",
                             fmt::format("{} was sent {} times; a request carries exactly one key",
                                         o.key_header, fields));
      return p;
    }
    const std::optional<std::string> key = parse_idempotency_key(sv(first->value()));
    if (!key) {
      p.answer = key_problem(
          "idempotency_key_invalid", "Invalid idempotency key",
          fmt::format("{} is neither a bare key (no comma, no double quote) nor one RFC 8941 "
                      "string with well-formed parameters, if any (a comma-separated list is not "
                      "a key)",
                      o.key_header));
      return p;
    }
    try {
      validate_key_part("key", *key);
      if (o.check) {
        if (std::optional<Reply> refused = o.check(req)) {
          p.answer = std::move(refused);
          return p;
        }
      }
      p.call.tenant = o.tenant ? o.tenant(req) : std::string();
      if (p.call.tenant.empty()) p.call.tenant = o.default_tenant;
      p.call.operation = o.operation ? o.operation(req) : default_operation(req);
      p.call.key = *key;
      p.call.fingerprint = o.fingerprint ? o.fingerprint(req) : default_fingerprint(req);
      p.call.in_flight = o.in_flight;
    } catch (const error& e) {
      p.answer = documented(to_reply(e));
      return p;
    }
    p.protect = true;
    p.context = Context{KeyId{p.call.tenant, p.call.operation, *key}, true};
    return p;
  }

  // The record's form of a reply the handler returned; throws Unstored when it is not an
  // outcome.
  Response stored_form(const Reply& r) const {
    const bool outcome = o.store ? o.store(r) : is_outcome(r.result_int());
    if (!outcome) throw Unstored{};
    if (o.max_stored_body && r.body().size() > *o.max_stored_body) throw Unstored{true};
    Response s;
    s.status = static_cast<int>(r.result_int());
    for (const auto& f : r) {
      const std::string_view name = sv(f.name_string());
      if (per_message(name) || named(name, kSessionFields) || named(name, o.unstored_headers))
        continue;
      if (!o.stored_headers.empty() && !named(name, o.stored_headers)) continue;
      s.headers.push_back({std::string(name), std::string(f.value())});
    }
    if (!o.replay_large_bodies && r.body().size() > o.large_body) {
      s.headers.push_back({"Idempotent-Body-Omitted", std::to_string(r.body().size())});
    } else {
      s.body = r.body();
    }
    return s;
  }

  // What the client gets for a call that returned: the handler's own reply when it ran in
  // this call, the stored one otherwise; marked as a replay and with the key's expiry.
  Reply answer(const Outcome& out, std::optional<Reply>& ran) const {
    Reply r = !out.replayed() && ran ? std::move(*ran) : to_reply(out.response);
    if (out.replayed()) r.set(o.replayed_header, "true");
    if (out.expires_at != TimePoint{})
      r.set(std::string(kExpiresHeader), http_date(out.expires_at));
    return r;
  }

  // After the handler returned `reply`: its duration noted for Retry-After (for a bounded
  // number of operations: the default operation is the client's path), its stored form made.
  Response ran(const std::string& operation, TimePoint started, const Reply& reply) {
    const double ms = static_cast<double>((coordinator.clock().now() - started).count());
    {
      std::lock_guard lock(mutex);
      if (const auto it = usual_ms.find(operation); it != usual_ms.end()) {
        it->second = 0.8 * it->second + 0.2 * ms;
      } else if (usual_ms.size() < kTimedOperations) {
        usual_ms.emplace(operation, ms);
      }
    }
    return stored_form(reply);
  }

  // The one body of handle() (P: drive.hpp's Blocking) and async_handle() (P: awaiting.hpp's
  // Awaiting): `handler` runs through the coordinator, at most once per key.
  template <class P, class H>
  typename P::template Task<Reply> serve(const Request& request, const H& handler) {
    Prepared p = prepare(request);
    if (p.answer) co_return std::move(*p.answer);
    if (!p.protect) {
      Reply passed = co_await P::run(handler, request, p.context);
      co_return passed;
    }
    const std::string operation = p.call.operation;
    std::optional<Reply> replied;
    std::optional<Outcome> out;
    std::exception_ptr failure;
    // The handler's run, timed and in its stored form (a coroutine: the context is copied in).
    const auto run = [&](Context context) -> typename P::template Task<Response> {
      const TimePoint started = coordinator.clock().now();
      std::exception_ptr threw;
      try {
        Reply reply = co_await P::run(handler, request, context);
        replied = std::move(reply);
      } catch (...) {
        threw = std::current_exception();
      }
      if (threw) throw HandlerThrew{threw};
      co_return ran(operation, started, *replied);
    };
    try {
      if (o.steps) {
        p.call.payload = stored_request(request);
        const auto action = [&](Attempt& attempt) {
          Context context = p.context;
          context.attempt = &attempt;
          return run(context);
        };
        Outcome done = co_await P::call(coordinator, std::move(p.call), action);
        out = std::move(done);
      } else {
        const auto action = [&] { return run(p.context); };
        Outcome done = co_await P::call(coordinator, std::move(p.call), action);
        out = std::move(done);
      }
    } catch (...) {
      failure = std::current_exception();
    }
    co_return conclude(failure, out, replied, operation);
  }

  // The answer once the coordinator returned `out` or threw `failure`. A reply the policy
  // did not store goes out as the handler made it; the handler's own exception propagates
  // unchanged; idem's errors become their HTTP answers.
  Reply conclude(std::exception_ptr failure, const std::optional<Outcome>& out,
                 std::optional<Reply>& handler_reply, const std::string& operation) {
    if (!failure) return answer(*out, handler_reply);
    try {
      std::rethrow_exception(failure);
    } catch (const Unstored& u) {
      Reply r = std::move(*handler_reply);
      if (u.too_large) r.set(std::string(kNotStoredHeader), "body-too-large");
      return r;
    } catch (const HandlerThrew& t) {
      // A step's own errors are idem's answers to give: the request lost the key (its reply
      // never stored as the key's outcome), or an effect may have happened (never "nothing
      // happened").
      try {
        std::rethrow_exception(t.error);
      } catch (const LeaseLostError& e) {
        return refusal(e, operation);
      } catch (const OutcomeUnknownError& e) {
        return documented(to_reply(e));
      }
    } catch (const error& e) {
      return refusal(e, operation);
    }
  }

  Reply refusal(const error& e, const std::string& operation) {
    const auto* busy = dynamic_cast<const InProgressError*>(&e);
    if (busy == nullptr) return documented(to_reply(e));
    double usual = static_cast<double>(o.expected_duration.count());
    {
      std::lock_guard lock(mutex);
      if (const auto it = usual_ms.find(operation); it != usual_ms.end()) usual = it->second;
    }
    const double ms = std::min(static_cast<double>(busy->retry_after().count()), usual);
    const long long seconds = std::max(1LL, static_cast<long long>(std::ceil(ms / 1000)));
    Reply r = to_reply(
        problem(409, http_error_code(e), "A request with this idempotency key is in progress",
                fmt::format("a request with this idempotency key is in progress; retry after {} s "
                            "(it holds the key for up to {} ms more)",
                            seconds, busy->retry_after().count())));
    r.set(boost::beast::http::field::retry_after, std::to_string(seconds));
    return r;
  }
};

Layer::Layer(Coordinator& coordinator, LayerOptions options)
    : impl_(std::make_unique<Impl>(coordinator, std::move(options))) {}
Layer::~Layer() = default;

Reply Layer::handle(const Request& request, const Handler& handler) {
  return impl_->serve<detail::Blocking>(request, handler).get();
}

std::string Layer::policy() const {
  const Impl& d = *impl_;
  nlohmann::json methods = nlohmann::json::array();
  for (Verb v : d.o.methods) methods.push_back(sv(boost::beast::http::to_string(v)));
  const Options& c = d.coordinator.options();
  const InFlight in_flight = d.o.in_flight.value_or(c.in_flight);
  const auto seconds = [](std::chrono::milliseconds ms) { return ms.count() / 1000; };
  nlohmann::json ttl_by_operation = nlohmann::json::object();
  for (const auto& [operation, ttl] : c.ttl_by_operation)
    ttl_by_operation[operation] = seconds(ttl);
  const nlohmann::json policy = {
      {"specification", "draft-ietf-httpapi-idempotency-key-header-07"},
      {"header", d.o.key_header},
      {"methods", methods},
      {"key_required", d.o.key_required},
      {"key_format", fmt::format("an RFC 8941 sf-string or a bare value without comma or quote; "
                                 "1 to {} printable ASCII bytes",
                                 kMaxKeyBytes)},
      {"scope", d.o.tenant ? "tenant (from the request's credentials), operation, key"
                           : "operation, key (one tenant)"},
      {"operation", d.o.operation ? "named by the service" : "method and path"},
      {"fingerprint",
       d.o.fingerprint ? "named request fields" : "target, Content-Type and body bytes"},
      {"reuse_with_another_payload", 422},
      {"expires_after_seconds", seconds(c.ttl)},
      {"expires_after_seconds_by_operation", ttl_by_operation},
      {"in_flight", in_flight == InFlight::wait
                        ? "the duplicate waits for the first and gets its response"
                        : "409 with Retry-After"},
      {"stored", d.o.store ? "as the service decides"
                           : "status below 500 but 408, 425 and 429; those release the key"},
      {"max_stored_body_bytes",
       d.o.max_stored_body ? nlohmann::json(*d.o.max_stored_body) : nlohmann::json(nullptr)},
      {"replayed_header", d.o.replayed_header},
      {"expires_header", kExpiresHeader},
      {"on_store_failure", c.on_store_failure == FailureMode::fail_closed
                               ? "503, nothing runs"
                               : "the request runs unprotected"}};
  return policy.dump();
}

boost::asio::awaitable<Reply> Layer::async_handle(const Request& request,
                                                  const AsyncHandler& handler) {
  co_return co_await impl_->serve<detail::Awaiting>(request, handler);
}

boost::asio::awaitable<Response> Layer::resume(Attempt& attempt, const AsyncHandler& handler) {
  const Impl& d = *impl_;
  const Request request = parse_stored_request(attempt.request());
  const Context context{attempt.id(), true, &attempt};
  const Reply reply = co_await handler(request, context);
  try {
    co_return d.stored_form(reply);
  } catch (const Unstored& u) {
    if (u.too_large) {
      throw std::runtime_error(fmt::format(
          "the handler's body of {} bytes is over max_stored_body ({}); the progress stays for "
          "the next try",
          reply.body().size(), *d.o.max_stored_body));
    }
    throw std::runtime_error(
        fmt::format("the handler answered {}, not an outcome; the progress stays for the next try",
                    reply.result_int()));
  }
}

}  // namespace idem::http
