"""The agent toy's tool (`rollout.env.file: calculator`): a calculator on the character
vocabulary, in the tool form of rollout/env.py.

A call is the policy's turn up to its `>` (for example `47*8>`): two non-negative integers
joined by `*` or `+`; the answer is the value followed by `=` (`376=`), after which the policy
writes its final answer and `<eos>`. Anything else raises, which ends the trajectory with a
counted tool error. Standard library only (the env workers import it by path).
"""

from __future__ import annotations

import re

CALL = re.compile(r"^(\d{1,6})([*+])(\d{1,6})>$")


def evaluate(call: str) -> str:
    """`47*8>` -> `376=`; ValueError for anything that is not one call."""
    m = CALL.match(call)
    if m is None:
        raise ValueError(f"not a calculator call: {call[:40]!r} (expected e.g. 47*8>)")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return f"{a * b if op == '*' else a + b}="


def tool(call: str) -> str:
    return evaluate(call)
