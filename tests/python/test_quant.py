"""The quant family's Python wrappers (fp8_group_quant, fp8_group_dequant) on the CPU backend
(numpy) against the e4m3 bounds, bad input, and CUDA tensors against the CPU backend bit for bit when
a GPU is visible."""
import numpy as np
import pytest

import encore
from helpers import needs_torch_cuda, torch


@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_group_quant_numpy(column_major, pow2):
    rng = np.random.default_rng()
    x = (3 * rng.standard_normal((5, 384))).astype(np.float32)
    q, s = encore.fp8_group_quant(x, column_major_scales=column_major, power_of_two_scales=pow2)
    assert q.dtype == np.uint8 and q.shape == x.shape and s.shape == (5, 3)
    amax = np.abs(x.reshape(5, 3, 128)).max(-1)
    if pow2:
        assert np.all(np.log2(s) == np.round(np.log2(s))) and np.all(s * 448 >= amax)
    else:
        np.testing.assert_allclose(s, amax / 448, rtol=1e-6)
    back = encore.fp8_group_dequant(q, s)
    err = np.abs(back - x)
    bound = np.maximum(np.abs(x) / 16, np.repeat(s, 128, axis=1) * 2.0**-10)
    assert np.all(err <= bound + 1e-12)


def test_fp8_group_quant_bad_k():
    with pytest.raises(ValueError, match="must be a multiple of group_size"):
        encore.fp8_group_quant(np.ones((2, 200), np.float32))


@needs_torch_cuda
def test_fp8_group_quant_torch_cuda_matches_cpu():
    x = torch.randn(33, 1024, dtype=torch.bfloat16, device="cuda") * 4
    q, s = encore.fp8_group_quant(x, column_major_scales=True)
    qc, sc = encore.fp8_group_quant(x.cpu(), column_major_scales=True)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.cpu().view(torch.uint8), qc.view(torch.uint8))
    assert torch.equal(s.cpu(), sc)
