#!/usr/bin/env bash
# Installs real SGLang 0.5.23 for CPU tests into its own venv (SGLang pins torch 2.14.1; lockstep pins
# 2.13.0, so the two never share an interpreter). Idempotent: a venv whose sglang imports is kept.
#   LOCKSTEP_SGLANG_VENV  where the venv goes (default ~/.cache/lockstep/sglang-0.5.23)
# About 4-6 minutes and ~6 GB on a 2-core machine; torch/torchvision come from pip's local wheels.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${LOCKSTEP_SGLANG_VENV:-$HOME/.cache/lockstep/sglang-0.5.23}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('sglang') == '0.5.23'" 2>/dev/null; then
  echo "sglang venv ready: $venv"; exit 0
fi
echo "installing real SGLang 0.5.23 (CPU test tier) into $venv ..."
start=$(date +%s)
rm -rf "$venv"
python3.11 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q -r "$here/requirements.txt"
# --no-deps: sglang's own requirements pull CUDA-only kernels (sgl-kernel, flashinfer) with no CPU build.
"$venv/bin/pip" install -q --no-deps sglang==0.5.23
"$venv/bin/python" -c "import importlib.metadata as m; print('sglang', m.version('sglang'), 'torch', m.version('torch'))"
echo "sglang venv installed in $(( $(date +%s) - start )) s: $venv"
