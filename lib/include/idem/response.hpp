// idem — what an action returns, and what a duplicate gets back.
#pragma once

#include <string>
#include <vector>

namespace idem {

struct Header {
  std::string name;
  std::string value;
  friend bool operator==(const Header&, const Header&) = default;
};

// The outcome of an action: success or a business rejection (a 402 "insufficient funds"
// is an outcome, stored and replayed like a 200). Infrastructure failures are not
// responses: the action throws, the key is released and the exception propagates.
struct Response {
  int status = 200;
  std::string body;             // bytes, usually JSON; replayed byte for byte
  std::vector<Header> headers;  // names and values in UTF-8 (SqliteStore keeps them as JSON;
                                // other bytes make completing fail with StoreError)
  friend bool operator==(const Response&, const Response&) = default;
};

}  // namespace idem
