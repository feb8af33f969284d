"""Synthetic verifiable tasks: prompts, exact-match rewards and demonstrations, all in code.

Two tasks share one 16-token character vocabulary so a model trained on one loads for the other:
- `addition`: `<bos>07+45=` -> `52<eos>` (operands zero-padded to `digits` digits, answer without
  leading zeros), reward 1 for the exact answer followed by `<eos>`, else 0.
- `sort`: `<bos>8351>` -> `1358<eos>` (digits sorted ascending), same reward rule.
- `multiply` (the multi-turn agent toy, `rollout.env.file: calculator`): `<bos>47*8=` ->
  the policy calls the calculator `47*8>`, reads `376=` (an observation, not trained) and
  answers `376<eos>`; reward 1 for the exact final answer. Its vocabulary adds `*` (id 16), so
  its models have 17 tokens.

Problems are a pure function of (seed, index): problem i of a run never depends on how many
problems were drawn before it, so a resumed run draws exactly the problems the killed one would
have (the data cursor is just the next index).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from tokenizers import Tokenizer

from lockstep.moe.tokenizer import BOS, EOS, PAD, build_char_tokenizer

SPECIALS = (PAD, BOS, EOS)
CHARS = "0123456789+=>"
"""Every character a prompt or answer of our tasks can contain (ids follow the specials)."""
AGENT_CHARS = CHARS + "*"
"""The multiply task's characters: the same ids, plus `*` after them."""


def build_tokenizer(chars: str = CHARS) -> Tokenizer:
    """Character-level `tokenizers.Tokenizer` (specials `<pad>`=0, `<bos>`=1, `<eos>`=2).

    Saved as `tokenizer.json` next to checkpoints so other engines (SGLang, transformers) load it.
    """
    return build_char_tokenizer(chars, SPECIALS)


@dataclass
class TaskConfig:
    """Which synthetic task to train on and its size."""

    name: Literal["addition", "sort", "multiply"] = "addition"
    """Task: `addition` (a+b=), `sort` (sort a digit string) or `multiply` (a*b= with a
    calculator tool: needs rollout.env)."""
    digits: int = 2
    """addition: digits per operand (answers have up to digits+1 digits); multiply: digits of
    the first operand (the second has one)."""
    sort_length: int = 4
    """sort: number of digits to sort."""
    reward: Literal["exact", "partial"] = field(default="exact", metadata={"saved": "non_default"})
    """exact: 1 for the exact answer then `<eos>`, else 0; partial: the fraction of the answer's
    tokens (its `<eos>` included) the response has at the same position (a long answer, e.g.
    sort_length 32, then gives every sample a graded score)."""

    def __post_init__(self) -> None:
        if self.name not in ("addition", "sort", "multiply"):
            raise ValueError(f"task.name must be 'addition', 'sort' or 'multiply', "
                             f"got {self.name!r}")
        if not (isinstance(self.digits, int) and 1 <= self.digits <= 8):
            raise ValueError(f"task.digits must be an integer in [1, 8], got {self.digits!r}")
        if not (isinstance(self.sort_length, int) and 1 <= self.sort_length <= 32):
            raise ValueError(f"task.sort_length must be an integer in [1, 32], "
                             f"got {self.sort_length!r}")
        if self.reward not in ("exact", "partial"):
            raise ValueError(f"task.reward must be 'exact' or 'partial', got {self.reward!r}")


@dataclass(frozen=True)
class Problem:
    """One prompt and its single correct answer (text, without `<bos>`/`<eos>`)."""

    prompt: str
    answer: str


class Task:
    """A task over the shared character tokenizer: problems, token ids, rewards, demonstrations."""

    def __init__(self, cfg: TaskConfig, tokenizer: Tokenizer | None = None):
        self.cfg = cfg
        self.chars = AGENT_CHARS if cfg.name == "multiply" else CHARS
        self.tokenizer = tokenizer or build_tokenizer(self.chars)
        ids = {s: self.tokenizer.token_to_id(s) for s in SPECIALS}
        missing = [s for s, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer lacks the special tokens {missing}")
        self.pad_id, self.bos_id, self.eos_id = ids[PAD], ids[BOS], ids[EOS]
        absent = [c for c in self.chars if self.tokenizer.token_to_id(c) is None]
        if absent:
            raise ValueError(f"tokenizer lacks the characters {absent}")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def max_new_tokens(self) -> int:
        """Longest correct response plus `<eos>`, plus one token of slack."""
        if self.cfg.name == "multiply":  # per turn: the call `47*8>` or the answer `376<eos>`
            return self.cfg.digits + 4
        longest = self.cfg.digits + 1 if self.cfg.name == "addition" else self.cfg.sort_length
        return longest + 2

    @property
    def uses_tool(self) -> bool:
        """Whether a trajectory calls the calculator (rollout/calculator_env.py) between turns."""
        return self.cfg.name == "multiply"

    @property
    def prompt_len(self) -> int:
        """Every prompt of a task has the same length (`<bos>` included)."""
        return len(self.prompt_ids(self.problem(0, 0)))

    # -- problems ------------------------------------------------------------------------
    def problem(self, seed: int, index: int) -> Problem:
        """Problem `index` of the stream seeded by `seed` (independent of other indices)."""
        if index < 0:
            raise ValueError(f"problem index must be >= 0, got {index}")
        rng = random.Random(f"{self.cfg.name}:{seed}:{index}")
        if self.cfg.name == "addition":
            n = self.cfg.digits
            a, b = rng.randrange(10**n), rng.randrange(10**n)
            return Problem(f"{a:0{n}d}+{b:0{n}d}=", str(a + b))
        if self.cfg.name == "multiply":
            n = self.cfg.digits
            a, b = rng.randrange(10 ** (n - 1), 10**n), rng.randrange(2, 10)
            return Problem(f"{a}*{b}=", str(a * b))
        digits = [rng.randrange(10) for _ in range(self.cfg.sort_length)]
        return Problem("".join(map(str, digits)) + ">", "".join(map(str, sorted(digits))))

    def problems(self, seed: int, start: int, count: int) -> list[Problem]:
        return [self.problem(seed, i) for i in range(start, start + count)]

    # -- tokens --------------------------------------------------------------------------
    def prompt_ids(self, p: Problem) -> list[int]:
        return [self.bos_id] + self._encode(p.prompt)

    def answer_ids(self, p: Problem) -> list[int]:
        """The correct response: answer characters then `<eos>`."""
        return self._encode(p.answer) + [self.eos_id]

    def demonstration(self, p: Problem) -> tuple[list[int], list[bool]]:
        """The correct continuation of the prompt and, per token, whether the policy writes it
        (False: an observation). Single-turn tasks: the answer, all True; multiply: the call,
        the calculator's answer (observation), then the final answer."""
        if not self.uses_tool:
            ids = self.answer_ids(p)
            return ids, [True] * len(ids)
        from lockstep.rollout.calculator_env import evaluate
        call = self._encode(p.prompt[:-1] + ">")
        obs = self._encode(evaluate(p.prompt[:-1] + ">"))
        answer = self.answer_ids(p)
        return call + obs + answer, [True] * len(call) + [False] * len(obs) + [True] * len(answer)

    def observe(self, turn_ids: list[int]) -> list[int] | None:
        """The calculator's answer to a policy turn that ends with `>` (None: no call, or a
        malformed one), as the env workers would give it: for the warm start's evaluation."""
        if not self.uses_tool or not turn_ids or turn_ids[-1] != self.tokenizer.token_to_id(">"):
            return None
        from lockstep.rollout.calculator_env import evaluate
        try:
            return self._encode(evaluate(self.tokenizer.decode(turn_ids)))
        except ValueError:
            return None

    def _encode(self, text: str) -> list[int]:
        bad = sorted(set(text) - set(self.chars))
        if bad:
            raise ValueError(f"text {text!r} has characters {bad} that are not among the task "
                             f"characters {self.chars!r}")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Response text up to (not including) the first `<eos>`."""
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # -- reward --------------------------------------------------------------------------
    def reward(self, p: Problem, response_ids: list[int]) -> float:
        """1.0 iff the response is exactly the answer followed by `<eos>` (nothing after);
        task.reward=partial: the fraction of answer positions the response matches."""
        want, got = self.answer_ids(p), list(response_ids)
        if self.cfg.reward == "partial":
            return sum(a == b for a, b in zip(want, got)) / len(want)
        return 1.0 if got == want else 0.0

    # -- demonstrations for the supervised warm start -------------------------------------
    def demonstrations(self, seed: int, start: int, count: int) -> list[tuple[list[int], list[int]]]:
        """(prompt_ids, answer_ids) pairs; use a seed different from the RL stream's."""
        return [(self.prompt_ids(p), self.answer_ids(p)) for p in self.problems(seed, start, count)]
