"""The rollout fleet on a real local Ray cluster: `lockstep serve` servers as Ray actors. The RL
loop over 2 servers (weights pushed with /update_weights_from_distributed over gloo) gives the
in-process run's metrics for the same seed, and writes no weight bytes to disk. The faults
(kill -9, a hung server, restarts) are in test_fleet_faults.py, for every backend."""

import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from lockstep.rollout.fleet import Fleet  # noqa: E402
from lockstep.trainer.config.load import load_config  # noqa: E402
from lockstep.trainer.loop import Trainer  # noqa: E402

pytestmark = pytest.mark.slow  # Ray and its worker processes take ~15-30 s to start
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_rl_loop_on_two_servers_equals_in_process(cluster, tmp_path):
    # 1-digit addition after a short supervised warm start (cached for the second run): the
    # policy earns rewards in some groups, so every step changes the weights (a push that did
    # not reach the engines would change the samples)
    sets = ["task.digits=1", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
            "rollout.max_new_tokens=4", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
            "loop.steps=5", "loop.tensorboard=false", "loop.plots=false",
            "loop.checkpoint_every=0", "warmstart.max_steps=60", "warmstart.eval_every=20",
            "warmstart.eval_size=32", f"warmstart.cache_dir={tmp_path / 'warmstart'}"]
    runs = {}
    for name, extra in (("local", []), ("fleet", ["rollout.backend=serve",
                                                  "rollout.num_engines=2"])):
        cfg = load_config(CONFIGS / "toy_r3.yaml", sets + extra)
        tr = Trainer(cfg, tmp_path / name, progress=False, log=lambda s: None)
        tr.run()
        runs[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text()
                      .splitlines()]
        if name == "fleet":
            fleet = tr.rollout
    assert isinstance(fleet, Fleet) and len(fleet.slots) == 2 and fleet.closed
    assert fleet.weight_sync == "distributed" and fleet.stats.pushes == 5
    assert {e for e in fleet.placement.values()} == {0, 1}  # both engines served the last step
    local, remote = runs["local"], runs["fleet"]
    assert [r["step"] for r in remote] == [1, 2, 3, 4, 5]
    keys = [k for k in local[0] if not k.startswith("time/")]
    assert keys == [k for k in remote[0] if not k.startswith("time/")]
    for a, b in zip(local, remote):
        # Same seeds and weights: the same tokens, routes and rewards (exact). A bf16 engine's
        # log-probs depend on the batch a sample shares (matmul blocking; each server sees half
        # the batch), at bf16-rounding level (~1e-5, docs/ray.md): what depends on the rollout
        # log-probs (KL, ppl, IS weights, is_split) is held to docs/cluster.md's tolerance,
        # rtol 1e-2 with atol 1e-4 for near-zero means. A missed push or wrong weights changes
        # the tokens and rewards; a dropped route shows in replay/mismatch.
        for k in keys:
            if k.split("/")[0] in ("step", "reward", "response", "routing", "replay"):
                assert a[k] == b[k], (a["step"], k)
            else:
                assert abs(a[k] - b[k]) <= 1e-2 * abs(a[k]) + 1e-4, (a["step"], k, a[k], b[k])
    assert remote[-1]["replay/mismatch"] == 0.0
    assert all(r["actor/grad_norm"] > 0 for r in local)  # the policy moved every step
    # weights travelled by broadcast only: nothing written for them
    assert fleet.stats.disk_bytes_written == 0 and fleet.stats.push_bytes > 0
    assert not (tmp_path / "fleet" / "weights").exists()
