"""`lockstep export` (launch/export.py) refuses an --out inside its source or inside any run or
checkpoint tree, verifies a checkpoint's manifest before reading it, and names a missing
source as missing. Fast: a tiny model, no run."""

import json
import struct

import pytest

from lockstep.launch.cli import main
from lockstep.moe.checkpoint import save_hf
from lockstep.moe.model import MoEModel
from lockstep.trainer.state.checkpoint import write_manifest
from lockstep.trainer.state.rundir import MARKER

from model_fixtures import tiny_config


@pytest.fixture
def ckpt(tmp_path):
    """A run's checkpoint: run/.lockstep-run, run/checkpoints/step_3/{hf/, state.json,
    manifest.json}."""
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_3"
    save_hf(MoEModel(tiny_config()), step / "hf")
    (step / "state.json").write_text(json.dumps({"step": 3}))
    (step / "trainer_state.json").write_text("{}")
    write_manifest(step)
    (run / MARKER).write_text("{}")
    return step


def _export(capsys, src, out) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["export", str(src), "--out", str(out), "--dtype", "bf16"])
    return code, capsys.readouterr().err.strip()


def test_a_checkpoint_exports(ckpt, tmp_path, capsys):
    code, err = _export(capsys, ckpt / "hf", tmp_path / "out")
    assert code == 0, err
    assert (tmp_path / "out" / "config.json").is_file()


@pytest.mark.parametrize("where", ["hf/sub", "hf_bf16", "../step_9", "../../../run/more"])
def test_out_inside_the_source_or_a_run_tree_is_refused(ckpt, capsys, where):
    out = ckpt / where
    code, err = _export(capsys, ckpt / "hf", out)
    assert code == 2 and not out.exists(), err
    if where == "hf/sub":
        assert err == (f"lockstep export: --out {out} lies inside the source {ckpt / 'hf'}; "
                       f"export writes a new folder outside it")
    else:
        assert f"--out {out} lies inside the lockstep run or checkpoint " in err, err
        assert err.endswith("files there would break its checkpoints: choose a folder "
                            "outside it")


def test_out_inside_a_plain_source_is_refused(tmp_path, capsys):
    src = save_hf(MoEModel(tiny_config()), tmp_path / "src")
    code, err = _export(capsys, src, src / "bf16")
    assert code == 2 and "lies inside the source" in err and not (src / "bf16").exists()


def test_a_flipped_bit_is_refused_before_reading(ckpt, tmp_path, capsys):
    """The lowest byte of the first weight: still a finite number, so only the manifest can
    tell (as `--resume` would)."""
    f = ckpt / "hf" / "model.safetensors"
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n] ^= 1
    f.write_bytes(bytes(raw))
    code, err = _export(capsys, ckpt / "hf", tmp_path / "out")
    assert code == 2 and not (tmp_path / "out").exists()
    assert err == f"lockstep export: {f}: sha256 does not match the manifest (corrupted)"


def test_a_file_added_to_the_checkpoint_is_refused(ckpt, tmp_path, capsys):
    (ckpt / "hf" / "extra.json").write_text("{}")
    code, err = _export(capsys, ckpt / "hf", tmp_path / "out")
    assert code == 2 and "files not in the manifest: ['hf/extra.json']" in err


def test_a_missing_source_is_named_missing(tmp_path, capsys):
    code, err = _export(capsys, tmp_path / "nope" / "hf", tmp_path / "out")
    assert (code, err) == (2, f"lockstep export: {tmp_path / 'nope' / 'hf'} does not exist")
