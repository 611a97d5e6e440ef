// `encore check`: every op on small random shapes, GPU against the CPU backend (or, without a GPU,
// the CPU backend against properties that must hold), printed as a pass/fail table.
#pragma once

namespace encore::app {

// Returns the process exit code: 0 when every row passed.
int run_check(bool force_cpu);

}  // namespace encore::app
