// Entry point of `encore bench`: runs the named suites (all when none is named).
#pragma once
#include <string>
#include <vector>

namespace encore::bench {

struct BenchOptions {
  std::vector<std::string> suites;  // empty: all
  std::string out_path;             // JSON output; empty: ./bench-<suite>-<commit>.json
  bool quick = false;               // fewer repetitions (smoke runs)
};

int run_suites(const BenchOptions& opts);

}  // namespace encore::bench
