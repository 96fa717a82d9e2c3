#include "idem/sim/driver.hpp"

namespace idem::sim {

void run(boost::asio::io_context& io, SimulatedClock& clock) {
  for (;;) {
    // Run everything that is ready. poll() stops the context when it runs out of work, so
    // restart before each round.
    do {
      io.restart();
    } while (io.poll() > 0);
    if (!clock.run_instant()) return;
  }
}

}  // namespace idem::sim
