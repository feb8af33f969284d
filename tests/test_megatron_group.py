"""The megatron actor hosted by the Ray actor group (gloo, one thread per rank): TP=2 and PP=2
on 2 ranks, from a warm-started policy (non-zero rewards, so the policy-gradient term drives
the update), give the one-process megatron run's first RL step (R3 replay on every rank,
rewards and routing metrics exactly, losses and grad norm within rounding), the same exported
weights and the same rollout dump (`loop.dump_every`: rows in batch order, every MoE layer's
natural top-k and router margins from the stage that holds it) (TP=2 + EP=2 on 4 ranks:
test_megatron_group4.py); a TP=2 run SIGKILLed after a checkpoint resumes to the
uninterrupted run's metrics exactly."""

from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("megatron.core")

from lockstep.trainer.config.load import load_config  # noqa: E402
from lockstep.trainer.observe.dump import ACTOR_FIELDS, read_dump  # noqa: E402
from lockstep.trainer.loop import Trainer  # noqa: E402

from kill_fixtures import kill_when_written  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.megatron]

CONFIGS = Path(__file__).resolve().parent.parent / "configs"



def _trainer(tmp_path, name: str, *sets: str) -> Trainer:
    cfg = load_config(CONFIGS / "toy_r3.yaml", [
        "warmstart.enabled=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "actor.mini_batch_size=8", "actor.micro_batch_size=4", "actor.aux_loss_coef=0.01",
        # without a warm start the rewards (so the policy gradient) may all be 0: the entropy
        # term keeps a gradient through the log-prob kernel and the LM head
        "loss.entropy_coef=0.05",
        "actor.backend=megatron", "model.num_hidden_layers=4", "loop.plots=false", "loop.tensorboard=false", *sets])
    return Trainer(cfg, tmp_path / name, progress=False, log=lambda s: None)


def warm(cache: Path) -> list[str]:
    """Overrides for a short supervised warm start on 1-digit addition (greedy accuracy ~0.4
    after <= 60 steps; trained once per `cache`, loaded after): rewards are non-zero, so the
    advantages and the policy-gradient term are too. The entropy bonus is off, so the pg
    term (plus the load-balancing loss) is what the gradient is made of."""
    return ["warmstart.enabled=true", "task.digits=1", "warmstart.max_steps=60",
            "warmstart.eval_every=20", "warmstart.eval_size=32", f"warmstart.cache_dir={cache}",
            "loss.entropy_coef=0"]


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("warmstart")


def _same_dump(one: Path, other: Path, name: str) -> None:
    """`other`'s dump of step 1 equals `one`'s: the batch's fields exactly, the actor's fields
    row by row (natural top-k exactly, log-probs and margins within fp32 rounding of another
    layout's reduction order) where defined."""
    a, b = (read_dump(d / "dumps/step_1.safetensors") for d in (one, other))
    assert a.tensors.keys() == b.tensors.keys(), name
    for k in set(a.tensors) - set(ACTOR_FIELDS):
        assert torch.equal(a.tensors[k], b.tensors[k]), (name, k)
    tok, routed = a.token_mask, a.rollout_routes_valid
    for k in ACTOR_FIELDS:
        where = routed if k in ("actor_routes", "router_margin") else tok
        x, y = a.tensors[k][where], b.tensors[k][where]
        if k == "actor_routes":
            assert torch.equal(x, y), (name, k)
        else:
            assert torch.allclose(x, y, atol=1e-5, rtol=0), (name, k, float((x - y).abs().max()))


def _export(actor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for bucket in actor.export_weights(1 << 20) for k, v in bucket}


def test_tp2_and_pp2_ranks_match_one_process(cluster, tmp_path, warm_cache):
    sets = [*warm(warm_cache), "loop.dump_every=1"]
    one = _trainer(tmp_path, "one", *sets)
    want, want_w = one.step(1), _export(one.actor)
    # the policy gradient is in play: rewards, advantages, a pg loss well above the tolerance
    assert want["reward/mean"] > 0 and abs(want["actor/pg_loss"]) > 1e-3, want
    # EP=2 on 2 ranks is DP=2 (each rank its own rows, half the experts): the dump's rows come
    # back from two shards. Its update is not compared here: with the load-balancing loss on,
    # each DP rank balances its own micro-batches, another loss by design (EP=2's update:
    # test_megatron_group4.py, tests/test_async_group.py, without that loss)
    layouts = {"tp2": "actor.megatron.tensor_parallel=2",
               "pp2": "actor.megatron.pipeline_parallel=2",
               "ep2": "actor.megatron.expert_parallel=2"}
    for name, layout in layouts.items():
        group = _trainer(tmp_path, name, *sets, "cluster.actor_ranks=2", layout)
        try:
            got = group.step(1)
            got_w = _export(group.actor)
        finally:
            group.actor.close()
        assert got["replay/mismatch"] == 0.0, name
        for k in ("reward/mean", "replay/replayed_fraction", "routing/flip_rate",
                  "routing/num_tokens", "routing_stale/num_tokens"):
            assert got[k] == want[k], (name, k, got[k], want[k])
        assert abs(got["rollout_corr/k3_kl"] - want["rollout_corr/k3_kl"]) <= \
            1e-4 * abs(want["rollout_corr/k3_kl"]) + 1e-6, name
        _same_dump(tmp_path / "one", tmp_path / name, name)
        if name == "ep2":
            continue
        for k in ("actor/grad_norm", "actor/pg_loss", "actor/aux_loss", "actor/entropy"):
            assert abs(got[k] - want[k]) <= 1e-4 * abs(want[k]) + 1e-6, (name, k, got[k], want[k])
        assert set(got_w) == set(want_w)
        # docs/cluster.md "tolerance": Adam's first steps move a weight whose gradient is at
        # rounding level (an expert few tokens reach) by a rounding-decided fraction of lr;
        # a real error (a dropped term, a wrong normaliser) moves most weights by O(lr)
        lr = one.cfg.actor.lr
        diff = max(float((got_w[k] - want_w[k]).abs().max()) for k in want_w)
        moved = sum(int(((got_w[k] - want_w[k]).abs() > lr / 100).sum()) for k in want_w)
        assert diff <= lr / 5 and moved <= 1e-3 * sum(v.numel() for v in want_w.values()), \
            (name, diff, moved)


def _cli(out, *sets: str, resume: bool = False):
    import os
    import subprocess
    import sys
    base = ["warmstart.enabled=false", "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=4", "actor.mini_batch_size=8", "actor.micro_batch_size=4",
            "actor.backend=megatron", "model.num_hidden_layers=4", "loop.checkpoint_every=1",
            "loop.keep_checkpoints=0", "loop.plots=false", "loop.tensorboard=false",
            "cluster.actor_ranks=2", "actor.megatron.tensor_parallel=2",
            # no warm start: rewards may all be 0; these terms keep the gradients (and so
            # each rank's Adam state) non-zero
            "actor.aux_loss_coef=0.01", "loss.entropy_coef=0.05"]
    args = [a for s in base + list(sets) for a in ("--set", s)]
    cmd = [sys.executable, "-m", "lockstep.launch.cli", "train", str(CONFIGS / "toy_r3.yaml"),
           "--out", str(out), "--no-progress", *(["--resume"] if resume else []), *args]
    # a session of its own: the Ray processes a SIGKILLed driver leaves can be ended
    return subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _finish(p) -> str:
    text, _ = p.communicate(timeout=900)
    assert p.returncode == 0, text[-3000:]
    return text


def _metrics(out) -> list[dict]:
    import json
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def test_tp2_group_resumes_after_sigkill_exactly(tmp_path):
    """TP=2 on two ranks (each rank's optimiser state is its own shard): SIGKILL the driver
    after the step-1 checkpoint, `--resume` gives the uninterrupted run's metrics bit for bit
    (every rank gets its own optimiser state back from `trainer_state["ranks"]`)."""
    import signal
    _finish(_cli(tmp_path / "whole", "loop.steps=2"))
    want = _metrics(tmp_path / "whole")
    assert [r["step"] for r in want] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 for r in want)
    victim = _cli(tmp_path / "run", "loop.steps=1000")
    done = tmp_path / "run/checkpoints/step_1/state.json"
    kill_when_written(victim, done, "step 1", whole_session=True)
    assert victim.returncode == -signal.SIGKILL
    assert len(_metrics(tmp_path / "run")) < 2
    text = _finish(_cli(tmp_path / "run", "loop.steps=2", resume=True))
    assert "resuming from" in text
    assert _metrics(tmp_path / "run") == want

