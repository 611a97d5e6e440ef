"""KDA context parallelism (issue 34): encore.chunk_kda(..., cp_group=) forward + backward with one sequence split
contiguously over the ranks, against one GPU running the whole sequence, in one job (one process per GPU).

Launch: python3 -m torch.distributed.run --standalone --nproc-per-node N bench/peers/kda_cp_peers.py OUT.json
(`scripts/gpu.sh peers` with ENCORE_PEERS=kda_cp and ENCORE_PEERS_NPROC=N). bf16, H 16, K = V = 128, the
in-kernel softplus gate with dt_bias, q/k L2 norm; KDA_CP_TOKENS_PER_RANK (default 8192: T = 32768 global at
CP 4, 65536 at CP 8). Medians over ROUNDS (default 5) of wall time per step between barriers (CUDA events;
the slowest rank's):
  cp_step          forward + backward of this rank's slice with cp_group (the summaries, their all-gathers,
                   the merges, the local forward and backward)
  single_step      forward + backward of the whole sequence on rank 0 alone (the others wait at the barrier)
  allgather_only   the two all-gathers of the packed fp32 [S_ext | M] summaries alone (H·K·(V + K)·4 bytes
                   per rank each), the communication share's floor
Rank 0 writes OUT.json with the ratios single_step / cp_step and allgather_only / cp_step."""
import json
import os
import sys

import torch
import torch.distributed as dist

import encore
from dist_timing import median_us  # the script's folder is on sys.path

H, K, V = 16, 128, 128
PER_RANK = int(os.environ.get("KDA_CP_TOKENS_PER_RANK", "8192"))
ROUNDS = int(os.environ.get("ROUNDS", "5"))


def leaves(T, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s, sd=1.0: (torch.randn(*s, generator=g, device=device) * sd)  # noqa: E731
    t = {"q": r(1, T, H, K).bfloat16(), "k": r(1, T, H, K).bfloat16(), "v": r(1, T, H, V).bfloat16(),
         "g": r(1, T, H, K).bfloat16(), "beta": torch.rand(1, T, H, generator=g, device=device).bfloat16(),
         "A_log": r(H, sd=0.5), "dt_bias": r(H * K, sd=0.5)}
    for x in t.values():
        x.requires_grad_(True)
    return t


def step(t, cu, group, d_o):
    o, _ = encore.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                            use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cp_group=group)
    torch.autograd.grad(o, list(t.values()), d_o)


def main(path):
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    T = PER_RANK * world
    cu = torch.tensor([0, T], dtype=torch.int32)
    res = {"world": world, "gpu": torch.cuda.get_device_name(), "T_global": T, "H": H, "K": K, "V": V}
    key = f"kda_cp{world}_T{T}"
    full = leaves(T, 0, "cuda")  # the same global tensors on every rank (same seed)
    sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    mine = {n: (x.detach()[:, sl] if x.dim() > 1 else x.detach()).clone().requires_grad_(True) for n, x in full.items()}
    d_o = torch.randn(1, PER_RANK, H, V, device="cuda").bfloat16()
    d_full = torch.randn(1, T, H, V, device="cuda").bfloat16()
    try:
        res[f"{key}_cp_step_us"] = median_us(lambda: step(mine, cu, dist.group.WORLD, d_o), ROUNDS)
        res[f"{key}_single_step_us"] = median_us(lambda: step(full, cu, None, d_full), ROUNDS, active=rank == 0)
        packed = torch.empty(H * K * (V + K), device="cuda")
        gathered = torch.empty(world * packed.numel(), device="cuda")
        res[f"{key}_allgather_only_us"] = median_us(lambda: [dist.all_gather_into_tensor(gathered, packed) for _ in range(2)], ROUNDS)
        res[f"{key}_speedup_vs_one_gpu"] = res[f"{key}_single_step_us"] / res[f"{key}_cp_step_us"]
        res[f"{key}_allgather_share"] = res[f"{key}_allgather_only_us"] / res[f"{key}_cp_step_us"]
    except Exception as err:  # noqa: BLE001 (recorded in the JSON)
        res[f"{key}_error"] = repr(err)[:300]
    if rank == 0:
        print(res, flush=True)
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "kda_cp_peers.json")
