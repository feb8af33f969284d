"""The actor as a Ray group of ranks (cluster.actor_ranks=2, torch DDP over gloo, one thread each):
the same run as one process within the documented tolerance (docs/cluster.md), R2/R3 replay
on every rank, exact --resume after SIGKILL of the driver, and a rank dying mid-step."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from lockstep.moe.checkpoint import read_hf_state_dict  # noqa: E402

from lockstep.replay import ReplayMode  # noqa: E402
from lockstep.trainer.actor.batch import collate, minibatch_schedule  # noqa: E402
from lockstep.trainer.state.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from lockstep.trainer.config.load import load_config  # noqa: E402
from lockstep.trainer.objective.correction import correct  # noqa: E402
from lockstep.trainer.observe.dump import ACTOR_FIELDS, read_dump  # noqa: E402
from lockstep.trainer.actor.group import ActorGroupError  # noqa: E402
from lockstep.trainer.loop import Trainer  # noqa: E402
from lockstep.trainer.actor.rank import shuffle_seed
from lockstep.trainer.objective.stats import stats_values

from kill_fixtures import kill_when_written  # noqa: E402

pytestmark = pytest.mark.slow  # each run starts a local Ray cluster (~5 s) and its ranks

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
LR = 3e-4  # toy_r3's actor.lr
# toy_r3, smaller: a short warm start (so rewards and advantages are not all zero), 16 prompts
# x 8 samples, two optimiser steps per RL step (each rank holds half of each mini-batch)
SETS = ["warmstart.target_accuracy=0.1", "warmstart.eval_every=10",
        "rollout.prompts_per_step=16", "actor.mini_batch_size=64", "actor.micro_batch_size=32",
        "loop.checkpoint_every=1", "loop.keep_checkpoints=0", "loop.plots=false",
        "loop.tensorboard=false"]
# |a - b| <= rtol * |a| + atol per metric; docs/cluster.md derives these
TOLERANCE = {"reward/mean": (0.0, 0.0), "routing/flip_rate": (0.0, 0.0),
             "rollout_corr/k3_kl": (1e-2, 1e-7), "actor/grad_norm": (1e-3, 0.0),
             "actor/pg_loss": (1e-2, 1e-4), "actor/entropy": (1e-3, 0.0)}


def _train(out: Path, cache: Path, *sets: str, resume: bool = False) -> subprocess.Popen:
    args = [a for s in SETS + [f"warmstart.cache_dir={cache}", *sets] for a in ("--set", s)]
    cmd = [sys.executable, "-m", "lockstep.launch.cli", "train", str(CONFIGS / "toy_r3.yaml"),
           "--out", str(out), "--no-progress", *(["--resume"] if resume else []), *args]
    # a session of its own: the Ray processes a SIGKILLed driver leaves can be found and ended
    return subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _run(out: Path, cache: Path, *sets: str, resume: bool = False) -> str:
    p = _train(out, cache, *sets, resume=resume)
    text, _ = p.communicate(timeout=900)
    assert p.returncode == 0, text[-3000:]
    return text


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return read_hf_state_dict(out / f"checkpoints/step_{step}/hf")  # parts written by the ranks


def test_dp2_equals_one_process_and_resumes_after_sigkill(tmp_path):
    cache = tmp_path / "cache"
    _run(tmp_path / "one", cache, "loop.steps=3")
    _run(tmp_path / "dp2", cache, "loop.steps=3", "cluster.actor_ranks=2")
    one, dp2 = _metrics(tmp_path / "one"), _metrics(tmp_path / "dp2")
    assert [r["step"] for r in dp2] == [1, 2, 3]
    for a, b in zip(one, dp2):
        for k, (rtol, atol) in TOLERANCE.items():
            assert abs(a[k] - b[k]) <= rtol * abs(a[k]) + atol, (a["step"], k, a[k], b[k])
        # R3 on both ranks: every replayed (token, layer) ran exactly the engine's experts
        assert b["replay/mismatch"] == 0.0 and a["replay/mismatch"] == 0.0
        assert b["replay/replayed_fraction"] == a["replay/replayed_fraction"] > 0.5
    for step in (1, 3):  # the weights pushed to the engine (the checkpoint is the same export)
        w1, w2 = _weights(tmp_path / "one", step), _weights(tmp_path / "dp2", step)
        assert w1.keys() == w2.keys()
        diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
        assert diff <= LR / 10, (step, diff)
    moved = max(float((_weights(tmp_path / "dp2", 3)[k] - _weights(tmp_path / "dp2", 1)[k])
                      .abs().max()) for k in w1)
    assert moved > LR  # the comparison is not between untouched weights

    # SIGKILL the driver after the step-1 checkpoint; --resume reproduces the dp2 run exactly
    victim = _train(tmp_path / "run", cache, "loop.steps=1000", "cluster.actor_ranks=2")
    done = tmp_path / "run/checkpoints/step_1/state.json"
    kill_when_written(victim, done, "step 1", whole_session=True)
    assert victim.returncode == -signal.SIGKILL
    assert len(_metrics(tmp_path / "run")) < 3
    text = _run(tmp_path / "run", cache, "loop.steps=3", "cluster.actor_ranks=2", resume=True)
    assert "resuming from" in text
    assert _metrics(tmp_path / "run") == dp2



def _trainer(tmp_path, name: str, *sets: str) -> Trainer:
    cfg = load_config(CONFIGS / "toy_r3.yaml", [
        "warmstart.enabled=false", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
        "actor.mini_batch_size=16", "actor.micro_batch_size=8", "loss.entropy_coef=0.05",
        "loop.plots=false", "loop.tensorboard=false", *sets])
    return Trainer(cfg, tmp_path / name, progress=False, log=lambda s: None)


def _replay_check(tr: Trainer, mode: ReplayMode, step: int) -> None:
    """Through the group's interface: the first optimiser step runs before any weight change,
    so where routes are replayed its forwards must give pi_old again (a one-position shift
    between routes and tokens on any rank, or routes replayed on the wrong rows, would not)."""
    prompts = tr.source.prompts(0, tr.cfg.rollout.prompts_per_step)
    batch = collate(tr.rollout.generate(tr.requests(prompts, step)), tr.source.pad_id,
                    *tr._route_shape())
    old = tr.actor.old_logprobs(batch, mode, step)
    mask_BT = batch.response_mask_BT.float()
    adv_BT = torch.linspace(-1, 1, batch.size)[:, None] * mask_BT
    corr = correct(tr.cfg.correction, old.logprobs_BT, batch.rollout_logprobs_BT, mask_BT)
    upd = tr.actor.policy_update(batch, tr.update_inputs(batch, old, adv_BT, corr, step),
                                 mode, step)
    a = tr.cfg.actor
    first = minibatch_schedule(batch.size, a.mini_batch_size, a.epochs,
                               shuffle_seed(tr.cfg.loop.seed, step))[0]
    resp = batch.response_mask_BT[first]
    assert torch.allclose(upd.logprobs_BT[first][resp], old.logprobs_BT[first][resp],
                          atol=1e-5, rtol=0), mode
    m = stats_values(upd.stats)
    assert m["replay/mismatch"] == 0.0 and m["replay/replayed_fraction"] > 0.5, (mode, m)


def test_replay_on_every_rank_and_a_dead_rank_stops_the_run(cluster, tmp_path):
    """Also: loop.dump_every and loss.kl_coef on the group (the dump's actor fields computed
    by each rank on its rows; the KL reference on every rank) equal the one-process run, and
    each rank runs cluster.threads_per_rank torch threads."""
    extra = ("replay.mode=R2", "loss.kl_coef=0.1", "loop.dump_every=1")
    one = _trainer(tmp_path, "one", *extra)
    group = _trainer(tmp_path, "group", *extra, "cluster.actor_ranks=2",
                     "cluster.threads_per_rank=2")
    try:
        assert [i.threads for i in group.actor.infos] == [2, 2]
        a, b = one.step(1), group.step(1)
        # the KL term against the reference: zero at the first (on-policy) optimiser step,
        # positive at the second; the group's equals the one-process value (DP tolerance)
        assert a["actor/kl_loss"] > 0
        assert abs(b["actor/kl_loss"] - a["actor/kl_loss"]) <= 1e-3 * a["actor/kl_loss"], \
            (a["actor/kl_loss"], b["actor/kl_loss"])
        d1, d2 = (read_dump(tmp_path / n / "dumps/step_1.safetensors") for n in ("one", "group"))
        assert d1.tensors.keys() == d2.tensors.keys()
        tok, routed = d1.token_mask, d1.rollout_routes_valid
        for k in ACTOR_FIELDS:  # the same weights, row-wise forwards: equal where defined
            where = routed if k in ("actor_routes", "router_margin") else tok
            x, y = d1.tensors[k][where], d2.tensors[k][where]
            if k == "actor_routes":
                assert torch.equal(x, y), k
            else:  # fp32 forwards of other micro-batch shapes: rounding only
                assert torch.allclose(x, y, atol=1e-5, rtol=0), (k, float((x - y).abs().max()))
        for k in set(d1.tensors) - set(ACTOR_FIELDS):
            assert torch.equal(d1.tensors[k], d2.tensors[k]), k
        # R2: each rank replays the routes its own old-log-prob forward recorded (kept there)
        assert b["replay/mismatch"] == 0.0 and b["replay/replayed_fraction"] == 1.0
        assert b["routing/flip_rate"] == a["routing/flip_rate"]
        assert b["routing_stale/num_tokens"] == a["routing_stale/num_tokens"] > 0
        assert abs(b["actor/grad_norm"] - a["actor/grad_norm"]) <= 1e-3 * a["actor/grad_norm"]
        # step 2: the reference is still the initial policy on every rank (a reference that
        # followed the policy would give a KL of 0 at its first optimiser step)
        a, b = one.step(2), group.step(2)
        assert abs(b["actor/kl_loss"] - a["actor/kl_loss"]) <= 1e-2 * a["actor/kl_loss"], \
            (a["actor/kl_loss"], b["actor/kl_loss"])
        _replay_check(group, ReplayMode.R3, 3)
        _replay_check(group, ReplayMode.R2, 4)
        ckpt = group.save()
        os.kill(group.actor.infos[1].pid, signal.SIGKILL)
        with pytest.raises(ActorGroupError, match=r"actor rank 1 \(pid \d+.*died"):
            group.step(3)  # the engine holds step 2's weights (the replay checks sync none)
    finally:
        group.actor.close()
        one.actor.close()
    assert latest_checkpoint(tmp_path / "group") == ckpt
    model, state, loop = load_checkpoint(ckpt)
    assert loop.step == 2 and state["actor"]["layout"] == {"actor_ranks": 2}
    assert {"step", "scheduler", "param_groups"} <= set(state["actor"])
    # each rank wrote its own parts of the weights and of the HF-named Adam moments
    assert len(list((ckpt / "optim/exp_avg").glob("model-*.safetensors"))) == \
        model.cfg.num_hidden_layers + 1


@pytest.mark.megatron
def test_megatron_tp2_on_the_group_equals_one_process(tmp_path):
    """`--set actor.backend=megatron --set actor.megatron.tensor_parallel=2` on two Ray ranks:
    the same metrics and pushed weights as the one-process megatron run (docs/cluster.md)."""
    pytest.importorskip("megatron.core")
    cache = tmp_path / "cache"
    mg = ["actor.backend=megatron", "loop.steps=2", "warmstart.enabled=false",
          "loss.entropy_coef=0.05", "loss.kl_coef=0.5"]  # each rank: its shard of pi_ref
    _run(tmp_path / "one", cache, *mg)
    _run(tmp_path / "tp2", cache, *mg, "cluster.actor_ranks=2",
         "actor.megatron.tensor_parallel=2")
    one, tp2 = _metrics(tmp_path / "one"), _metrics(tmp_path / "tp2")
    assert [r["step"] for r in tp2] == [1, 2]
    for a, b in zip(one, tp2):
        for k, (rtol, atol) in TOLERANCE.items():
            assert abs(a[k] - b[k]) <= rtol * abs(a[k]) + atol, (a["step"], k, a[k], b[k])
        assert b["replay/mismatch"] == 0.0
        assert abs(a["actor/kl_loss"] - b["actor/kl_loss"]) <= 1e-2 * a["actor/kl_loss"] + 1e-9
    assert min(r["actor/kl_loss"] for r in tp2) > 1e-4  # several updates a step: pi moved
    w1, w2 = _weights(tmp_path / "one", 2), _weights(tmp_path / "tp2", 2)
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) <= LR / 10
