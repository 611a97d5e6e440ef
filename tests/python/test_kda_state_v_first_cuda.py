"""fla's state_v_first on CUDA tensors: the checks of test_kda_state_v_first.py (each call with state_v_first
against the default layout on the same inputs with the states transposed) through the CUDA kernels, which
index the transposed layout at their state loads and stores only, so outputs, gradients and states agree to
1e-6 relative RMS (they are expected bit-identical): chunk_kda forward + backward (the first backward for
fp32, the second for bf16 with saved states, the rematerializing one; K, V <= 128 on tensor cores and K 160
on the token-recurrent path), return_intermediate_states, fused_recurrent_kda (in place, new final states),
the decode on fp32 / bf16 pools and the prefill on a pool. At K = V = 128 the default layout's decode takes
the compile-time kernels and state_v_first the general one (another summation order): 5e-3 there, the
serving tests' bound against the fp64 reference. Skipped without CUDA."""
import pytest

torch = pytest.importorskip("torch")

import encore  # noqa: E402
from test_kda_state_v_first import check_chunk_kda, check_fused_recurrent, check_intermediate_states, check_pool, check_prefill  # noqa: E402

HAS_CUDA = encore.built_with_cuda() and encore.cuda_device_count() > 0 and torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

SAME = 1e-6  # the same kernels on both layouts
DIMS = [(48, 40), (128, 128)]


def decode_tol(kd, vd):
    return 5e-3 if kd == vd == 128 else SAME


@pytest.mark.parametrize("kd,vd", DIMS + [(160, 64)])
@pytest.mark.parametrize("dtype,rematerialize", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
                         ids=["fp32-saved-h", "bf16-saved-h", "bf16-rematerialize"])
def test_chunk_kda_forward_backward(dtype, rematerialize, kd, vd):
    check_chunk_kda("cuda", dtype, kd, vd, rematerialize, SAME)


@pytest.mark.parametrize("kd,vd", DIMS)
def test_return_intermediate_states(kd, vd):
    check_intermediate_states("cuda", torch.bfloat16, kd, vd, SAME)


@pytest.mark.parametrize("kd,vd", DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_recurrent_kda(dtype, kd, vd):
    check_fused_recurrent("cuda", dtype, kd, vd, decode_tol(kd, vd))


@pytest.mark.parametrize("kd,vd", DIMS)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_decode_on_the_pool(pool_dtype, kd, vd):
    check_pool("cuda", torch.bfloat16, kd, vd, pool_dtype, decode_tol(kd, vd))


@pytest.mark.parametrize("kd,vd", DIMS)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_prefill_on_the_pool(pool_dtype, kd, vd):
    check_prefill("cuda", torch.bfloat16, kd, vd, pool_dtype, SAME)
