#include "idem/sim/driver.hpp"

namespace idem::sim {

std::size_t run(boost::asio::io_context& io, SimulatedClock& clock) {
  std::size_t events = 0;
  for (;;) {
    // Run everything that is ready. poll() stops the context when it runs out of work, so
    // restart before each round.
    for (;;) {
      io.restart();
      const std::size_t ran = io.poll();
      if (ran == 0) break;
      events += ran;
    }
    if (!clock.run_instant()) return events;
    ++events;
  }
}

}  // namespace idem::sim
