// idem — completed records held in process memory, in front of any store.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "idem/clock.hpp"
#include "idem/store_wrapper.hpp"

namespace idem {

struct ReplayCacheOptions {
  // The most bytes the cached records may take (keys, fingerprint, status, headers, body and
  // a fixed allowance per entry); the least recently used go first. Default: 64 MiB.
  std::size_t max_bytes = std::size_t{64} << 20;
  // The clock the Coordinator uses (its Options::clock): a record is served only before its
  // expires_at on it. Default (null): a SystemClock, the Coordinator's default.
  std::shared_ptr<Clock> clock{};
};

// A Store decorator that answers a replay, or a key-reuse check, of a hot key from memory:
// a completed record never changes until it expires (no write of the Store contract touches
// a live completed record), so once read or found it is kept and served until its
// expires_at, with no database round trip: load(), and reserve() and store_if_absent() (one
// by one or through apply()) that meet it, return it as the store would. Everything else,
// and every write, goes to the wrapped store. An in-progress or released record is never
// cached, and nothing is served at or after its expires_at.
//
// Off unless you wrap your store in it:
//   auto store = std::make_shared<idem::ReplayCache>(std::make_shared<idem::PgStore>(...),
//                                                   idem::ReplayCacheOptions{.clock = clock});
// What it cannot see: a record deleted or changed behind idem's back (by hand, or by a
// migration) stays served from this process's memory until it expires or is evicted. And a
// record's expires_at is kept as the store gave it when read: over PgStore with
// PgClock::database, that is the database's time moved onto this node's clock by the offset
// measured then, so if this node's clock steps or drifts afterwards, a held record ends that
// much early or late on it (the store, re-measuring every clock_refresh, would not). Keep
// the node's clock disciplined (NTP slewing, no steps), or leave the cache off.
//
// Thread-safety: safe for concurrent use (one lock around the entries; the wrapped store is
// called without it).
class ReplayCache final : public StoreWrapper {
 public:
  // Throws idem::error(errc::invalid_argument) if `target` is null or max_bytes is 0.
  ReplayCache(std::shared_ptr<Store> target, ReplayCacheOptions options = {});
  ~ReplayCache() override;

  std::optional<Record> load(const KeyId& id) override;
  // As load() for each: what the cache holds is answered at once, the rest goes to the
  // target's load_many() together.
  void load_many(std::span<StoreRead* const> reads) override;
  void apply(std::span<StoreOp* const> ops) override;
  // As apply(): what the cache answers is decided at once, the rest goes to the target's
  // start_apply() (or its apply(), when it cannot), and what it finds is remembered.
  std::unique_ptr<PendingApply> start_apply(std::span<StoreOp* const> ops) override;

  struct Stats {
    std::uint64_t hits = 0;       // answered from memory
    std::uint64_t misses = 0;     // looked up and not there (or no longer live)
    std::uint64_t evictions = 0;  // dropped to stay within max_bytes
    std::uint64_t expired = 0;    // dropped at their expires_at
    std::size_t entries = 0;
    std::size_t bytes = 0;
  };
  Stats stats() const;
  // The counters in Prometheus' text format (idem_replay_cache_*), to append to
  // MetricsSnapshot::to_prometheus().
  std::string to_prometheus() const;

 private:
  // Answers the ops it holds a record for; returns the others.
  std::vector<StoreOp*> answer_held(std::span<StoreOp* const> ops);
  // Remembers the completed records the target's answers to `ops` found.
  void remember_all(std::span<StoreOp* const> ops);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem
