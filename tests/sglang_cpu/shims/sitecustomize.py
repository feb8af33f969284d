"""Test-only start-up hook for real SGLang on a CPU (lockstep's tier, tests/sglang_cpu/).

With LOCKSTEP_SGLANG_CPU_HOST_BUFFER=1: SGLang's routed-experts host buffer
(`sglang.srt.state_capturer.base.BaseHostCache`, used by --enable-return-routed-experts) is
allocated as a plain zeroed CPU tensor. SGLang allocates it pinned and registers it with
cudaHostRegister, which fails at start-up on a machine without CUDA. Nothing else changes.
"""

import os

if os.environ.get("LOCKSTEP_SGLANG_CPU_HOST_BUFFER") == "1":
    import importlib.abc
    import importlib.util
    import sys

    _TARGET = "sglang.srt.state_capturer.base"

    def _plain_host_cache(cls):
        def __init__(self, num_tokens, num_layers, topk_size, name, device):
            import torch
            self.buffer = torch.zeros((num_tokens, num_layers, topk_size), dtype=torch.int32)
            self.num_tokens, self.num_layers, self.topk_size = num_tokens, num_layers, topk_size
            self.name = name
            self._log_allocation()
        cls.__init__ = __init__

    class _PatchAfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != _TARGET:
                return None
            sys.meta_path.remove(self)  # find the real module, once
            spec = importlib.util.find_spec(fullname)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _plain_host_cache(module.BaseHostCache)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchAfterImport())
