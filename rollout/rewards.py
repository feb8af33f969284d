"""Reward functions for prompt data sets: verl's `compute_score` signature, run in worker
processes with a per-call timeout, so a reward that raises, hangs or returns garbage costs one
sample's score (`RewardConfig.error_score`) and a count in the metrics, never the run.

    reward:
      function: rewards/my_math.py:compute_score    # or a built-in: exact_match, math_verify
      timeout_s: 5

The function is called as verl's reward managers call it, with keywords:
`compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)`, and returns
a number in [-SCORE_LIMIT, SCORE_LIMIT] (bool counts as 0/1) or a dict with such a number under
"score" (other keys are ignored). Anything else (a NaN, 1e300, a string) is a `bad_value` error
naming the value: a score that large would overflow the float32 rewards to inf.

Workers are fresh `python -m lockstep.rollout.workers` processes (no fork of a process holding
torch threads, no re-import of the caller's main module) that load the function once and take
one call at a time over a socket; a call past its deadline gets its worker killed and replaced.
Error kinds: `raised`, `timeout`, `bad_value`, `crashed` (the worker died).

The function file is imported only in the workers, never in the caller's process, and each
worker's start is bounded by `reward.import_timeout_s`: a file that raises, calls `sys.exit`,
kills its process or hangs at import is one `RewardFunctionError` (a `ValueError`: a one-line
error with exit status 2 from the CLI), before the run writes anything.

This module imports only the standard library, so a worker starts in well under a second.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

BUILTINS = ("exact_match", "math_verify")
ERROR_KINDS = ("raised", "timeout", "bad_value", "crashed")
SCORE_LIMIT = 1e6  # |score| bound: larger ones are bad_value, not an inf reward


class RewardFunctionError(ValueError):
    """A reward function that cannot be loaded (missing callable, import raised, exited or
    hung)."""


@dataclass
class RewardConfig:
    """How data-set samples are scored (the synthetic tasks keep their own exact-match reward)."""

    function: str = "exact_match"
    """`path/to/file.py:name` (verl's compute_score signature; a relative path is taken from
    the working directory), or a built-in: `exact_match` (stripped response == ground truth),
    `math_verify` (math answer equivalence with the `math-verify` package, extra 'data')."""
    timeout_s: float = 10.0
    """Seconds one call may take, in (0, 3600]; a slower call is killed and scored error_score."""
    error_score: float = 0.0
    """Score of a sample whose reward call raised, timed out or returned garbage."""
    num_workers: int = 2
    """Reward worker processes, in [1, 256]."""
    import_timeout_s: float = field(default=120.0, metadata={"saved": "non_default"})
    """Seconds a worker may take to start and import the function file, in (0, 3600]."""

    def __post_init__(self) -> None:
        if not (isinstance(self.function, str) and (self.function in BUILTINS
                                                    or ":" in self.function)):
            raise ValueError(f"reward.function={self.function!r} must be 'path/to/file.py:name' "
                             f"or one of the built-ins {list(BUILTINS)}")
        if not 0 < self.timeout_s <= 3600:
            raise ValueError(f"reward.timeout_s={self.timeout_s!r} is outside (0, 3600]")
        if not math.isfinite(self.error_score):
            raise ValueError(f"reward.error_score={self.error_score!r} must be finite")
        if not 1 <= self.num_workers <= 256:
            raise ValueError(f"reward.num_workers={self.num_workers!r} is outside [1, 256]")
        if not 0 < self.import_timeout_s <= 3600:
            raise ValueError(f"reward.import_timeout_s={self.import_timeout_s!r} is outside "
                             f"(0, 3600]")
        if not abs(self.error_score) <= SCORE_LIMIT:
            raise ValueError(f"reward.error_score={self.error_score!r} is outside "
                             f"[-{SCORE_LIMIT:g}, {SCORE_LIMIT:g}]")


# -- built-ins -----------------------------------------------------------------------------
def exact_match(data_source: str, solution_str: str, ground_truth: Any,
                extra_info: dict | None = None) -> float:
    """1.0 iff the response, stripped of surrounding whitespace, equals the ground truth."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def math_verify(data_source: str, solution_str: str, ground_truth: Any,
                extra_info: dict | None = None) -> float:
    """1.0 iff math-verify finds the response's final answer equal to the ground truth
    (LaTeX or plain expressions; `\\boxed{}` is preferred when present)."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("reward.function=math_verify needs the 'math-verify' package "
                          "(pip install 'lockstep[data]')") from None
    gold = parse(str(ground_truth))
    answer = parse(solution_str)
    return 1.0 if gold and answer and verify(gold, answer) else 0.0


def function_file(spec: str) -> Path | None:
    """The file of a `path/to/file.py:name` spec (checked to exist), None for a built-in."""
    if spec in BUILTINS:
        return None
    file = Path(spec.rpartition(":")[0]).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"reward.function={spec!r}: no file {file}")
    return file


def load_function(spec: str) -> Callable[..., Any]:
    """The callable named by `spec` (a built-in name or `path/to/file.py:name`). Imports the
    file into this process: the workers call it, `RewardPool` never does."""
    file = function_file(spec)
    if file is None:
        return globals()[spec]
    name = spec.rpartition(":")[2]
    module = import_file(file, f"reward.function={spec!r}")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardFunctionError(f"reward.function={spec!r}: {file} has no callable {name!r}")
    return fn


def import_file(file: Path, what: str):
    """Import a user's Python file as a module; whatever its import does (raise, sys.exit)
    is one RewardFunctionError starting with `what` (the config key and value)."""
    mod_spec = importlib.util.spec_from_file_location(f"lockstep_user_{file.stem}", file)
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
    except SystemExit as e:  # a scheduler would read exit 0 as success
        raise RewardFunctionError(f"{what}: importing {file} called "
                                  f"sys.exit({e.code!r})") from None
    except BaseException as e:  # noqa: BLE001 - the file's import code may raise anything
        raise RewardFunctionError(f"{what}: importing {file} failed: "
                                  f"{type(e).__name__}: {e}") from None
    return module


def check_score(out: Any) -> float:
    """The float score of a compute_score result; ValueError for anything else."""
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"dict without a 'score' key (keys {sorted(out)[:8]})")
        out = out["score"]
    if isinstance(out, bool):
        return float(out)
    if not isinstance(out, (int, float)) or isinstance(out, complex):
        raise ValueError(f"returned {type(out).__name__} {str(out)[:80]!r}, not a number")
    if isinstance(out, int) and not -SCORE_LIMIT <= out <= SCORE_LIMIT:  # float(10**400) overflows
        raise ValueError(f"returned an integer of {out.bit_length()} bits, outside the score "
                         f"range [-{SCORE_LIMIT:g}, {SCORE_LIMIT:g}]")
    if not math.isfinite(out):
        raise ValueError(f"returned the non-finite score {out!r}")
    if not abs(out) <= SCORE_LIMIT:
        raise ValueError(f"returned {out!r}, outside the score range [-{SCORE_LIMIT:g}, "
                         f"{SCORE_LIMIT:g}]")
    return float(out)


@dataclass
class RewardCall:
    """One sample to score (verl's compute_score keywords)."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)


@dataclass
class Scores:
    """Scores of a list of calls, with error counts by kind and the first messages."""

    scores: list[float]
    errors: Counter
    messages: list[str]

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        m = {f"{prefix}/errors": float(sum(self.errors.values()))}
        m.update({f"{prefix}/errors_{k}": float(self.errors[k]) for k in ERROR_KINDS})
        return m


class RewardPool:
    """`num_workers` processes running one reward function, each call under a deadline.
    `role="env"`: the same processes run an environment file's functions
    (rollout/env.py `EnvPool`; `cfg` is then the env section, whose `function` is the file)."""

    def __init__(self, cfg: RewardConfig, log: Callable[[str], None] = print,
                 max_logged_errors: int = 5, role: str = "reward"):
        if role == "reward":
            function_file(cfg.function)  # a missing file fails here; its import only in a worker
        self.cfg, self.log, self.role = cfg, log, role
        self.max_logged, self.logged = max_logged_errors, Counter()
        self.first_errors: dict[str, list[str]] = {}  # kind -> its first max_logged messages
        self.calls = 0  # ids of the calls sent (a reply must carry the id of its call)
        self.workers: list[tuple[subprocess.Popen, Connection]] = []
        try:
            for _ in range(cfg.num_workers):
                self.workers.append(self._start())
        except BaseException:
            self.close()
            raise

    def _start(self) -> tuple[subprocess.Popen, Connection]:
        ours, theirs = socket.socketpair()
        with theirs:
            proc = subprocess.Popen(
                [sys.executable, "-m", "lockstep.rollout.workers", str(theirs.fileno()),
                 self.cfg.function, self.role], pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL, stdout=2, start_new_session=True)
        conn = Connection(ours.detach())
        # the deadline of a call starts once the worker has loaded the function
        limit = self.cfg.import_timeout_s
        try:
            msg = conn.recv() if conn.poll(limit) else "timeout"
        except (EOFError, OSError):
            msg = "died"
        if msg == "ready":
            return proc, conn
        code = _kill(proc)
        conn.close()
        spec, sec = self.cfg.function, "reward" if self.role == "reward" else "rollout.env"
        key = "function" if self.role == "reward" else "file"
        if isinstance(msg, tuple) and msg[0] == "error":
            raise RewardFunctionError(msg[1])
        if msg == "timeout":
            raise RewardFunctionError(f"{sec}.{key}={spec!r}: its worker did not start "
                                      f"(import the file) within {sec}.import_timeout_s="
                                      f"{limit:g}")
        raise RewardFunctionError(f"{sec}.{key}={spec!r}: its worker exited (code {code}) "
                                  f"while importing the file")

    def _replace(self, w: int) -> None:
        proc, conn = self.workers[w]
        _kill(proc)
        conn.close()
        self.workers[w] = self._start()

    def score(self, calls: Sequence[RewardCall]) -> Scores:
        """Score every call (order kept); errors become `error_score` and are counted."""
        return self.run([vars(c) for c in calls],
                        [f"reward call for sample {i} ({c.data_source!r})"
                         for i, c in enumerate(calls)])

    def run(self, payloads: Sequence[dict], labels: Sequence[str]) -> Scores:
        """Call the worker function with each payload's keywords (order kept): checked
        results, or `error_score` and a counted error (its message starts with the label)."""
        scores: list[Any] = [self.cfg.error_score] * len(payloads)
        errors: Counter = Counter()
        messages: list[str] = []
        todo = list(range(len(payloads)))[::-1]
        busy: dict[int, tuple[int, int, float]] = {}  # worker -> (index, call id, deadline)

        def fail(i: int, kind: str, msg: str) -> None:
            errors[kind] += 1
            text = f"{labels[i]}: {kind}: {msg}"
            messages.append(text)
            if self.logged[kind] < self.max_logged:
                self.logged[kind] += 1
                self.first_errors.setdefault(kind, []).append(text)
                more = (f"; further {kind} errors of the {self.role} workers are only counted "
                        f"in the metrics" if self.logged[kind] == self.max_logged else "")
                self.log(text + more)

        while todo or busy:
            for w in range(len(self.workers)):
                if w not in busy and todo:
                    i = todo.pop()
                    self.calls += 1
                    try:
                        self.workers[w][1].send((self.calls, payloads[i]))
                    except Exception as e:  # unpicklable inputs, or a dead worker
                        fail(i, "crashed", f"could not send the call: {type(e).__name__}: {e}")
                        self._replace(w)
                        continue
                    busy[w] = (i, self.calls, time.monotonic() + self.cfg.timeout_s)
            if not busy:
                continue
            now = time.monotonic()
            conns = {self.workers[w][1]: w for w in busy}
            ready = wait(list(conns), timeout=max(0.0, min(d for *_, d in busy.values()) - now))
            for conn in ready:
                w = conns[conn]
                i, call, _ = busy.pop(w)
                try:
                    answered, kind, value = conn.recv()
                except (EOFError, OSError):
                    try:  # a worker whose socket closed exits by itself, saying why (its code)
                        self.workers[w][0].wait(2)
                    except subprocess.TimeoutExpired:
                        pass
                    code = _kill(self.workers[w][0])
                    fail(i, "crashed", f"worker exited (code {code})" + (
                        "; did the function close its file descriptors?" if code == 3 else ""))
                    self._replace(w)
                    continue
                if answered != call:  # never taken for this call's answer
                    fail(i, "crashed", f"the worker answered call {answered}, not the call in "
                                       f"flight ({call}): did the function fork?")
                    self._replace(w)
                elif kind == "ok":
                    scores[i] = value
                else:
                    fail(i, kind, value)
            now = time.monotonic()
            for w, (i, _, deadline) in list(busy.items()):
                if now >= deadline:
                    del busy[w]
                    fail(i, "timeout", f"no result within "
                                          f"{'reward' if self.role == 'reward' else 'rollout.env'}"
                                          f".timeout_s={self.cfg.timeout_s}")
                    self._replace(w)
        return Scores(scores, errors, messages)

    def close(self) -> None:
        for proc, conn in self.workers:
            try:
                conn.send(None)
            except OSError:
                pass
            conn.close()
        for proc, _ in self.workers:
            try:
                proc.wait(2)
            except subprocess.TimeoutExpired:
                pass
            _kill(proc)  # and whatever the user's code started in its group
        self.workers = []

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _kill(proc: subprocess.Popen) -> int:
    """End a worker and its process group (what the user's code started); its exit code."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.wait()
