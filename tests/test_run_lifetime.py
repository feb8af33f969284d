"""A run owns what it starts (trainer/loop.py `Trainer`): a start-up that fails after the actor
group (Ray), the reward workers (processes) and the server's weight group are up, and a
Ctrl-C (KeyboardInterrupt) in the middle of a step, leave no Ray, no child process and no
weight group behind.

The run: a data set with a reward file (reward workers), two actor ranks on a Ray actor group,
rollouts over HTTP from a `lockstep serve`-style server on a thread of this process, whose
weights the group pushes over a weight group (`rollout.weight_sync: distributed`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from data_fixtures import build_model_folder

pytest.importorskip("transformers")
pytest.importorskip("ray")

from lockstep.rollout.engine import Engine  # noqa: E402
from lockstep.rollout.engine_config import EngineConfig  # noqa: E402
from lockstep.rollout.server import ServerThread  # noqa: E402
from lockstep.rollout.weight_receiver import RECEIVER  # noqa: E402
from lockstep.trainer import loop  # noqa: E402
from lockstep.trainer.config.load import load_config  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray actor group of two ranks per test (~20 s each)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifetime")
    folder, train, val, reward = build_model_folder(root, family="mixtral")
    return root, folder, train, reward


def _children() -> set[int]:
    """Every live descendant of this process (from /proc: no psutil here)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":  # a zombie is gone
                parent[int(d.name)] = int(fields[1])
    out, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - out
        out |= frontier
    return out


def _wait_no_children(before: set[int], timeout_s: float = 60.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _children() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _cfg(root, folder, train, reward, url):
    cfg = {
        "model": {"path": str(folder)},
        "data": {"train_files": [str(train)], "max_prompt_length": 64},
        "reward": {"function": f"{reward}:compute_score", "timeout_s": 20, "num_workers": 2},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 4,
                    "dtype": "fp32", "backend": "http", "url": url,
                    "weight_sync": "distributed"},
        "actor": {"mini_batch_size": 4, "micro_batch_size": 4},
        "warmstart": {"enabled": False},
        "cluster": {"actor_ranks": 2, "threads_per_rank": 1},
        "loop": {"steps": 3, "checkpoint_every": 0, "tensorboard": False, "plots": False},
    }
    path = root / "lifetime.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path)


def _server(folder):
    return ServerThread(Engine.from_hf(folder, EngineConfig(dtype="fp32", max_len=96)),
                        weight_sync_timeout_s=60)


def _assert_nothing_left(before: set[int], srv) -> None:
    import ray

    assert not ray.is_initialized(), "the actor group's Ray is still up"
    left = _wait_no_children(before)
    assert not left, f"processes left behind: {sorted(left)}"
    assert not srv.app[RECEIVER].groups, "the server still holds the run's weight group"


def test_a_failed_start_up_closes_the_group_workers_and_weight_group(setup, tmp_path,
                                                                     monkeypatch):
    root, folder, train, reward = setup
    before = _children()
    with _server(folder) as srv:
        cfg = _cfg(root, folder, train, reward, srv.url)
        pushed = []
        real_backends = loop.Trainer._make_backends

        def backends_then_watch(self, *a, **kw):  # the group and the weight group are up
            real_backends(self, *a, **kw)
            pushed.append(self.actor)

        def fail(*a, **kw):  # the last thing start-up does
            assert srv.app[RECEIVER].groups, "the initial push should have joined a group"
            raise RuntimeError("injected: W&B could not start")

        monkeypatch.setattr(loop.Trainer, "_make_backends", backends_then_watch)
        monkeypatch.setattr(loop.WandbRun, "start", fail)
        with pytest.raises(RuntimeError, match="injected"):
            loop.Trainer(cfg, tmp_path / "run", progress=False, log=lambda s: None)
        assert pushed and type(pushed[0]).__name__ == "ActorGroup"
        _assert_nothing_left(before, srv)


def test_ctrl_c_mid_step_closes_everything(setup, tmp_path, monkeypatch):
    root, folder, train, reward = setup
    before = _children()
    with _server(folder) as srv:
        cfg = _cfg(root, folder, train, reward, srv.url)
        trainer = loop.Trainer(cfg, tmp_path / "run", progress=False, log=lambda s: None)
        real_update = trainer.actor.policy_update

        def interrupted(batch, inputs, mode, step):  # step 2, after generate and pi_old
            if step == 2:
                raise KeyboardInterrupt
            return real_update(batch, inputs, mode, step)

        monkeypatch.setattr(trainer.actor, "policy_update", interrupted)
        with pytest.raises(KeyboardInterrupt):
            trainer.run()
        assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1  # step 1 kept
        _assert_nothing_left(before, srv)
