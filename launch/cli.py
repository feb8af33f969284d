"""The `lockstep` command line: one sub-command per job, each defined in its own module.

The process-wide start (the OpenMP wait policy, one-line errors and exit statuses) is
launch/entry.py, shared with `python -m lockstep.launch.serve`.
"""

from __future__ import annotations

import sys

from lockstep.launch import entry  # first: sets the wait policy before torch loads

from lockstep.launch import compare, diagnose, example, export, plan, serve, train  # noqa: E402

COMMANDS = (train.add_parser, serve.add_parser, compare.add_parser, diagnose.add_parser,
            example.add_parser, plan.add_parser, export.add_parser)


def main(argv: list[str] | None = None) -> int:
    return entry.run(entry.command_parser(COMMANDS), argv)


if __name__ == "__main__":
    sys.exit(main())
