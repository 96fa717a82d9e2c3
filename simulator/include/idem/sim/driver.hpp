// idem::sim — runs an Asio io_context on simulated time.
#pragma once

#include <boost/asio/io_context.hpp>
#include <cstddef>

#include "idem/sim/simulated_clock.hpp"

namespace idem::sim {

// Runs every ready handler of `io`; when none is ready, moves `clock` to its next deadline
// and runs everything due at that instant (so simultaneous events share one turn); stops when
// nothing is ready and nothing is scheduled. All waits inside must go through `clock`
// (idem::async_sleep_until, the coordinator's waits, the simulated provider), never through real
// timers. Single-threaded: call it from the one thread that runs `io`. Returns how many
// handlers ran and instants passed (a measure of the scenario's size).
std::size_t run(boost::asio::io_context& io, SimulatedClock& clock);

}  // namespace idem::sim
