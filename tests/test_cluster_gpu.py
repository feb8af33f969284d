"""Runs tests/gpu/check_torch_cuda.py (2 RL steps with the torch actor and the embedded engine on
CUDA vs the CPU, then the megatron actor on CUDA) where a GPU is at hand."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_actor_and_engine_on_cuda_match_cpu():
    path = Path(__file__).parent / "gpu" / "check_torch_cuda.py"
    spec = importlib.util.spec_from_file_location("check_torch_cuda", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([]) == 0
