#!/usr/bin/env bash
# Builds the `encore` binary of each named git revision (branch or commit) here and packs them for
# scripts/gpu_kda_ab.sh: .gpupack/exp.tar.gz holds one directory per revision (its name with '/'
# replaced by '_'), each with `encore` and COMMIT. The working tree must be clean; it is returned to
# the current branch afterwards (the CUDA build reuses ccache, so each revision recompiles only
# what differs). Carry [".gpupack"] and on the GPU machine:
#   mkdir -p /tmp/x && tar xzf .gpupack/exp.tar.gz -C /tmp/x && scripts/gpu_kda_ab.sh .gpubin /tmp/x/*
# Each directory also holds that revision's `encore_tests_gpu` (about 7 MB compressed), which
# gpu_kda_ab.sh runs first (KDA tests): a measured build is a tested build. ENCORE_AB_TESTS=0 leaves
# it out (3 builds with tests plus gpu.tar.gz exceed the 64 MiB a device call carries: stage two).
# Usage: scripts/stage_ab.sh REV [REV ...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ $# -ge 1 ] || { echo "usage: scripts/stage_ab.sh REV [REV ...]" >&2; exit 2; }
git diff --quiet HEAD || { echo "stage_ab.sh: commit or stash your changes first" >&2; exit 2; }
here=$(git rev-parse --abbrev-ref HEAD)
[ "$here" != HEAD ] || here=$(git rev-parse HEAD)
work=$(mktemp -d)
trap 'git checkout -q "$here"; rm -rf "$work"' EXIT
for rev in "$@"; do
  name=${rev//\//_}
  git checkout -q "$rev"
  ./scripts/build.sh cuda >"$work/build_$name.log" 2>&1 || { echo "build of $rev failed: $work/build_$name.log" >&2; tail -20 "$work/build_$name.log" >&2; exit 1; }
  mkdir -p "$work/$name"
  cp build-cuda/apps/encore/encore "$work/$name/"
  [ "${ENCORE_AB_TESTS:-1}" = 0 ] || cp build-cuda/tests/encore_tests_gpu "$work/$name/"
  git rev-parse --short=12 HEAD >"$work/$name/COMMIT"
  echo "built $rev ($(cat "$work/$name/COMMIT")) -> $name"
done
git checkout -q "$here"
./scripts/build.sh cuda >/dev/null  # the build tree back at the current branch
mkdir -p .gpupack
(cd "$work" && tar -czf "$root/.gpupack/exp.tar.gz" $(for rev in "$@"; do echo "${rev//\//_}"; done))
ls -la .gpupack
