#include "idem/store.hpp"

#include "idem/errors.hpp"

namespace idem {
namespace {

[[noreturn]] void no_steps() {
  throw error(errc::invalid_argument,
              "idem: this store keeps no progress: multi-step operations and the outbox need "
              "an engine that implements them (SqliteStore and PgStore do)");
}

}  // namespace

std::unique_ptr<PendingApply> Store::start_apply(std::span<StoreOp* const>) { return nullptr; }

std::size_t Store::concurrent_applies() const noexcept { return 1; }

bool Store::remote() const noexcept { return false; }

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
          op.applied = release(*op.id, op.token, op.now);  // progress, if any, is not kept
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

std::optional<Progress> Store::begin_steps(const KeyId&, std::int64_t, const std::string&) {
  no_steps();
}
bool Store::mark_pending(const KeyId&, std::int64_t, std::int64_t, const std::string&,
                         const LeaseCheck&) {
  no_steps();
}
bool Store::commit_step(const KeyId&, std::int64_t, std::int64_t, const StepCommit&) { no_steps(); }
std::vector<AbandonedOperation> Store::abandoned(TimePoint, TimePoint, std::size_t,
                                                 std::span<const std::string>) {
  no_steps();
}
std::vector<OutboxMessage> Store::claim_outbox(TimePoint, TimePoint, std::size_t) { no_steps(); }
bool Store::outbox_delivered(const std::string&, TimePoint) { no_steps(); }
void Store::outbox_failed(const std::string&, TimePoint, bool, const std::string&) { no_steps(); }
OutboxCounts Store::outbox_counts() { no_steps(); }
std::uint64_t Store::add_change_listener(ChangeListener) { return 0; }
void Store::remove_change_listener(std::uint64_t) {}
std::size_t Store::purge_outbox(TimePoint, std::size_t) { no_steps(); }

namespace {

// Runs one op through apply() and rethrows its error.
StoreOp& apply_one(Store& store, StoreOp&& op) {
  StoreOp* one = &op;
  store.apply(std::span<StoreOp* const>(&one, 1));
  if (op.error) std::rethrow_exception(op.error);
  return op;
}

}  // namespace

Reservation BatchedStore::reserve(const KeyId& id, const Fingerprint& fingerprint, TimePoint now,
                                  TimePoint lease_until) {
  return std::move(apply_one(*this, StoreOp{.kind = StoreOp::Kind::reserve,
                                            .id = &id,
                                            .fingerprint = &fingerprint,
                                            .now = now,
                                            .lease_until = lease_until})
                       .reservation);
}

bool BatchedStore::complete(const KeyId& id, std::int64_t token, const StoredResponse& response,
                            TimePoint expires_at) {
  return apply_one(*this, StoreOp{.kind = StoreOp::Kind::complete,
                                  .id = &id,
                                  .expires_at = expires_at,
                                  .token = token,
                                  .response = &response})
      .applied;
}

bool BatchedStore::release(const KeyId& id, std::int64_t token, TimePoint now) {
  return apply_one(*this,
                   StoreOp{.kind = StoreOp::Kind::release, .id = &id, .now = now, .token = token})
      .applied;
}

std::optional<Record> BatchedStore::store_if_absent(const KeyId& id, const Fingerprint& fingerprint,
                                                    const StoredResponse& response, TimePoint now,
                                                    TimePoint expires_at) {
  return std::move(apply_one(*this, StoreOp{.kind = StoreOp::Kind::store_if_absent,
                                            .id = &id,
                                            .fingerprint = &fingerprint,
                                            .now = now,
                                            .expires_at = expires_at,
                                            .response = &response})
                       .reservation.existing);
}

}  // namespace idem
