"""fla chunk_kda forward (the peer of `encore bench kda`): bf16, H 16, K = V = 128, in-kernel
softplus gate with dt_bias, q/k L2 norm, at the standard varlen configuration (seq_lens 1800, 1500,
2000, 1200, 800) and fixed B 1 / B 4, T 8192. Device time = the sum of the CUDA kernel times per
call from torch.profiler, wall time from triton's do_bench; the per-kernel split of the device time
is in the JSON. Needs fla-core (carried as a wheel in .whl).

When the encore Python module is importable (built for this Python on the GPU machine, e.g.
`scripts/gpu.sh build`, then PYTHONPATH=build-cuda/python; `ENCORE_PEERS=kda scripts/gpu.sh peers`
sets it), encore.kda_forward is timed on the same inputs by the same two methods, fla and
encore alternating over ROUNDS rounds (medians reported), so the ratio does not depend on the GPU
clock of two separate jobs; and encore's o and final state are compared with fla's (relative RMS
difference; both compute the same forward from the same bf16 inputs). Usage: kda_peers.py OUT.json
(KDA_PEER_CONFIGS=fixed_B4_T8192,... picks configurations; ROUNDS, default 3)."""
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from fla.ops.kda import chunk_kda

from kda_configs import CONFIGS, HAVE_ENCORE, ROUNDS, H, K, V, bf, dev, write  # noqa: E402 (the script's folder is on sys.path)

if HAVE_ENCORE:
    import encore


def main(out):
    res = {}
    for name, (B, lens) in CONFIGS.items():
        T = sum(lens) if lens else 8192
        torch.manual_seed(0)  # the same draw every run: encore's time depends on the decays (A_log, dt_bias)
        q, k = torch.randn(B, T, H, K, device=dev, dtype=bf), torch.randn(B, T, H, K, device=dev, dtype=bf)
        v, g = torch.randn(B, T, H, V, device=dev, dtype=bf), torch.randn(B, T, H, K, device=dev, dtype=bf)
        beta = torch.randn(B, T, H, device=dev, dtype=bf).sigmoid()
        A_log = torch.randn(H, device=dev, dtype=torch.float32)
        dt_bias = torch.randn(H * K, device=dev, dtype=torch.float32)
        kw = {}
        if lens:
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.long)
            kw = {"cu_seqlens": cu.to(dev), "cu_seqlens_cpu": cu}

        def fwd():
            return chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                             output_final_state=True, **kw)

        def enc():
            return encore.kda_forward(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True, use_gate_in_kernel=True,
                                      A_log=A_log, dt_bias=dt_bias, cu_seqlens=kw["cu_seqlens_cpu"].numpy() if lens else None)

        def gpu_kernel_ms(f):  # the summed CUDA kernel time per call, and the profiler's events
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(5):
                    f()
                torch.cuda.synchronize()
            return sum(e.device_time_total for e in p.key_averages()) / 5 / 1e3, p

        runs = {"fla": fwd}
        if HAVE_ENCORE:
            try:  # a failing encore call must not cost the fla numbers
                with torch.no_grad():
                    enc()
                torch.cuda.synchronize()
                runs["encore"] = enc
            except Exception as e:  # noqa: BLE001 (reported in the JSON)
                res[f"kda_encore_{name}_error"] = repr(e)
                print(f"  {name} encore.kda_forward failed: {e!r}", flush=True)
        wall = {who: [] for who in runs}
        gpu = {who: [] for who in runs}
        prof = {}
        with torch.no_grad():
            for f in runs.values():
                for _ in range(3):
                    f()
            torch.cuda.synchronize()
            for _ in range(ROUNDS):  # alternating, so clock drift hits both alike
                for who, f in runs.items():
                    wall[who].append(do_bench(f, warmup=10, rep=100, return_mode="median"))
                    ms, prof[who] = gpu_kernel_ms(f)  # the last round's profile of each
                    gpu[who].append(ms)
            if "encore" in runs:  # encore against fla on the same inputs
                of, sf = fwd()
                oe, se = enc()
                rel = lambda a, b: ((a.float() - b.float()).pow(2).mean() / b.float().pow(2).mean()).sqrt().item()
                res[f"kda_encore_vs_fla_{name}_o_rel_rms"] = rel(oe, of)
                res[f"kda_encore_vs_fla_{name}_final_state_rel_rms"] = rel(se, sf)
        for who in runs:
            res[f"kda_{who}_{name}_fwd_wall_ms"] = statistics.median(wall[who])
            res[f"kda_{who}_{name}_fwd_gpu_kernel_ms"] = statistics.median(gpu[who])
        res[f"kda_fla_{name}_fwd_kernels"] = sum(e.count for e in prof["fla"].key_averages()) / 5
        res[f"kda_{name}_rounds"] = {"wall_ms": wall, "gpu_kernel_ms": gpu}
        # Per-kernel device time per call (ms) and launches per call: where fla's time goes, and
        # encore's kernels in this process (against the harness's graph-replay time).
        for who, pr in prof.items():
            res[f"kda_{who}_{name}_fwd_breakdown"] = {e.key: {"ms": e.device_time_total / 5 / 1e3, "launches": e.count / 5}
                                                      for e in sorted(pr.key_averages(), key=lambda e: -e.device_time_total)
                                                      if e.device_time_total > 0}
        for kname, kv in res[f"kda_fla_{name}_fwd_breakdown"].items():
            print(f"  {name} {kv['ms']:8.4f} ms x{kv['launches']:.1f} {kname[:90]}", flush=True)
        for key in (f"kda_fla_{name}_fwd_wall_ms", f"kda_fla_{name}_fwd_gpu_kernel_ms", f"kda_fla_{name}_fwd_kernels",
                    f"kda_encore_{name}_fwd_wall_ms", f"kda_encore_{name}_fwd_gpu_kernel_ms",
                    f"kda_encore_vs_fla_{name}_o_rel_rms", f"kda_encore_vs_fla_{name}_final_state_rel_rms"):
            if key in res:
                print(f"{key} {res[key]:.4g}", flush=True)
        del q, k, v, g, beta
        torch.cuda.empty_cache()
        write(out, res)  # after every configuration: a run cut by its timeout keeps what it measured
    res["complete"] = True
    write(out, res)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "kda_peers.json")
