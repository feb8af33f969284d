"""Issue 22, run files: nothing in a run directory is followed through a symbolic link, no run
inside another run's tree, the metric history checked against the checkpoint on resume, and a
`--resume` that would run nothing says so and changes nothing (`lockstep train` in-process)."""

import json
import os
import shutil

import pytest

from lockstep.launch.cli import main
from lockstep.trainer.state.checkpoint import verify_manifest
from lockstep.trainer.observe.metrics import (HISTORY_FILE, MetricsFileError, history_problem,
                                      resumed_history, save_history)
from lockstep.trainer.state.rundir import LOCK_FILE, MARKER, RunDirError, claim_run_dir

from rundir_fixtures import COLD, FAST, TOY, metrics, sets

pytestmark = pytest.mark.reliability


def train(capsys, *args):
    code = main(["train", *args])
    return code, capsys.readouterr().err.strip().splitlines()


def one_line(code, err, status=2):
    assert code == status, (code, err)
    assert not any("Traceback" in line for line in err), err
    assert err[-1].startswith("lockstep train: "), err
    return err[-1]


def fresh(out, *extra):
    return [str(TOY), "--out", str(out), *sets(*FAST, *COLD, *extra)]


def snapshot(d):
    """(path, size, mtime, bytes) of every file under d: 'nothing changed on disk'."""
    return sorted((str(p.relative_to(d)), p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
                  for p in d.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A finished 2-step run with a checkpoint at each step (copied by each test)."""
    out = tmp_path_factory.mktemp("base") / "run"
    assert main(["train", *fresh(out, "loop.steps=2")]) == 0
    return out


def copy_run(two_steps, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    return out


def test_a_planted_lock_link_is_refused_and_its_target_untouched(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).symlink_to(victim)
    msg = one_line(*train(capsys, *fresh(out, "loop.steps=1")))
    assert "symbolic link" in msg and LOCK_FILE in msg
    assert victim.read_text() == "the user's file\n"
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]


def test_a_marker_link_does_not_make_a_users_directory_a_run(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text(TOY.read_text())
    (tmp_path / "anything").write_text("{}\n")
    (mine / MARKER).symlink_to(tmp_path / "anything")
    before = (mine / "config.yaml").read_bytes()
    msg = one_line(*train(capsys, str(mine / "config.yaml"), "--out", str(mine),
                          *sets(*FAST, *COLD, "loop.steps=1")))
    assert "symbolic link" in msg and MARKER in msg
    assert (mine / "config.yaml").read_bytes() == before
    (mine / MARKER).unlink()  # a dangling link is never created through either
    (mine / MARKER).symlink_to(tmp_path / "created")
    one_line(*train(capsys, str(mine / "config.yaml"), "--out", str(mine)))
    assert not (tmp_path / "created").exists()


def test_a_run_inside_another_runs_tree_is_refused(two_steps, tmp_path, capsys):
    out = copy_run(two_steps, tmp_path)
    before = snapshot(out)
    for inside in (out / "checkpoints" / "step_2", out / "checkpoints" / "step_2" / "x",
                   out / "sub"):
        msg = one_line(*train(capsys, *fresh(inside, "loop.steps=1")))
        assert "lies inside the lockstep run or checkpoint" in msg, msg
    assert snapshot(out) == before
    verify_manifest(out / "checkpoints" / "step_2")


def test_resume_that_runs_nothing_says_so_and_changes_nothing(two_steps, tmp_path, capsys):
    out = copy_run(two_steps, tmp_path)
    before = snapshot(out)
    msg = one_line(*train(capsys, "--resume", "--out", str(out), "--set", "loop.steps=1"))
    assert "already at step 2" in msg and "loop.steps=1" in msg
    code, err = train(capsys, "--resume", "--out", str(out))  # complete: not a failure
    assert code == 0 and "nothing to do" in err[-1], err
    assert snapshot(out) == before


@pytest.mark.parametrize("damage", ["emptied", "torn", "deleted", "doubled"])
def test_damaged_history_is_restored_from_the_checkpoint(two_steps, tmp_path, capsys, damage):
    out = copy_run(two_steps, tmp_path)
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    if damage == "emptied":
        path.write_text("")
    elif damage == "torn":  # the last line, of the checkpointed step 2, cut short
        path.write_text(lines[0] + lines[1][:20])
    elif damage == "deleted":
        path.write_text(lines[1])
    else:
        path.write_text(lines[0] + lines[0] + lines[1])
    code, err = train(capsys, "--resume", "--out", str(out), "--set", "loop.steps=3")
    assert code == 0, err
    assert any("restored its 2 rows from the checkpoint's copy" in line for line in err), err
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


def test_history_checks_without_a_checkpoint_copy(tmp_path):
    rows = [{"step": 1}, {"step": 2}, {"step": 3}]
    assert history_problem(rows) is None and history_problem(rows, 3) is None
    assert "appears more than once" in history_problem([rows[0], rows[0], rows[1]])
    assert "out of order" in history_problem([rows[1], rows[0]])
    assert "missing (first: step 2)" in history_problem([rows[0], rows[2]])
    assert "no rows" in history_problem([], 2)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert resumed_history(path, 2) == rows[:2]  # rows after the checkpoint: dropped
    for bad in ([rows[0], rows[0], rows[1]], [], [rows[1]]):  # an old checkpoint: no copy
        path.write_text("".join(json.dumps(r) + "\n" for r in bad))
        with pytest.raises(MetricsFileError, match="keeps no copy"):
            resumed_history(path, 2)
    ckpt = tmp_path / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    save_history(path, ckpt)
    path.write_text("not json\n{}\n")
    seen = []
    assert resumed_history(path, 2, seen.append) == rows[:2] and "restored" in seen[0]
    assert (ckpt / HISTORY_FILE).stat().st_size < 200


def fake_run(d):
    """A run directory as claim_run_dir sees it: marker, config.yaml, one checkpoint."""
    ckpt = d / "checkpoints" / "step_1"
    ckpt.mkdir(parents=True)
    for f in ("manifest.json", "state.json"):
        (ckpt / f).write_text("{}\n")
    (d / MARKER).write_text("{}\n")
    (d / "config.yaml").write_text("loop: {steps: 1}\n")
    return d


@pytest.mark.parametrize("link", ["checkpoints", "checkpoints/step_1"])
def test_run_folders_linked_into_another_run_are_refused(tmp_path, link):
    """Probe round 2: checkpoints/ (or a step folder) linked into another run's tree made a
    resume write its checkpoints into that run."""
    other, out = fake_run(tmp_path / "other"), fake_run(tmp_path / "run")
    shutil.rmtree(out / link)
    (out / link).symlink_to(other / link)
    before = snapshot(other)
    with pytest.raises(RunDirError, match="is a link into the lockstep run .*other"):
        claim_run_dir(out, resume=True).release()
    assert snapshot(other) == before
    plain = tmp_path / "disk2"  # a link to a folder that is no run's stays allowed
    shutil.copytree(other / "checkpoints", plain)
    (out / link).unlink()
    (out / link).symlink_to(plain / link.removeprefix("checkpoints").strip("/")
                            if "/" in link else plain)
    claim_run_dir(out, resume=True).release()


@pytest.mark.parametrize("name", [MARKER, LOCK_FILE])
def test_a_marker_or_lock_that_is_a_directory_is_named(tmp_path, name):
    out = fake_run(tmp_path / "run")
    (out / name).unlink(missing_ok=True)
    (out / name).mkdir()
    with pytest.raises(RunDirError, match=f"{name} is not a regular file"):
        claim_run_dir(out, resume=True).release()


def test_a_fresh_run_above_another_run_is_refused(tmp_path):
    """Probe round 2: `--out runs` next to runs/x started a run there, after which runs/x lay
    inside another run and could no longer resume."""
    inner = fake_run(tmp_path / "runs" / "x")
    with pytest.raises(RunDirError, match="holds the lockstep run .*x"):
        claim_run_dir(tmp_path / "runs", resume=False).release()
    assert not (tmp_path / "runs" / MARKER).exists()
    claim_run_dir(inner, resume=True).release()
