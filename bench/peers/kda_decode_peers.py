"""KDA decode against fla (issue 49): fla-core 0.6.0's serving form fused_recurrent_kda_fwd (fla.ops.kda.fused_recurrent,
ssm_state_indices, the pool updated in place, out=) and encore.kda.fused_recurrent_kda_fwd (the CUDA decode kernel) in
one process on the same tensors: one token per sequence, batch 1, 8, 64, 256, 1024, H = HV = 32, K = V = 128 (Kimi-Linear's
KDA layer), bf16 q, k, v, g, beta, o, fp32 A_log / dt_bias, in-kernel softplus gate with dt_bias, q/k L2 norm, beta
sigmoid, int32 indices [N], fp32 and bf16 pools.

Device time per call from CUDA-graph replays of back-to-back calls (graph_timing.graph_us), the calls rotating over index
sets of distinct slots in a pool of >= 3x L2 (the states come from HBM, as `encore bench kda_decode` measures); the
implementations alternate over ROUNDS rounds (medians). The floor: the bytes a call must move (each touched state read and
written once, the token inputs, o, the indices) at the device-to-device copy bandwidth measured here (torch copy of 1 GiB);
ratios to the floor and fla / encore. Also encore's o and pool slots against fla's after one call from the same pool
(relative RMS difference).

Needs fla-core 0.6.0 (+ einops) for the peer and the encore module built for this Python (PYTHONPATH=build-cuda/python);
either missing is reported in the JSON ("errors") and skipped. Usage: kda_decode_peers.py [OUT.json] (default
$OUT/kda_decode_peers.json). Env: ROUNDS (default 3), KDA_DECODE_BATCHES (default 1,8,64,256,1024), KDA_DECODE_POOLS
(default float32,bfloat16)."""
import json
import math
import os
import statistics
import sys

import torch

from graph_timing import graph_us  # the script's folder is on sys.path

dev, bf = "cuda", torch.bfloat16
H, HV, K, V = 32, 32, 128, 128
ROUNDS = int(os.environ.get("ROUNDS", "3"))
BATCHES = [int(x) for x in os.environ.get("KDA_DECODE_BATCHES", "1,8,64,256,1024").split(",")]
POOLS = os.environ.get("KDA_DECODE_POOLS", "float32,bfloat16").split(",")


def load_peers(errors):
    fns = {}
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fwd
        fns["fla"] = fla_fwd
    except Exception as e:  # noqa: BLE001
        errors["fla"] = f"import fla.ops.kda.fused_recurrent failed ({e!r}): install the fla-core 0.6.0 and einops wheels"
    try:
        import encore
        if not (encore.built_with_cuda() and encore.cuda_device_count() > 0):
            raise RuntimeError("the encore module is built without CUDA or sees no GPU")
        from encore.kda import fused_recurrent_kda_fwd as enc_fwd
        fns["encore"] = enc_fwd
    except Exception as e:  # noqa: BLE001
        errors["encore"] = f"encore unusable ({e!r}): build it for this Python and put build-cuda/python on PYTHONPATH"
    return fns


def copy_gbps():
    """Device-to-device copy bandwidth (bytes read + written per second / 1e9) of a 1 GiB torch copy."""
    a = torch.empty(1 << 29, dtype=torch.int16, device=dev)
    b = torch.empty_like(a)
    us = graph_us(lambda i: b.copy_(a), 1, batch=10, replays=9)
    return 2.0 * a.numel() * 2 / (us * 1e-6) / 1e9


def main(out):
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "errors": {}, "records": []}
    fns = load_peers(res["errors"])
    try:
        import importlib.metadata as md
        res["fla_version"] = md.version("fla-core")
    except Exception:  # noqa: BLE001
        pass
    res["copy_gbps"] = bw = copy_gbps()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"copy {bw:.0f} GB/s; timing {sorted(fns)}", flush=True)
    for pool_name in POOLS:
        pdt = getattr(torch, pool_name)
        es = torch.finfo(pdt).bits // 8
        for N in BATCHES:
            slot = HV * K * V * es
            sets = max(1, math.ceil(3 * l2 / (N * slot)))
            P = N * sets
            torch.manual_seed(0)
            q, k = torch.randn(N, 1, H, K, device=dev, dtype=bf), torch.randn(N, 1, H, K, device=dev, dtype=bf)
            v, g = torch.randn(N, 1, HV, V, device=dev, dtype=bf), torch.randn(N, 1, HV, K, device=dev, dtype=bf)
            beta = torch.randn(N, 1, HV, device=dev, dtype=bf)
            A_log = torch.zeros(HV, device=dev)
            dt_bias = torch.zeros(HV * K, device=dev)
            pool = (0.1 * torch.randn(P, HV, K, V, device=dev)).to(pdt)
            idx = torch.randperm(P, device=dev, dtype=torch.int64).to(torch.int32).view(sets, N)
            outs = {who: torch.empty(N, 1, HV, V, device=dev, dtype=bf) for who in fns}
            kw = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True, inplace_final_state=True)

            def call(who, i, p=pool):
                return fns[who](q, k, v, g, beta, initial_state=p, ssm_state_indices=idx[i % sets], out=outs[who], **kw)

            rec = {"batch": N, "pool": pool_name, "H": H, "HV": HV, "K": K, "V": V, "index_sets": sets}
            state_bytes = 2.0 * N * slot
            io_bytes = N * (2 * H * K + 2 * HV * V + HV * K + HV) * 2 + N * 4
            rec["bytes"] = state_bytes + io_bytes
            rec["floor_us"] = rec["bytes"] / (bw * 1e3)
            ok = {}
            for who in fns:  # a failing implementation must not cost the other's numbers
                try:
                    with torch.no_grad():
                        call(who, 0)
                    torch.cuda.synchronize()
                    ok[who] = True
                except Exception as e:  # noqa: BLE001
                    res["errors"][f"{who}_{pool_name}_{N}"] = repr(e)
                    print(f"  {who} batch {N} pool {pool_name} failed: {e!r}", flush=True)
            times = {who: [] for who in ok}
            with torch.no_grad():
                for _ in range(ROUNDS):  # alternating, so clock drift hits both alike
                    for who in ok:
                        times[who].append(graph_us(lambda i, w=who: call(w, i), sets, batch=max(sets, 20)))
                if len(ok) == 2:  # the same call from the same fresh pool: o and the written slots (the timed
                    # replays repeat one token, so the timed pool sits at the recurrence's fixed point)
                    fresh = (0.1 * torch.randn(P, HV, K, V, device=dev)).to(pdt)
                    p_f, p_e = fresh, fresh.clone()
                    call("fla", 0, p_f)
                    call("encore", 0, p_e)
                    rel = lambda a, b: ((a.float() - b.float()).pow(2).mean() / b.float().pow(2).mean()).sqrt().item()  # noqa: E731
                    rows = idx[0].long()
                    rec["o_rel_rms_vs_fla"] = rel(outs["encore"], outs["fla"])
                    rec["state_rel_rms_vs_fla"] = rel(p_e[rows], p_f[rows])
                    rec["untouched_equal"] = bool(torch.equal(p_e[idx[1:].flatten().long()], p_f[idx[1:].flatten().long()])) if sets > 1 else None
                    del p_f, p_e
            for who, ts in times.items():
                rec[f"{who}_us"] = statistics.median(ts)
                rec[f"{who}_ratio_to_floor"] = rec[f"{who}_us"] / rec["floor_us"]
            if "fla_us" in rec and "encore_us" in rec:
                rec["fla_over_encore"] = rec["fla_us"] / rec["encore_us"]
            res["records"].append(rec)
            print(json.dumps({k_: (float(f"{v_:.4g}") if isinstance(v_, float) else v_) for k_, v_ in rec.items() if "rounds" not in k_}), flush=True)
            del q, k, v, g, beta, pool, idx, outs
            torch.cuda.empty_cache()
            with open(out, "w") as f:  # after every configuration: a run cut by its timeout keeps what it measured
                json.dump(res, f, indent=1)
    res["complete"] = True
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ.get("OUT", "."), "kda_decode_peers.json"))
