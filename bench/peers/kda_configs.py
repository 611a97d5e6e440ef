"""The KDA peer scripts' shared setup: whether encore is importable (with a GPU, or on the CPU backend for
KDA_PEER_DEVICE=cpu), the rounds, the head counts and the configurations (bf16, K = V = 128; varlen seq_lens
1800, 1500, 2000, 1200, 800 and fixed B 1 / B 4, T 8192). KDA_PEER_CONFIGS=name,name... measures those
configurations only, in that order (varlen_tiny, seq_lens 100 and 60, is a smoke test's and never a default);
KDA_PEER_HEADS=16,32 the head counts of the scripts that take several (kda_peers.py runs H); ROUNDS."""
import json
import os

import torch

dev, bf = os.environ.get("KDA_PEER_DEVICE", "cuda"), torch.bfloat16
try:
    import encore
    HAVE_ENCORE = dev == "cpu" or (encore.built_with_cuda() and encore.cuda_device_count() > 0)
    ENCORE_WHY = None if HAVE_ENCORE else "the encore module is built without CUDA or sees no GPU"
except ImportError as e:
    HAVE_ENCORE = False
    ENCORE_WHY = f"import encore failed ({e}): build it for this Python and put build-cuda/python on PYTHONPATH"
ROUNDS = int(os.environ.get("ROUNDS", "3"))

H, K, V = 16, 128, 128
HEADS = [int(h) for h in os.environ.get("KDA_PEER_HEADS", "16,32").split(",")]
_ALL = {"varlen_std": (1, [1800, 1500, 2000, 1200, 800]), "fixed_B1_T8192": (1, None), "fixed_B4_T8192": (4, None),
        "varlen_tiny": (1, [100, 60])}
_picked = os.environ.get("KDA_PEER_CONFIGS", "varlen_std,fixed_B1_T8192,fixed_B4_T8192").split(",")
if set(_picked) - set(_ALL):
    raise SystemExit(f"KDA_PEER_CONFIGS: unknown {sorted(set(_picked) - set(_ALL))}; known: {', '.join(_ALL)}")
CONFIGS = {n: _ALL[n] for n in _picked}


def write(out, res):
    """The results so far (after every configuration: a run cut by its timeout keeps what it measured)."""
    res["gpu"] = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"
    res["encore_timed"] = HAVE_ENCORE
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
