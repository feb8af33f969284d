"""Warm-start steps (and optionally the README main job) on a quiet and on a busy machine, with
lockstep's OpenMP wait policy (`kernels/threads.py`: chosen from the run queue at start) against
fixed policies, in the same run.

    python bench/busy_machine.py                       # 100 warm-start steps, 5 runs a case
    python bench/busy_machine.py --steps 30 --runs 3   # shorter
    python bench/busy_machine.py --spin-busy           # also the runtime's default when busy (slow)
    python bench/busy_machine.py --main-job            # also `lockstep train configs/toy_r3.yaml`

Policies: `lockstep` calls `set_wait_policy()` in the child before torch loads, as every
`lockstep ...` process does (quiet: GOMP_SPINCOUNT=10000, busy: PASSIVE); `active` and `passive`
set OMP_WAIT_POLICY (passive was lockstep's fixed default before); `spin` leaves the runtime's
default (~300k spins; lockstep before issue 22). "Busy" = `--busy` processes running a Python
busy loop for the whole case. Every case is a fresh process with torch's default thread count
(OMP_NUM_THREADS removed from its environment, as a user's shell has it). Prints the median
seconds per case and the targets: quiet lockstep/active <= 1.1x, busy/quiet (lockstep) <= 2x.
With `--busy 2` on a 2-core box, the two loops hold half the CPU, so ~2x is the fair share.
The main job runs with an empty warm-start cache of its own and compares summary.json across
policies (every key but time/*: the wait policy changes no number).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARM = """
import sys, time
if sys.argv[1] == "lockstep":
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
FIXED = {"active": {"OMP_WAIT_POLICY": "ACTIVE"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
         # the CLI chooses when neither is set; a set-but-empty variable is the runtime's default
         "spin": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": ""}, "lockstep": {}}


def child_env(policy: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return {**env, **FIXED[policy]}


def with_busy(n: int, fn):
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.3)  # spinning before the case starts (and samples the run queue)
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
                   env=child_env(policy), capture_output=True, text=True, check=True, cwd=tmp)
    summary = json.loads((out / "summary.json").read_text())
    return time.perf_counter() - t0, {k: v for k, v in summary.items() if not k.startswith("time/")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="warm-start steps per case")
    ap.add_argument("--runs", type=int, default=5, help="runs per case (the median is printed)")
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes when busy")
    ap.add_argument("--spin-busy", action="store_true",
                    help="also the runtime's default policy when busy (~40x slower)")
    ap.add_argument("--main-job", action="store_true", help="also the README main job")
    ap.add_argument("--main-policies", default="lockstep,active",
                    help="with --main-job: the policies to run it with, quiet and busy")
    ap.add_argument("--baseline", metavar="SUMMARY_JSON",
                    help="with --main-job: also compare each summary.json with this one")
    ap.add_argument("--no-warm", action="store_true", help="skip the warm-start cases")
    args = ap.parse_args()
    cases = [("quiet", p) for p in ("active", "lockstep", "passive", "spin")]
    cases += [("busy", p) for p in ("lockstep", "passive") + (("spin",) if args.spin_busy else ())]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        runs: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
        for i in range(0 if args.no_warm else args.runs):  # interleaved: drift hits every case
            for load, policy in cases:
                run = lambda: warm_case(policy, args.steps, str(tmp / "cache"))  # noqa: E731
                runs[load, policy].append(run() if load == "quiet" else with_busy(args.busy, run))
            print(f"run {i + 1}/{args.runs}: " + ", ".join(
                f"{load} {p} {runs[load, p][-1]:.1f} s" for load, p in cases), flush=True)
        if not args.no_warm:
            t = {c: statistics.median(v) for c, v in runs.items()}
            for (load, policy), s in t.items():
                print(f"warm start {args.steps} steps, {load:5} ({args.busy if load == 'busy' else 0}"
                      f" busy loops), {policy:8} policy: median {s:6.2f} s of {args.runs}")
            print(f"quiet lockstep/active {t['quiet', 'lockstep'] / t['quiet', 'active']:.2f}x "
                  f"(target <= 1.1x); busy/quiet lockstep "
                  f"{t['busy', 'lockstep'] / t['quiet', 'lockstep']:.2f}x (target <= 2x); quiet "
                  f"passive/active {t['quiet', 'passive'] / t['quiet', 'active']:.2f}x (the fixed "
                  f"PASSIVE default's cost); busy passive/lockstep "
                  f"{t['busy', 'passive'] / t['busy', 'lockstep']:.2f}x"
                  + (f"; busy spin/lockstep {t['busy', 'spin'] / t['busy', 'lockstep']:.1f}x"
                     if args.spin_busy else ""))
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
            print(f"main job busy/quiet, {p} policy: {m['busy', p] / m['quiet', p]:.2f}x")
        same = all(v == next(iter(s.values())) for v in s.values())
        print(f"summary.json equal across policies and loads (all but time/*): {same}")
        if args.baseline:
            want = {k: v for k, v in json.loads(Path(args.baseline).read_text()).items()
                    if not k.startswith("time/")}
            print("summary.json == baseline (all but time/*): "
                  + ", ".join(f"{k[0]} {k[1]} {v == want}" for k, v in s.items()))


if __name__ == "__main__":
    main()
