"""QK-norm peers measured the way `encore bench qk_norm` measures encore: device time per call from
CUDA-graph replays of back-to-back calls, L2-flushed (calls rotate over buffer sets covering >= 3x
L2, up to 1024 sets per graph) and warm (one set). Paths: eager PyTorch, torch.compile of the same
function (Q and K heads of a fused QKV buffer, out of place; compiled afresh for each shape, static
shapes), and Liger's RMSNorm applied twice to contiguous [T*H, 128] Q and K buffers.
Usage: python3 bench/peers/qk_norm_peers.py [OUT.json]; ENCORE_PEERS_QUICK=1: 32 q + 8 kv heads, flushed only."""
import json
import math
import os
import sys

import torch
from graph_timing import graph_us

dev, bf, D = "cuda", torch.bfloat16, 128
L2 = torch.cuda.get_device_properties(0).L2_cache_size


def rmsnorm(h, w, eps=1e-6):
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(h.dtype)


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ.get("OUT", "."), "qk_norm_peers.json")
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception as e:  # noqa: BLE001
        LigerRMSNormFunction = None
        print(f"liger-kernel not importable: {e}", flush=True)
    wq = torch.rand(D, device=dev, dtype=bf) + 0.5
    wk = torch.rand(D, device=dev, dtype=bf) + 0.5

    def qkn(q, k):
        return rmsnorm(q, wq), rmsnorm(k, wk)

    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "records": []}
    heads = ((32, 8), (64, 4)) if os.environ.get("ENCORE_PEERS_QUICK") != "1" else ((32, 8),)
    for hq, hk in heads:
        for T in (1, 16, 64, 256, 4096, 8192, 16384, 65536):
            width = (hq + 2 * hk) * D
            set_bytes = T * width * 2
            for flush in ((True, False) if os.environ.get("ENCORE_PEERS_QUICK") != "1" else (True,)):
                nsets = max(1, min(math.ceil(3 * L2 / set_bytes), 1024)) if flush else 1
                batch = max(nsets, 1 if T >= 4096 else 64)
                qkv = torch.randn(nsets, T, width, device=dev, dtype=bf)
                q = [qkv[i, :, : hq * D].view(T, hq, D) for i in range(nsets)]
                k = [qkv[i, :, hq * D:(hq + hk) * D].view(T, hk, D) for i in range(nsets)]
                rec = {"q_heads": hq, "kv_heads": hk, "tokens": T, "l2": "flushed" if flush else "warm",
                       "bytes": 4.0 * T * (hq + hk) * D}
                rec["eager_us"] = graph_us(lambda i: qkn(q[i], k[i]), nsets, batch)
                # A fresh static-shape compile per shape: one compiled function reused across shapes
                # turns dynamic after the first recompile, and its kernels were 3-4x slower.
                torch._dynamo.reset()
                qknc = torch.compile(qkn, dynamic=False)
                qknc(q[0], k[0])
                rec["compile_us"] = graph_us(lambda i: qknc(q[i], k[i]), nsets, batch)
                if LigerRMSNormFunction is not None:
                    qc = [x.reshape(-1, D).contiguous() for x in q]
                    kc = [x.reshape(-1, D).contiguous() for x in k]
                    rec["liger_us"] = graph_us(lambda i: (LigerRMSNormFunction.apply(qc[i], wq, 1e-6),
                                                          LigerRMSNormFunction.apply(kc[i], wk, 1e-6)), nsets, batch)
                    del qc, kc
                res["records"].append(rec)
                print(json.dumps(rec), flush=True)
                del qkv, q, k
                torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
