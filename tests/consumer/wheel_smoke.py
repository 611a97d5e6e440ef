"""Smoke test of an installed encore wheel (scripts/test_packaging.sh runs it in a fresh venv):
imports the package, prints the version and backend, runs rms_norm on numpy and checks it."""
import sys

import numpy as np

import encore

print(f"encore {encore.__version__} from {encore.__file__} (CUDA backend built in: {encore.built_with_cuda()})")
rng = np.random.default_rng(0)
x = rng.standard_normal((5, 100), dtype=np.float32)
w = rng.standard_normal(100, dtype=np.float32)
y = encore.rms_norm(x, w, eps=1e-6)
x64 = x.astype(np.float64)
want = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-6) * w
err = float(np.max(np.abs(y - want)))
ok = y.shape == x.shape and y.dtype == np.float32 and err < 1e-5
print(f"rms_norm [5, 100] fp32 on numpy: max |err| {err:.2e} {'OK' if ok else 'MISMATCH'}")
sys.exit(0 if ok else 1)
