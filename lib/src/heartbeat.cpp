#include "heartbeat.hpp"

#include <mutex>

#include "core.hpp"

namespace idem::detail {

struct Heartbeat::State : std::enable_shared_from_this<State> {
  CoordinatorCore& core;
  const KeyId id;  // a copy: a renewal in flight may outlive the call
  const std::int64_t token;
  std::mutex mutex;
  bool stopped = false;      // guarded by mutex
  Clock::TimerId timer = 0;  // guarded by mutex

  State(CoordinatorCore& c, KeyId k, std::int64_t t) : core(c), id(std::move(k)), token(t) {}

  void arm() {  // requires mutex
    timer = core.clock->call_at(core.now() + core.options.heartbeat, [weak = weak_from_this()] {
      if (auto self = weak.lock()) self->tick();
    });
  }

  // One renewal, on the clock's thread: a store that stalls holds that thread (and the other
  // timers) up for its reply deadline at most. The store is called without the lock, so
  // stopping (the action ended) never waits for a renewal a stalled store holds up.
  void tick() {
    {
      std::lock_guard lock(mutex);
      if (stopped) return;
    }
    bool renewed = true;
    std::string failure;
    try {
      renewed = core.latency.time(StoreCall::renew, [&] {
        return core.store->renew(id, token, core.now() + core.options.lease);
      });
    } catch (const std::exception& e) {
      failure = e.what();
    }
    std::lock_guard lock(mutex);
    if (stopped) return;
    if (!failure.empty()) {
      bump(core.counters.store_errors);
      core.log(LogLevel::warning, "renew_failed", short_hash(id), id.operation, token, failure);
    } else if (!renewed) {
      bump(core.counters.lease_lost);
      core.log(LogLevel::error, "lease_lost", short_hash(id), id.operation, token,
               "renewal refused: the lease was taken over");
      stopped = true;
      return;
    }
    arm();
  }
};

Heartbeat::Heartbeat(CoordinatorCore& core, const KeyId& id, std::int64_t token) {
  if (core.options.heartbeat.count() == 0) return;
  state_ = std::make_shared<State>(core, id, token);
  std::lock_guard lock(state_->mutex);
  state_->arm();
}

Heartbeat::~Heartbeat() {
  if (!state_) return;
  std::lock_guard lock(state_->mutex);
  state_->stopped = true;
  state_->core.clock->cancel(state_->timer);
}

}  // namespace idem::detail
