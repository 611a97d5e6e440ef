"""examples/serve_kda.py: one KDA layer served on a state pool (prefills with chunk_kda on the pool, decode steps of
a fixed batch with padding rows, speculative steps accepting 1-4 tokens, slots reused) equal to chunk_kda over each
request's whole sequence: the pool's rounding only (fp32 pool 1e-5, bf16 pool 5e-3 relative RMS), every request
finished. The CPU backend in CI; the same on CUDA (bf16 inputs) on the GPU machine."""
import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch")
import encore  # noqa: E402

_path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "serve_kda.py"
_spec = importlib.util.spec_from_file_location("serve_kda", _path)
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)


@pytest.mark.parametrize("pool", ["float32", "bfloat16"])
def test_serving_equals_chunk_kda_cpu(pool, capsys):
    o_err, s_err, finished = ex.main(["--device", "cpu", "--pool-dtype", pool, "--requests", "10", "--steps", "60"])
    bound = 1e-5 if pool == "float32" else 5e-3
    assert o_err < bound and s_err < bound, (o_err, s_err)
    assert finished == 10
    assert "spec" in capsys.readouterr().out


@pytest.mark.skipif(not (encore.built_with_cuda() and encore.cuda_device_count() > 0 and torch.cuda.is_available()), reason="needs CUDA")
@pytest.mark.parametrize("pool", ["float32", "bfloat16"])
def test_serving_equals_chunk_kda_cuda(pool):
    o_err, s_err, finished = ex.main(["--device", "cuda", "--pool-dtype", pool, "--requests", "10", "--steps", "60"])
    assert o_err < 5e-3 and s_err < 5e-3 and finished == 10, (o_err, s_err, finished)
