// Benchmark records, the printed table and the JSON file (commit, GPU, clocks, ceilings, records).
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "bench/harness.hpp"

namespace encore::bench {

struct Record {
  std::string suite, name;
  std::vector<std::pair<std::string, std::string>> params;  // shape, dtype, plan, ...
  std::vector<std::pair<std::string, double>> metrics;      // time_us, gbps, frac_copy_bw, ...
  double metric(const std::string& key) const;
};

struct Report {
  Environment env;
  Ceilings ceilings;
  std::vector<Record> records;
  void print_table() const;
  bool write_json(const std::string& path) const;
};

}  // namespace encore::bench
