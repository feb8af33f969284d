"""Issue 22's fresh probe, second half: the run-directory, resume, config, reward, `compare` and
`diagnose` classes, through the CLI only. Run by hand (not by CI):

    OMP_NUM_THREADS=1 nice -n 19 python tests/reliability/probe_round2_cli.py

Rows are printed by probe_round2's ROWS (same columns). Verdicts:
  clear error   - exit 1 or 2, the last stderr line names the problem, no traceback, and no file
                  already saved changed (checked byte for byte)
  correct       - exit 0 and the check of the result holds (history 1..n once, in order, ...)
  silent        - accepted what it should refuse, a wrong result, or an error that changed files
  crash         - a traceback or another exit status
  hang          - no exit within the bound
Exits 1 if any row is silent, crash or hang.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_round2 import ROWS  # noqa: E402
from rundir_fixtures import CONFIGS, TOY, lockstep, sets  # noqa: E402

DATASET = CONFIGS / "dataset_example.yaml"

TINY = sets("loop.steps=2", "warmstart.enabled=false", "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=2", "loop.tensorboard=false", "loop.plots=false",
            "actor.mini_batch_size=8", "actor.micro_batch_size=8", "loop.checkpoint_every=1")
LOCK = ".lockstep-lock"


def snapshot(root: Path) -> dict[str, bytes]:
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (b"link:" + str(p.readlink()).encode() if p.is_symlink()
                                       else p.read_bytes())
            for p in sorted(root.rglob("*")) if (p.is_file() or p.is_symlink())
            and p.name != LOCK}


def history(out: Path) -> list[int] | None:
    try:
        return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run(cls, what, args, expect, keep=(), check=None, bound=240.0):
    """expect: "error" (a clear refusal is right), "ok" (exit 0 and `check()` is right), or
    "either" (a clear refusal or exit 0 with `check()` right). `keep`: paths whose files must be
    byte-identical afterwards when the command refused (and always, for paths outside the run)."""
    before = {p: snapshot(p) for p in keep}
    try:
        res = lockstep(*args, timeout=bound)
    except subprocess.TimeoutExpired:
        ROWS.append((cls, what, "hang", f"no exit within {bound:.0f}s"))
        return
    err = res.stderr.strip().splitlines()
    last = (err or [""])[-1][:150]
    changed = [f"{p}/{k}" for p, snap in before.items() for k in
               set(snap) | set(snapshot(p)) if snapshot(p).get(k) != snap.get(k)]
    if "Traceback" in res.stderr or res.returncode not in (0, 1, 2):
        verdict, detail = "crash", f"exit {res.returncode}: {last}"
    elif res.returncode in (1, 2):
        if not last.startswith("lockstep "):
            verdict, detail = "silent", f"exit {res.returncode}, no named error: {last}"
        elif changed:
            verdict, detail = "silent", f"refused but changed {sorted(changed)[:3]}: {last}"
        elif expect == "ok":
            verdict, detail = "silent", f"refused a valid input: {last}"
        else:
            verdict, detail = "clear error", last
    else:
        ok = check() if check else True
        if expect == "error":
            verdict, detail = "silent", f"accepted (exit 0): {last}"
        elif ok is True:
            verdict, detail = "correct", f"exit 0: {last}"
        else:
            verdict, detail = "silent", f"exit 0 but {ok or 'the result is wrong'}"
    ROWS.append((cls, what, verdict, detail))


def train(out, *extra, config=TOY):
    return ["train", str(config), "--out", str(out), *TINY, *extra]


def resume(out, *extra):
    return ["train", "--resume", "--out", str(out), *extra]


def steps_once(out, n):
    def check():
        h = history(out)
        return True if h == list(range(1, n + 1)) else f"history is {h}"
    return check


# -- planted run files ----------------------------------------------------------------------
def probe_runfiles(tmp, template, other):
    cls = "run files"
    victim = tmp / "victim.txt"
    victim.write_text("precious\n")
    def fresh(name):
        d = tmp / name
        d.mkdir()
        return d
    def copy(name):
        d = tmp / name
        shutil.copytree(template, d, symlinks=True)
        return d
    d = fresh("lock-link")
    (d / LOCK).symlink_to(victim)
    run(cls, "fresh: lock -> user's file", train(d), "error", keep=[tmp / "victim.txt"])
    d = fresh("lock-dangling")
    (d / LOCK).symlink_to(tmp / "nowhere")
    run(cls, "fresh: lock dangling link", train(d), "error",
        check=lambda: not (tmp / "nowhere").exists())
    d = copy("lock-link-resume")
    (d / LOCK).unlink()
    (d / LOCK).symlink_to(victim)
    run(cls, "resume: lock -> user's file", resume(d, "--set", "loop.steps=3"), "error",
        keep=[d, tmp / "victim.txt"])
    d = copy("marker-link")
    (d / ".lockstep-run").unlink()
    (d / ".lockstep-run").symlink_to(other / ".lockstep-run")
    run(cls, "resume: marker -> other run's marker", resume(d, "--set", "loop.steps=3"),
        "error", keep=[d, other])
    d = copy("marker-dir")
    (d / ".lockstep-run").unlink()
    (d / ".lockstep-run").mkdir()
    run(cls, "resume: marker is a directory", resume(d, "--set", "loop.steps=3"), "error",
        keep=[d])
    d = copy("marker-garbage")
    (d / ".lockstep-run").write_bytes(b"\x00\xffgarbage")
    run(cls, "resume: marker garbage bytes", resume(d, "--set", "loop.steps=3"), "either",
        keep=[d], check=steps_once(d, 3))
    for f in ("config.yaml", "metrics.jsonl", "summary.json"):
        d = copy(f"link-{f}")
        theirs = other / f
        (d / f).unlink()
        (d / f).symlink_to(theirs)
        run(cls, f"resume: {f} -> other run's", resume(d, "--set", "loop.steps=3"), "error",
            keep=[d, other])
    d = copy("ckpts-link")
    shutil.rmtree(d / "checkpoints")
    (d / "checkpoints").symlink_to(other / "checkpoints")
    run(cls, "resume: checkpoints/ -> other run's", resume(d, "--set", "loop.steps=3"),
        "error", keep=[d, other])
    d = copy("step-link")
    shutil.rmtree(d / "checkpoints" / "step_2")
    (d / "checkpoints" / "step_2").symlink_to(other / "checkpoints" / "step_2")
    run(cls, "resume: checkpoints/step_2 -> other's", resume(d, "--set", "loop.steps=3"),
        "error", keep=[d, other])
    d = fresh("planted-metrics")
    (d / "metrics.jsonl").write_text('{"step": 1}\n')
    run(cls, "fresh: unmarked dir with metrics.jsonl", train(d), "error", keep=[d])
    (tmp / "a-file").write_text("x")
    run(cls, "fresh: --out is a regular file", train(tmp / "a-file"), "error",
        keep=[tmp / "a-file"])
    d = copy("stale-lock")
    (d / LOCK).write_text("999999999\n")
    run(cls, "resume: stale lock naming a dead PID", resume(d, "--set", "loop.steps=3"),
        "ok", check=steps_once(d, 3))
    link = tmp / "out-link"
    link.symlink_to(copy("via-link"))
    run(cls, "resume: --out is a link to a run", resume(link, "--set", "loop.steps=3"),
        "either", keep=[tmp / "via-link"], check=steps_once(tmp / "via-link", 3))


# -- runs inside other runs' trees ----------------------------------------------------------
def probe_nested(tmp, other):
    cls = "nested runs"
    for sub in ("checkpoints/step_1", "checkpoints", "newsub", "checkpoints/step_1/actor",
                "checkpoints/step_9", "metrics.jsonl/x"):
        run(cls, f"fresh: --out RUN/{sub}", train(other / sub), "error", keep=[other])
    link = tmp / "into-ckpts"
    link.symlink_to(other / "checkpoints")
    run(cls, "fresh: --out LINK/new, LINK -> RUN/ckpts", train(link / "new"), "error",
        keep=[other])
    parent = tmp / "parent-of-run"
    parent.mkdir()
    shutil.copytree(other, parent / "inner", symlinks=True)
    run(cls, "fresh: --out a dir holding a run", train(parent), "error", keep=[parent])
    run(cls, "resume: --out RUN/checkpoints/..", resume(other / "checkpoints" / "..",
                                                         "--set", "loop.steps=2"),
        "either", keep=[other])


# -- damaged metric histories on resume -----------------------------------------------------
def probe_history(tmp, template):
    cls = "metric history"
    def case(name, mutate, expect="either"):
        d = tmp / f"hist-{name}"
        shutil.copytree(template, d, symlinks=True)
        m = d / "metrics.jsonl"
        mutate(m, m.read_text().splitlines(keepends=True))
        run(cls, f"resume 2->3: {name}", resume(d, "--set", "loop.steps=3"), expect,
            keep=[d], check=steps_once(d, 3))
    case("torn last row", lambda m, ls: m.write_text(ls[0] + ls[1][: len(ls[1]) // 2]))
    case("row 1 missing", lambda m, ls: m.write_text(ls[1]))
    case("row 2 missing", lambda m, ls: m.write_text(ls[0]))
    case("row 1 doubled", lambda m, ls: m.write_text(ls[0] + ls[0] + ls[1]))
    case("rows reordered", lambda m, ls: m.write_text(ls[1] + ls[0]))
    case("emptied", lambda m, ls: m.write_text(""))
    case("deleted", lambda m, ls: m.unlink())
    case("garbage line between", lambda m, ls: m.write_text(ls[0] + "garbage{\n" + ls[1]))
    case("blank line at the end", lambda m, ls: m.write_text(ls[0] + ls[1] + "\n"))
    case("NUL bytes appended", lambda m, ls: m.write_bytes((ls[0] + ls[1]).encode() + b"\0" * 64))
    case("row 2 says step 5", lambda m, ls: m.write_text(
        ls[0] + ls[1].replace('"step": 2', '"step": 5', 1)))
    case("row 2 is a JSON list", lambda m, ls: m.write_text(ls[0] + "[1, 2]\n"))
    case("CRLF line ends", lambda m, ls: m.write_bytes("".join(ls).replace("\n", "\r\n").encode()))
    case("metrics.jsonl is a dir", lambda m, ls: (m.unlink(), m.mkdir()), expect="error")
    def past_ckpt(m, ls):  # killed after step 2's row but before its checkpoint
        shutil.rmtree(m.parent / "checkpoints" / "step_2")
    case("row past the checkpoint", past_ckpt)
    d = tmp / "hist-summary-gone"
    shutil.copytree(template, d, symlinks=True)
    (d / "summary.json").unlink()
    run(cls, "resume 2->3: summary.json deleted", resume(d, "--set", "loop.steps=3"), "ok",
        check=lambda: steps_once(d, 3)() is True and (d / "summary.json").exists() or
        "no summary.json")


# -- --resume with changed or no-op settings -------------------------------------------------
def probe_resume(tmp, template):
    cls = "resume settings"
    def copy(name):
        d = tmp / f"res-{name}"
        shutil.copytree(template, d, symlinks=True)
        return d
    for name, extra in (("steps equal (no-op)", ["--set", "loop.steps=2"]),
                        ("steps fewer", ["--set", "loop.steps=1"]),
                        ("no --set at all (done run)", [])):
        d = copy(name.split()[1])
        run(cls, f"resume: {name}", resume(d, *extra), "either", keep=[d],
            check=lambda d=d: "files changed" if snapshot(d) != snapshot(template) and
            history(d) != [1, 2] else True)
    d = copy("arch")
    run(cls, "resume: model.hidden_size changed", resume(d, "--set", "loop.steps=3", "--set",
        "model.hidden_size=64"), "error", keep=[d])
    d = copy("nokey")
    run(cls, "resume: --set unknown key", resume(d, "--set", "loop.steps=3", "--set",
        "nosuch.key=1"), "error", keep=[d])
    d = copy("nocfg")
    (d / "config.yaml").unlink()
    run(cls, "resume: config.yaml deleted", resume(d, "--set", "loop.steps=3"), "error",
        keep=[d])
    d = copy("badcfg")
    (d / "config.yaml").write_text("rollout: [unclosed\n")
    run(cls, "resume: config.yaml garbage", resume(d, "--set", "loop.steps=3"), "error",
        keep=[d])
    d = copy("nockpt")
    shutil.rmtree(d / "checkpoints")
    (d / "checkpoints").mkdir()
    run(cls, "resume: no checkpoints left", resume(d, "--set", "loop.steps=3"), "error",
        keep=[d])
    empty = tmp / "res-empty"
    empty.mkdir()
    run(cls, "resume: empty dir", resume(empty, "--set", "loop.steps=3"), "error", keep=[empty])
    run(cls, "resume: missing dir", resume(tmp / "res-missing"), "error",
        check=lambda: not (tmp / "res-missing").exists())
    d = copy("torn-ckpt")
    state = d / "checkpoints" / "step_2" / "state.json"
    if state.exists():
        state.write_text(state.read_text()[:5])
    run(cls, "resume: step_2 state.json torn", resume(d, "--set", "loop.steps=3"), "either",
        keep=[d / "checkpoints" / "step_1"], check=steps_once(d, 3))
    d = copy("fresh-over")
    run(cls, "fresh (no --resume) over a finished run", train(d), "error", keep=[d])


# -- config edges ---------------------------------------------------------------------------
def probe_config(tmp):
    cls = "config edges"
    n = iter(range(1000))
    def fresh(what, extra, expect="error", config=TOY, check=None):
        out = tmp / f"cfg-{next(n)}"
        run(cls, what, train(out, *extra, config=config), expect, check=check)
        return out
    out = tmp / "cfg-merge"
    run(cls, "--set 'rollout={temperature: 0.9}'", train(out, "--set",
        "rollout={temperature: 0.9}", "--set", "loop.steps=1"), "either",
        check=lambda: "rollout section replaced" if "dtype: bf16" not in
        (out / "config.yaml").read_text() else True)
    for what in ("rollout=5", "rollout=[1, 2]", "rollout={nosuch: 1}", "rollout={1: 2}",
                 "rollout.temperature=1e-9", "rollout.temperature=-1",
                 "rollout.temperature=nan", "rollout.temperature=inf", "cluster.nodes=3",
                 "cluster.nodes=0", "model.hidden_size=1e9", "model.hidden_size=abc",
                 "model.hidden_size=96.5", "model.hidden_size=true",
                 "model.num_experts=1000000000", "data.train_files={a: b}",
                 "data.train_files=5",
                 f"data.train_files={tmp}/missing.parquet", "loop.steps=-1", "actor.lr=nan",
                 "rollout.prompts_per_step=0", "loop.seed=1180591620717411303424",
                 "noequals", "=3", "loop=null"):
        fresh(f"--set {what}", ["--set", "loop.steps=1", "--set", what])
    for what in ("model.max_position_embeddings=1000000000000", "data.train_files=[]"):
        out = fresh(f"--set {what}", ["--set", "loop.steps=1", "--set", what], expect="either",
                    check=lambda: True)
    for name, text in (("list at top", "- a\n- b\n"), ("non-string top key", "1: 2\n"),
                       ("null top key", "null: 3\n"), ("duplicate section key",
                        TOY.read_text() + "\nrollout: {temperature: 0.5}\n"),
                       ("binary garbage", "\x00\x01\x02")):
        path = tmp / f"cfg-{name.replace(' ', '_')}.yaml"
        path.write_text(text)
        fresh(f"config file: {name}", [], config=path)


# -- reward files ---------------------------------------------------------------------------
def probe_rewards(tmp):
    """On the files `lockstep example-data` writes (the reward section is for data sets)."""
    cls = "reward files"
    ex = tmp / "example"
    res = lockstep("example-data", str(ex))
    if res.returncode:
        raise SystemExit(f"lockstep example-data failed: {res.stderr[-2000:]}")
    data = ["--set", f"model.path={ex}/policy", "--set", f"data.train_files=[{ex}/train.jsonl]",
            "--set", f"data.val_files=[{ex}/val.jsonl]", "--set",
            f"reward.function={ex}/reward.py:compute_score"]
    for what, files in (("string", f"{ex}/train.jsonl"), ("list of two", f"[{ex}/train.jsonl, "
                        f"{ex}/train.jsonl]"), ("missing file", f"{ex}/nosuch.jsonl"),
                        ("a folder", f"{ex}/policy"), ("reward.py as data", f"{ex}/reward.py")):
        out = tmp / f"rw-data-{what.replace(' ', '_')}"
        run("config edges", f"data set: train_files {what}", train(
            out, *data, "--set", f"data.train_files={files}", "--set", "loop.steps=1",
            config=DATASET), "ok" if what in ("string", "list of two") else "error",
            check=steps_once(out, 1))
    def case(name, body, expect, fn="f", extra=(), faulty=False):
        path = tmp / f"reward_{name.replace(' ', '_').replace('/', '')}.py"
        path.write_text(body)
        out = tmp / f"rw-{path.stem}"
        def check():
            h = history(out)
            if h != [1]:
                return f"history {h}"
            row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
            bad = {k: v for k, v in row.items() if k.startswith("reward/") and
                   isinstance(v, float) and not abs(v) < float("inf")}
            if bad:
                return f"non-finite {bad}"
            counted = row.get("reward/errors", 0) > 0
            if counted != faulty:
                return (f"reward/errors={row.get('reward/errors')} for a "
                        f"{'bad' if faulty else 'good'} reward")
            return True
        run(cls, f"reward: {name}", train(out, *data, "--set", "loop.steps=1", "--set",
            f"reward.function={path}:{fn}", "--set", "reward.import_timeout_s=5",
            "--set", "reward.timeout_s=3", *extra, config=DATASET), expect, check=check,
            bound=120)
    good = "def f(data_source, solution_str, ground_truth, extra_info=None):\n    return "
    case("sys.exit(0) at import", "import sys\nsys.exit(0)\n", "error")
    case("sys.exit(3) at import", "import sys\nsys.exit(3)\n", "error")
    case("os._exit(0) at import", "import os\nos._exit(0)\n", "error")
    case("sleep at import", "import time\ntime.sleep(60)\n", "error")
    case("raise at import", "raise RuntimeError('boom')\n", "error")
    case("syntax error", "def f(:\n", "error")
    case("missing function", good + "1.0\n", "error", fn="nosuch")
    case("name not callable", "f = 3\n", "error")
    case("KeyboardInterrupt at import", "raise KeyboardInterrupt\n", "error")
    case("prints at import", "print('hello from import')\n" + good + "1.0\n", "ok")
    for value in ("float('inf')", "float('nan')", "1e300", "-1e300", "'abc'", "None",
                  "[1.0]", "{'score': float('nan')}", "10**400"):
        case(f"returns {value}", good + value + "\n", "ok", faulty=True)
    case("call raises", good.replace("return ", "raise ValueError('x') #"), "ok", faulty=True)
    case("call os._exit", "import os\n" + good.replace("return ", "os._exit(1) #"), "ok",
         faulty=True)
    case("call prints", good.replace("return ", "print('noise'); return 1.0 #"), "ok")
    case("call sleeps past timeout", "import time\n" + good.replace(
        "return ", "time.sleep(30) #"), "ok", faulty=True)
    case("wrong signature", "def f(x):\n    return 1.0\n", "ok", faulty=True)
    run(cls, "reward: missing file", train(tmp / "rw-missing", *data, "--set", "loop.steps=1",
        "--set", f"reward.function={tmp}/nosuch.py:f", config=DATASET), "error")
    run(cls, "reward: no ':name'", train(tmp / "rw-nocolon", *data, "--set", "loop.steps=1",
        "--set", f"reward.function={ex}/reward.py", config=DATASET), "error")


# -- compare --------------------------------------------------------------------------------
def probe_compare(tmp, template, other):
    cls = "compare"
    def copy(name, mutate=None):
        d = tmp / f"cmp-{name}"
        shutil.copytree(template, d, symlinks=True)
        if mutate:
            m = d / "metrics.jsonl"
            mutate(m, m.read_text().splitlines(keepends=True))
        return d
    n = iter(range(1000))
    def out():
        return str(tmp / f"cmp-out-{next(n)}")
    run(cls, "compare: a dir that is no run", ["compare", str(tmp / "cfg-merge-not"), "--out",
        out()], "error")
    (tmp / "cmp-plain").mkdir()
    run(cls, "compare: empty dir", ["compare", str(tmp / "cmp-plain"), "--out", out()], "error")
    for name, mut in (("torn last row", lambda m, ls: m.write_text(ls[0] + ls[1][:20])),
                      ("duplicated row", lambda m, ls: m.write_text(ls[0] + ls[0] + ls[1])),
                      ("emptied metrics", lambda m, ls: m.write_text("")),
                      ("garbage line", lambda m, ls: m.write_text(ls[0] + "xx\n" + ls[1])),
                      ("reordered rows", lambda m, ls: m.write_text(ls[1] + ls[0]))):
        d = copy(name.split()[0], mut)
        o = out()
        res_check = (lambda o=o: True)
        run(cls, f"compare: run with {name}", ["compare", str(d), str(other), "--out", o],
            "error", keep=[d], check=res_check)
    run(cls, "compare: --out an existing run", ["compare", str(other), "--out",
        str(copy("target"))], "error", keep=[tmp / "cmp-target"])
    run(cls, "compare: --out a regular file", ["compare", str(other), "--out",
        str(tmp / "a-file")], "error", keep=[tmp / "a-file"])
    run(cls, "compare: --out inside a run", ["compare", str(other), "--out",
        str(other / "checkpoints" / "cmp")], "error", keep=[other])
    run(cls, "compare: --window 0", ["compare", str(other), "--out", out(), "--window", "0"],
        "error")
    run(cls, "compare: --window -3", ["compare", str(other), "--out", out(), "--window", "-3"],
        "error")
    d = copy("metrics-link")
    (d / "metrics.jsonl").unlink()
    (d / "metrics.jsonl").symlink_to("/etc/passwd")
    run(cls, "compare: metrics.jsonl -> /etc/passwd", ["compare", str(d), "--out", out()],
        "error")
    unrelated = tmp / "cmp-unrelated"
    unrelated.mkdir()
    (unrelated / "reward.png").write_bytes(b"user's own picture")
    run(cls, "compare: --out dir with the user's reward.png", ["compare", str(other), "--out",
        str(unrelated)], "error", keep=[unrelated])


# -- diagnose --url -------------------------------------------------------------------------
def silent_server():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    conns = []
    def accept():
        while True:
            try:
                conns.append(s.accept()[0])
            except OSError:
                return
    threading.Thread(target=accept, daemon=True).start()
    return s, conns


def garbage_server():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    def serve():
        while True:
            try:
                c = s.accept()[0]
            except OSError:
                return
            c.recv(65536)
            c.sendall(b"\x00\x01not http at all\r\n\r\n")
            c.close()
    threading.Thread(target=serve, daemon=True).start()
    return s


def probe_diagnose(tmp, other):
    cls = "diagnose"
    ckpt = str(other / "checkpoints" / "step_2")
    n = iter(range(1000))
    def out():
        return str(tmp / f"diag-out-{next(n)}")
    s, conns = silent_server()
    port = s.getsockname()[1]
    run(cls, "diagnose --url silent server, timeout 3", ["diagnose", ckpt, "--out", out(),
        "--url", f"http://127.0.0.1:{port}", "--set", "rollout.request_timeout_s=3",
        "--samples", "4"], "error", bound=90)
    g = garbage_server()
    run(cls, "diagnose --url non-HTTP answer", ["diagnose", ckpt, "--out", out(), "--url",
        f"http://127.0.0.1:{g.getsockname()[1]}", "--set", "rollout.request_timeout_s=3",
        "--samples", "4"], "error", bound=90)
    s.close()
    g.close()
    run(cls, "diagnose --url closed port", ["diagnose", ckpt, "--out", out(), "--url",
        f"http://127.0.0.1:{port}", "--samples", "4"], "error", bound=90)
    run(cls, "diagnose --url not-a-url", ["diagnose", ckpt, "--out", out(), "--url",
        "not a url"], "error")
    run(cls, "diagnose: missing checkpoint", ["diagnose", str(tmp / "nosuch"), "--out",
        out()], "error")
    run(cls, "diagnose --out the run dir", ["diagnose", ckpt, "--out", str(other),
        "--samples", "4"], "error", keep=[other])
    run(cls, "diagnose --samples 0", ["diagnose", ckpt, "--out", out(), "--samples", "0"],
        "error")


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="probe-round2-cli-"))
    template, other = tmp / "template", tmp / "other"
    for d in (template, other):
        res = lockstep(*train(d))
        if res.returncode:
            raise SystemExit(f"the template run failed: {res.stderr[-2000:]}")
    sections = [lambda: probe_runfiles(tmp, template, other), lambda: probe_nested(tmp, other),
                lambda: probe_history(tmp, template), lambda: probe_resume(tmp, template),
                lambda: probe_config(tmp), lambda: probe_rewards(tmp),
                lambda: probe_compare(tmp, template, other), lambda: probe_diagnose(tmp, other)]
    only = sys.argv[1:]
    for i, section in enumerate(sections):
        if not only or str(i) in only:
            section()
    by_class = Counter((r[0], r[2]) for r in ROWS)
    for c in dict.fromkeys(r[0] for r in ROWS):
        print(f"{c:20s} " + ", ".join(f"{v} {k}" for (cc, v), k in by_class.items() if cc == c))
    counts = Counter(r[2] for r in ROWS)
    print(f"\n{len(ROWS)} inputs: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    return 1 if counts["silent"] or counts["crash"] or counts["hang"] else 0


if __name__ == "__main__":
    sys.exit(main())
