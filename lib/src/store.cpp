#include "idem/store.hpp"

namespace idem {

void Store::apply(std::span<StoreOp* const> ops) {
  for (StoreOp* p : ops) {
    StoreOp& op = *p;
    try {
      switch (op.kind) {
        case StoreOp::Kind::reserve:
          op.reservation = reserve(*op.id, *op.fingerprint, op.now, op.lease_until);
          break;
        case StoreOp::Kind::complete:
          op.applied = complete(*op.id, op.token, *op.response, op.expires_at);
          break;
        case StoreOp::Kind::release:
          op.applied = release(*op.id, op.token, op.now);
          break;
        case StoreOp::Kind::store_if_absent:
          if (std::optional<Record> winner =
                  store_if_absent(*op.id, *op.fingerprint, *op.response, op.now, op.expires_at)) {
            op.reservation.kind = Reservation::Kind::existing;
            op.reservation.existing = std::move(winner);
          }
          break;
      }
    } catch (...) {
      op.error = std::current_exception();
    }
  }
}

}  // namespace idem
