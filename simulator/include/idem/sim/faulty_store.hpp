// idem::sim — a store outage on demand.
#pragma once

#include <atomic>
#include <memory>

#include "idem/store.hpp"

namespace idem::sim {

// Wraps a real Store and makes chosen operations fail with StoreError, the way a disk that
// stops taking writes or a database that cannot be reached would (the idea of LevelDB's
// FaultInjectionTestEnv). Operations not switched to fail go to the real store.
//
// Thread-safety: as the wrapped store; the switches are atomic.
class FaultyStore final : public Store {
 public:
  explicit FaultyStore(std::shared_ptr<Store> inner) : inner_(std::move(inner)) {}

  std::atomic<bool> fail_reserve{false};   // reserve() and store_if_absent()'s first look
  std::atomic<bool> fail_complete{false};  // complete() and store_if_absent()
  std::atomic<bool> fail_release{false};
  std::atomic<bool> fail_load{false};

  // Every switch at once: the store is unreachable.
  void set_unreachable(bool down) {
    fail_reserve = down;
    fail_complete = down;
    fail_release = down;
    fail_load = down;
  }

  Reservation reserve(const KeyId& id, const Fingerprint& fp, TimePoint now, TimePoint lease) override;
  bool complete(const KeyId& id, std::int64_t token, const StoredResponse& r, TimePoint expires) override;
  bool release(const KeyId& id, std::int64_t token, TimePoint now) override;
  bool renew(const KeyId& id, std::int64_t token, TimePoint lease) override;
  bool set_recovery_point(const KeyId& id, std::int64_t token, const std::string& point) override;
  std::optional<Record> load(const KeyId& id) override;
  std::optional<Record> store_if_absent(const KeyId& id, const Fingerprint& fp,
                                        const StoredResponse& r, TimePoint now,
                                        TimePoint expires) override;
  std::size_t purge_expired(TimePoint now, std::size_t limit) override;
  std::vector<ReapedRecord> reap(TimePoint before, std::size_t limit) override;
  // With no fault switched on, the wrapped store's own apply() (its group commit).
  void apply(std::span<StoreOp* const> ops) override;

 private:
  std::shared_ptr<Store> inner_;
};

}  // namespace idem::sim
