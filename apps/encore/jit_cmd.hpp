// `encore jit ...` and the JIT lines of `encore info` (jit_cmd.cpp).
#pragma once
#include <string>
#include <vector>

namespace encore::app {
int run_jit(const std::vector<std::string>& args);
void print_jit_info();
}  // namespace encore::app
