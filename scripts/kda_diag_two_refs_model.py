#!/usr/bin/env python3
# A numpy model of diag_block_two_refs + the kernel's write-out, lane by lane with the mma m16n8k16
# fragment layouts, against the exact per-pair Aqk and L of a diagonal block.
import numpy as np
rng = np.random.default_rng(1)
kC, kD = 64, 128

def bf16(x):
    x = np.asarray(x, np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32)

def run(scale_decay):
    q = rng.standard_normal((kC, kD)).astype(np.float32)
    k = rng.standard_normal((kC, kD)).astype(np.float32)
    g = -scale_decay * rng.random((kC, kD)).astype(np.float32)  # log2 decays <= 0
    G = np.cumsum(g, axis=0).astype(np.float32)
    rn = np.concatenate([1 / np.linalg.norm(q, axis=1), 1 / np.linalg.norm(k, axis=1)]).astype(np.float32)
    beta = rng.random(kC).astype(np.float32)
    scale = 0.088
    out = {}
    for s in range(4):
        r = 16 * s
        spanA = max(G[r, c] - G[i, c] for c in range(kD) for i in range(r, r + 8))
        spanB = max(G[r + 8, c] - G[i, c] for c in range(kD) for i in range(r + 8, r + 16))
        span = max(G[r, c] - G[i, c] for c in range(kD) for i in range(r, r + 16))
        # fragments per lane
        acc = np.zeros((32, 2, 3, 4), np.float64)
        for ksp in range(kD // 16):
            A = np.zeros((2, 16, 16)); Bm = np.zeros((3, 16, 8))
            for lane in range(32):
                gg, t = lane >> 2, lane & 3
                for qq in range(4):
                    i = r + gg + 8 * (qq & 1); ref = r + 8 * (qq & 1); c = 16 * ksp + 2 * t + 8 * (qq >> 1)
                    for e in range(2):
                        f = np.float32(2.0) ** (G[i, c + e] - G[ref, c + e])
                        A[0, gg + 8 * (qq & 1), 2 * t + 8 * (qq >> 1) + e] = bf16(q[i, c + e] * rn[i] * f)
                        A[1, gg + 8 * (qq & 1), 2 * t + 8 * (qq >> 1) + e] = bf16(k[i, c + e] * rn[kC + i] * f)
                for part in range(3):
                    j = r + gg + (8 if part == 2 else 0); ref = r if part == 0 else r + 8
                    for qq in range(2):
                        c = 16 * ksp + 2 * t + 8 * qq
                        for e in range(2):
                            Bm[part, 2 * t + 8 * qq + e, gg] = bf16(k[j, c + e] * rn[kC + j] * np.float32(2.0) ** (G[ref, c + e] - G[j, c + e]))
            for m in range(2):
                for part in range(3):
                    C = A[m] @ Bm[part]  # 16 x 8
                    for lane in range(32):
                        gg, t = lane >> 2, lane & 3
                        acc[lane, m, part] += [C[gg, 2 * t], C[gg, 2 * t + 1], C[gg + 8, 2 * t], C[gg + 8, 2 * t + 1]]
        Aq = np.full((16, 16), np.nan); Ls = np.full((16, 16), np.nan)
        for lane in range(32):
            g8, t4 = lane >> 2, lane & 3
            for m in range(2):
                for part in range(4):
                    for e in range(2):
                        i = g8 + (0 if part in (0, 3) else 8); j = 2 * t4 + e + (8 if part >= 2 else 0)
                        x = 0.0 if part == 3 else acc[lane, m, part][(0 if part == 0 else 2) + e]
                        keep = j < i if m == 1 else j <= i
                        val = ((beta[r + i] if m == 1 else scale) * x) if keep else 0.0
                        (Ls if m == 1 else Aq)[i, j] = val
        # exact
        Ae = np.zeros((16, 16)); Le = np.zeros((16, 16))
        for i in range(16):
            for j in range(i + 1):
                fac = 2.0 ** (G[r + i].astype(np.float64) - G[r + j])
                Ae[i, j] = scale * rn[r + i] * rn[kC + r + j] * np.sum(q[r + i] * k[r + j] * fac)
                if j < i: Le[i, j] = beta[r + i] * rn[kC + r + i] * rn[kC + r + j] * np.sum(k[r + i] * k[r + j] * fac)
        assert not np.isnan(Aq).any() and not np.isnan(Ls).any(), "entries not written"
        ea = np.sqrt(np.mean((Aq - Ae) ** 2) / np.mean(Ae ** 2)); el = np.sqrt(np.mean((Ls - Le) ** 2) / np.mean(Le ** 2))
        out[s] = (round(span, 1), round(spanA, 1), round(spanB, 1), f"{ea:.2e}", f"{el:.2e}")
    return out

for sd in (2.0, 12.0):
    print("decay scale", sd, run(sd))
