"""The start of every lockstep process (`lockstep ...`, `python -m lockstep.launch.serve`).

Importing it sets the OpenMP wait policy before anything loads torch (OpenMP reads it once:
kernels/threads.py), so it is the first import of every entry point. `run` is the one exit
path: every user error ends the command with one line on stderr, `lockstep <cmd>: <what is
wrong>`, and exit status 2 (1 when a run failed on its way, e.g. diverged); `--debug` shows
the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from lockstep.kernels.threads import set_wait_policy

set_wait_policy()  # first, before any import loads torch

# Optional packages -> the extra that installs them.
EXTRAS = {"ray": "ray", "megatron": "megatron", "transformer_engine": "gpu", "sglang": "gpu",
          "flash_attn": "gpu", "hypothesis": "test", "transformers": "data",
          "pyarrow": "data", "math_verify": "data", "wandb": "wandb"}

AddParser = Callable[[argparse._SubParsersAction], argparse.ArgumentParser]


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the sub-command and --help."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def command_parser(commands: Sequence[AddParser]) -> argparse.ArgumentParser:
    """`lockstep` with the sub-commands each `add_parser` defines, all taking --debug."""
    parser = Parser(
        prog="lockstep",
        description="RL for MoE policies with routing replay (R2/R3) and rollout correction.",
    )
    parser.add_argument("--debug", action="store_true",
                        help="show Python tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for add_parser in commands:
        add_parser(sub)
    for p in sub.choices.values():
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show Python tracebacks instead of one-line errors")
    return parser


def describe_error(e: BaseException) -> tuple[str, int]:
    """(one-line message, exit status) for an exception that ended a command."""
    from lockstep.moe.checks import ConfigError
    from lockstep.moe.hf_lazy import CheckpointError
    from lockstep.trainer.observe.metrics import MetricsFileError
    from lockstep.trainer.observe.nonfinite import DivergenceError
    from lockstep.trainer.state.rundir import RunDirError

    if isinstance(e, ModuleNotFoundError) and e.name:
        root = e.name.split(".")[0]
        if root in EXTRAS:
            return (f"this needs the optional package '{root}', which is not installed: "
                    f"pip install 'lockstep[{EXTRAS[root]}]'"), 2
    one = " ".join(str(e).split())
    if isinstance(e, DivergenceError):
        return one, 1
    if isinstance(e, CheckpointError) and "could not write checkpoint" in str(e):
        return one, 1
    if isinstance(e, (ConfigError, CheckpointError, RunDirError,  # a bad config: ConfigError
                      MetricsFileError)):
        return one, 2
    if isinstance(e, OSError) and e.strerror:
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror}", 2
    msg = one or type(e).__name__
    if isinstance(e, (FileNotFoundError, ValueError)):
        return msg, 2
    from lockstep.rollout.types import FleetError
    from lockstep.trainer.actor.group import ActorGroupError
    if isinstance(e, (ActorGroupError, FleetError)):  # the cluster lost a rank, an engine, a node
        return f"{type(e).__name__}: {msg}", 1
    return f"{type(e).__name__}: {msg} (an internal error; rerun with --debug for the traceback)", 1


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse `argv` and run the sub-command it names; its errors become one line (module
    docstring) and an exit status."""
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"lockstep {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - every error becomes one line (unless --debug)
        if args.debug:
            raise
        msg, code = describe_error(e)
        print(f"lockstep {args.command}: {msg}", file=sys.stderr)
        return code
