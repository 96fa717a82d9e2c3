// Prometheus text read back by Prometheus's own parser: tests/prometheus_check.py (Python's
// prometheus_client, from python3-prometheus-client) parses it, checks every histogram's
// buckets, sum and count against each other, and hands back what it read as JSON.
#pragma once

#include <doctest/doctest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "test_support.hpp"

namespace idem::test {

// What prometheus_check.py printed for `text` (its format is in the script's docstring); a
// text that does not parse, or a histogram whose parts disagree, fails the test with the
// parser's message.
inline nlohmann::json prometheus_parsed(const std::string& text) {
  TempDir dir;
  const std::string in = dir.file("metrics.txt"), out = dir.file("out.json"),
                    err = dir.file("err.txt");
  std::ofstream(in) << text;
  // Debian's python3, where python3-prometheus-client is installed (not one on PATH).
  REQUIRE_MESSAGE(std::system("/usr/bin/python3 -c 'import prometheus_client' 2>/dev/null") == 0,
                  "python3-prometheus-client is missing (scripts/setup installs it)");
  const int rc = std::system(
      ("/usr/bin/python3 " IDEM_PROMETHEUS_CHECK " < " + in + " > " + out + " 2> " + err).c_str());
  std::stringstream complaint;
  complaint << std::ifstream(err).rdbuf();
  REQUIRE_MESSAGE(rc == 0, complaint.str());
  return nlohmann::json::parse(std::ifstream(out));
}

// The count of one histogram series: `labels` as the script writes them ("outcome=executed"),
// empty for a series without labels. -1 when the series is not there.
inline double histogram_count(const nlohmann::json& parsed, const std::string& name,
                              const std::string& labels = "") {
  const nlohmann::json& h = parsed.at("histograms");
  if (!h.contains(name) || !h.at(name).contains(labels)) return -1;
  return h.at(name).at(labels).at("count").get<double>();
}

}  // namespace idem::test
