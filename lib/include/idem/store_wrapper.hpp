// idem — a Store that forwards every operation to another Store: the base for decorators
// (fault injection, tracing, metrics), in the manner of LevelDB's EnvWrapper. A decorator
// derives from it and overrides only what it changes. Every write of a record reaches it
// through apply() or renew() (Store's single writes are apply() of one op), so a decorator
// that overrides those two sees them all; every read reaches its load() (load_many() is not
// forwarded: Store's default calls load() for each, unless the decorator overrides it).
#pragma once

#include <memory>

#include "idem/store.hpp"

namespace idem {

// Thread-safety: as the target's (the wrapper adds no state).
class StoreWrapper : public Store, public StepStore {
 public:
  // Throws idem::error(errc::invalid_argument) if `target` is null.
  explicit StoreWrapper(std::shared_ptr<Store> target);

  // The wrapped store.
  Store& target() const noexcept { return *target_; }

  void apply(std::span<StoreOp* const> ops) override;
  bool renew(const KeyId& id, std::int64_t token, TimePoint lease_until) override;
  std::optional<Record> load(const KeyId& id) override;
  std::size_t purge_expired(TimePoint now, std::size_t limit) override;
  std::vector<ReapedRecord> reap(TimePoint lease_ended_before, std::size_t limit) override;
  // Null: batches go through apply(), so a decorator that overrides it sees them. One that
  // can forward its target's start_apply() (ReplayCache) overrides this.
  std::unique_ptr<PendingApply> start_apply(std::span<StoreOp* const> ops) override;
  // The target's.
  std::size_t concurrent_applies() const noexcept override;
  bool remote() const noexcept override;
  std::uint64_t add_change_listener(ChangeListener listener) override;
  void remove_change_listener(std::uint64_t id) override;
  // This wrapper when the target has steps (each step call goes to the target's), else null.
  StepStore* steps() noexcept override;

  // The target's StepStore (steps() is null when the target has none).
  std::optional<Progress> begin_steps(const KeyId& id, std::int64_t token,
                                      const std::string& request) override;
  bool mark_pending(const KeyId& id, std::int64_t token, std::int64_t origin,
                    const std::string& step, const LeaseCheck& lease) override;
  bool commit_step(const KeyId& id, std::int64_t token, std::int64_t origin,
                   const StepCommit& step) override;
  std::vector<AbandonedOperation> abandoned(TimePoint idle_before, TimePoint now, std::size_t limit,
                                            std::span<const std::string> operations) override;
  std::vector<OutboxMessage> claim_outbox(TimePoint now, TimePoint claim_until,
                                          std::size_t limit) override;
  std::size_t outbox_delivered(std::span<const std::string> ids, TimePoint now) override;
  void outbox_failed(const std::string& id, TimePoint retry_at, bool park,
                     const std::string& why) override;
  OutboxCounts outbox_counts() override;
  std::size_t purge_outbox(TimePoint delivered_before, std::size_t limit) override;

 private:
  std::shared_ptr<Store> target_;
};

}  // namespace idem
