"""Typed requests and results of the rollout engine, shared by the engine, server and client.

`SamplingParams` is the typed form of SGLang's `sampling_params` dict: `from_sglang` accepts
exactly SGLang's key set (unknown key -> `RequestError` naming it) and refuses, by name, the
SGLang features this engine does not implement (penalties, grammars, stop strings) instead of
silently ignoring them.

Shapes: P prompt tokens, R generated tokens, L MoE layers, K experts per token, V vocabulary.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..moe.checks import need as _need
from ..replay.indexer import IndexerTrace
from ..replay.trace import RoutingTrace


class RequestError(ValueError):
    """A generation request that cannot be served; the message names the offending value."""


class RolloutError(RuntimeError):
    """A server refused a request or answered something that breaks the contract."""


class EngineDown(RolloutError):
    """The server did not answer: connection refused or lost, or no answer within the timeout
    (a dead or hung engine; a fleet retries the request on another engine)."""


class FleetError(RolloutError):
    """The rollout fleet cannot go on: an engine past its restarts, no live engine left, a
    launch or a weight push that could not be recovered (rollout/dispatch.py)."""


class PushRefused(RolloutError):
    """A server answered a weight push with a refusal before any of its weights changed
    (`/begin_weight_update` or the first bucket refused): the same weights can still go
    another way (`rollout.weight_sync: auto` falls back to disk). `buckets`: what the push
    had not sent yet, in order (the refused bucket first)."""

    def __init__(self, message: str, buckets=()):
        super().__init__(message)
        self.buckets = buckets


# SGLang 0.5.x `SamplingParams` API keys (python/sglang/srt/sampling/sampling_params.py).
SGLANG_SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias", "sampling_seed",
)
# SGLang keys we accept only at their no-op value (value -> the no-op values allowed).
_NOOP_ONLY = {
    "stop": (None, [], ""), "stop_regex": (None, [], ""), "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,),
    "custom_params": (None, {}), "logit_bias": (None, {}),
}
# Keys about detokenisation or streaming: meaningless without a tokenizer, accepted and ignored.
_IGNORED = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
            "stream_interval")
# The one temperature rule: below this an engine samples greedily (SGLang's rule, and ours in
# rollout/sampling.py) and reports temperature-1 log-probs, so a sampled run's
# rollout.temperature must be at least this (trainer/config/sections.py).
GREEDY_TEMPERATURE = 1e-6


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


@dataclass
class SamplingParams:
    """How to sample one request (SGLang semantics and defaults)."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax), as in SGLang."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 keeps everything."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps the whole vocabulary."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p x the largest probability."""
    max_new_tokens: int = 128
    """Most tokens to generate (a stop token counts)."""
    min_new_tokens: int = 0
    """EOS and stop ids are masked out until this many tokens were generated."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra ids that end generation (the id is kept in the output, as SGLang does)."""
    ignore_eos: bool = False
    """Do not stop on the model's EOS id."""
    n: int = 1
    """Samples per prompt; they share the prompt's prefill."""
    seed: int | None = None
    """Per-request seed (SGLang `sampling_seed`); sample j of n uses seed + j."""

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def truncates(self) -> bool:
        """True when top-k/top-p/min-p (or greedy) can drop candidates."""
        return self.greedy or self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        need = functools.partial(_need, error=RequestError)
        need(_is_num(self.temperature) and self.temperature >= 0,
             f"temperature must be a non-negative finite number, got {self.temperature!r}")
        need(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0,
             f"top_p must be in (0, 1], got {self.top_p!r}")
        need(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
             f"top_k must be -1 (whole vocabulary) or at least 1, got {self.top_k!r}")
        need(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0,
             f"min_p must be in [0, 1], got {self.min_p!r}")
        need(_is_int(self.max_new_tokens) and self.max_new_tokens >= 0,
             f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        need(_is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens,
             f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
             f"got {self.min_new_tokens!r}")
        need(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        need(self.seed is None or _is_int(self.seed),
             f"sampling_seed must be an integer or null, got {self.seed!r}")
        need(self.seed is None or -(1 << 63) <= self.seed <= (1 << 63) - self.n,
             f"sampling_seed {self.seed} (+ n - 1 = {self.n - 1} for the last sample) is "
             f"outside int64; engines take 64-bit seeds")
        need(isinstance(self.ignore_eos, bool), f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for t in self.stop_token_ids:
            need(_is_int(t) and t >= 0 and (vocab_size is None or t < vocab_size),
                 f"stop_token_ids has {t!r}, outside the vocabulary [0, {vocab_size})")

    @classmethod
    def from_sglang(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Parse SGLang's `sampling_params` dict; null values mean the default, as in SGLang."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise RequestError(f"sampling_params must be a JSON object, got {type(d).__name__}")
        unknown = sorted(k for k in d if k not in SGLANG_SAMPLING_KEYS)
        if unknown:
            raise RequestError(f"unknown sampling_params key(s) {unknown}; "
                               f"valid keys are {sorted(SGLANG_SAMPLING_KEYS)}")
        for k, allowed in _NOOP_ONLY.items():
            if k in d and d[k] not in allowed:
                hint = " (use stop_token_ids)" if k in ("stop", "stop_regex") else ""
                raise RequestError(f"sampling_params.{k}={d[k]!r} is not supported by the "
                                   f"lockstep engine{hint}")
        kw: dict[str, Any] = {}
        for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"),
                             ("top_k", "top_k"), ("min_p", "min_p"),
                             ("max_new_tokens", "max_new_tokens"),
                             ("min_new_tokens", "min_new_tokens"), ("ignore_eos", "ignore_eos"),
                             ("n", "n"), ("seed", "sampling_seed")):
            if d.get(theirs) is not None:
                kw[ours] = d[theirs]
        stops = d.get("stop_token_ids")
        if stops is not None:
            if not isinstance(stops, (list, tuple)):
                raise RequestError(f"stop_token_ids must be a list of ints, got {stops!r}")
            kw["stop_token_ids"] = tuple(stops)
        if _is_num(kw.get("top_k")) and float(kw["top_k"]) >= (1 << 30):
            kw["top_k"] = -1  # SGLang's TOP_K_ALL sentinel
        return cls(**kw)

    def to_sglang(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "max_new_tokens": self.max_new_tokens,
            "min_new_tokens": self.min_new_tokens, "ignore_eos": self.ignore_eos, "n": self.n,
        }
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            d["sampling_seed"] = self.seed
        return d


@dataclass
class GenerateRequest:
    """One prompt to the engine (it yields `sampling.n` results)."""

    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = ""
    """Request id; results carry it (with the sample index when n > 1)."""
    return_routes: bool = True
    """Record routed experts for prompt and generated tokens."""
    trajectories: tuple[str, ...] = ()
    """Multi-turn: the trajectory each sample is a turn of (one id per sample, or empty); a
    fleet sends every turn of a trajectory to one engine (rollout/pins.py)."""
    routes_start: int = 0
    """First position whose route is returned (SGLang's `routed_experts_start_len`): a later
    turn of a trajectory asks only for the rows the earlier turns do not have."""
    return_gates: bool = False
    """Also record the gate weights the engine combined those experts with (a lockstep
    extension: `replay.gates: engine`; needs return_routes)."""
    return_indexer_topk: bool = False
    """DSA models: also record each token's lightning-indexer picks (SGLang's
    `return_indexer_topk`; replay.indexer), rows from `indexer_start`."""
    indexer_start: int = 0
    """First position whose picks are returned (a later turn asks only for new rows)."""
    return_input_logprobs: bool = False
    """Also return log-probs of the prompt tokens (first one has none)."""
    top_logprobs_num: int = 0
    """Also return the top-N (log-prob, id) pairs at every generated position."""
    return_sampling_mask: bool = False
    """Record the kept candidate ids at every generated position (sampling-mask replay)."""
    return_support_logprobs: bool = False
    """With the mask: also the renormalised log-probs over each position's support."""


@dataclass
class GenerationResult:
    """One finished sample: tokens, log-probs, routes and provenance.

    `output_logprobs[i]` is log softmax(logits / temperature)[output_ids[i]] over the full
    vocabulary (temperature 1 when greedy): what the trainer recomputes by default.
    `sampling_logprobs[i]` is the same token's log-prob under the truncated, renormalised
    distribution the sampler actually drew from (SGLang's "selected" sampling log-prob).
    """

    rid: str
    index: int
    """Sample index within the request's n."""
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: torch.Tensor        # [R] fp32
    sampling_logprobs: torch.Tensor | None  # [R] fp32; None when a server did not report it
    finish_reason: dict[str, Any]        # {"type": "length", "length": R} | {"type": "stop", "matched": id}
    weight_version: str
    routes_NLK: torch.Tensor | None = None
    """[P+R-1-routes_start, L, K] uint8/uint16 routed experts (MoE layers only); row i is the
    token at position routes_start + i; None when not requested."""
    routes_start: int = 0
    """Absolute position of routes row 0 (the request's `routes_start`)."""
    gates_NLK: torch.Tensor | None = None
    """Gate weights of those experts as the engine combined them, rows as routes_NLK's, in
    its compute dtype (bf16/fp16/fp32); None unless `return_gates`."""
    indexer: IndexerTrace | None = None
    """DSA models: the key positions each token attended to per indexer layer, rows from
    the request's `indexer_start` (replay/indexer.py); None unless `return_indexer_topk`."""
    input_logprobs: torch.Tensor | None = None
    """[P] fp32, entry 0 is NaN (the first prompt token has no prediction)."""
    top_logprobs: list[list[tuple[float, int]]] | None = None
    """Per generated token, the top-N (log-prob, id) of the full distribution."""
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    """Per prompt token (entry 0 None), the top-N (log-prob, id) predicted for it."""
    sampling_mask: list[torch.Tensor | None] | None = None
    """Per generated token, the kept candidate ids (int32, ascending); None where untruncated."""
    support_logprobs: list[torch.Tensor] | None = None
    """Per generated token, log-probs renormalised over its support (aligned with
    `sampling_mask`; over the whole vocabulary where the mask entry is None)."""
    sampled_mask: torch.Tensor | None = None
    """Multi-turn trajectories (rollout/agent.py): [R] bool, True at the output tokens the
    policy sampled, False at observation tokens (their log-probs are 0 and they are not
    trained); None = every output token was sampled (a single-turn sample)."""
    trajectory: Any = None
    """Multi-turn trajectories: the `rollout.agent.TrajectoryInfo` (turns, env reward, error)."""
    routes_ref: Any = None
    """rollout.routes_by_reference: where the routes stayed (a `rollout.route_refs.RouteRef`,
    in the object store of the engine's node); routes_NLK is None then."""

    def trace(self, num_experts: int, sample: int | None = None) -> RoutingTrace | None:
        """Routes as a validated `RoutingTrace` (checked against P+R-1-routes_start rows,
        starting at `routes_start`)."""
        if self.routes_NLK is None:
            return None
        t = RoutingTrace(self.routes_NLK, num_experts, start=self.routes_start, sample=sample)
        t.check(self.prompt_tokens, self.completion_tokens, t.num_layers, t.top_k, num_experts,
                sample=sample)
        return t

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)
