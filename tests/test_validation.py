"""The shared config validators: `need` and `strict_kwargs` (unknown keys named, valid listed)."""

from dataclasses import dataclass

import pytest

from lockstep.moe.checks import ConfigError, need, strict_kwargs
from lockstep.rollout.sglang import SGLangConfig
from lockstep.rollout.types import RequestError, SamplingParams
from lockstep.trainer.objective.correction import CorrectionConfig
from lockstep.trainer.objective.losses import LossConfig


@dataclass
class _Cfg:
    a: int = 1
    b: str = "x"


def test_need_raises_the_callers_error_with_the_message():
    need(True, "unused")
    with pytest.raises(ConfigError, match="^a must be > 0$"):
        need(False, "a must be > 0")
    with pytest.raises(KeyError, match="b is missing"):
        need(False, "b is missing", KeyError)


def test_strict_kwargs_names_unknown_and_lists_valid():
    assert strict_kwargs(_Cfg, {"a": 3}) == {"a": 3}
    with pytest.raises(ConfigError, match=r"^_Cfg: unknown keys \['c', 'z'\]; valid keys are \['a', 'b'\]$"):
        strict_kwargs(_Cfg, {"z": 1, "a": 2, "c": 3})
    with pytest.raises(ValueError, match=r"^thing: unknown keys \['q'\]"):
        strict_kwargs(_Cfg, {"q": 1}, "thing", ValueError)
    with pytest.raises(ConfigError, match="_Cfg must be a mapping, got list"):
        strict_kwargs(_Cfg, [("a", 1)])


def test_call_sites_keep_their_exception_types():
    with pytest.raises(ValueError, match=r"^SGLangConfig: unknown keys \['tp'\]"):
        SGLangConfig.from_dict({"model_path": "m", "tp": 2})
    with pytest.raises(ValueError, match="^SGLangConfig: port must be in 1..65535"):
        SGLangConfig(model_path="m", port=0)
    with pytest.raises(ValueError, match=r"^correction: unknown keys \['x'\]"):
        CorrectionConfig.from_dict({"x": 1})
    with pytest.raises(ValueError, match=r"^loss: unknown keys \['x'\]"):
        LossConfig.from_dict({"x": 1})
    with pytest.raises(RequestError, match="^top_p must be in"):
        SamplingParams(top_p=0.0)
