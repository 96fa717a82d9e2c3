// idem::sim — a store outage on demand.
#pragma once

#include <atomic>
#include <memory>

#include "idem/errors.hpp"
#include "idem/store_wrapper.hpp"

namespace idem::sim {

// The operations of a Store, each of which FaultyStore can make fail.
enum class Operation : unsigned {
  reserve,
  complete,
  release,
  renew,
  load,
  store_if_absent,
  purge,
  reap,
  steps,         // begin_steps, commit_step, abandoned: a multi-step operation's other writes
  outbox,        // every outbox operation
  mark_pending,  // the write right before an external call (StepStore::mark_pending)
};

// Wraps a real Store and makes chosen operations fail with StoreError, the way a disk that
// stops taking writes or a database that cannot be reached would (the idea of LevelDB's
// FaultInjectionTestEnv). A failing operation changes nothing; the others go to the real
// store, and batched writes that are not failing still commit together.
//
// Thread-safety: as the wrapped store; the switches are atomic.
class FaultyStore final : public StoreWrapper {
 public:
  using StoreWrapper::StoreWrapper;

  // Makes `op` fail (or work again). The StoreError carries the SQLite code a real outage
  // of that kind would: SQLITE_IOERR_READ for load, SQLITE_FULL for complete,
  // store_if_absent and steps, SQLITE_IOERR_WRITE for the rest.
  void fail(Operation op, bool on = true) noexcept;
  bool failing(Operation op) const noexcept;
  // Every operation at once: the store is unreachable.
  void set_unreachable(bool down) noexcept;
  // Makes `op` lose its replies (or answer again): the operation goes to the wrapped store and
  // takes effect there, then the caller gets a StoreError, as when a connection breaks after
  // the database committed and before its answer arrived. (A failing operation fails first.)
  void lose_replies(Operation op, bool on = true) noexcept;
  bool losing(Operation op) const noexcept;
  // Whether remote() says true, as a store across a network does (PgStore), whatever the
  // wrapped store is; the coordinator then treats the store's failures as it would a
  // database server's. Default: the wrapped store's answer.
  void act_remote(bool on = true) noexcept { act_remote_ = on; }
  bool remote() const noexcept override { return act_remote_ || StoreWrapper::remote(); }

  // Ops whose operation is failing get the error; the rest go to the wrapped store's apply()
  // together (its group commit). Store's single writes (reserve() …) are apply() of one op.
  void apply(std::span<StoreOp* const> ops) override;
  bool renew(const KeyId& id, std::int64_t token, TimePoint lease) override;
  std::optional<Record> load(const KeyId& id) override;
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
  std::size_t purge_expired(TimePoint now, std::size_t limit) override;
  std::vector<ReapedRecord> reap(TimePoint before, std::size_t limit) override;

 private:
  void fail_if(Operation op) const;
  static StoreError lost_reply();
  // Runs `f` on the wrapped store unless `op` is failing; then throws a lost reply if `op`
  // loses its replies.
  template <class F>
  auto through(Operation op, F&& f) -> decltype(f()) {
    fail_if(op);
    auto result = f();
    if (losing(op)) throw lost_reply();
    return result;
  }
  std::atomic<unsigned> failing_{0};  // one bit per Operation
  std::atomic<bool> act_remote_{false};
  std::atomic<unsigned> losing_{0};  // one bit per Operation
};

}  // namespace idem::sim
