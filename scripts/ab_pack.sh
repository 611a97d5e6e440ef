#!/usr/bin/env bash
# Packs the sources of git revisions for `scripts/gpu.sh ab` (the GPU machine's copy of the tree
# has no usable history): one .deps/ab/NAME.tar.gz per revision, NAME being the revision with each
# character other than letters, digits, '.', '_' and '-' replaced by '_'. It holds NAME/ (git
# archive of the revision, without bench/results) and NAME/COMMIT (its 12-digit hash). Carry .deps
# and run there, e.g.
#   ENCORE_AB_A=main ENCORE_AB_B=. scripts/gpu.sh ab     (main against the carried working tree)
# Usage: scripts/ab_pack.sh REV [REV ...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ $# -ge 1 ] || { echo "usage: scripts/ab_pack.sh REV [REV ...]" >&2; exit 2; }
mkdir -p .deps/ab
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for rev in "$@"; do
  name=$(printf %s "$rev" | tr -c 'A-Za-z0-9._-' _)
  hash=$(git rev-parse --short=12 "$rev^{commit}")
  git archive --format=tar --prefix="$name/" "$hash" -- . ':(exclude)bench/results' >"$tmp/$name.tar"
  mkdir -p "$tmp/$name" && echo "$hash" >"$tmp/$name/COMMIT"
  tar -rf "$tmp/$name.tar" -C "$tmp" "$name/COMMIT"
  gzip -c "$tmp/$name.tar" >".deps/ab/$name.tar.gz"
  echo "$rev ($hash) -> .deps/ab/$name.tar.gz ($(du -h ".deps/ab/$name.tar.gz" | cut -f1))"
done
