#include "idem/store_wrapper.hpp"

#include "idem/errors.hpp"

namespace idem {

StoreWrapper::StoreWrapper(std::shared_ptr<Store> target) : target_(std::move(target)) {
  if (!target_) throw error(errc::invalid_argument, "idem: StoreWrapper needs a store to wrap");
}

bool StoreWrapper::renew(const KeyId& id, std::int64_t token, TimePoint lease_until) {
  return target_->renew(id, token, lease_until);
}

std::optional<Record> StoreWrapper::load(const KeyId& id) { return target_->load(id); }

void StoreWrapper::apply(std::span<StoreOp* const> ops) { target_->apply(ops); }

std::unique_ptr<PendingApply> StoreWrapper::start_apply(std::span<StoreOp* const>) {
  return nullptr;
}

std::size_t StoreWrapper::concurrent_applies() const noexcept {
  return target_->concurrent_applies();
}

bool StoreWrapper::remote() const noexcept { return target_->remote(); }

StepStore* StoreWrapper::steps() noexcept { return target_->steps() != nullptr ? this : nullptr; }

std::optional<Progress> StoreWrapper::begin_steps(const KeyId& id, std::int64_t token,
                                                  const std::string& request) {
  return steps_of(*target_).begin_steps(id, token, request);
}

bool StoreWrapper::mark_pending(const KeyId& id, std::int64_t token, std::int64_t origin,
                                const std::string& step, const LeaseCheck& lease) {
  return steps_of(*target_).mark_pending(id, token, origin, step, lease);
}

bool StoreWrapper::commit_step(const KeyId& id, std::int64_t token, std::int64_t origin,
                               const StepCommit& step) {
  return steps_of(*target_).commit_step(id, token, origin, step);
}

std::vector<AbandonedOperation> StoreWrapper::abandoned(TimePoint idle_before, TimePoint now,
                                                        std::size_t limit,
                                                        std::span<const std::string> operations) {
  return steps_of(*target_).abandoned(idle_before, now, limit, operations);
}

std::vector<OutboxMessage> StoreWrapper::claim_outbox(TimePoint now, TimePoint claim_until,
                                                      std::size_t limit) {
  return steps_of(*target_).claim_outbox(now, claim_until, limit);
}

std::size_t StoreWrapper::outbox_delivered(std::span<const std::string> ids, TimePoint now) {
  return steps_of(*target_).outbox_delivered(ids, now);
}

void StoreWrapper::outbox_failed(const std::string& id, TimePoint retry_at, bool park,
                                 const std::string& why) {
  steps_of(*target_).outbox_failed(id, retry_at, park, why);
}

OutboxCounts StoreWrapper::outbox_counts() { return steps_of(*target_).outbox_counts(); }

std::uint64_t StoreWrapper::add_change_listener(ChangeListener listener) {
  return target_->add_change_listener(std::move(listener));
}

void StoreWrapper::remove_change_listener(std::uint64_t id) { target_->remove_change_listener(id); }

std::size_t StoreWrapper::purge_outbox(TimePoint delivered_before, std::size_t limit) {
  return steps_of(*target_).purge_outbox(delivered_before, limit);
}

std::size_t StoreWrapper::purge_expired(TimePoint now, std::size_t limit) {
  return target_->purge_expired(now, limit);
}

std::vector<ReapedRecord> StoreWrapper::reap(TimePoint lease_ended_before, std::size_t limit) {
  return target_->reap(lease_ended_before, limit);
}

}  // namespace idem
