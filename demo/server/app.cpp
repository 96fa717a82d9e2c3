#include "app.hpp"

#include "idem/http.hpp"

namespace idem::demo {

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
