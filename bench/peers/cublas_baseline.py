"""Which cuBLAS baseline: torch.matmul against a raw cublasGemmEx call of the same GEMM (the call the C++ harness
makes, bench/gemm/bench_gemm.cpp cublas_gemm), with cuBLAS's default workspace and with a 32 MiB one, CUBLAS_GEMM_DEFAULT
and CUBLAS_GEMM_DEFAULT_TENSOR_OP, on the LLaMA block's GEMM shapes (bf16 in and out, fp32 accumulation), same buffers,
contenders interleaved over ROUNDS rounds (medians), and the kernel each one launches (torch.profiler).
No encore build needed. Usage: python3 bench/peers/cublas_baseline.py [OUT.json]   (gpu.sh: ENCORE_PEERS=<this path>)"""
import ctypes
import json
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

ROUNDS = int(os.environ.get("ROUNDS", "5"))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ.get("OUT", "."), "cublas_baseline.json")
OP_N, OP_T, R_16BF, COMPUTE_32F = 0, 1, 14, 68
ALGOS = {"default": -1, "tensor_op": 99}


def load_cublas():
    """The libcublas torch has loaded (one cuBLAS in the process), opened again by its path."""
    torch.zeros(1, 1, device="cuda") @ torch.zeros(1, 1, device="cuda")  # torch loads its libcublas
    with open("/proc/self/maps") as fh:
        paths = sorted({ln.split()[-1] for ln in fh if "/libcublas.so" in ln})
    if not paths:
        raise OSError("libcublas: not loaded by torch")
    return ctypes.CDLL(paths[0]), paths[0]


lib, libname = load_cublas()
lib.cublasGemmEx.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                             ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
workspace = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")


def make_handle(ws):
    """A cuBLAS handle on torch's current stream; ws: a 32 MiB workspace set after the stream (cublasSetStream resets
    a user workspace to cuBLAS's default pool)."""
    h = ctypes.c_void_p()
    assert lib.cublasCreate_v2(ctypes.byref(h)) == 0
    assert lib.cublasSetStream_v2(h, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)) == 0
    if ws:
        assert lib.cublasSetWorkspace_v2(h, ctypes.c_void_p(workspace.data_ptr()), ctypes.c_size_t(workspace.numel())) == 0
    return h


HANDLES = {False: make_handle(False), True: make_handle(True)}


def gemm_ex(handle, a, w, c, w_kn, algo):
    """Row-major c [M, N] = a [M, K] · wᵀ (w [N, K]) or a · w (w [K, N], w_kn), as bench_gemm.cpp's cublas_gemm."""
    M, K = a.shape
    N = w.shape[1] if w_kn else w.shape[0]
    s = lib.cublasGemmEx(handle, OP_N if w_kn else OP_T, OP_N, N, M, K, ctypes.byref(one), ctypes.c_void_p(w.data_ptr()), R_16BF,
                         N if w_kn else K, ctypes.c_void_p(a.data_ptr()), R_16BF, K, ctypes.byref(zero),
                         ctypes.c_void_p(c.data_ptr()), R_16BF, N, COMPUTE_32F, algo)
    assert s == 0, f"cublasGemmEx failed ({s})"


def time_us(fn, iters=20):
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    st.record()
    for _ in range(iters):
        fn()
    en.record()
    torch.cuda.synchronize()
    return st.elapsed_time(en) * 1000 / iters


def kernel_of(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    names = [e.key for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA and "Memset" not in e.key]
    return ",".join(n[:70] for n in names)


M = 8192
SHAPES = {  # name: (N, K, w_kn)
    "8B o-proj 4096x4096": (4096, 4096, False), "8B gate/up 28672x4096": (28672, 4096, False),
    "8B down 4096x14336": (4096, 14336, False), "8B QKV 6144x4096": (6144, 4096, False),
    "8B dgrad down (swiglu_bwd) N 14336 K 4096": (14336, 4096, True), "8B dgrad gate/up N 4096 K 28672": (4096, 28672, True),
    "1B gate/up 16384x2048": (16384, 2048, False), "1B dgrad down N 8192 K 2048": (8192, 2048, True),
    "70B down 8192x28672": (8192, 28672, False),
}
res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "libcublas": libname, "M": M, "rounds": ROUNDS, "shapes": {}}
for name, (N, K, w_kn) in SHAPES.items():
    torch.manual_seed(0)
    a = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    w = (torch.randn(K, N, device="cuda") if w_kn else torch.randn(N, K, device="cuda")).to(torch.bfloat16)
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    ref = a @ w if w_kn else a @ w.t()
    fns = {"torch.matmul": (lambda: torch.matmul(a, w, out=c)) if w_kn else (lambda: torch.matmul(a, w.t(), out=c))}
    for ws in (False, True):
        for an, av in ALGOS.items():
            def f(h=HANDLES[ws], av=av):
                gemm_ex(h, a, w, c, w_kn, av)
            fns[f"gemm_ex_{an}{'_ws32' if ws else ''}"] = f
    out = {}
    for k, f in fns.items():
        f()
        torch.cuda.synchronize()
        err = (c.float() - ref.float()).abs().max().item()
        out[k] = {"max_abs_diff_vs_torch": err, "kernel": kernel_of(f), "rounds_us": []}
    for r in range(ROUNDS):
        names = list(fns)
        for k in names[r % len(names):] + names[:r % len(names)]:
            out[k]["rounds_us"].append(time_us(fns[k]))
    base = None
    for k, v in out.items():
        v["median_us"] = statistics.median(v["rounds_us"])
        base = base or v["median_us"]
        v["over_torch"] = v["median_us"] / base
        print(f"{name:44s} {k:26s} {v['median_us']:9.1f} us  {v['over_torch']:.3f}  {v['kernel']}", flush=True)
    res["shapes"][name] = out
    with open(OUT, "w") as fh:
        json.dump(res, fh, indent=1)
    del a, w, c, ref
    torch.cuda.empty_cache()
res["complete"] = True
with open(OUT, "w") as fh:
    json.dump(res, fh, indent=1)
