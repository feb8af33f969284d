"""The one dtype table (kernels/dtypes.py) and the spellings each edge accepts from it."""

import pytest
import torch

from lockstep.kernels.dtypes import BY_HF, BY_NAME, DTYPES, HF_PRECISIONS, PRECISIONS, hf_name, \
    torch_dtype


def test_table_rows_agree_with_torch():
    for d in DTYPES:
        assert d.torch == getattr(torch, d.hf)
        assert torch.empty(0, dtype=d.torch).element_size() == d.bytes
        assert BY_NAME[d.name] is d and BY_HF[d.hf] is d
        assert torch_dtype(d.name) == torch_dtype(d.hf) == d.torch
    assert PRECISIONS == ("bf16", "fp16", "fp32")
    assert HF_PRECISIONS == ("bfloat16", "float16", "float32")
    assert hf_name("bf16") == "bfloat16"
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        torch_dtype("int8")


def test_edges_accept_the_spellings_of_today():
    from lockstep.launch.serve import _DTYPES as serve
    from lockstep.rollout.engine_config import DTYPES as engine
    from lockstep.rollout.sglang import _DTYPES as sglang
    from lockstep.rollout.weight_receiver import DTYPES as wire
    from lockstep.trainer.config.megatron import MegatronOptions

    assert serve == ["bf16", "fp16", "fp32"]
    assert engine == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    assert sglang == ("auto", "bfloat16", "float16", "float32")
    assert wire == {"bfloat16": torch.bfloat16, "float16": torch.float16,
                    "float32": torch.float32, "float64": torch.float64,
                    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
    for s in HF_PRECISIONS:
        assert MegatronOptions(params_dtype=s).torch_dtype == getattr(torch, s)
