"""`lockstep train CONFIG --out DIR [--set key=value ...] [--resume]`: run an RL experiment.

    lockstep train configs/toy_r3.yaml --out runs/toy
    lockstep train configs/toy_r3.yaml --out runs/toy --set replay.mode=off --set loop.steps=50
    lockstep train --resume --out runs/toy            # continue a killed run (config from DIR)
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
    p.add_argument("--out", required=True, help="run directory (metrics, checkpoints, plots)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. actor.lr=1e-4 (repeatable)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: keep torch's; OMP_NUM_THREADS applies)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from lockstep.trainer.loop import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    config = args.config
    if args.resume and config is None:
        config = out / "config.yaml"
    if config is None:
        print("lockstep train: a CONFIG file is required (or --resume with --out DIR)",
              file=sys.stderr)
        return 2
    try:
        cfg = load_config(config, args.overrides)
    except ExperimentConfigError as e:
        print(f"lockstep train: {e}", file=sys.stderr)
        return 2
    if not args.resume and (out / "metrics.jsonl").exists():
        print(f"lockstep train: {out} already holds a run; pass --resume to continue it or "
              f"choose another --out", file=sys.stderr)
        return 2
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    trainer = Trainer(cfg, out, resume=args.resume, log=log,
                      progress=not args.no_progress and sys.stderr.isatty())
    summary = trainer.run()
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":  # python -m lockstep.launch.train ... (before the CLI registers it)
    parser = argparse.ArgumentParser(prog="lockstep")
    add_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["train", *sys.argv[1:]])
    sys.exit(ns.run(ns))
