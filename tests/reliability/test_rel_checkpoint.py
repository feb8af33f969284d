"""Classes 5 and 6 (silent corruption, pickle on load): the state-tree format round-trips
optimiser / scheduler / RNG state without pickle; every checkpoint file is checked against its
manifest; a corrupt newest checkpoint falls back to the newest good one; a failed write leaves
no trace but one clear error."""

import errno
import json
import random
import warnings

import numpy as np
import pytest
import torch

from lockstep.moe.hf_lazy import CheckpointError
from lockstep.moe.model import MoEModel
from lockstep.trainer.state import checkpoint as ck
from lockstep.trainer.state.checkpoint import (load_checkpoint, load_latest, load_tree, LoopState,
                                               save_checkpoint, save_tree)

from model_fixtures import tiny_config

pytestmark = pytest.mark.reliability


def _optimizer_state():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    return lin, opt, sched


def test_state_tree_roundtrips_optimizer_scheduler_and_rng(tmp_path):
    _, opt, sched = _optimizer_state()
    random.seed(3)
    np.random.seed(4)
    tree = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "rng": ck.rng_state(), "misc": {1: (None, True, float("nan"), -float("inf"), "s"),
                                            "bf16": torch.ones(2, dtype=torch.bfloat16),
                                            "u32": np.arange(3, dtype=np.uint32), 2.5: []}}
    save_tree(tmp_path / "state", tree)
    back = load_tree(tmp_path / "state")
    assert back["optimizer"]["state"][0]["exp_avg"].equal(tree["optimizer"]["state"][0]["exp_avg"])
    assert back["optimizer"]["param_groups"] == tree["optimizer"]["param_groups"]
    assert back["scheduler"] == tree["scheduler"]
    _, opt2, sched2 = _optimizer_state()
    opt2.load_state_dict(back["optimizer"])  # torch accepts it as its own
    sched2.load_state_dict(back["scheduler"])
    m = back["misc"]
    assert m[1][:2] == (None, True) and np.isnan(m[1][2]) and m[1][3] == -float("inf")
    assert m["bf16"].dtype == torch.bfloat16 and m[2.5] == []
    assert m["u32"].dtype == np.uint32 and m["u32"].tolist() == [0, 1, 2]
    a = (random.random(), np.random.rand(), torch.rand(1))
    ck.set_rng_state(back["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == a


def test_state_tree_refuses_what_it_cannot_store(tmp_path):
    with pytest.raises(CheckpointError, match=r"tree opt\.ids: a set cannot be stored"):
        save_tree(tmp_path / "x", {"opt": {"ids": {1, 2}}})


def _save(run, model, step, **kw):
    return save_checkpoint(run, model, {"optimizer": {"lr": 0.1}}, LoopState(step, step, "h",
                                                                            str(step)), **kw)


def test_planted_pickle_never_runs(tmp_path):
    model = MoEModel(tiny_config())
    folder = _save(tmp_path, model, 1)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('x')",))

    # an old-format checkpoint (or a downloaded one) carrying a pickle payload
    torch.save({"optimizer": Payload()}, folder / "trainer_state.pt")
    (folder / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="old checkpoint format.*no longer unpickles"):
        load_checkpoint(folder)
    # the same file slipped next to a valid manifest is refused as an unlisted file
    folder2 = _save(tmp_path, model, 2)
    torch.save({"optimizer": Payload()}, folder2 / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="files not in the manifest.*trainer_state.pt"):
        load_checkpoint(folder2)
    # and a hostile tree JSON only ever builds plain data
    (tmp_path / "t.json").write_text(json.dumps({"format": ck.TREE_FORMAT, "tree": {
        "__reduce__": ["os.system", "touch pwned"]}}))
    save_tree(tmp_path / "u", {})
    (tmp_path / "u.json").replace(tmp_path / "t.json.bak")
    (tmp_path / "u.safetensors").replace(tmp_path / "t.safetensors")
    with pytest.raises(CheckpointError, match="malformed node"):
        load_tree(tmp_path / "t")
    assert not marker.exists()


def test_flipped_bytes_in_safetensors_are_detected_and_named(tmp_path):
    model = MoEModel(tiny_config())
    folder = _save(tmp_path, model, 1)
    f = folder / "hf" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"hf/model.safetensors: sha256 does not match"):
        load_checkpoint(folder)
    f.write_bytes(bytes(data[:-100]))  # truncated
    with pytest.raises(CheckpointError, match=r"hf/model.safetensors: \d+ bytes, the manifest"):
        load_checkpoint(folder)


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    torch.manual_seed(0)
    model = MoEModel(tiny_config())
    _save(tmp_path, model, 1)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    newest = _save(tmp_path, model, 2)
    f = newest / "trainer_state.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0x10]))
    warned = []
    folder, loaded, state, loop = load_latest(tmp_path, warn=warned.append)
    assert folder.name == "step_1" and loop.step == 1
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in good.items())
    assert len(warned) == 1 and "step_2" in warned[0] and "trainer_state.safetensors" in warned[0]
    (folder / "state.json").write_text("{}")  # now none is usable: one error naming both
    with pytest.raises(CheckpointError, match="no usable checkpoint.*step_2.*step_1"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_latest(tmp_path)


def test_failed_write_leaves_no_tmp_and_earlier_checkpoints_intact(tmp_path, monkeypatch):
    model = MoEModel(tiny_config())
    _save(tmp_path, model, 1)
    _save(tmp_path, model, 2)
    real = ck.save_tree

    def full_disk(path, tree):
        real(path, tree)  # half the files are on disk when the disk fills up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck, "save_tree", full_disk)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*step_3: No space "
                                              r"left on device \(free some space\); earlier"):
        _save(tmp_path, model, 3, keep=1)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]  # nothing rotated
    for name in ("step_1", "step_2"):
        load_checkpoint(root / name)
    # overwriting an existing step that fails keeps the old one too
    with pytest.raises(CheckpointError):
        _save(tmp_path, model, 2)
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]
    load_checkpoint(root / "step_2")
