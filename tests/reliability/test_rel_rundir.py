"""Classes 4, 6, 7, 8 through `lockstep train` / `compare` (in-process `cli.main`, stderr not a
terminal): the run-directory lock, never overwriting a user's files, restart before the first
checkpoint, --resume rewriting config.yaml, secrets never persisted, one-line errors, divergence
that keeps the last good checkpoint, progress lines and plots at each checkpoint."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from lockstep.launch.cli import main
from lockstep.moe.checks import ConfigError
from lockstep.moe.config import ModelConfig
from lockstep.rollout.server import ServerThread
from lockstep.trainer.config.load import load_config, save_config
from lockstep.trainer.state.rundir import LOCK_FILE, MARKER, RunLock

from model_fixtures import tiny_config
from rundir_fixtures import COLD, FAST, TOY, metrics, sets

pytestmark = pytest.mark.reliability
WS = ["warmstart.target_accuracy=0.02", "warmstart.eval_every=5", "warmstart.eval_size=32",
      "warmstart.batch_size=32"]


def train(capsys, *args):
    """(exit status, stderr lines) of `lockstep train ARGS` run in this process."""
    code = main(["train", *args])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def one_line(code, err, cmd="train", status=2):
    assert code == status, (code, err)
    assert not any("Traceback" in line for line in err), err
    assert err[-1].startswith(f"lockstep {cmd}: "), err
    return err[-1]


def fresh(out, *extra):
    return [str(TOY), "--out", str(out), *sets(*FAST, *COLD, *extra)]


def test_restart_before_first_checkpoint_and_resume_rewrites_config(tmp_path, capsys):
    out = tmp_path / "run"
    code, err = train(capsys, *fresh(out, "loop.steps=1"))
    assert code == 0, err
    assert any(line.startswith("step 1/1 reward") and "ETA" in line for line in err), err
    # the state of a run killed before its first checkpoint
    import shutil
    shutil.rmtree(out / "checkpoints")
    msg = one_line(*train(capsys, "--resume", "--out", str(out)))
    assert "no checkpoint yet" in msg and f"lockstep train {out / 'config.yaml'} --out {out}" in msg
    code, err = train(capsys, str(out / "config.yaml"), "--out", str(out))  # as the hint says
    assert code == 0, err
    assert [r["step"] for r in metrics(out)] == [1]
    code, err = train(capsys, "--resume", "--out", str(out), "--set", "loop.steps=2")
    assert code == 0, err
    assert yaml.safe_load((out / "config.yaml").read_text())["loop"]["steps"] == 2
    assert [r["step"] for r in metrics(out)] == [1, 2]
    msg = one_line(*train(capsys, *fresh(out, "loop.steps=1")))  # a run with checkpoints
    assert "--resume" in msg and "step_2" in msg


def test_never_overwrites_files_lockstep_did_not_create(tmp_path, capsys, monkeypatch):
    (tmp_path / "config.yaml").write_text("mine: 1\n")
    (tmp_path / "summary.json").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    msg = one_line(*train(capsys, str(TOY), "--out", ".", *sets(*FAST, *COLD, "loop.steps=1")))
    assert "config.yaml, summary.json" in msg and "never writes over" in msg
    assert (tmp_path / "config.yaml").read_text() == "mine: 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "summary.json"]


def test_second_process_on_a_run_dir_is_refused_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from lockstep.trainer.state.rundir import RunLock; "
         f"lock = RunLock.acquire({str(out)!r}); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert holder.stdout.readline().strip() == "held"
        msg = one_line(*train(capsys, *fresh(out, "loop.steps=1")))
        assert f"in use by another lockstep process (PID {holder.pid})" in msg
        (out / MARKER).write_text("{}\n")  # the holder's run as it would look
        save_config(load_config(TOY, [*FAST, *COLD]), out / "config.yaml")
        msg = one_line(*train(capsys, "--resume", "--out", str(out)))
        assert f"PID {holder.pid}" in msg
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with RunLock.acquire(out):  # the lock died with its holder
        assert (out / LOCK_FILE).read_text().strip() == str(os.getpid())


def test_api_key_is_never_persisted_nor_taken_from_argv_or_yaml(tmp_path, capsys, monkeypatch):
    from lockstep.moe.model import MoEModel
    from lockstep.rollout.engine import Engine
    from lockstep.rollout.engine_config import EngineConfig
    from lockstep.trainer.config.load import rollout_api_key

    secret = "sk-do-not-persist-0123456789"
    msg = one_line(*train(capsys, *fresh(tmp_path / "a", f"rollout.api_key={secret}")))
    assert "LOCKSTEP_API_KEY" in msg and secret not in msg
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"rollout:\n  api_key: {secret}\n")
    msg = one_line(*train(capsys, str(bad), "--out", str(tmp_path / "a")))
    assert "api_key_file" in msg and secret not in msg
    keyfile = tmp_path / "key"
    keyfile.write_text(secret + "\n")
    assert rollout_api_key(load_config(TOY, [f"rollout.api_key_file={keyfile}"]).rollout) == secret
    monkeypatch.setenv("LOCKSTEP_API_KEY", secret)
    cfg = load_config(TOY, FAST)
    engine = Engine.from_model(MoEModel(cfg.model), EngineConfig(max_len=32))
    with ServerThread(engine, api_key=secret) as srv:
        out = tmp_path / "http"
        http = ["loop.steps=1", "rollout.backend=http", f"rollout.url={srv.url}"]
        code, err = train(capsys, *fresh(out, *http))
        assert code == 0, err
        monkeypatch.setenv("LOCKSTEP_API_KEY", "wrong")  # the key is really what is sent
        code, err = train(capsys, *fresh(tmp_path / "http2", *http))
        assert code != 0 and "401" in err[-1], err
    leaked = [p for p in out.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaked == [] and (out / "summary.json").exists()


def test_user_errors_are_one_line(tmp_path, capsys, monkeypatch):
    cases = []

    def check(args, *want, cmd="train"):
        try:
            code = main([cmd, *args])
        except SystemExit as e:  # argparse's own usage errors
            code = e.code
        err = capsys.readouterr().err.strip().splitlines()
        line = one_line(code, err, cmd)
        for w in want:
            assert w in line, (w, line)
        cases.append(line)

    out = str(tmp_path / "o")
    check([str(tmp_path), "--out", out], "is a directory")
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    check([str(tmp_path / "empty.yaml"), "--out", out], "is empty")
    (tmp_path / "dup.yaml").write_text("actor:\n  lr: 1.0e-3\n  grad_clip: 1.0\n  lr: 2.0e-3\n")
    check([str(tmp_path / "dup.yaml"), "--out", out], "duplicate key 'lr' at lines 2 and 4")
    check([str(TOY), "--out", out, "--set", "actor.lr"], "actor.lr", "key.sub=value")
    check([str(TOY), "--out", out, "--set", "actor.lr=[1"], "not valid YAML")
    check([str(TOY), "--out", out, "--threads", "x"], "--threads")
    (tmp_path / "file").write_text("")
    check([str(TOY), "--out", str(tmp_path / "file" / "sub"), *sets(*COLD)], "cannot create --out")
    monkeypatch.setitem(sys.modules, "ray", None)  # the extra 'ray' not installed
    monkeypatch.delitem(sys.modules, "lockstep.cluster.ray_ops", raising=False)
    check([str(TOY), "--out", str(tmp_path / "r"), *sets(*FAST, *COLD, "loop.steps=1",
                                                       "rollout.backend=ray")],
          "pip install 'lockstep[ray]'")
    check([str(tmp_path / "nope"), "--out", out], "not a run directory", cmd="compare")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "metrics.jsonl").write_text('{"step": 1}\n[1, 2]\n{"step": 3}\n')
    check([str(tmp_path / "m"), "--out", out], "metrics.jsonl:2: not a step record", cmd="compare")
    assert len(cases) == 10


def test_truncated_checkpoint_file_is_named(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(capsys, *fresh(out, "loop.steps=1"))[0] == 0
    f = out / "checkpoints/step_1/hf/model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    msg = one_line(*train(capsys, "--resume", "--out", str(out), "--set", "loop.steps=2"))
    assert "step_1/hf/model.safetensors: 1000 bytes" in msg


def test_hf_config_without_moe_fields_is_refused():
    d = tiny_config().to_hf_dict()
    for key in ("num_experts", "num_local_experts"):
        d.pop(key, None)
    with pytest.raises(ConfigError, match=r"missing required MoE field\(s\) \['num_experts'\]"):
        ModelConfig.from_hf_dict(d)


def test_diverging_run_stops_naming_what_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    code, err = train(capsys, str(TOY), "--out", str(out), *sets(
        *FAST, *WS, f"warmstart.cache_dir={tmp_path / 'cache'}", "actor.lr=1",
        "actor.grad_clip=0", "loop.steps=12"))
    msg = one_line(code, err, status=1)
    assert "diverged at step" in msg and "lower actor.lr (now 1)" in msg, msg
    step = int(msg.split("diverged at step ")[1].split(":")[0])
    kept = sorted(int(p.name[5:]) for p in (out / "checkpoints").iterdir())
    assert kept and kept[-1] == step - 1 and f"step_{step - 1}, is kept" in msg
    from lockstep.trainer.state.checkpoint import load_checkpoint
    model, _, _ = load_checkpoint(out / f"checkpoints/step_{step - 1}")
    assert all(bool(p.isfinite().all()) for p in model.parameters())


def test_plots_are_refreshed_at_each_checkpoint(tmp_path, capsys, monkeypatch):
    from lockstep.trainer.loop import Trainer
    real = Trainer.step

    def step(self, n):
        if n == 3:
            raise KeyboardInterrupt  # the run is stopped after the checkpoint of step 2
        return real(self, n)

    monkeypatch.setattr(Trainer, "step", step)
    out = tmp_path / "run"
    code, err = train(capsys, *fresh(out, "loop.steps=4", "loop.plots=true",
                                     "loop.checkpoint_every=2"))
    assert code == 130, err
    assert (out / "reward.png").stat().st_size > 1000 and (out / "k3_kl.png").exists()
