"""The `lockstep` command line: one sub-command per job, each defined in its own module."""

from __future__ import annotations

import argparse
import sys

from lockstep.launch import compare, diagnose, serve, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lockstep",
        description="RL for MoE policies with routing replay (R2/R3) and rollout correction.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Sub-commands, each defined in its own module.
    train.add_parser(sub)
    serve.add_parser(sub)
    compare.add_parser(sub)
    diagnose.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0 if args.command is None else 2
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
