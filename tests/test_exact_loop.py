"""`rollout.exact` and `rollout.mismatch` through the RL loop: zero mismatch on every row, the
injected one calibrated and recorded, and the knobs that would break exact mode refused."""

import json
from pathlib import Path

import pytest

from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.types import ExperimentConfigError
from lockstep.trainer.loop import Trainer

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SMALL = ["warmstart.enabled=false", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
         "actor.mini_batch_size=16", "actor.micro_batch_size=16", "loop.steps=2",
         "loop.tensorboard=false", "loop.plots=false", "loop.checkpoint_every=0"]
EXACT = ["rollout.exact=true", "actor.dtype=bf16"]


def _rows(d):
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["R3", "off"])
def test_exact_mode_has_no_mismatch_on_any_step(tmp_path, mode):
    cfg = load_config(CONFIGS / "toy_r3.yaml", SMALL + EXACT + [f"replay.mode={mode}"])
    Trainer(cfg, tmp_path, progress=False, log=lambda s: None).run()
    for m in _rows(tmp_path):
        assert m["rollout_corr/k3_kl"] == 0.0 and m["rollout_corr/kl"] == 0.0
        assert m["routing/flip_rate"] == 0.0
        assert m["rollout_corr/rollout_is_mean"] == 1.0  # TIS: every weight exactly 1
    assert "exact: true" in (tmp_path / "config.yaml").read_text()


@pytest.mark.slow
def test_injected_mismatch_is_calibrated_and_recorded(tmp_path):
    cfg = load_config(CONFIGS / "toy_r3.yaml", SMALL + EXACT + [
        "replay.mode=off", "rollout.mismatch={router_flip_rate: 0.1}"])
    logs = []
    Trainer(cfg, tmp_path, progress=False, log=logs.append).run()
    assert any("router noise sigma" in s for s in logs)
    rows = _rows(tmp_path)
    for m in rows:
        assert m["mismatch/router_flip_rate_target"] == 0.1 and m["mismatch/router_noise"] > 0
        assert abs(m["mismatch/calibrated_flip_rate"] - 0.1) <= 0.003
        assert 0.05 < m["routing/flip_rate"] < 0.2  # the actor measures it (a small batch)
        assert m["rollout_corr/k3_kl"] > 0
    assert "router_flip_rate: 0.1" in (tmp_path / "config.yaml").read_text()


def test_default_runs_have_no_new_keys():
    cfg = load_config(CONFIGS / "toy_r3.yaml")
    d = cfg.to_dict()
    assert "exact" not in d["rollout"] and "mismatch" not in d["rollout"]
    assert not {"kpop", "kpop_phi", "trm_delta", "trm_k3_mean"} & set(d["correction"])
    assert "reward" not in d["task"]


@pytest.mark.parametrize("sets,needle", [
    (["rollout.exact=true"], "actor.dtype=bf16"),  # the toy's actor is fp32
    (EXACT + ["rollout.lm_head_dtype=fp32"], "lm_head_dtype"),
    (EXACT + ["rollout.top_p=0.9"], "truncate"),
    (EXACT + ["actor.fp8=true"], "FP8"),
    (["rollout.exact=true", "rollout.dtype=fp8", "actor.dtype=bf16"], "fp8"),
    (EXACT + ["actor.backend=megatron"], "megatron"),
    (EXACT + ["rollout.backend=http", "rollout.url=http://127.0.0.1:1"], "HTTP"),
    (["rollout.mismatch={router_flip_rate: 0.1}", "loop.max_staleness=1"], "max_staleness"),
    (["rollout.mismatch={router_flip_rate: 0.1}", "rollout.backend=ray"], "embedded"),
    (["rollout.mismatch={router_flip_rate: 0.1, router_noise: 0.5}"], "both set"),
])
def test_knobs_that_break_it_are_refused(sets, needle):
    with pytest.raises(ExperimentConfigError, match=needle):
        load_config(CONFIGS / "toy_r3.yaml", sets)
