"""Sampling seeds (rollout/seeds.py): one derivation that stays int64 for every allowed
loop.seed and step, gives the seeds of the formula it replaces wherever those fit (so runs in
that range sample what they did), and is what the step's requests and validation send."""

from pathlib import Path

import pytest
import torch

from lockstep.moe.model import MoEModel
from lockstep.rollout.engine import Engine, EngineConfig
from lockstep.rollout.seeds import MAX_LOOP_SEED, MAX_SAMPLES, sampling_seed
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.types import ExperimentConfigError
from lockstep.trainer.driver.requests import step_requests

from model_fixtures import tiny_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
INT64_END = 1 << 63


def _before(loop_seed: int, step: int, index: int, validation: bool = False) -> int:
    """The formula before rollout/seeds.py (trainer/driver/requests.py, loop.validate)."""
    return (loop_seed * 1_000_003 + step) * (1 << 24) + (1 << 23) * validation + index


@pytest.mark.parametrize("loop_seed,step", [(0, 1), (0, 200), (7, 10**6), (549_753, 1),
                                            (549_753, 9_000)])
def test_the_same_seeds_where_the_old_ones_fit(loop_seed, step):
    for index in (0, 1, 255, MAX_SAMPLES - 1):
        for val in (False, True):
            want = _before(loop_seed, step, index, val)
            assert want < INT64_END
            assert sampling_seed(loop_seed, step, index, val) == want


@pytest.mark.parametrize("loop_seed", [549_755, 10**9, MAX_LOOP_SEED])
@pytest.mark.parametrize("step", [1, 200, 10**7, 2**40, 2**70])
def test_every_allowed_seed_and_step_stays_int64(loop_seed, step):
    assert _before(loop_seed, step, 0) >= INT64_END or step >= 2**39  # overflowed before
    for index, val in ((0, False), (MAX_SAMPLES - 1, False), (MAX_SAMPLES - 1, True)):
        s = sampling_seed(loop_seed, step, index, val)
        assert 0 <= s < INT64_END


def test_streams_and_steps_do_not_share_seeds():
    a = {sampling_seed(MAX_LOOP_SEED, step, i, v) for step in (1, 2, 3) for i in (0, 1, 2)
         for v in (False, True)}
    assert len(a) == 18
    with pytest.raises(ValueError, match="one step seeds at most 8388608 samples"):
        sampling_seed(0, 1, MAX_SAMPLES)


def test_the_steps_requests_carry_int64_seeds_an_engine_takes():
    """loop.seed 2^31-1: each request's seed + n - 1 is an int64, the embedded engine samples
    with it (before: 2^31-1 * 1_000_003 * 2^24 overflowed int64 and the engine refused)."""
    cfg = load_config(CONFIGS / "toy_r3.yaml", [f"loop.seed={MAX_LOOP_SEED}"])
    prompts = [type("P", (), {"ids": [1, 3, 4]})()] * 3
    reqs = step_requests(cfg, prompts, 7, 4)
    n = cfg.rollout.samples_per_prompt
    assert [r.sampling.seed for r in reqs] == [sampling_seed(MAX_LOOP_SEED, 7, i * n)
                                               for i in range(3)]
    assert all(0 <= r.sampling.seed and r.sampling.seed + n - 1 < INT64_END for r in reqs)
    torch.manual_seed(0)
    eng = Engine.from_model(MoEModel(tiny_config()), EngineConfig(dtype="fp32", max_running=8,
                                                                 max_len=16))
    assert len(eng.generate(reqs[:1])) == n


def test_a_seed_past_int64_is_refused_by_name():
    with pytest.raises(ValueError, match=r"sampling_seed 9223372036854775807 \(\+ n - 1 = 1 "
                                         r"for the last sample\) is outside int64"):
        SamplingParams(n=2, seed=INT64_END - 1).validate()
    SamplingParams(n=1, seed=INT64_END - 1).validate()


def test_loop_seed_is_bounded_where_the_derivation_is():
    load_config(CONFIGS / "toy_r3.yaml", [f"loop.seed={MAX_LOOP_SEED}"])
    with pytest.raises(ExperimentConfigError, match="loop.seed"):
        load_config(CONFIGS / "toy_r3.yaml", [f"loop.seed={MAX_LOOP_SEED + 1}"])
    with pytest.raises(ExperimentConfigError, match="at most 8388608"):
        load_config(CONFIGS / "toy_r3.yaml", ["rollout.prompts_per_step=4096",
                                              "rollout.samples_per_prompt=4096"])
