"""bench/replay_study.py's cell runner: one tiny cell through `lockstep train`, its command
file, its summary and the study table (the study itself is a bench, not run by CI)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("replay_study", ROOT / "bench/replay_study.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)

TINY = ["warmstart.enabled=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
        "actor.mini_batch_size=8", "actor.micro_batch_size=8", "loop.plots=false",
        "loop.tensorboard=false"]


def test_one_cell_runs_and_lands_in_the_table(tmp_path):
    config = ROOT / "configs/toy_r3.yaml"
    d = study.train(config, tmp_path, "off", "tis", 3, 2, TINY, sched="trig")
    assert d.name == "off_tis_trig_s3" and (d / "summary.json").exists(), \
        (tmp_path / "off_tis_trig_s3.log").read_text()[-2000:]
    cmd = (tmp_path / "off_tis_trig_s3.cmd").read_text()
    assert "--set replay.mode=off" in cmd and "--set actor.lr_schedule=triggered" in cmd
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["replay/mode"] for r in rows] == ["off"] * 2 and "lr_trigger/scale" in rows[0]
    r = study.summarize_run(d)
    assert r["steps"] == 2 and r["reward_curve"] == [x["reward/mean"] for x in rows]
    assert r["reward_peak"] >= r["reward_last"] and isinstance(r["degraded"], bool)
    text = study.report(tmp_path, [3])
    assert "| off | tis | trig | 3 | 2 |" in text and "`off_tis_trig_s3.cmd`" in text
    assert (tmp_path / "study_reward.png").exists()
    # a finished cell is not run again
    assert study.train(config, tmp_path, "off", "tis", 3, 2, TINY, sched="trig") == d


def _summary(tmp_path, reward):
    d = tmp_path / "run"
    d.mkdir(exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": i + 1, "reward/mean": x, "rollout_corr/k3_kl": 1e-3, "routing/flip_rate": 0.0,
         "routing/token_any_flip": 0.0, "actor/grad_norm": 0.5}) + "\n"
        for i, x in enumerate(reward)))
    return study.summarize_run(d)


def test_degraded_means_the_moving_mean_fell_below_half_its_peak(tmp_path):
    r = _summary(tmp_path, [0.2] * 5 + [0.6] * 10 + [0.25] * 10)  # peak 0.6 at 10..15, last 0.25
    assert (r["reward_peak"], r["peak_step"], r["reward_last"]) == pytest.approx((0.6, 10, 0.25))
    assert r["degraded"]
    assert not _summary(tmp_path, [0.6] * 5 + [0.2] * 5 + [0.5] * 5)["degraded"]  # recovered
    assert not _summary(tmp_path, [0.06] * 5 + [0.02] * 5)["degraded"]  # too small to count


def test_a_variant_this_checkout_lacks_is_refused_up_front(monkeypatch):
    monkeypatch.setitem(study.REPLAYS, "nope", ["replay.no_such_option=1"])
    with pytest.raises(SystemExit, match="replay variant 'nope' / schedule 'const' is not "
                                         "available on this checkout: .*no_such_option"):
        study.check_cells(ROOT / "configs/toy_r3.yaml", ["off", "nope"], ["const"], [])
