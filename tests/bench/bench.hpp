// A small benchmark harness: latencies in microseconds, summarised as throughput and
// p50 / p99 / max. Wall-clock time belongs here, never in the test suite.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

namespace idem::bench {

using Clock = std::chrono::steady_clock;

// The middle of a ratio's back-to-back pairs (the upper middle of an even count): this VM's
// speed drifts by ±15 % over seconds, so a ratio is read from pairs run one right after the
// other, never from two runs a minute apart.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

inline double micros_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

struct Stats {
  std::size_t calls = 0;
  double seconds = 0;
  double per_s = 0;
  double p50_us = 0, p99_us = 0, max_us = 0;

  nlohmann::json json() const {
    return {{"calls", calls},   {"seconds", seconds}, {"per_s", per_s},
            {"p50_us", p50_us}, {"p99_us", p99_us},   {"max_us", max_us}};
  }
};

inline Stats summarize(std::vector<double> latencies_us, double seconds) {
  Stats s;
  s.calls = latencies_us.size();
  s.seconds = seconds;
  s.per_s = seconds > 0 ? static_cast<double>(s.calls) / seconds : 0;
  if (latencies_us.empty()) return s;
  std::sort(latencies_us.begin(), latencies_us.end());
  auto at = [&](double q) {
    const auto i = static_cast<std::size_t>(q * static_cast<double>(latencies_us.size() - 1));
    return latencies_us[i];
  };
  s.p50_us = at(0.50);
  s.p99_us = at(0.99);
  s.max_us = latencies_us.back();
  return s;
}

// One client lane's answers (a connection, a thread): each latency, and when its last came.
struct Lane {
  std::vector<double> latencies_us;
  Clock::time_point ended;
};

// Every lane's latencies, over the time from `t0` to the last lane's last answer.
inline Stats collect(const std::vector<Lane>& lanes, Clock::time_point t0) {
  std::vector<double> all;
  Clock::time_point end = t0;
  for (const Lane& l : lanes) {
    all.insert(all.end(), l.latencies_us.begin(), l.latencies_us.end());
    end = std::max(end, l.ended);
  }
  return summarize(std::move(all), std::chrono::duration<double>(end - t0).count());
}

}  // namespace idem::bench
