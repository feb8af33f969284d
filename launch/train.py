"""`lockstep train CONFIG --out DIR [--set key=value ...] [--resume]`: run an RL experiment.

    lockstep train configs/toy_r3.yaml --out runs/toy
    lockstep train configs/toy_r3.yaml --out runs/toy --set replay.mode=off --set loop.steps=50
    lockstep train --resume --out runs/toy            # continue a killed run (config from DIR)
    lockstep train --resume --out runs/toy --set loop.steps=300   # extend it (config.yaml too)

Prints a JSON summary at the end (also written to DIR/summary.json). One process per run
directory (a lock names the holder's PID); files lockstep did not write are never overwritten.
Without a terminal, progress is logged as one line every --log-every steps. The http backend's
API key comes from LOCKSTEP_API_KEY or rollout.api_key_file, never from the config or argv.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lockstep.trainer.config.load import load_config, save_config


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="run an RL experiment (GRPO with routing replay)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="experiment YAML (default with --resume: DIR/config.yaml)")
    p.add_argument("--out", help="run directory (metrics, checkpoints, plots); default loop.out_dir")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. actor.lr=1e-4 (repeatable)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-every", type=int, default=10, metavar="N",
                   help="without a progress bar (stderr not a terminal, or --no-progress), log a "
                        "progress line every N steps (0 = never; default 10)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: keep torch's; OMP_NUM_THREADS applies); "
                        "the OpenMP wait policy follows the load at start unless "
                        "OMP_WAIT_POLICY or GOMP_SPINCOUNT is set")
    p.set_defaults(run=run)
    return p


def _fail(msg: str) -> int:
    print(f"lockstep train: {msg}", file=sys.stderr)
    return 2


def _nothing_to_run(out: Path, cfg) -> str | None:
    """Why `--resume` with this config would run no step (nothing is written then), or None.
    A newest checkpoint that fails verification is not counted: the resume redoes it; one
    written under another config is not either: the Trainer refuses that with the reason."""
    from lockstep.moe.hf_lazy import CheckpointError
    from lockstep.trainer.loop import run_hash
    from lockstep.trainer.state.checkpoint import list_checkpoints, STATE_FILE, verify_manifest

    ckpts, steps = list_checkpoints(out), cfg.loop.steps
    if not ckpts:
        return None
    try:
        written_by = json.loads((ckpts[-1] / STATE_FILE).read_text())["config_hash"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # an unreadable state: the resume names the problem
    if written_by not in (run_hash(cfg), run_hash(cfg, layout=True)):
        return None
    done = int(ckpts[-1].name[5:])
    if steps > done:
        return None
    if steps < done:
        return (f"--resume: {out} is already at step {done} ({ckpts[-1].name}) and "
                f"loop.steps={steps} asks for fewer; nothing was run or changed (raise "
                f"loop.steps above {done} to continue it)")
    try:
        verify_manifest(ckpts[-1])
    except CheckpointError:
        return None
    return (f"--resume: {out} is complete (step {done} of loop.steps={steps}); nothing to do, "
            f"nothing changed (raise loop.steps to continue it)")


def run(args: argparse.Namespace) -> int:
    if args.threads is not None and not 1 <= args.threads <= 4096:
        return _fail(f"--threads={args.threads} must be in [1, 4096]")
    if args.log_every < 0:
        return _fail(f"--log-every={args.log_every} must be >= 0")
    config = args.config
    if config is None and not (args.resume and args.out):
        return _fail("a CONFIG file is required (or --resume --out DIR, which reads DIR/config.yaml)")
    if config is None:
        config = Path(args.out) / "config.yaml"
        if not Path(args.out).is_dir():
            return _fail(f"--resume: {args.out} does not exist")
        if not config.exists():
            return _fail(f"--resume: {args.out} holds no lockstep run (no config.yaml)")
    cfg = load_config(config, args.overrides)  # errors: one line via lockstep.launch.cli
    from lockstep.launch.plan import check_devices
    check_devices(cfg, str(config))  # a GPU layout on a machine without those GPUs: refuse now
    if not args.resume and cfg.cluster.actor_ranks == 1:  # the policy is built in this process
        from lockstep.trainer.actor.build import check_policy_fits
        check_policy_fits(cfg)  # a size typo: "would need N GB", before any allocation

    import torch

    from lockstep.trainer.loop import Trainer
    from lockstep.trainer.state.rundir import claim_run_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    from lockstep.kernels.threads import describe
    print(describe(), file=sys.stderr, flush=True)
    out = Path(args.out or cfg.loop.out_dir)
    if args.resume and (done := _nothing_to_run(out, cfg)):
        print(f"lockstep train: {done}", file=sys.stderr)
        return 0 if "nothing to do" in done else 2
    with claim_run_dir(out, args.resume):  # held (and the PID shown) until the run ends

        def log(msg: str) -> None:
            print(msg, file=sys.stderr, flush=True)

        bar = not args.no_progress and sys.stderr.isatty()
        with Trainer(cfg, out, resume=args.resume, log=log, progress=bar) as trainer:
            if args.resume:  # the run now goes on with these settings (e.g. a new loop.steps)
                save_config(trainer.cfg, out / "config.yaml")
            if not bar:
                trainer.metrics.log_lines(log, args.log_every)
            summary = trainer.run()
        print(json.dumps(summary))
    return 0
