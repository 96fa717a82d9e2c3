#include "idem/sim/driver.hpp"

namespace idem::sim {

std::size_t run(boost::asio::io_context& io, SimulatedClock& clock) {
  std::size_t events = 0;
  for (;;) {
    // poll() runs every ready handler and every one those make ready, until none is left
    // (a second poll would find nothing: each costs a look at the reactor, a system call).
    // It stops the context when it runs out of work, so restart before each round.
    io.restart();
    events += io.poll();
    if (!clock.run_instant()) return events;
    ++events;
  }
}

}  // namespace idem::sim
