// Renews a held lease every Options::heartbeat while the action runs, on the
// clock's thread.
#pragma once

#include <cstdint>
#include <memory>

#include "idem/key.hpp"

namespace idem::detail {

class CoordinatorCore;

// Starts renewing on construction (unless Options::heartbeat is 0); stops when destroyed,
// or when a renewal finds the lease lost (logged "lease_lost" and counted). A renewal that
// fails with StoreError is logged "renew_failed", counted, and tried again a period later.
class Heartbeat {
 public:
  Heartbeat(CoordinatorCore& core, const KeyId& id, std::int64_t token);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  struct State;
  std::shared_ptr<State> state_;  // shared with the pending timer, which holds it weakly
};

}  // namespace idem::detail
