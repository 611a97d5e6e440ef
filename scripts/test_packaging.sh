#!/usr/bin/env bash
# Packaging checks (called by scripts/test.sh; runnable alone): every public header compiles on
# its own; a CPU-only wheel (pip wheel .) installs into a fresh venv and passes
# tests/consumer/wheel_smoke.py; `cmake --install` of the CPU build tree serves find_package(encore
# CONFIG) to tests/consumer, which builds and runs. Temporary files go to a mktemp dir (removed).
# ENCORE_PKG_BUILD: the build tree to install (default build-cpu; built with scripts/build.sh cpu
# when absent, brought up to date otherwise).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"  # pip's cmake
unset PYTHONPATH
tmp=$(mktemp -d /tmp/encore-pkg.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)

echo "== packaging: public headers compile standalone"
for h in $(cd include && find encore -name '*.hpp' | sort); do
  echo "#include \"$h\"" | g++ -std=c++20 -Wall -Wextra -Werror -I include -x c++ -fsyntax-only - ||
    { echo "packaging: $h does not compile on its own"; exit 1; }
done

echo "== packaging: CPU-only wheel (pip wheel . -Ccmake.define.ENCORE_CUDA=OFF)"
t0=$SECONDS
python3 -m pip wheel . --no-deps -v -w "$tmp/wheel" -Ccmake.define.ENCORE_CUDA=OFF >"$tmp/wheel.log" 2>&1 ||
  { tail -40 "$tmp/wheel.log"; echo "packaging: wheel build FAILED"; exit 1; }
whl=$(ls "$tmp"/wheel/encore-*.whl)
echo "   built $(basename "$whl") in $((SECONDS - t0)) s;$(grep -m1 -o ' encore: CUDA=.*' "$tmp/wheel.log")"
python3 - "$whl" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["encore/__init__.py", "encore/norm.py"]
missing = [n for n in need if n not in names] + ([] if any(n.startswith("encore/_encore.") for n in names) else ["encore/_encore.*"])
stray = [n for n in names if not n.startswith(("encore/", "encore-"))]
if missing or stray:
    sys.exit(f"packaging: wheel content wrong: missing {missing}, unexpected {stray[:5]}")
PY

echo "== packaging: install the wheel into a fresh venv (numpy from the index) and smoke-test it"
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q "$whl"
(cd "$tmp" && "$tmp/venv/bin/python" "$root/tests/consumer/wheel_smoke.py")

bdir=${ENCORE_PKG_BUILD:-build-cpu}
echo "== packaging: cmake --install $bdir, then tests/consumer via find_package(encore CONFIG)"
if [ ! -f "$bdir/CMakeCache.txt" ]; then
  if [ "$bdir" = build-cpu ]; then
    ./scripts/build.sh cpu
  else
    cmake -S . -B "$bdir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DENCORE_CUDA=OFF >/dev/null
    cmake --build "$bdir" -j "$(nproc)"
  fi
else
  cmake --build "$bdir" -j "$(nproc)" >/dev/null  # no-op when current; regenerates the install rules
fi
cmake --install "$bdir" --prefix "$tmp/prefix" >/dev/null
if grep -rl "$root" "$tmp/prefix/lib/cmake/encore" >/dev/null; then
  echo "packaging: the installed encoreTargets.cmake names the source tree ($root)"; exit 1
fi
cmake -S tests/consumer -B "$tmp/consumer" "${gen[@]}" -DCMAKE_PREFIX_PATH="$tmp/prefix" >"$tmp/consumer.log" 2>&1 ||
  { cat "$tmp/consumer.log"; echo "packaging: consumer configure FAILED"; exit 1; }
grep "encore .* from" "$tmp/consumer.log" | sed 's/^-- /   /'
cmake --build "$tmp/consumer" >>"$tmp/consumer.log" 2>&1 ||
  { cat "$tmp/consumer.log"; echo "packaging: consumer build FAILED"; exit 1; }
"$tmp/consumer/encore_consumer"
echo "== packaging: all checks passed"
