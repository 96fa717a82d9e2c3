#include "app.hpp"

#include <boost/beast/http/error.hpp>

#include "idem/http.hpp"

namespace idem::demo {

namespace bh = boost::beast::http;

std::optional<Reply> read_failure(const boost::beast::error_code& ec) {
  if (ec == bh::error::body_limit) {
    return problem_reply(413, "payload_too_large", "Payload too large",
                         "the body exceeds the server's limit");
  }
  if (ec == bh::error::header_limit) {
    return problem_reply(431, "headers_too_large", "Request header fields too large",
                         "the header section exceeds the server's limit");
  }
  static const auto& http_errors = boost::beast::error_code(bh::error::bad_method).category();
  if (ec.category() == http_errors && ec != bh::error::end_of_stream &&
      ec != bh::error::partial_message) {
    return problem_reply(400, "bad_request", "Malformed HTTP request", ec.message());
  }
  return std::nullopt;
}

void finish_reply(Reply& res, bool keep_alive) {
  res.version(11);
  res.set(bh::field::server, "idem-demo");
  // RFC 9110 §6.6.1: an origin server with a clock sends Date (the layer never stores one).
  res.set(
      bh::field::date,
      http_date(std::chrono::floor<std::chrono::milliseconds>(std::chrono::system_clock::now())));
  if (!res.body().empty() && res.find(bh::field::content_type) == res.end())
    res.set(bh::field::content_type, "application/json");
  res.keep_alive(keep_alive);
  // A chunked reply keeps its Transfer-Encoding: prepare_payload() would make it
  // Content-Length.
  if (res.find(bh::field::content_length) == res.end() && !res.chunked()) res.prepare_payload();
}

Reply problem_reply(int status, std::string_view code, std::string_view title,
                    std::string_view detail) {
  return http::to_reply(problem(status, code, title, detail));
}

Reply body_reply(int status, std::string body, std::string_view content_type) {
  return http::to_reply(
      Response{status, std::move(body), {{"Content-Type", std::string(content_type)}}});
}

Reply method_not_allowed(std::string_view allow) {
  Reply r = problem_reply(405, "method_not_allowed", "Method not allowed",
                          "this resource accepts " + std::string(allow));
  r.set(boost::beast::http::field::allow, std::string(allow));
  return r;
}

}  // namespace idem::demo
