#include "heartbeat.hpp"

#include <mutex>

#include "core.hpp"

namespace idem::detail {

struct Heartbeat::State : std::enable_shared_from_this<State> {
  CoordinatorCore& core;
  const Call& call;  // the flow's, which outlives its heartbeat
  const std::int64_t token;
  std::mutex mutex;
  bool stopped = false;      // guarded by mutex
  Clock::TimerId timer = 0;  // guarded by mutex

  State(CoordinatorCore& c, const Call& k, std::int64_t t) : core(c), call(k), token(t) {}

  void arm() {  // requires mutex
    timer = core.clock->call_at(core.now() + core.options.heartbeat, [weak = weak_from_this()] {
      if (auto self = weak.lock()) self->tick();
    });
  }

  void tick() {
    std::lock_guard lock(mutex);
    if (stopped) return;
    try {
      if (!core.store->renew(call.id, token, core.now() + core.options.lease)) {
        bump(core.counters.lease_lost);
        core.log(LogLevel::error, "lease_lost", call, token,
                 "renewal refused: the lease was taken over");
        stopped = true;
        return;
      }
    } catch (const std::exception& e) {
      bump(core.counters.store_errors);
      core.log(LogLevel::warning, "renew_failed", call, token, e.what());
    }
    arm();
  }
};

Heartbeat::Heartbeat(CoordinatorCore& core, const Call& call, std::int64_t token) {
  if (core.options.heartbeat.count() == 0) return;
  state_ = std::make_shared<State>(core, call, token);
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
