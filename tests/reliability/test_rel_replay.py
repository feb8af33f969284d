"""The reliability replay of issue 12's run-directory / CLI / checkpoint classes with fresh
inputs: each case is run through `lockstep train` / `compare` in this process and classified
as a clear error (exit 2 or 1, one line `lockstep <cmd>: ...` naming what it must), handled
(exit 0, as intended), silent failure (exit 0 where an error was due, or a message missing what
it must name), traceback, or hang (no answer within 120 s). Every case must be clear or
handled; the counts are printed (`pytest -s`)."""

import shutil
import signal
import sys

import pytest

from lockstep.launch.cli import main
from lockstep.trainer.config.load import load_config, save_config

from rundir_fixtures import COLD, FAST, TOY, sets

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang


def _run(argv, capsys):
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(120)
    try:
        try:
            code = main(argv)
        except SystemExit as e:  # argparse usage errors
            code = e.code
        return code, capsys.readouterr().err
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A finished 2-step run with checkpoints step_1 and step_2."""
    out = tmp_path_factory.mktemp("base") / "run"
    assert main(["train", str(TOY), "--out", str(out),
                 *sets(*FAST, *COLD, "loop.steps=2")]) == 0
    return out


def test_replay_run_dir_cli_and_checkpoint_classes(tmp_path, capsys, monkeypatch, base_run):
    t = tmp_path
    q = [*FAST, *COLD, "loop.steps=1"]

    def f(name, text, mode="w"):
        p = t / name
        p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text)
        return str(p)

    def copy(name):
        dst = t / name
        shutil.copytree(base_run, dst)
        return dst

    def flip(path):
        b = bytearray(path.read_bytes())
        b[len(b) // 2] ^= 0x40
        path.write_bytes(bytes(b))

    (t / "user").mkdir()
    (t / "user" / "config.yaml").write_text("mine: true\n")
    (t / "afile").write_text("x")
    (t / "bad_metrics").mkdir()
    (t / "bad_metrics" / "metrics.jsonl").write_text("not json\n{\"step\": 2}\n")
    marked = t / "marked"
    marked.mkdir()
    (marked / ".lockstep-run").write_text("{}\n")
    save_config(load_config(TOY, q), marked / "config.yaml")
    one_ckpt = copy("one")
    shutil.rmtree(one_ckpt / "checkpoints" / "step_1")
    trunc = one_ckpt / "checkpoints/step_2/hf/model.safetensors"
    trunc.write_bytes(trunc.read_bytes()[:500])
    flipped = copy("flipped")
    flip(flipped / "checkpoints/step_2/trainer_state.safetensors")
    legacy = copy("legacy")
    for s in ("step_1", "step_2"):
        (legacy / f"checkpoints/{s}/manifest.json").unlink()
        (legacy / f"checkpoints/{s}/trainer_state.pt").write_bytes(b"\x80\x04K\x01.")
    for s in ("step_1", "step_2"):
        (flipped / f"checkpoints/{s}").exists()

    # (name, argv, expected: "error" | "ok", what the message / outcome must name)
    cases = [
        ("config is a directory", ["train", str(t), "--out", str(t / "o")], "error", "is a directory"),
        ("config missing", ["train", str(t / "nope.yaml"), "--out", str(t / "o")], "error", "no config file"),
        ("empty yaml", ["train", f("e.yaml", ""), "--out", str(t / "o")], "error", "is empty"),
        ("comments only", ["train", f("c.yaml", "# x\n"), "--out", str(t / "o")], "error", "is empty"),
        ("duplicate section", ["train", f("d1.yaml", "loop: {steps: 1}\nloop: {steps: 2}\n"),
                               "--out", str(t / "o")], "error", "duplicate key 'loop'"),
        ("duplicate nested key", ["train", f("d2.yaml", "actor:\n  eps: 1.0e-8\n  eps: 1.0e-6\n"),
                                  "--out", str(t / "o")], "error", "lines 2 and 3"),
        ("binary file", ["train", f("b.yaml", b"\xff\xfe\x00garbage"), "--out", str(t / "o")],
         "error", "not a text"),
        ("list at top", ["train", f("l.yaml", "- 1\n- 2\n"), "--out", str(t / "o")], "error", "mapping"),
        ("int key", ["train", f("i.yaml", "1: 2\n"), "--out", str(t / "o")], "error", "unknown key"),
        ("bad date", ["train", f("dt.yaml", "loop:\n  out_dir: 2001-13-45\n"), "--out", str(t / "o")],
         "error", "YAML"),
        ("huge float", ["train", str(TOY), "--out", str(t / "o"), "--set", "actor.lr=1e400"],
         "error", "actor.lr"),
        ("--set no =", ["train", str(TOY), "--out", str(t / "o"), "--set", "loop.steps"], "error", "key.sub=value"),
        ("--set unknown", ["train", str(TOY), "--out", str(t / "o"), "--set", "loop.stepz=3"], "error", "'steps'"),
        ("--set bad yaml", ["train", str(TOY), "--out", str(t / "o"), "--set", "actor.betas=[0.9"],
         "error", "not valid YAML"),
        ("--set api key", ["train", str(TOY), "--out", str(t / "o"), "--set", "rollout.api_key=s3"],
         "error", "LOCKSTEP_API_KEY"),
        ("yaml api key", ["train", f("k.yaml", "rollout:\n  api_key: s3\n"), "--out", str(t / "o")],
         "error", "api_key_file"),
        ("bad experts", ["train", str(TOY), "--out", str(t / "o"), "--set", "model.num_experts_per_tok=9"],
         "error", "num_experts_per_tok"),
        ("--threads 0", ["train", str(TOY), "--out", str(t / "o"), "--threads", "0"], "error", "--threads"),
        ("--threads abc", ["train", str(TOY), "--out", str(t / "o"), "--threads", "abc"], "error", "--threads"),
        ("--log-every -1", ["train", str(TOY), "--out", str(t / "o"), "--log-every", "-1"], "error", "--log-every"),
        ("--out under a file", ["train", str(TOY), "--out", str(t / "afile" / "x"), *sets(*q)],
         "error", "cannot create"),
        ("--out is a file", ["train", str(TOY), "--out", str(t / "afile"), *sets(*q)], "error", "is a file"),
        ("--out with user files", ["train", str(TOY), "--out", str(t / "user"), *sets(*q)],
         "error", "config.yaml"),
        ("--resume missing dir", ["train", "--resume", "--out", str(t / "none")], "error", "does not exist"),
        ("--resume no checkpoint", ["train", "--resume", "--out", str(marked)], "error",
         "restart it from scratch"),
        ("--resume changed config", ["train", "--resume", "--out", str(copy("changed")), "--set",
                                     "actor.lr=1e-3"], "error", "another config"),
        ("--resume truncated", ["train", "--resume", "--out", str(one_ckpt), "--set", "loop.steps=3"],
         "error", "hf/model.safetensors: 500 bytes"),
        ("--resume old format", ["train", "--resume", "--out", str(legacy), "--set", "loop.steps=3"],
         "error", "old checkpoint format"),
        ("--resume corrupt newest", ["train", "--resume", "--out", str(flipped), "--set",
                                     "loop.steps=3"], "ok", "step_2 is not usable"),
        ("fresh run", ["train", str(TOY), "--out", str(t / "fresh"), *sets(*q)], "ok", "step 1/1"),
        ("ray missing", ["train", str(TOY), "--out", str(t / "ray"), *sets(*q, "rollout.backend=ray")],
         "error", "lockstep[ray]"),
        ("compare missing", ["compare", str(t / "nope"), "--out", str(t / "cmp")], "error", "not a run directory"),
        ("compare bad metrics", ["compare", str(t / "bad_metrics"), "--out", str(t / "cmp")],
         "error", "metrics.jsonl:1"),
        ("compare window 0", ["compare", str(base_run), "--out", str(t / "cmp"), "--window", "0"],
         "error", "--window"),
        ("compare out is file", ["compare", str(base_run), "--out", str(t / "afile")], "error", "is a file"),
        ("compare ok", ["compare", str(base_run), "--out", str(t / "cmp")], "ok", ""),
    ]
    counts = {"clear": 0, "handled": 0, "silent": 0, "traceback": 0, "hang": 0}
    bad = []
    for name, argv, want, needle in cases:
        if name == "ray missing":
            monkeypatch.setitem(sys.modules, "ray", None)
            monkeypatch.delitem(sys.modules, "lockstep.cluster.ray_ops", raising=False)
        try:
            code, err = _run(argv, capsys)
        except Hang:
            kind = "hang"
        except Exception as e:  # noqa: BLE001 - an exception escaping main is a traceback
            kind, err = "traceback", repr(e)
        else:
            lines = err.strip().splitlines()
            if "Traceback" in err:
                kind = "traceback"
            elif want == "error":
                ok = (code in (1, 2) and lines and lines[-1].startswith(f"lockstep {argv[0]}: ")
                      and needle in lines[-1])
                kind = "clear" if ok else "silent"
            else:
                kind = "handled" if code == 0 and needle in err else "silent"
        counts[kind] += 1
        if kind not in ("clear", "handled"):
            bad.append((name, kind, err[-500:]))
    print(f"\nreliability replay: {len(cases)} cases: {counts}")
    assert not bad, bad
