"""Class 1 (training correctness): a cold and a cached warm start give the same RL run; the
warm start leaves no gradient behind; the shared cache is written atomically and verified."""

import pytest
import torch

from lockstep.moe.model import MoEModel
from lockstep.rollout.tasks import Task
from lockstep.trainer.loop import Trainer
from lockstep.trainer.driver.warmstart import cache_key, warm_start

from rundir_fixtures import fast_config, metrics

WS = ["warmstart.target_accuracy=0.02", "warmstart.eval_every=5", "warmstart.eval_size=32",
      "warmstart.batch_size=32", "loop.steps=2"]

pytestmark = pytest.mark.reliability


def _ws(tmp_path, log=lambda m: None):
    cfg = fast_config(*WS, f"warmstart.cache_dir={tmp_path / 'cache'}")
    torch.manual_seed(0)
    model = MoEModel(cfg.model)
    res = warm_start(model, Task(cfg.task), cfg.warmstart, 0, cache_key(cfg), log)
    return cfg, model, res


def test_warm_start_leaves_no_gradient(tmp_path):
    _, model, res = _ws(tmp_path)
    assert not res.cached and res.steps > 0
    assert [n for n, p in model.named_parameters() if p.grad is not None] == []


def test_cold_and_cached_warm_start_give_identical_rl_metrics(tmp_path):
    cfg = fast_config(*WS, f"warmstart.cache_dir={tmp_path / 'cache'}")
    logs = []
    Trainer(cfg, tmp_path / "cold", progress=False, log=logs.append).run()
    Trainer(cfg, tmp_path / "cached", progress=False, log=logs.append).run()
    assert not any("loaded from cache" in m for m in logs[:1])
    assert any("loaded from cache" in m for m in logs)
    cold, cached = metrics(tmp_path / "cold"), metrics(tmp_path / "cached")
    assert len(cold) == 2
    assert cold == cached  # grad_norm of step 1 included


def test_corrupt_cache_entry_is_retrained_not_loaded(tmp_path):
    cfg, model, _ = _ws(tmp_path)
    entry = tmp_path / "cache" / cache_key(cfg)
    f = entry / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-7] ^= 0xFF  # one flipped byte in a weight
    f.write_bytes(bytes(data))
    logs = []
    _, _, res = _ws(tmp_path, logs.append)
    assert not res.cached
    assert any("not usable" in m and "model.safetensors" in m for m in logs), logs
    _, _, again = _ws(tmp_path)  # the retrained entry replaced the bad one
    assert again.cached
    assert not [p.name for p in entry.parent.iterdir() if p != entry]  # no .tmp / .bad left
