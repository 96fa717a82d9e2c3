// Whether a call looks at its key's record before it writes a reservation.
//
// Both ways decide the same (a reservation that finds a live record returns it, and the call
// goes on from there as if a read had found it); they differ in price. A fresh key's read
// finds nothing and costs a read transaction, a tenth of a protected call. A duplicate found
// by the reservation instead costs a write transaction: the write lock, shared with every
// process on the file, for an answer a read would have given. So calls reserve at once while
// duplicates are rare, and read first while more than about one recent call in eight of this
// coordinator found a live record (a retry storm, a replay-heavy client) or had to wait for
// another process's write lock (see contended()).
//
// The rate is a moving average over roughly the last sixteen calls that reached a record or a
// reservation. Thread-safety: safe for concurrent use; concurrent updates may each miss the
// other's, which only blurs the average.
#pragma once

#include <atomic>
#include <cstdint>

namespace idem::detail {

class ReadFirst {
 public:
  // Whether the next call should read before it reserves.
  bool now() const noexcept { return rate_.load(std::memory_order_relaxed) > kThreshold; }
  // A call found a live record (replay, wait, in progress, key reuse).
  void found() noexcept { update(kOne); }
  // A call reserved a key that no live record held.
  void fresh() noexcept { update(0); }
  // A write had to wait for another writer's lock (another process on the file). Counts as
  // a found record: back-to-back write transactions leave the other process no gap to take
  // the lock in, and a read between them does.
  void contended() noexcept { update(kOne); }

 private:
  static constexpr std::uint32_t kOne = 1u << 16;  // the rate in fixed point: kOne is 100 %
  static constexpr std::uint32_t kThreshold = kOne / 8;
  static constexpr int kShift = 4;  // each call weighs 1/16

  void update(std::uint32_t sample) noexcept {
    const std::uint32_t r = rate_.load(std::memory_order_relaxed);
    rate_.store(r - (r >> kShift) + (sample >> kShift), std::memory_order_relaxed);
  }

  std::atomic<std::uint32_t> rate_{0};
};

}  // namespace idem::detail
