#!/usr/bin/env bash
# Installs the wheels carried in .whl/ (fla-core, einops, liger-kernel, nvidia-cudnn-frontend: the peers' packages;
# transformers and the newer huggingface-hub it needs, docs/gpu_workflow.md) into /tmp/site on the GPU machine, which has
# no network; put /tmp/site on PYTHONPATH to use them (they then shadow the machine's own versions).
# Quiet; pip's output goes to LOG (default /dev/null). Usage: scripts/gpu_wheels.sh [LOG]
ls .whl/*.whl >/dev/null 2>&1 || exit 0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"${1:-/dev/null}" 2>&1
