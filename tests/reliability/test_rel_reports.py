"""Issue 22, probe round 2 (tests/reliability/probe_round2_cli.py): `lockstep compare` and
`lockstep diagnose` never write their reports over a run directory, into a checkpoint folder,
or over plots they did not write; compare says when it summarises a run whose last line is torn."""

import json

import pytest

from lockstep.launch.cli import main
from lockstep.trainer.state.rundir import MARKER

pytestmark = pytest.mark.reliability


def run_dir(d, steps=3):
    d.mkdir(parents=True)
    (d / MARKER).write_text("{}\n")
    rows = [{"step": s, "reward/mean": 0.1 * s, "rollout_corr/k3_kl": 1e-3} for s in
            range(1, steps + 1)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ckpt = d / "checkpoints" / "step_1"
    ckpt.mkdir(parents=True)
    for f in ("manifest.json", "state.json"):
        (ckpt / f).write_text("{}\n")
    return d


def cli(capsys, *args):
    code = main(list(args))
    return code, capsys.readouterr().err.strip().splitlines()


def test_compare_never_writes_over_plots_it_did_not_write(tmp_path, capsys):
    run = run_dir(tmp_path / "a")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "reward.png").write_bytes(b"the user's picture")
    code, err = cli(capsys, "compare", str(run), "--out", str(out))
    assert code == 2 and "already holds reward.png, not written by lockstep compare" in err[-1]
    assert (out / "reward.png").read_bytes() == b"the user's picture"
    fresh = tmp_path / "cmp"  # its own output may be rewritten (a rerun)
    assert cli(capsys, "compare", str(run), "--out", str(fresh))[0] == 0
    assert cli(capsys, "compare", str(run), "--out", str(fresh))[0] == 0


def test_compare_and_diagnose_refuse_a_run_dir_or_checkpoint_as_out(tmp_path, capsys):
    run = run_dir(tmp_path / "a")
    ckpt = run / "checkpoints" / "step_1"
    for out, why in ((run, "is a run directory"), (ckpt / "plots", "lies inside the checkpoint")):
        before = sorted(p.name for p in run.rglob("*"))
        code, err = cli(capsys, "compare", str(run), "--out", str(out))
        assert code == 2 and err[-1].startswith("lockstep compare: ") and why in err[-1], err
        code, err = cli(capsys, "diagnose", str(ckpt), "--out", str(out))
        assert code == 2 and err[-1].startswith("lockstep diagnose: ") and why in err[-1], err
        assert sorted(p.name for p in run.rglob("*")) == before


def test_compare_says_when_the_last_line_is_torn(tmp_path, capsys):
    run = run_dir(tmp_path / "a")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "rew')
    code, err = cli(capsys, "compare", str(run), "--out", str(tmp_path / "cmp"))
    assert code == 0
    assert any("last line of" in line and "is torn" in line and "steps 1..3" in line
               for line in err), err
