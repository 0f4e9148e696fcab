#!/usr/bin/env bash
# Builds (or reuses) the separate virtualenv that the verl tests run in.
#
# verl pins its own transformers (>=5.5.3,<5.11) while entropylens' main venv follows the latest,
# so verl gets a venv of its own. Order matters: torch==2.13.0 (the CPU wheel this project uses)
# goes in FIRST and stays pinned while verl resolves, so nothing pulls a CUDA build of torch.
# verl's base requirements carry no torch pin, no vllm/sglang/flash-attn (those are extras), so
# the plain `verl==0.9.1` install is used, with torch held by a constraints file.
#
# Cache: the venv lives outside the clone (default ~/.cache/entropylens/verl-venv, override with
# ENTROPYLENS_VERL_VENV) so CI on the same machine reuses it. It is rebuilt when the key (this
# script's hash) changes. entropylens itself is (re)installed editable from the calling working
# tree on every call (a few seconds, no dependencies), so the venv always tests the tree that calls it.
#
# Usage: tests/verl_env/build.sh            -> prints the venv's python path on its last line
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${ENTROPYLENS_VERL_VENV:-$HOME/.cache/entropylens/verl-venv}"
TORCH_VERSION="2.13.0"
VERL_VERSION="0.9.1"
key="$(cat "$here/build.sh" "$here/requirements.txt" | sha256sum | cut -c1-16)"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9   # one builder at a time (a dev shell and CI may share the cache)

if [ ! -f "$venv/.entropylens-key" ] || [ "$(cat "$venv/.entropylens-key")" != "$key" ]; then
  start=$(date +%s)
  echo "building verl venv at $venv (key $key)" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  pip="$venv/bin/python -m pip"
  $pip install -q --upgrade pip >&2
  # 1) torch first (the CPU wheel; PyPI's default torch would be the multi-GB CUDA build).
  $pip install -q "torch==$TORCH_VERSION" >&2
  # 2) verl and what its imports need, torch held fixed.
  echo "torch==$TORCH_VERSION" > "$venv/constraints.txt"
  $pip install -q -c "$venv/constraints.txt" "verl==$VERL_VERSION" -r "$here/requirements.txt" >&2
  # entropylens' own dependencies (duckdb, polars, ...), resolved against verl's pins
  ( cd / && $pip install -q -c "$venv/constraints.txt" -e "$repo" >&2 )
  "$venv/bin/python" -c "import torch, verl; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__" >&2
  echo "$key" > "$venv/.entropylens-key"
  echo "verl venv built in $(( $(date +%s) - start )) s" >&2
fi

# 3) entropylens from the calling working tree: editable, no dependencies (they came with the build);
#    redone on every call (a few seconds) so the entry points always match this tree's pyproject.toml.
( cd / && "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$repo" >&2 )
( cd / && "$venv/bin/python" - "$repo" >&2 <<'PY'
import sys
from importlib.metadata import entry_points
import entropylens
want = sys.argv[1]
assert entropylens.__file__.startswith(want + "/"), f"verl venv imports entropylens from {entropylens.__file__}, not {want}"
assert any(ep.value == "entropylens.integrations.verl" for ep in entry_points(group="verl.plugins")), "no verl.plugins entry point"
PY
)
echo "$venv/bin/python"
