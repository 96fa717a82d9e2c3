// idem-demo grpc-serve and grpc-call: the payments service of demo/grpc/payments.proto over
// gRPC, each method behind an idem::grpc::Guard, and a client that makes a key once and
// retries with it (idem::grpc::call_with_key). No gRPC type here: only grpc_demo.cpp includes
// gRPC's headers.
#pragma once

#include <string>

namespace idem::demo {

struct GrpcServeArgs {
  std::string host = "127.0.0.1";
  int port = 0;                 // 0: any free port (printed on stderr)
  std::string db;               // keys, orders, outbox: a SQLite file or a postgresql:// URI
  std::string ledger;           // provider ledger and mail journal (SQLite file; empty: memory)
  std::string policy = "wait";  // a duplicate that arrives while the first runs: wait or raise
  long long provider_latency_ms = 300;
  bool provider_dedup = true;  // off: a second debit would be a second charge
  long long lease_ms = 30000;
  bool fail_closed = false;  // UNAVAILABLE instead of running when the store fails
};

// Serves until SIGINT or SIGTERM; prints "idem-demo: serving gRPC payments on HOST:PORT ..."
// on stderr once it listens. Returns the exit code.
int run_grpc_serve(const GrpcServeArgs& args);

struct GrpcCallArgs {
  std::string target;             // host:port of a grpc-serve
  std::string method = "charge";  // charge or checkout
  std::string key;                // empty: a fresh one (idem::grpc::new_key)
  std::string api_key = "sk_test_alpha";
  long long amount = 4990;
  std::string currency = "RUB";
  std::string order_id = "A-10023";
  int attempts = 5;               // the first call and its retries with the same key
  long long deadline_ms = 10000;  // each attempt's deadline
  int parallel = 1;               // this many identical calls at once, with the same key
};

// Prints one JSON line per call (code, message, the reply's fields, the trailing metadata,
// the key, attempts) and, with parallel > 1, a summary line (calls, ok, charge_ids: the
// distinct charge ids the calls got). Returns 0 when every call ended OK, 1 otherwise.
int run_grpc_call(const GrpcCallArgs& args);

}  // namespace idem::demo
