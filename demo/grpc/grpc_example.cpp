// A gRPC service of your own with idem in front of its method (docs/grpc.md shows this file).
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <iostream>
#include <string>

#include "idem/grpc.hpp"
#include "idem/sqlite_store.hpp"
#include "payments.grpc.pb.h"

class PaymentsService final : public payments::Payments::Service {
 public:
  explicit PaymentsService(idem::Coordinator& idem) : guard_(idem) {}

  grpc::Status Charge(grpc::ServerContext* context, const payments::ChargeRequest* request,
                      payments::ChargeReply* reply) override {
    return guard_.unary(*context, "/payments.Payments/Charge", *request, *reply,
                        [&](idem::grpc::Context&) {
                          // The effect: runs at most once per idempotency key.
                          reply->set_charge_id("ch_" + std::to_string(++charges));
                          reply->set_amount(request->amount());
                          return grpc::Status::OK;
                        });
  }

  std::atomic<int> charges{0};

 private:
  idem::grpc::Guard guard_;
};

int main() {
  idem::Coordinator idem(std::make_shared<idem::SqliteStore>(":memory:"), idem::Options{});
  PaymentsService service(idem);
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  const std::unique_ptr<grpc::Server> server = builder.BuildAndStart();

  // The client: one key for the operation, kept by every retry (here three calls).
  auto stub = payments::Payments::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  const std::string key = idem::grpc::new_key();
  payments::ChargeRequest request;
  request.set_amount(4990);
  request.set_currency("RUB");
  request.set_order_id("A-10023");
  for (int attempt = 0; attempt < 3; ++attempt) {
    payments::ChargeReply reply;
    const grpc::Status status = idem::grpc::call_with_key(
        key, [&](grpc::ClientContext& context) { return stub->Charge(&context, request, &reply); });
    std::cout << status.error_code() << ' ' << reply.charge_id() << '\n';
  }
  server->Shutdown();
  std::cout << "charges: " << service.charges << '\n';
  return service.charges == 1 ? 0 : 1;
}
