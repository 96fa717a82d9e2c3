#include "idem/test_control.hpp"

#include <atomic>

namespace idem::test_control {
namespace {

std::atomic<unsigned> switches{0};  // one bit per Mutation

unsigned bit(Mutation m) noexcept { return 1u << static_cast<unsigned>(m); }

}  // namespace

void set(Mutation m, bool on) noexcept {
  if (on) {
    switches.fetch_or(bit(m), std::memory_order_relaxed);
  } else {
    switches.fetch_and(~bit(m), std::memory_order_relaxed);
  }
}

bool enabled(Mutation m) noexcept {
  return (switches.load(std::memory_order_relaxed) & bit(m)) != 0;
}

}  // namespace idem::test_control
