"""bench/peers/transformers_peers.py --smoke (the GPU benchmark of encore.transformers against eager, torch.compile and
Liger, run here on the CPU with tiny models, eager and encore only): it runs, patches, and writes the JSON the GPU run will."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.25")  # encore.transformers' minimum

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_transformers_peers_smoke(tmp_path):
    out = tmp_path / "tp.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, str(ROOT / "bench/peers/transformers_peers.py"), str(out), "--smoke"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["complete"] and set(res["results"]) == {f"{m}_tiny/{mode}" for m in ("llama", "qwen3", "qwen3_moe")
                                                       for mode in ("train", "infer", "decode")}
    for key, entry in res["results"].items():
        enc = entry["variants"]["encore"]
        assert enc["median_ms"] > 0 and enc["patched"]["modules"], key
        if key.endswith("/train"):
            assert enc["loss_close"], key
        if key.startswith("qwen3_moe") and not key.endswith("/train"):  # inference: the MoE layers through moe_forward
            assert enc["patched"]["report"]["moe"] == 2, key
        blk = entry["variants"]["encore_block"]
        if key.startswith("llama"):
            assert blk["median_ms"] > 0 and blk["patched"]["report"]["block_schedule"] == 1, key
            if key.endswith("/train"):
                assert blk["loss_close"], key
        else:
            assert blk["not_run"] and "Llama/Mistral" in blk["reason"], key
