"""MoE across GPUs (issue 33): encore.moe_forward_ep on the collective path (NCCL all-to-all for expert parallel,
NCCL all-reduce for tensor parallel) against NCCL alone moving the same bytes, in one job, one process per GPU.

Launch: python3 -m torch.distributed.run --standalone --nproc-per-node N bench/peers/moe_ep_peers.py OUT.json
(`scripts/gpu.sh peers` with ENCORE_PEERS=moe_ep and ENCORE_PEERS_NPROC=N). Per shape (DeepSeek-V3-like: hidden
7168, 256 experts, top-8, expert FFN 2048; Qwen3-30B-A3B: 2048, 128, top-8, 768) and tokens per GPU
(MOE_EP_TOKENS, default 128,4096), medians over ROUNDS (default 5) of wall time per call between barriers
(CUDA events; the collective path synchronizes the host once per call for the split sizes):
  ep_layer        the whole EP layer: routing, the counts / rows / ids all-to-alls, the local experts, the rows
                  back, the combine
  nccl_a2a_rows   all_to_all_single of the dispatch rows alone with the same splits (bf16 [T * k, hidden]),
                  the floor of one direction on this path
  ep_peer_layer   the EP layer on the peer-memory transport (transport="peer": rows written into the owners'
                  GPU memory, outputs straight back; one host synchronization per call for the received counts)
  ep_peer_a2a     the peer transport's dispatch + combine alone (no expert compute: the received rows sent
                  back as the outputs), one round trip of the rows
  ep_peer_fp8_a2a the same with FP8 dispatch (e4m3 rows + 1x128 fp32 scales) and a bf16 combine, the rows
                  quantized beforehand (the deployment the issue names for DeepSeek-V3 at 128 tokens)
  nccl_a2a_fp8_rows  all_to_all_single of those e4m3 rows (bytes) alone
  ep_peer_fp8_layer  the EP layer on the peer transport with dispatch_fp8=True (quantize, dispatch, dequantize,
                  experts, bf16 combine)
  tp_layer        the TP layer (every GPU the same tokens): local experts, fp32 partial combine, all-reduce
  nccl_allreduce  all_reduce of the fp32 [T, hidden] partials alone
Rank 0 writes OUT.json (one key per figure, plus the world size and GPU)."""
import json
import os
import sys

import torch
import torch.distributed as dist

import encore
from encore import _moe_ep
from encore._core import dl


def _dl(*arrays):
    return tuple(dl(a) for a in arrays)
from dist_timing import median_us  # the script's folder is on sys.path

SHAPES = {"deepseek_v3": (7168, 256, 8, 2048), "qwen3_30b_a3b": (2048, 128, 8, 768)}
TOKENS = [int(t) for t in os.environ.get("MOE_EP_TOKENS", "128,4096").split(",")]
ROUNDS = int(os.environ.get("ROUNDS", "5"))


def main(path):
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    res = {"world": world, "gpu": torch.cuda.get_device_name()}
    for name, (d, e, k, f) in SHAPES.items():
        el = e // world
        g = torch.Generator(device="cuda").manual_seed(rank)
        w13 = (torch.randn(el, 2 * f, d, device="cuda", generator=g) * d ** -0.5).bfloat16()
        w2 = (torch.randn(el, d, f, device="cuda", generator=g) * f ** -0.5).bfloat16()
        for t in TOKENS:
            key = f"{name}_T{t}_ep{world}"
            x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
            logits = torch.randn(t, e, device="cuda", generator=g)
            try:
                res[f"{key}_ep_layer_us"] = median_us(lambda: encore.moe_forward_ep(x, logits, w13, w2, k), ROUNDS, reps=10)
                ids, _ = encore.moe_routing(logits, k)
                dest = torch.div(ids.reshape(-1).long(), el, rounding_mode="floor")
                send = torch.bincount(dest, minlength=world)
                recv = torch.empty_like(send)
                dist.all_to_all_single(recv, send)
                s_l, r_l = send.tolist(), recv.tolist()
                rows = x.index_select(0, torch.div(torch.argsort(dest, stable=True), k, rounding_mode="floor"))
                rows_in = rows.new_empty(sum(r_l), d)
                res[f"{key}_nccl_a2a_rows_us"] = median_us(lambda: dist.all_to_all_single(rows_in, rows, r_l, s_l), ROUNDS, reps=10)
                res[f"{key}_ep_peer_layer_us"] = median_us(lambda: encore.moe_forward_ep(x, logits, w13, w2, k, transport="peer"), ROUNDS,
                                                           reps=10)
                _, ep = _moe_ep._peer_rank(None, world, rank, e, k, d, x, t)
                y = torch.zeros(ep.max_rows, d, dtype=x.dtype, device="cuda")
                out = torch.empty_like(x)
                w = torch.full((t, k), 1.0 / k, device="cuda")
                stream = torch.cuda.current_stream().cuda_stream

                def round_trip():
                    ep.dispatch(*_dl(x, ids.contiguous()), None, stream)
                    ep.combine(*_dl(y, w, out), stream)

                res[f"{key}_ep_peer_a2a_us"] = median_us(round_trip, ROUNDS, reps=10)
                torch.cuda.synchronize()
                ep.check()
                if d % 128 == 0:  # FP8 dispatch, bf16 combine
                    q, scales = encore.fp8_group_quant(x)
                    qb, sb = q.view(torch.uint8), scales.contiguous().view(torch.uint8)
                    _, ep8 = _moe_ep._peer_rank(None, world, rank, e, k, d, x, t, fp8=True)

                    def round_trip_fp8():
                        ep8.dispatch(*_dl(qb, ids.contiguous(), sb), stream)
                        ep8.combine(*_dl(y, w, out), stream)

                    res[f"{key}_ep_peer_fp8_a2a_us"] = median_us(round_trip_fp8, ROUNDS, reps=10)
                    torch.cuda.synchronize()
                    ep8.check()
                    rows8 = qb.index_select(0, torch.div(torch.argsort(dest, stable=True), k, rounding_mode="floor"))
                    rows8_in = rows8.new_empty(sum(r_l), d)
                    res[f"{key}_nccl_a2a_fp8_rows_us"] = median_us(lambda: dist.all_to_all_single(rows8_in, rows8, r_l, s_l), ROUNDS, reps=10)
                    res[f"{key}_ep_peer_fp8_layer_us"] = median_us(
                        lambda: encore.moe_forward_ep(x, logits, w13, w2, k, transport="peer", dispatch_fp8=True), ROUNDS, reps=10)
                res[f"{key}_tp_layer_us"] = median_us(lambda: encore.moe_forward_ep(x, logits, w13, w2, k, mode="tp"), ROUNDS, reps=10)
                part = torch.randn(t, d, device="cuda")
                res[f"{key}_nccl_allreduce_us"] = median_us(lambda: dist.all_reduce(part), ROUNDS, reps=10)
            except Exception as err:  # noqa: BLE001 (recorded; the other shapes still run)
                res[f"{key}_error"] = repr(err)[:300]
            if rank == 0:
                print({k_: v for k_, v in res.items() if k_.startswith(key)}, flush=True)
        w13 = w2 = None  # free this shape's experts before the next
        torch.cuda.empty_cache()
    if rank == 0:
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "moe_ep_peers.json")
