"""Issue 22, reward files through `lockstep train` (a fresh process, as a scheduler runs it):
a file that calls sys.exit(0) at import is a one-line error with exit status 2 before
anything is written, not a silent exit 0."""

import pytest
import yaml

from data_fixtures import build_model_folder
from rundir_fixtures import lockstep, one_line_error

pytestmark = [pytest.mark.reliability, pytest.mark.slow]
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model_folder(tmp_path_factory.mktemp("data"), n_train=4, n_val=1)[:2]


def test_train_with_a_reward_file_that_exits_at_import(model, tmp_path):
    """(A hang at import takes the same path: tests/test_rewards.py bounds it.)"""
    folder, train = model
    reward = tmp_path / "bad_reward.py"
    reward.write_text("import sys\nsys.exit(0)\ndef compute_score(**kw):\n    return 1.0\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"path": str(folder)},
        "data": {"train_files": [str(train)], "max_prompt_length": 64},
        "reward": {"function": f"{reward}:compute_score", "num_workers": 1},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 4},
        "actor": {"mini_batch_size": 4, "micro_batch_size": 4},
        "warmstart": {"enabled": False}, "loop": {"steps": 1, "plots": False,
                                                  "tensorboard": False}}))
    out = tmp_path / "run"
    res = lockstep("train", str(cfg), "--out", str(out), timeout=120)
    msg = one_line_error(res)
    assert "reward.function=" in msg and "called sys.exit(0)" in msg, msg
    assert not any(p.name in ("config.yaml", "metrics.jsonl", "summary.json")
                   for p in out.iterdir()), list(out.iterdir())
