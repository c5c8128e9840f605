#!/usr/bin/env bash
# A Python 3.12 virtualenv for benchmarks/maxtext_fit.py: MaxText 0.2.5 with its TPU extra
# (jax 0.12.0.1, libtpu 0.0.50.1) and tfjax installed editable from this checkout, so that both
# projects' train steps compile under the same libtpu in one process. Benchmark use only: CI
# never builds it (MaxText needs Python >= 3.12 and pulls in ~250 packages).
#
#   benchmarks/maxtext/setup.sh [PYTHON]    # PYTHON: a Python 3.12 (default: python3.12)
#
# The venv lands in benchmarks/maxtext/.venv (git-ignored). It needs PyPI once, here; the
# benchmark itself downloads nothing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="${1:-python3.12}"
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || {
  echo "setup.sh: $python is not Python 3.12 (MaxText 0.2.5 needs >= 3.12); pass one" >&2
  exit 1
}
"$python" -m venv "$here/.venv"
pip=("$here/.venv/bin/python" -m pip install --disable-pip-version-check)
"${pip[@]}" --upgrade pip
# MaxText's tpu extra at the versions it was released with, and tfjax (it allows jax < 0.13),
# resolved together so neither moves the other's pins.
"${pip[@]}" "maxtext[tpu]==0.2.5" "jax==0.12.0.1" "jaxlib==0.12.0.1" "libtpu==0.0.50.1" -e "$root"
"$here/.venv/bin/python" - <<'PY'
import importlib.metadata as m
for p in ("maxtext", "jax", "jaxlib", "libtpu", "flax", "tfjax"):
    print(f"{p} {m.version(p)}")
PY
