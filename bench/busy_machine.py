"""Warm-start steps (and optionally the README main job) on a quiet and on a busy machine, with
the OpenMP wait policy of lockstep before issue 22 (the runtime's default: waiting threads spin)
and after it (`kernels/threads.py`: PASSIVE), in the same run.

    python bench/busy_machine.py                       # 100 warm-start steps, 4 cases
    python bench/busy_machine.py --steps 30 --busy 2   # shorter
    python bench/busy_machine.py --main-job            # also `lockstep train configs/toy_r3.yaml`

"Busy" = `--busy` processes running a Python busy loop for the whole case (other jobs on the
box). Every case is a fresh process with torch's default thread count (OMP_NUM_THREADS
removed from its environment, as a user's shell has it): `old` imports torch as lockstep did,
`new` calls `set_wait_policy()` first, as `lockstep ...` does now; `new-1t` also runs one
thread (as `--threads 1` / `OMP_NUM_THREADS=1` would; a different thread count gives other
last bits, so lockstep does not choose it for you). Prints seconds per case and
the ratios busy/quiet per policy and old/new when busy (target: new busy within 3x of quiet).
The main job runs with an empty warm-start cache of its own (`warmstart.cache_dir` in a temp
folder) and compares summary.json of old and new (every key but time/*).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARM = """
import sys, time
if sys.argv[1].startswith("new"):
    from lockstep.kernels.threads import set_wait_policy
    set_wait_policy()
import torch
from lockstep.moe.model import MoEModel
from lockstep.rollout.tasks import Task
from lockstep.trainer.config.load import load_config
from lockstep.trainer.driver.warmstart import warm_start
steps, cache = sys.argv[2], sys.argv[4]
cfg = load_config(sys.argv[3], [f"warmstart.max_steps={steps}", "warmstart.target_accuracy=1.0",
                                f"warmstart.eval_every={steps}", f"warmstart.cache_dir={cache}"])
torch.manual_seed(cfg.loop.seed)
model = MoEModel(cfg.model)
t0 = time.perf_counter()
warm_start(model, Task(cfg.task), cfg.warmstart, cfg.loop.seed, f"bench-{time.time_ns()}",
           log=lambda m: None)
print(time.perf_counter() - t0)
"""


def child_env(policy: str, cli: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    if policy == "old" and cli:  # the CLI sets PASSIVE when unset; "" is the runtime's default
        env["OMP_WAIT_POLICY"] = ""
    if policy == "new-1t":  # and one thread (--threads 1): other numbers than the default count
        env["OMP_NUM_THREADS"] = "1"
    return env


def with_busy(n: int, fn):
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        return fn()
    finally:
        for p in loops:
            p.kill()
            p.wait()


def warm_case(policy: str, steps: int, cache: str) -> float:
    out = subprocess.run([sys.executable, "-c", WARM, policy, str(steps),
                          str(ROOT / "configs" / "toy_r3.yaml"), cache],
                         env=child_env(policy), capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main_job(policy: str, tmp: Path) -> tuple[float, dict]:
    out = tmp / f"main_{policy}_{time.time_ns()}"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lockstep.launch.cli", "train",
                    str(ROOT / "configs" / "toy_r3.yaml"), "--out", str(out), "--no-progress",
                    "--set", f"warmstart.cache_dir={tmp / ('cache_' + out.name)}"],
                   env=child_env(policy, cli=True), capture_output=True, text=True, check=True,
                   cwd=tmp)
    summary = json.loads((out / "summary.json").read_text())
    return time.perf_counter() - t0, {k: v for k, v in summary.items() if not k.startswith("time/")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="warm-start steps per case")
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes when busy")
    ap.add_argument("--main-job", action="store_true", help="also the README main job")
    ap.add_argument("--main-policies", default="old,new",
                    help="with --main-job: the policies to run it with (the old one busy takes "
                         "~15 min on 2 cores)")
    ap.add_argument("--baseline", metavar="SUMMARY_JSON",
                    help="with --main-job: also compare each summary.json with this one")
    ap.add_argument("--no-warm", action="store_true", help="skip the warm-start cases")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        t = {}
        for load in () if args.no_warm else ("quiet", "busy"):
            for policy in ("old", "new", "new-1t"):
                run = lambda: warm_case(policy, args.steps, str(tmp / "cache"))  # noqa: E731
                t[load, policy] = run() if load == "quiet" else with_busy(args.busy, run)
                loops = args.busy if load == "busy" else 0
                print(f"warm start {args.steps} steps, {load:5} ({loops} busy loops), "
                      f"{policy:6} policy: {t[load, policy]:7.1f} s", flush=True)
        if t:
            print(f"busy/quiet: old {t['busy', 'old'] / t['quiet', 'old']:.1f}x, new "
                  f"{t['busy', 'new'] / t['quiet', 'new']:.1f}x (target <= 3x); busy old/new "
                  f"{t['busy', 'old'] / t['busy', 'new']:.1f}x; quiet old/new "
                  f"{t['quiet', 'old'] / t['quiet', 'new']:.2f}x; new-1t (PASSIVE, 1 thread) "
                  f"busy/quiet {t['busy', 'new-1t'] / t['quiet', 'new-1t']:.1f}x, busy "
                  f"{t['busy', 'new-1t']:.1f} s")
        if not args.main_job:
            return
        m, s = {}, {}
        policies = args.main_policies.split(",")
        for load, policy in [(load, p) for load in ("quiet", "busy") for p in policies]:
            run = lambda: main_job(policy, tmp)  # noqa: E731
            got = run() if load == "quiet" else with_busy(args.busy, run)
            m[load, policy], s[load, policy] = got
            print(f"main job, {load:5}, {policy} policy: {m[load, policy]:7.1f} s", flush=True)
        for p in policies:
            print(f"main job busy/quiet, {p} policy: {m['busy', p] / m['quiet', p]:.1f}x")
        if len(policies) == 2:
            same = s["quiet", "old"] == s["quiet", "new"] == s["busy", "old"] == s["busy", "new"]
            print(f"main job busy old/new: {m['busy', 'old'] / m['busy', 'new']:.1f}x; "
                  f"summary.json old == new (all but time/*): {same}")
        if args.baseline:
            want = {k: v for k, v in json.loads(Path(args.baseline).read_text()).items()
                    if not k.startswith("time/")}
            print("summary.json == baseline (all but time/*): "
                  + ", ".join(f"{k[0]} {k[1]} {v == want}" for k, v in s.items()))


if __name__ == "__main__":
    main()
