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

void Store::load_many(std::span<StoreRead* const> reads) {
  for (StoreRead* r : reads) {
    try {
      r->record = load(*r->id);
    } catch (...) {  // a StoreError (CorruptRecordError included), or whatever load() threw
      r->error = std::current_exception();
    }
  }
}

std::unique_ptr<PendingApply> Store::start_apply(std::span<StoreOp* const>) { return nullptr; }
std::size_t Store::concurrent_applies() const noexcept { return 1; }
bool Store::remote() const noexcept { return false; }
StepStore* Store::steps() noexcept { return nullptr; }
std::uint64_t Store::add_change_listener(ChangeListener) { return 0; }
void Store::remove_change_listener(std::uint64_t) {}

StepStore& steps_of(Store& store) {
  StepStore* steps = store.steps();
  if (steps == nullptr) no_steps();
  return *steps;
}

namespace {

// Runs one op through apply() and rethrows its error.
StoreOp& apply_one(Store& store, StoreOp&& op) {
  StoreOp* one = &op;
  store.apply(std::span<StoreOp* const>(&one, 1));
  if (op.error) std::rethrow_exception(op.error);
  return op;
}

}  // namespace

Reservation Store::reserve(const KeyId& id, const Fingerprint& fingerprint, TimePoint now,
                           TimePoint lease_until) {
  return std::move(apply_one(*this, StoreOp{.kind = StoreOp::Kind::reserve,
                                            .id = &id,
                                            .fingerprint = &fingerprint,
                                            .now = now,
                                            .lease_until = lease_until})
                       .reservation);
}

bool Store::complete(const KeyId& id, std::int64_t token, const StoredResponse& response,
                     TimePoint expires_at) {
  return apply_one(*this, StoreOp{.kind = StoreOp::Kind::complete,
                                  .id = &id,
                                  .expires_at = expires_at,
                                  .token = token,
                                  .response = &response})
      .applied;
}

bool Store::release(const KeyId& id, std::int64_t token, TimePoint now) {
  return apply_one(*this,
                   StoreOp{.kind = StoreOp::Kind::release, .id = &id, .now = now, .token = token})
      .applied;
}

std::optional<Record> Store::store_if_absent(const KeyId& id, const Fingerprint& fingerprint,
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
