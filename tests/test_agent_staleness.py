"""Multi-turn trajectories that span a weight push (loop.max_staleness=1,
rollout.env.turns_before_push=1): a step generated ahead runs its first turn before the push
and the rest after, so step 2's trajectories have turn 1 by version 0 and turns 2-3 by version
1, always (the pool's order follows the trainer's calls). The IS split's pi_gen is per turn:
pi_old itself on the current turns, version 0's forward on turn 1; mask_stale_turns drops
turn 1's tokens from the loss. Ignoring a turn's version breaks each check."""

import json
import textwrap

import pytest
import torch

from lockstep.trainer.config.types import ExperimentConfigError
from lockstep.trainer.loop import Trainer

from test_agent_train import _config

# three turns; a reward that differs between samples, so the first update moves the weights
THREE_TURNS = """
    def step(state, turn):
        return {"observation": "12=", "reward": float(turn["ids"][0] % 3)}
"""


def _run(tmp_path, *sets):
    env_file = tmp_path / "env.py"
    env_file.write_text(textwrap.dedent(THREE_TURNS))
    env = {"file": str(env_file), "max_turns": 3, "num_workers": 1, "turns_before_push": 1}
    cfg = _config(tmp_path, env, "loop.max_staleness=1", "loop.steps=2",
                  "rollout.max_new_tokens=4", *sets)
    tr = Trainer(cfg, tmp_path / "run", progress=False, log=lambda s: None)
    seen = {}
    take, gen = tr.pipeline.take, tr.versions.gen_logprobs

    def take_and_keep(step):
        out = take(step)
        seen[step] = out[1]
        return out

    def gen_and_keep(actor, batch, versions, old_BT, mode, step):
        got = gen(actor, batch, versions, old_BT, mode, step)
        seen[f"gen{step}"] = (versions, old_BT, got, batch.response_mask_BT.clone())
        return got
    tr.pipeline.take, tr.versions.gen_logprobs = take_and_keep, gen_and_keep
    tr.run()
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    return seen, metrics


def test_trajectories_span_the_push_and_pi_gen_is_per_turn(tmp_path):
    seen, m = _run(tmp_path, "rollout.env.mask_stale_turns=true")
    assert all([t.weight_version for t in r.trajectory.turns] == ["0", "0", "0"]
               for r in seen[1])  # step 1: no push before it is taken
    assert all([t.weight_version for t in r.trajectory.turns] == ["0", "1", "1"]
               for r in seen[2])  # step 2: turn 1 ahead, the rest after push 1
    assert m[0]["rollout/trajectories_spanning_pushes"] == 0.0
    assert m[1]["rollout/trajectories_spanning_pushes"] == 1.0
    first = sum(r.trajectory.turns[0].sampled for r in seen[2])
    total = sum(t.sampled for r in seen[2] for t in r.trajectory.turns)
    assert m[1]["rollout/stale_sampled_tokens"] == pytest.approx(first / total)
    # pi_gen of step 2: pi_old on turns 2-3 (current), version 0's forward on turn 1
    versions, old_BT, gen_BT, resp_BT = seen["gen2"]
    assert all(isinstance(v, tuple) for v in versions)
    turn1 = torch.zeros_like(resp_BT)
    for b, r in enumerate(seen[2]):
        t = r.trajectory.turns[0]
        turn1[b, t.start:t.start + t.sampled] = True
    later = resp_BT & ~turn1  # the loss mask kept turns 2-3 only (mask_stale_turns)
    assert not (resp_BT & turn1).any() and later.any()
    assert torch.equal(gen_BT[later], old_BT[later])
    assert float((gen_BT[turn1] - old_BT[turn1]).abs().max()) > 0  # the weights moved
    assert m[1]["rollout/stale_turn_tokens_masked"] == pytest.approx(first / total)
    assert m[0]["rollout/stale_turn_tokens_masked"] == 0.0


def test_turns_before_push_needs_max_staleness(tmp_path):
    env = {"file": "calculator", "stop": [">"], "turns_before_push": 1}
    with pytest.raises(ExperimentConfigError, match=r"turns_before_push=1 generates turns "
                                                    r"ahead .* loop.max_staleness >= 1"):
        _config(tmp_path, env)

