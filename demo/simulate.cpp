// `idem-demo simulate`: seeded whole-system scenarios from the command line.
#include <fmt/format.h>

#include <sqlite3.h>
#include <array>
#include <chrono>
#include <ctime>
#include <fstream>
#include <iostream>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>

#include "commands.hpp"
#include "idem/sim/simulation.hpp"
#include "idem/test_control.hpp"

namespace idem::demo {
namespace {

test_control::Mutation mutation_named(const std::string& name) {
  using test_control::Mutation;
  if (name == "complete_without_token_check") return Mutation::complete_without_token_check;
  if (name == "wait_runs_unprotected") return Mutation::wait_runs_unprotected;
  if (name == "release_without_wake") return Mutation::release_without_wake;
  if (name == "takeover_reuses_token") return Mutation::takeover_reuses_token;
  if (name == "skip_lease_check") return Mutation::skip_lease_check;
  throw std::invalid_argument(fmt::format("unknown mutation '{}'", name));
}

double cpu_seconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

}  // namespace

int run_simulate(const SimulateArgs& args) {
  // Before SQLite starts in this process: nothing here reads SQLite's memory statistics,
  // which otherwise take a global mutex on every allocation (about 4% of a scenario's
  // instructions). If SQLite has started already, this is refused and changes nothing.
  sqlite3_config(SQLITE_CONFIG_MEMSTATUS, 0);
  if (!args.mutation.empty()) {
    test_control::set(mutation_named(args.mutation), true);
    std::cout << "mutation " << args.mutation << " is ON: idem is broken on purpose\n";
  }
  std::uint64_t seed = args.seed;
  if (args.minutes > 0) seed = std::random_device{}() * 65536ull + std::random_device{}();
  const auto wall_start = std::chrono::steady_clock::now();
  const auto wall_end = wall_start + std::chrono::duration<double, std::ratio<60>>(args.minutes);
  const double cpu_start = cpu_seconds();
  std::uint64_t ran = 0, failed = 0;
  std::size_t requests = 0, attempts = 0, events = 0, crashes = 0, faults = 0, pauses = 0;
  long long simulated_ms = 0;
  std::array<std::size_t, sim::kInvariantCount> checked{};
  std::optional<sim::ScenarioResult> drawn;  // the first failure, else the first scenario
  sim::ScenarioOptions options;
  options.requests = args.steps;
  options.trace = args.trace;
  for (;; ++seed) {
    if (args.minutes > 0 ? std::chrono::steady_clock::now() >= wall_end : ran >= args.scenarios)
      break;
    sim::ScenarioOptions this_one = options;
    this_one.trace = options.trace || (!args.svg.empty() && !drawn);
    const sim::ScenarioResult r = sim::simulate(seed, this_one);
    if (!args.svg.empty() && (!drawn || (drawn->ok() && !r.ok())) && !r.trace.empty()) drawn = r;
    ++ran;
    requests += r.requests;
    attempts += r.attempts;
    events += r.events;
    crashes += r.crashes;
    faults += r.faults;
    pauses += r.pauses;
    simulated_ms += r.simulated_ms;
    for (std::size_t i = 0; i < checked.size(); ++i) checked[i] += r.checked[i];
    if (!r.ok()) {
      ++failed;
      std::cout << sim::describe(r) << std::flush;
    } else if (args.trace) {
      std::cout << sim::describe(r);
    }
  }
  const double cpu = cpu_seconds() - cpu_start;
  if (drawn) {
    const sim::TimelinePanel panel = sim::timeline_of(*drawn);
    std::ofstream out(args.svg, std::ios::binary | std::ios::trunc);
    out << sim::timeline_svg(fmt::format("idem-demo simulate --seed {}", drawn->seed),
                             std::span<const sim::TimelinePanel>(&panel, 1));
    if (!out) throw std::runtime_error(fmt::format("cannot write {}", args.svg));
    std::cout << "wrote " << args.svg << " (seed " << drawn->seed << ")\n";
  }
  const double n = ran == 0 ? 1.0 : static_cast<double>(ran);
  std::cout << fmt::format(
      "simulated {} scenarios (seeds {}..{}): {} failed\n"
      "{:.0f} scenarios per CPU-minute ({:.2f} CPU s); an average scenario: {:.1f} requests, "
      "{:.1f} attempts, {:.1f} events, {:.2f} crashes, {:.2f} store faults, {:.2f} pauses, {:.0f} "
      "simulated ms\n",
      ran, seed - ran, seed == 0 ? 0 : seed - 1, failed,
      cpu > 0 ? static_cast<double>(ran) * 60.0 / cpu : 0.0, cpu, static_cast<double>(requests) / n,
      static_cast<double>(attempts) / n, static_cast<double>(events) / n,
      static_cast<double>(crashes) / n, static_cast<double>(faults) / n,
      static_cast<double>(pauses) / n, static_cast<double>(simulated_ms) / n);
  std::cout << "each invariant judged:";
  for (std::size_t i = 0; i < checked.size(); ++i) {
    std::cout << fmt::format("{} {} {}", i == 0 ? "" : ",",
                             sim::to_string(static_cast<sim::Invariant>(i)), checked[i]);
  }
  std::cout << "\n";
  return failed == 0 ? 0 : 1;
}

}  // namespace idem::demo
