// idem — the storage interface: atomic operations on one record per key.
//
// A Store does no policy: it reserves, completes, releases and loads records atomically,
// and the Coordinator decides what those outcomes mean. SqliteStore is the engine that
// ships; another engine implements this interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "idem/clock.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/response.hpp"

namespace idem {

enum class State : int {
  in_progress = 1,  // reserved; the owner holds a lease and a fencing token
  completed = 2,    // the response is stored and replayed until expires_at
  released = 3,     // the owner failed and let go: counts as absent
};

struct Record {
  Fingerprint fingerprint;
  State state = State::in_progress;
  std::int64_t token = 0;  // fencing token; grows with every reservation or takeover
  TimePoint lease_until;   // in_progress: the lease's end
  TimePoint created_at;    // when this reservation was made
  TimePoint expires_at;    // when the record stops counting: the lease's end while in
                           // progress, the TTL's end once completed, the release time
  Response response;       // completed only
  std::string body_ref;    // completed only: non-empty when the body is stored elsewhere
  std::optional<std::string> recovery_point;  // last finished step (SPEC §7)

  // Whether the record still counts at `now`: an in_progress record within its lease, a
  // completed record within its TTL. A record that does not count is as good as absent.
  bool live_at(TimePoint now) const noexcept {
    switch (state) {
      case State::in_progress:
        return now < lease_until;
      case State::completed:
        return now < expires_at;
      case State::released:
        return false;
    }
    return false;
  }
};

// The body of a completed record as the store keeps it: inline, or by reference.
struct StoredResponse {
  Response response;     // body empty when body_ref is set
  std::string body_ref;  // reference from PayloadStore::put, or empty
};

struct Reservation {
  enum class Kind {
    reserved,    // the key was absent (or its record no longer counted): caller owns it
    taken_over,  // an in_progress record whose lease had expired: caller owns it now
    existing,    // a live record holds the key: see `existing`
  };
  Kind kind = Kind::reserved;
  std::int64_t token = 0;                     // the caller's token when it owns the key
  std::optional<std::string> recovery_point;  // kept on a takeover by the same request
  std::optional<Record> existing;             // Kind::existing only
};

// A reservation the reaper cleared (SPEC §8).
struct ReapedRecord {
  std::string key_hash;  // short_hash of the key, never the key
  std::string operation;
  std::int64_t token = 0;
  TimePoint lease_until;
};

// One write for Store::apply: the inputs of reserve(), complete(), release() or
// store_if_absent(), and room for the result. The pointers belong to the caller and must
// stay valid until apply() has returned.
struct StoreOp {
  enum class Kind { reserve, complete, release, store_if_absent };
  Kind kind = Kind::reserve;
  const KeyId* id = nullptr;
  const Fingerprint* fingerprint = nullptr;  // reserve, store_if_absent
  TimePoint now{};                           // reserve, release, store_if_absent
  TimePoint lease_until{};                   // reserve
  TimePoint expires_at{};                    // complete, store_if_absent
  std::int64_t token = 0;                    // complete, release
  const StoredResponse* response = nullptr;  // complete, store_if_absent

  // Results. reserve: `reservation`. complete and release: `applied` (false: the token was
  // not current). store_if_absent: `reservation`, Kind::existing with the live record that
  // won, or Kind::reserved when this op stored its response. `error` holds the StoreError
  // if this op failed; then the other results mean nothing and nothing of this op was
  // written.
  Reservation reservation{};
  bool applied = false;
  std::exception_ptr error{};
};

// Thread-safety: implementations must be safe for concurrent use from many threads, and
// atomic against other processes sharing the same storage.
// Errors: every operation throws StoreError when the storage cannot be used; an
// operation that throws changed nothing.
class Store {
 public:
  virtual ~Store() = default;

  // One atomic step: if no record for `id` counts at `now` (absent, expired, released,
  // or in_progress with an expired lease), makes an in_progress record with `fingerprint`
  // and a new token larger than any earlier token of this key, leased until
  // `lease_until`; otherwise returns the live record untouched.
  virtual Reservation reserve(const KeyId& id, const Fingerprint& fingerprint, TimePoint now,
                              TimePoint lease_until) = 0;

  // in_progress -> completed with `response`, only if `token` is still current (and the
  // record still in_progress). Returns false, changing nothing, if it is not (lease lost).
  virtual bool complete(const KeyId& id, std::int64_t token, const StoredResponse& response,
                        TimePoint expires_at) = 0;

  // in_progress -> released, only if `token` is current. Returns false if it is not.
  virtual bool release(const KeyId& id, std::int64_t token, TimePoint now) = 0;

  // Extends the lease of an in_progress record to `lease_until`, only if `token` is current.
  // Returns false, changing nothing, if it is not (the lease was taken over, or the record
  // was completed, released, reaped or purged): the caller no longer holds the key.
  virtual bool renew(const KeyId& id, std::int64_t token, TimePoint lease_until) = 0;

  // Records the last finished step of a multi-step operation, only if `token` is current
  // (and the record in progress). Returns false, changing nothing, if it is not.
  virtual bool set_recovery_point(const KeyId& id, std::int64_t token,
                                  const std::string& point) = 0;

  // The record as stored (live or not), or nullopt.
  virtual std::optional<Record> load(const KeyId& id) = 0;

  // For InFlight::run, which does not reserve: stores a completed record if none counts
  // at `now` and returns nullopt; otherwise returns the live record that won.
  virtual std::optional<Record> store_if_absent(const KeyId& id, const Fingerprint& fingerprint,
                                                const StoredResponse& response, TimePoint now,
                                                TimePoint expires_at) = 0;

  // Applies several writes, each with its own outcome, as if one after another in `ops`
  // order: a conflict or a stale token in one op never fails its neighbours. An engine may
  // commit them in one transaction (SqliteStore does; the coordinator's group commit hands
  // it the writes of every call that is ready at once); no result may be acted on before
  // its write is durable as configured. Never throws: failures go to StoreOp::error. The
  // default runs reserve(), complete(), release() and store_if_absent() one by one.
  virtual void apply(std::span<StoreOp* const> ops);

  // Deletes up to `limit` records that no longer count (completed past expires_at, or
  // released) in one short transaction. Returns how many it deleted.
  virtual std::size_t purge_expired(TimePoint now, std::size_t limit) = 0;

  // Deletes up to `limit` in_progress records whose lease ended before `lease_ended_before`
  // and returns them.
  virtual std::vector<ReapedRecord> reap(TimePoint lease_ended_before, std::size_t limit) = 0;
};

}  // namespace idem
