"""Runs tests/gpu/check_megatron_te.py (TE spec + replay parity) where a GPU is at hand."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.megatron]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_te_spec_replay_parity_on_gpu():
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformer_engine")
    path = Path(__file__).parent / "gpu" / "check_megatron_te.py"
    spec = importlib.util.spec_from_file_location("check_megatron_te", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main() == 0
