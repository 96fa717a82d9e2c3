// The in-flight rules in one function: what a call does next, given what it has learned of its key.
// No I/O, no clock, no counters: the flow (flow.hpp) feeds it and performs its answer.
#pragma once

#include <chrono>

#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/options.hpp"
#include "idem/store.hpp"

namespace idem::detail {

// One call, validated (Coordinator::Impl::prepare).
struct Call {
  KeyId id;
  Fingerprint fingerprint;
  InFlight policy = InFlight::wait;
  std::chrono::milliseconds ttl{0};
  std::chrono::milliseconds margin{0};  // Options::call_margin for this operation
  bool has_key = true;  // false: no key, and Options::missing_key is run_unprotected
  bool steps = false;   // call_steps: its progress lives in the store, so never unprotected
};

// What the call has learned of its key.
struct Found {
  enum class Kind {
    no_key,        // the call carries no key
    store_failed,  // reading the record or writing the reservation failed (StoreError)
    nothing_live,  // a read found no record that counts now (absent, expired, released)
    owned,         // the reservation was written: this call holds the key with a new token
    live,          // a record that counts now holds the key (`record`)
  };
  Kind kind = Kind::nothing_live;
  const Record* record = nullptr;  // Kind::live only
};

enum class Decision {
  reserve,            // write a reservation (then decide again on what it found)
  run_reserved,       // run the action holding the key, then complete or release
  run_unreserved,     // InFlight::run: run with no reservation, then store if absent
  run_unprotected,    // run without the store: no key, or the store failed under fail_open
  replay,             // answer with the live record's stored response
  wait,               // another request holds the key: wait for its outcome, then decide again
  key_reuse,          // KeyReuseError: same key, other fingerprint
  in_progress,        // InProgressError: raise, or a wait that passed `give_up`
  store_unavailable,  // StoreError: the store failed under fail_closed
};

// The whole table. `give_up` is when a wait under InFlight::wait ends with InProgressError.
inline Decision decide(const Found& found, const Call& call, FailureMode on_store_failure,
                       TimePoint now, TimePoint give_up) {
  switch (found.kind) {
    case Found::Kind::no_key:
      return Decision::run_unprotected;
    case Found::Kind::store_failed:
      return on_store_failure == FailureMode::fail_closed || call.steps
                 ? Decision::store_unavailable
                 : Decision::run_unprotected;
    case Found::Kind::owned:
      return Decision::run_reserved;
    case Found::Kind::nothing_live:
      return call.policy == InFlight::run ? Decision::run_unreserved : Decision::reserve;
    case Found::Kind::live:
      break;
  }
  const Record& record = *found.record;
  // The fingerprint is checked before anything else about the record.
  if (record.fingerprint != call.fingerprint) return Decision::key_reuse;
  if (record.state == State::completed) return Decision::replay;
  // In progress: the in-flight policy.
  switch (call.policy) {
    case InFlight::run:
      return Decision::run_unreserved;  // the result cache does not look at reservations
    case InFlight::raise:
      return Decision::in_progress;
    case InFlight::wait:
      return now < give_up ? Decision::wait : Decision::in_progress;
  }
  return Decision::in_progress;
}

}  // namespace idem::detail
