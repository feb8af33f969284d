"""`lockstep train CONFIG --out DIR [--set key=value ...] [--resume]`: run an RL experiment.

    lockstep train configs/toy_r3.yaml --out runs/toy
    lockstep train configs/toy_r3.yaml --out runs/toy --set replay.mode=off --set loop.steps=50
    lockstep train --resume --out runs/toy            # continue a killed run (config from DIR)

Prints a JSON summary at the end (also written to DIR/summary.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lockstep.trainer.config import ExperimentConfigError, load_config


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
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: keep torch's; OMP_NUM_THREADS applies)")
    p.set_defaults(run=run)
    return p


def _fail(msg: str) -> int:
    print(f"lockstep train: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    import torch

    from lockstep.trainer.loop import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    config = args.config
    if config is None and not (args.resume and args.out):
        return _fail("a CONFIG file is required (or --resume --out DIR, which reads DIR/config.yaml)")
    if config is None:
        config = Path(args.out) / "config.yaml"
    try:
        cfg = load_config(config, args.overrides)
    except ExperimentConfigError as e:
        return _fail(str(e))
    out = Path(args.out or cfg.loop.out_dir)
    if not args.resume and (out / "metrics.jsonl").exists():
        return _fail(f"{out} already holds a run; pass --resume to continue it or choose "
                     f"another --out")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    trainer = Trainer(cfg, out, resume=args.resume, log=log,
                      progress=not args.no_progress and sys.stderr.isatty())
    print(json.dumps(trainer.run()))
    return 0
