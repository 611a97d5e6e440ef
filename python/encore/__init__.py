"""encore: fused transformer kernels for NVIDIA Hopper with a CPU reference backend.

Arrays are exchanged through DLPack: numpy arrays (CPU backend) and torch tensors (CPU backend, or
the CUDA backend for CUDA tensors). Outputs are allocated with the caller's framework; CUDA work
runs on torch's current stream unless ``stream`` is given. Invalid arguments raise ``ValueError``
with encore's message, other failures ``RuntimeError``. One module per family (norm, quant, gemm,
blocks, kda, moe) holds its public functions, its launchers (one binding call over the family's C++
Args / Options structs) and its torch.library ops (torch.ops.encore.<op>, with fakes and, where
differentiable, autograd), so torch.compile(fullgraph=True) traces encore calls; _core holds what
they share.
"""
from __future__ import annotations

import sys as _sys

from . import _encore
from ._core import register_torch_ops
from .blocks import llama_block_forward, llama_block_workspace_bytes
from .blocks import llama_block_backward, qkv_norm_backward
from .gemm import cross_entropy_bwd, cross_entropy_bwd_
from .gemm import (Epilogue, GemmTile, gemm_epilogue, gemm_lse, gemm_qkv_head_sqsum, gemm_residual_rms_partial, gemm_rope,
                   gemm_row_scale, gemm_scalar_scale, gemm_swiglu, interleave_gate_up, lse_finish, partials_sum, qk_norm_rope_,
                   qk_norm_rope_backward, rms_final_reduce, rope_freq_turns)
from .kda import chunk_kda, kda_backward, kda_forward, kda_forward_workspace_bytes
from .moe import moe_buffers_bytes, moe_combine, moe_dispatch, moe_forward, moe_permuted_rows, moe_routing
from .norm import add_rms_norm, qk_norm_, rms_norm
from .quant import fp8_group_dequant, fp8_group_quant, mxfp8_dequant, mxfp8_quant, nvfp4_dequant, nvfp4_quant

__all__ = ["rms_norm", "add_rms_norm", "qk_norm_", "fp8_group_quant", "fp8_group_dequant", "mxfp8_quant", "mxfp8_dequant", "nvfp4_quant", "nvfp4_dequant", "built_with_cuda",
           "cuda_device_count", "gemm_row_scale", "gemm_scalar_scale", "gemm_residual_rms_partial",
           "rms_final_reduce", "partials_sum", "gemm_swiglu", "gemm_rope", "gemm_qkv_head_sqsum", "gemm_lse", "lse_finish", "cross_entropy_bwd", "cross_entropy_bwd_",
           "rope_freq_turns", "interleave_gate_up", "llama_block_forward", "llama_block_workspace_bytes", "llama_block_backward", "qkv_norm_backward",
           "kda_forward", "kda_forward_workspace_bytes", "kda_backward", "chunk_kda", "qk_norm_rope_", "qk_norm_rope_backward", "gemm_epilogue", "Epilogue", "GemmTile",
           "moe_routing", "moe_dispatch", "moe_combine", "moe_forward", "moe_permuted_rows", "moe_buffers_bytes", "register_torch_ops"]

__version__ = _encore.__version__  # project(encore VERSION ...) in CMakeLists.txt
built_with_cuda = _encore.built_with_cuda
cuda_device_count = _encore.cuda_device_count



def __getattr__(name):
    """encore.nn (torch modules), encore.transformers (the Hugging Face patch; transformers itself is imported only
    by its functions) and encore.moe_forward_ep (torch.distributed) on first use: `import encore` alone never
    imports torch."""
    if name in ("nn", "transformers", "moe_forward_ep"):
        import importlib

        mod = importlib.import_module("._moe_ep" if name == "moe_forward_ep" else "." + name, __name__)
        return mod.moe_forward_ep if name == "moe_forward_ep" else mod
    raise AttributeError(f"module 'encore' has no attribute {name!r}")


# torch.ops.encore (each family module declares its ops): registered now where torch is already
# loaded, else on the first call with torch tensors or register_torch_ops(); numpy-only use never
# imports torch.
if "torch" in _sys.modules:
    register_torch_ops()
