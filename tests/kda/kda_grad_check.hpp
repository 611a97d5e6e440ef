// Test helper: central finite differences of the KDA loss sum(o * d_o) + sum(final_state * d_final)
// (the public CPU forward, fp64) against analytic gradients, for every input of a KdaCase; shared by
// the CPU backward tests.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "encore/kda.hpp"
#include "tests/kda/kda_case.hpp"

namespace encore::test {

// loss = sum(o * d_o) + sum(final * d_final) of the current inputs of kc (d_final empty: no term).
inline double kda_loss(KdaCase& kc, const std::vector<double>& d_o, const std::vector<double>& d_final) {
  KdaForwardArgs a = kc.args();
  EXPECT_TRUE(run(a, kc.opts));
  double l = 0;
  for (size_t i = 0; i < kc.o.size(); ++i) l += kc.o[i] * d_o[i];
  for (size_t i = 0; i < d_final.size(); ++i) l += kc.fin[i] * d_final[i];
  return l;
}

// Analytic gradients of one case, w.r.t. the inputs as passed (empty: that input is absent).
struct KdaGradView {
  const std::vector<double> *dq, *dk, *dv, *dg, *dbeta, *dh0, *dA_log, *ddt_bias;
};

// Central differences (step 1e-6 max(1, |x|)) of every entry of every present input; each gradient
// within `tol` relative RMS (NaN fails).
inline void expect_matches_finite_differences(KdaCase& kc, const std::vector<double>& d_o, const std::vector<double>& d_final,
                                              const KdaGradView& g, double tol = 1e-6) {
  auto check = [&](const char* name, std::vector<double>& x, const std::vector<double>& grad) {
    ASSERT_EQ(grad.size(), x.size()) << name;
    std::vector<double> fd(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      const double x0 = x[i], h = 1e-6 * std::max(1.0, std::fabs(x0));
      x[i] = x0 + h;
      const double lp = kda_loss(kc, d_o, d_final);
      x[i] = x0 - h;
      const double lm = kda_loss(kc, d_o, d_final);
      x[i] = x0;
      fd[i] = (lp - lm) / (2 * h);
    }
    const double e = rel_err(grad, fd);
    std::printf("[fd] %s: rel RMS err %.3g\n", name, e);
    EXPECT_LT(e, tol) << name;
  };
  check("q", kc.q, *g.dq);
  check("k", kc.k, *g.dk);
  check("v", kc.v, *g.dv);
  check("g", kc.g, *g.dg);
  check("beta", kc.beta, *g.dbeta);
  if (kc.h0) check("h0", kc.init, *g.dh0);
  if (!kc.A_log.empty()) check("A_log", kc.A_log, *g.dA_log);
  if (!kc.dt_bias.empty()) check("dt_bias", kc.dt_bias, *g.ddt_bias);
}

}  // namespace encore::test
