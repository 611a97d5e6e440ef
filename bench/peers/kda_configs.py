"""The KDA peer scripts' shared setup: whether encore is importable with a GPU, the rounds, and the
configurations (bf16, H 16, K = V = 128; varlen seq_lens 1800, 1500, 2000, 1200, 800 and fixed B 1 / B 4,
T 8192). KDA_PEER_CONFIGS=name,name... measures those configurations only, in that order; ROUNDS."""
import json
import os

import torch

try:
    import encore
    HAVE_ENCORE = encore.built_with_cuda() and encore.cuda_device_count() > 0
except ImportError:
    HAVE_ENCORE = False
ROUNDS = int(os.environ.get("ROUNDS", "3"))

dev, bf = "cuda", torch.bfloat16
H, K, V = 16, 128, 128
CONFIGS = {"varlen_std": (1, [1800, 1500, 2000, 1200, 800]), "fixed_B1_T8192": (1, None), "fixed_B4_T8192": (4, None)}
if os.environ.get("KDA_PEER_CONFIGS"):
    CONFIGS = {n: CONFIGS[n] for n in os.environ["KDA_PEER_CONFIGS"].split(",")}


def write(out, res):
    """The results so far (after every configuration: a run cut by its timeout keeps what it measured)."""
    res["gpu"] = torch.cuda.get_device_name(0)
    res["encore_timed"] = HAVE_ENCORE
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
