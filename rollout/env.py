"""Environments of multi-turn (agentic) rollouts: the protocol a user's file implements, its
checks, and the worker pool that runs it (the reward workers of rollout/rewards.py: one loader,
one deadline per call, one error count).

    rollout:
      env:
        file: envs/my_env.py       # or the built-in `calculator` (the agent toy's tool)
        max_turns: 4

The file is verifiers' MultiTurnEnv in functional form: everything a trajectory remembers
travels in `state` (a JSON-able dict), so any worker can serve any call and a worker killed on
a timeout loses nothing but that call.

    def reset(problem: dict) -> dict:          # optional; the trajectory's first state
        return {"tries": 0}

    def step(state: dict, turn: dict) -> dict: # after every policy turn
        return {"observation": "...",          # str | list[int] | [{"role", "content"}, ...]
                "reward": 0.0,                 # optional (default 0), summed over the turns
                "done": False,                 # optional (default False)
                "state": state}                # optional (default: unchanged)

`problem`: {"prompt_ids", "ground_truth", "data_source", "extra_info"} of the data row (or of
the synthetic task's problem). `turn`: {"text", "ids", "finish", "index"}: the policy's turn as
text and as the sampled ids, how it ended ("eos", "stop": one of `stop`'s markers, "length")
and its index from 0. A text observation is tokenised as it is, or, with `observation_role`,
wrapped as one message of that role; messages go through the model folder's chat template
(rollout/agent.py). A list of ints is used as those token ids.

Tool form (the common case): instead of `step`, the file defines `tool(call: str) -> str`. A
turn that ends with EOS ends the trajectory; any other turn is the call (its text) and the
tool's answer is the observation.

A function that raises, hangs past `timeout_s`, returns None, a non-finite reward, something
that is not one of the forms above or an observation past `max_observation_chars` ends that
trajectory with a counted error (`agent/errors_<kind>`) and the score `error_score`; so does an
observation that does not fit the context. The run goes on.

This module imports only the standard library (a worker starts in well under a second).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockstep.rollout.rewards import (RewardFunctionError, RewardPool, Scores, check_score,
                                      import_file)

BUILTIN_ENVS = {"calculator": Path(__file__).with_name("calculator_env.py")}
ROLES = ("tool", "user")
MAX_TURNS = 64  # later turns' sampling seeds are (seed + j) * MAX_TURNS + turn
STEP_KEYS = ("observation", "reward", "done", "state")


@dataclass
class EnvConfig:
    """A multi-turn environment (rollout.env): its file and how its trajectories run."""

    file: str = "calculator"
    """`path/to/env.py` (relative to the working directory) defining `step` (and optionally
    `reset`) or `tool`; or a built-in: `calculator` (the agent toy's tool)."""
    max_turns: int = 4
    """Policy turns per trajectory, in [1, 64]; the trajectory ends after the last one."""
    stop: list[str] = field(default_factory=list)
    """Markers (each one token) that end a policy turn besides EOS, e.g. a tool call's
    closing tag; they stay in the turn's tokens."""
    observation_role: str | None = None
    """Wrap a text observation as a message of this role (`tool` or `user`) and render it with
    the chat template; None: tokenise the text as it is."""
    timeout_s: float = 10.0
    """Seconds one reset/step/tool call may take, in (0, 3600]; a slower call is killed."""
    error_score: float = 0.0
    """Score of a trajectory whose environment failed (raised, timed out, returned garbage) or
    whose observation did not fit the context."""
    num_workers: int = 2
    """Environment worker processes, in [1, 256]."""
    import_timeout_s: float = 120.0
    """Seconds a worker may take to start and import the file, in (0, 3600]."""
    max_observation_chars: int = 1 << 16
    """Longest text observation accepted, in [1, 2^24] characters (longer: a bad_value error)."""

    def __post_init__(self) -> None:
        if not isinstance(self.file, str) or not self.file:
            raise ValueError(f"rollout.env.file={self.file!r} must be a path to a .py file or "
                             f"one of the built-ins {sorted(BUILTIN_ENVS)}")
        if not (isinstance(self.max_turns, int) and 1 <= self.max_turns <= MAX_TURNS):
            raise ValueError(f"rollout.env.max_turns={self.max_turns!r} is outside [1, {MAX_TURNS}]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"rollout.env.stop={self.stop!r} must be a list of non-empty strings")
        if self.observation_role not in (None, *ROLES):
            raise ValueError(f"rollout.env.observation_role={self.observation_role!r} must be "
                             f"null or one of {list(ROLES)}")
        for key in ("timeout_s", "import_timeout_s"):
            if not 0 < getattr(self, key) <= 3600:
                raise ValueError(f"rollout.env.{key}={getattr(self, key)!r} is outside (0, 3600]")
        if not (math.isfinite(self.error_score) and abs(self.error_score) <= 1e6):
            raise ValueError(f"rollout.env.error_score={self.error_score!r} must be finite, "
                             f"within [-1e6, 1e6]")
        if not 1 <= self.num_workers <= 256:
            raise ValueError(f"rollout.env.num_workers={self.num_workers!r} is outside [1, 256]")
        if not 1 <= self.max_observation_chars <= 1 << 24:
            raise ValueError(f"rollout.env.max_observation_chars={self.max_observation_chars!r} "
                             f"is outside [1, 16777216]")

    @property
    def function(self) -> str:
        """The env file's path (checked to exist): what the workers import."""
        path = BUILTIN_ENVS.get(self.file) or Path(self.file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"rollout.env.file={self.file!r}: no file {path} (or a "
                                    f"built-in: {sorted(BUILTIN_ENVS)})")
        return str(path)


# -- inside a worker -----------------------------------------------------------------------
def load_env(file: str) -> Callable[..., Any]:
    """The worker's one callable for an env file: `call(fn="reset"|"step", args={...})`."""
    module = import_file(Path(file), f"rollout.env.file={file!r}")
    step, reset, tool = (getattr(module, n, None) for n in ("step", "reset", "tool"))
    for name, fn in (("step", step), ("reset", reset), ("tool", tool)):
        if fn is not None and not callable(fn):
            raise RewardFunctionError(f"rollout.env.file={file!r}: {name} is not callable")
    if step is None and tool is None:
        raise RewardFunctionError(f"rollout.env.file={file!r}: defines neither step(state, turn) "
                                  f"nor tool(call)")

    def tool_step(state: dict, turn: dict) -> dict:
        if turn["finish"] == "eos":
            return {"observation": "", "done": True}
        return {"observation": tool(turn["text"])}

    def call(fn: str, args: dict, max_chars: int) -> Any:
        if fn == "reset":
            return ("reset", {} if reset is None else reset(**args), max_chars)
        return ("step", (step or tool_step)(**args), max_chars)
    return call


def check_reply(out: Any) -> dict:
    """A checked reset/step reply (dict); ValueError naming what is wrong."""
    kind, value, max_chars = out
    if kind == "reset":
        if not isinstance(value, dict):
            raise ValueError(f"reset returned {type(value).__name__} {str(value)[:80]!r}, not a "
                             "state dict")
        _check_state(value, "reset")
        return {"state": value}
    if not isinstance(value, dict):
        raise ValueError(f"step returned {type(value).__name__} {str(value)[:80]!r}, not a dict "
                         f"with keys {list(STEP_KEYS)}")
    unknown = sorted(set(value) - set(STEP_KEYS))
    if unknown:
        raise ValueError(f"step returned unknown keys {unknown}; valid keys are {list(STEP_KEYS)}")
    if "observation" not in value and not value.get("done"):
        raise ValueError("step returned no observation and done is not true")
    obs = value.get("observation", "")
    _check_observation(obs, max_chars)
    reward = check_score(value.get("reward", 0.0))
    done = value.get("done", False)
    if not isinstance(done, bool):
        raise ValueError(f"step returned done={done!r}, not a bool")
    reply = {"observation": obs, "reward": reward, "done": done}
    if "state" in value:
        if not isinstance(value["state"], dict):
            raise ValueError(f"step returned state of type {type(value['state']).__name__}, "
                             "not a dict")
        _check_state(value["state"], "step")
        reply["state"] = value["state"]
    return reply


def _check_state(state: dict, where: str) -> None:
    try:
        text = json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} returned a state that is not JSON-able ({e})") from None
    if len(text) > 1 << 24:
        raise ValueError(f"{where} returned a state of {len(text)} JSON characters (> 16M)")


def _check_observation(obs: Any, max_chars: int) -> None:
    if obs is None:
        raise ValueError("step returned observation None")
    size = len(obs) if isinstance(obs, (str, list)) else 0
    if isinstance(obs, list):
        size = sum(len(m["content"]) if isinstance(m, dict) and isinstance(m.get("content"), str)
                   else 1 for m in obs)
    if size > max_chars:
        raise ValueError(f"observation of {size} characters/tokens is longer than "
                         f"rollout.env.max_observation_chars={max_chars}")
    if isinstance(obs, str):
        return
    if not isinstance(obs, list):
        raise ValueError(f"observation of type {type(obs).__name__} {str(obs)[:80]!r}: expected "
                         "a str, a list of token ids or a list of {role, content} messages")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in obs):
        if any(not 0 <= t < 1 << 31 for t in obs):
            raise ValueError("observation token ids must be in [0, 2^31)")
        return
    for m in obs:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ValueError(f"observation list item {str(m)[:80]!r} is neither a token id nor "
                             "a {role, content} message")


# -- the caller's side ---------------------------------------------------------------------
class EnvPool:
    """Worker processes running one env file; `reset` and `step` take a batch of trajectories'
    calls and return, per call, the checked reply or None (the error is in `Scores.messages`
    and counted by kind)."""

    def __init__(self, cfg: EnvConfig, log: Callable[[str], None] = print):
        cfg.function  # a missing file fails here; its import only in a worker
        self.cfg = cfg
        self.pool = RewardPool(_PoolView(cfg), log, role="env")

    def reset(self, problems: Sequence[dict], labels: Sequence[str]) -> Scores:
        return self._run("reset", [{"problem": p} for p in problems], labels)

    def step(self, states: Sequence[dict], turns: Sequence[dict], labels: Sequence[str]) -> Scores:
        return self._run("step", [{"state": s, "turn": t} for s, t in zip(states, turns)], labels)

    def _run(self, fn: str, args: list[dict], labels: Sequence[str]) -> Scores:
        out = self.pool.run([{"fn": fn, "args": a, "max_chars": self.cfg.max_observation_chars}
                             for a in args],
                            [f"{lb}: env {fn}" for lb in labels])
        out.scores = [v if isinstance(v, dict) else None for v in out.scores]
        return out

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class _PoolView:
    """The fields RewardPool reads, from an EnvConfig (function = the resolved file)."""

    function: str
    timeout_s: float
    error_score: Any
    num_workers: int
    import_timeout_s: float

    def __init__(self, cfg: EnvConfig):
        self.function, self.timeout_s = cfg.function, cfg.timeout_s
        self.error_score, self.num_workers = None, cfg.num_workers
        self.import_timeout_s = cfg.import_timeout_s
