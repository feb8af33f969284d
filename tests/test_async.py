"""Async rollout (`loop.max_staleness`): versions of the samples, the version part of the IS
split, the refusal of versions the loop did not ask for, and max_staleness 0 unchanged."""

import math
from pathlib import Path

import pytest
import torch

from lockstep.rollout.client import RolloutError
from lockstep.rollout.types import GenerationResult
from lockstep.rollout.weight_sync import check_versions
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.config.load import load_config
from lockstep.trainer.driver.pipeline import allowed_versions
from lockstep.trainer.loop import Trainer, run_hash
from lockstep.trainer.objective.correction import correct, is_split_metrics
from lockstep.trainer.objective.losses import grpo_advantages
from lockstep.trainer.objective.stats import stats_values
from lockstep.trainer.observe.expert_load import COUNT_KEY

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# the toy, smaller; lr and an entropy bonus so the weights move even where rewards are all 0
SMALL = ["warmstart.enabled=false", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
         "actor.mini_batch_size=32", "actor.micro_batch_size=32", "loop.steps=3",
         "loop.tensorboard=false", "loop.plots=false", "loop.checkpoint_every=0",
         "actor.lr=1e-2", "loss.entropy_coef=0.1"]
VERSION_STATS = ("mean", "max", "min", "log_mean", "log_std", "k3")


def _trainer(path, *extra, resume=False):
    cfg = load_config(CONFIGS / "toy_r3.yaml", SMALL + list(extra))
    return Trainer(cfg, path, resume=resume, progress=False, log=lambda s: None)


def _recording(tr):
    """Record each step's sample versions as the loop takes them from the pipeline."""
    seen = {}
    take = tr.pipeline.take

    def wrapped(step):
        prompts, results, s = take(step)
        seen[step] = sorted({r.weight_version for r in results})
        return prompts, results, s
    tr.pipeline.take = wrapped
    return seen


def _exactly_one(m):
    return all(m[f"is_split/version_{s}"] == (1.0 if s in ("mean", "max", "min") else 0.0)
               for s in VERSION_STATS)


def test_staleness_1_trains_on_the_previous_version_and_logs_the_version_part(tmp_path):
    tr = _trainer(tmp_path / "a1", "loop.max_staleness=1")
    seen = _recording(tr)
    ms = [tr.step(s) for s in (1, 2, 3)]
    tr.pipeline.close()
    # step n trains from version n-1 (the weights after n-1 updates); its samples are one
    # version older: step 2's were generated while step 1 trained (version 0), step 3's
    # while step 2 trained (version 1); step 1 has nothing older than version 0
    assert seen == {1: ["0"], 2: ["0"], 3: ["1"]}
    assert [m["rollout/weight_version_lag_mean"] for m in ms] == [0.0, 1.0, 1.0]
    assert [m["rollout/weight_version_lag_max"] for m in ms] == [0.0, 1.0, 1.0]
    assert [m["training/off_policy/trajectory_staleness/min"] for m in ms] == [0.0, 1.0, 1.0]
    assert _exactly_one(ms[0])  # versions match: pi_gen is pi_old
    for m in ms[1:]:  # one update behind: the version part is a real ratio
        assert m["is_split/version_mean"] != 1.0 and m["is_split/version_log_std"] > 1e-4
        # pi_old/mu = (pi_old/pi_gen) x (pi_gen/mu): the logs add up
        assert m["is_split/version_log_mean"] + m["is_split/engine_log_mean"] == pytest.approx(
            m["is_split/mismatch_log_mean"], abs=1e-6)
    # at equal weights the engine part is the bf16/fp32 mismatch alone: far smaller than the lag
    assert ms[1]["is_split/engine_log_std"] < ms[1]["is_split/version_log_std"]
    assert list(tr.actor.kept_versions()) == ["2"]  # at most k versions kept
    assert all(m["replay/mismatch"] == 0.0 for m in ms)  # R3 replays the engine's routes


def test_staleness_2_fills_a_two_step_pipeline(tmp_path):
    tr = _trainer(tmp_path / "k2", "loop.max_staleness=2", "loop.steps=4")
    seen = _recording(tr)
    ms = [tr.step(s) for s in (1, 2, 3, 4)]
    tr.pipeline.close()
    # steps 1-3 were all submitted at step 1 (version 0); step 4 after step 1's push
    assert seen == {1: ["0"], 2: ["0"], 3: ["0"], 4: ["1"]}
    assert [m["rollout/weight_version_lag_max"] for m in ms] == [0.0, 1.0, 2.0, 2.0]
    assert list(tr.actor.kept_versions()) == ["2", "3"]  # k = 2 copies: what steps 5, 6 may need
    assert ms[2]["is_split/version_log_std"] > ms[1]["is_split/version_log_std"]  # 2 > 1 behind


def test_staleness_1_under_r2_replays_the_pi_old_routes(tmp_path):
    """R2 replays the routes of the policy that computed pi_old (the current weights), also
    when the samples come from an older version."""
    tr = _trainer(tmp_path / "r2", "loop.max_staleness=1", "loop.steps=2", "replay.mode=R2")
    ms = [tr.step(s) for s in (1, 2)]
    tr.pipeline.close()
    assert ms[1]["rollout/weight_version_lag_max"] == 1.0 and ms[1]["is_split/version_mean"] != 1
    assert all(m["replay/mismatch"] == 0.0 and m["replay/replayed_fraction"] == 1.0 for m in ms)


def test_staleness_0_logs_an_exact_version_part_and_no_lag(tmp_path):
    tr = _trainer(tmp_path / "a0", "loop.steps=2")
    seen = _recording(tr)
    ms = [tr.step(s) for s in (1, 2)]
    assert seen == {1: ["0"], 2: ["1"]}
    assert all(_exactly_one(m) and m["rollout/weight_version_lag_max"] == 0.0 for m in ms)
    assert all(m["is_split/engine_mean"] == m["is_split/mismatch_mean"] for m in ms)
    assert tr.actor.kept_versions() == {} and tr.pipeline._pool is None  # nothing kept, no thread


def _step_before_async(tr, step):
    """`Trainer.step` as it was before loop.max_staleness existed (main at d69d63f)."""
    cfg = tr.cfg
    prompts = tr.source.prompts(tr.state.cursor, cfg.rollout.prompts_per_step)
    results = tr.rollout.generate(tr.requests(prompts, step))
    batch = collate(results, tr.source.pad_id, *tr._route_shape(),
                    sampling_mask=cfg.rollout.mask_replay, vocab_size=cfg.model.vocab_size)
    rewards_B, reward_m = tr.source.rewards(
        [prompts[i // cfg.rollout.samples_per_prompt] for i in range(len(results))], results)
    old = tr.actor.old_logprobs(batch, tr.mode, step)
    group_B = torch.arange(batch.size) // cfg.rollout.samples_per_prompt
    mask_BT = batch.response_mask_BT.float()
    adv_BT = grpo_advantages(rewards_B, group_B, mask_BT, norm_by_std=cfg.advantage.norm_by_std)
    corr = correct(cfg.correction, old.logprobs_BT, batch.rollout_logprobs_BT, mask_BT)
    upd = tr.actor.policy_update(batch, tr.update_inputs(batch, old, adv_BT, corr, step),
                                 tr.mode, step)
    tr.state.weight_version = tr.rollout.update_weights(
        {n: t for b in tr.actor.export_weights(cfg.cluster.weight_bucket_bytes) for n, t in b},
        str(step))
    tr.state.step, tr.state.cursor = step, tr.state.cursor + len(prompts)
    split = is_split_metrics(upd.logprobs_BT, old.logprobs_BT, batch.rollout_logprobs_BT, mask_BT)
    # (the actor's expert-load counts, added to its stats later, are not logged: left out)
    old_m = {k: v for k, v in stats_values(old.stats).items() if not k.startswith(COUNT_KEY)}
    return {"step": step, **tr.reward_metrics(rewards_B, batch, group_B), **reward_m,
            **corr.metrics, **split, "replay/mode": tr.mode.value, **old_m,
            **stats_values(upd.stats)}


@pytest.mark.parametrize("mode", ["R3", "R2"])
def test_staleness_0_is_bit_identical_to_the_synchronous_step(tmp_path, mode):
    extra = (f"replay.mode={mode}", "loop.steps=2", "actor.mini_batch_size=16",
             "actor.micro_batch_size=8", "actor.epochs=2")
    new, before = _trainer(tmp_path / "new", *extra), _trainer(tmp_path / "before", *extra)
    for step in (1, 2):
        got, want = new.step(step), _step_before_async(before, step)
        for k, v in want.items():
            assert got[k] == v or (math.isnan(v) and math.isnan(got[k])), (step, k, got[k], v)
    assert run_hash(new.cfg) == run_hash(load_config(CONFIGS / "toy_r3.yaml", SMALL + list(extra)))


def test_a_version_outside_the_allowed_set_is_refused_naming_the_rid(tmp_path):
    def res(rid, v):
        return GenerationResult(rid=rid, index=1, prompt_ids=[1], output_ids=[2],
                                output_logprobs=torch.zeros(1), sampling_logprobs=None,
                                finish_reason={"type": "length", "length": 1}, weight_version=v)
    assert allowed_versions(5, 1) == ["3", "4"] and allowed_versions(1, 2) == ["0"]
    assert allowed_versions(6, 2, first_version=4) == ["4", "5"]
    check_versions([res("a", "3"), res("b", "4")], set(allowed_versions(5, 1)))
    with pytest.raises(RolloutError, match=r"request b sample 1 .*'2'.*\['3', '4'\]"):
        check_versions([res("a", "3"), res("b", "2")], set(allowed_versions(5, 1)))
    # through the loop: an engine holding weights of a version nobody pushed
    tr = _trainer(tmp_path / "bad")
    tr.rollout.engine.weight_version = "7"
    with pytest.raises(RolloutError, match=r"request s1p0 sample 0 .*'7'.*\['0'\]"):
        tr.step(1)


def test_max_staleness_config_is_validated_and_part_of_the_run_hash():
    with pytest.raises(ValueError, match=r"loop.max_staleness=-1"):
        load_config(CONFIGS / "toy_r3.yaml", ["loop.max_staleness=-1"])
    base = load_config(CONFIGS / "toy_r3.yaml", [])
    assert base.loop.max_staleness == 0
    one = load_config(CONFIGS / "toy_r3.yaml", ["loop.max_staleness=1"])
    assert run_hash(one) != run_hash(base)  # resuming with another staleness is refused


def test_resume_under_staleness_1_regenerates_the_next_step_with_the_saved_weights(tmp_path):
    out = tmp_path / "r"
    tr = _trainer(out, "loop.max_staleness=1", "loop.steps=2", "loop.checkpoint_every=2")
    tr.run()
    tr2 = _trainer(out, "loop.max_staleness=1", "loop.steps=4", "loop.checkpoint_every=2",
                   resume=True)
    seen = _recording(tr2)
    tr2.run()
    # in flight when the run stopped: step 3's samples (of version 1); the resumed run
    # regenerates them from the saved cursor and seeds with the checkpoint's weights (2)
    assert seen == {3: ["2"], 4: ["2"]}
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4


@pytest.mark.parametrize("backend", ["http", pytest.param("ray", marks=pytest.mark.slow)])
def test_staleness_1_over_a_server_and_over_ray_engines(tmp_path, backend, request):
    """The same pipeline over the SGLang wire (a loopback `lockstep serve`, weights from disk)
    and over 2 Ray engine workers: step n trains on version n-2 samples (n >= 2), and each
    backend's own check (results of exactly the version it last loaded) holds, since a push
    never overlaps a generation."""
    from lockstep.moe.model import MoEModel
    from lockstep.rollout.engine import Engine
    from lockstep.rollout.engine_config import EngineConfig
    from lockstep.rollout.server import ServerThread
    extra = ["loop.max_staleness=1", "rollout.max_new_tokens=6"]
    if backend == "ray":
        request.getfixturevalue("cluster")
        tr = _trainer(tmp_path / "ray", *extra, "rollout.backend=ray", "rollout.num_engines=2")
        srv = None
    else:
        cfg = load_config(CONFIGS / "toy_r3.yaml", SMALL)
        engine = Engine(MoEModel(cfg.model), EngineConfig(dtype="bf16", max_running=64,
                                                          max_len=16, seed=0))
        srv = ServerThread(engine).start()
        tr = _trainer(tmp_path / "http", *extra, "rollout.backend=http", f"rollout.url={srv.url}")
    seen = _recording(tr)
    try:
        ms = [tr.step(s) for s in (1, 2, 3)]
    finally:
        tr.pipeline.close()
        tr.rollout.close()
        if srv is not None:
            srv.stop()
    assert seen == {1: ["0"], 2: ["0"], 3: ["1"]}
    assert tr.rollout.weight_version == "3"  # every push landed, in order
    assert _exactly_one(ms[0]) and ms[1]["is_split/version_mean"] != 1.0
