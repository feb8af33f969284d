"""Multi-turn trajectories: the policy writes a turn, the environment (rollout/env.py) answers
with an observation, the policy writes again; token in, token out, routes stitched across turns.

    runner = TrajectoryRunner(backend.generate, EnvPool(cfg.rollout.env),
                              ObservationCodec(tokenizer), max_len=engine_max_len,
                              num_experts=E, eos_id=eos, vocab_size=V)
    results = runner.run(requests, problems)   # one GenerationResult per trajectory

`run` takes the requests of a step (one per prompt, `sampling.n` samples each; problem i is
the env's view of prompt i) and returns, like `generate`, one result per sample in request
order, each a whole trajectory:
- `prompt_ids` is the first prompt; `output_ids` every later token: the sampled ids of each
  turn exactly as sampled, then the observation's ids (never a re-tokenised transcript);
- `sampled_mask` [R] is True at sampled tokens only (the loss mask); `output_logprobs` and
  `sampling_logprobs` hold the engine's log-probs at sampled tokens and 0 at observations;
- `routes_NLK` covers all P+R-1 positions (observation tokens included), stitched: turn t>1 is
  requested with `routes_start` = the previous turn's last sampled token (whose route only this
  prefill gives), so each turn's rows start where the previous ones end
  (`RoutingTrace.extend` checks that at every stitch);
- `trajectory` is the `TrajectoryInfo`: turns (where each starts, its sampled and observation
  token counts, its weight version, how it ended), the env's summed reward, and the error that
  ended it, if any.
Turns of all live trajectories are generated together, one `generate` call per turn index.
Later turns' seeds are a pure function of the first turn's seed, the sample index and the turn
(`turn_seed`), so a resumed run samples the same trajectories.

`generate` is any `RolloutBackend.generate` (embedded engine, server client, fleet): each turn
after the first is a fresh request carrying the whole trajectory as `input_ids` (a server's
prefix cache keeps the earlier turns' KV). Requests name their trajectories
(`GenerateRequest.trajectories`, "<rid>/<sample>"), so a fleet sends every turn of one to the
engine of its first turn (rollout/pins.py). A trajectory whose engine is lost mid-trajectory
(`TrajectoriesLost`) is started again from its first turn, once, with the same seeds (the same
trajectory when the weights are the same); lost again, it ends with the error `lost`.
`release` (a backend's `release_trajectories`) is told the ids of every trajectory that ended.

Shapes: N routes rows, L MoE layers, K top-k; P first-prompt tokens, R tokens after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lockstep.replay.indexer import IndexerTrace
from lockstep.replay.trace import RoutingTrace
from lockstep.rollout.env import MAX_TURNS, EnvConfig, EnvPool
from lockstep.rollout.pins import TrajectoriesLost
from lockstep.rollout.types import GenerateRequest, GenerationResult

ERROR_KINDS = ("raised", "timeout", "bad_value", "crashed", "context", "aborted", "lost")
"""Why an environment ended a trajectory with `error_score`: the worker kinds of
rollout/rewards.py, `context` (an observation that does not fit the engine's max_len),
`aborted` (the engine aborted a turn) and `lost` (its engine was lost mid-trajectory on the
one restart from its first turn too)."""


@dataclass
class Turn:
    """One policy turn of a trajectory, and the observation appended after it."""

    start: int
    """Absolute position of the turn's first sampled token."""
    sampled: int
    """Tokens the policy sampled in this turn."""
    observation: int = 0
    """Observation tokens appended after it (0 for the last turn)."""
    weight_version: str = ""
    """Weights that sampled the turn."""
    finish: str = ""
    """How the turn ended: eos, stop (an env stop marker), length, abort."""


@dataclass
class TrajectoryInfo:
    """What a trajectory did, beside its tokens."""

    turns: list[Turn] = field(default_factory=list)
    env_reward: float = 0.0
    """Sum of the env's step rewards."""
    error: str | None = None
    """One of ERROR_KINDS when the environment ended the trajectory with error_score."""
    message: str = ""
    """The error's one-line message."""
    end: str = ""
    """done (the env said so), max_turns, context (no room for another turn) or error."""
    restarts: int = 0
    """1 when its engine was lost mid-trajectory and it was started again from its first turn."""

    @property
    def tool_calls(self) -> int:
        """Turns that got an observation (a tool or environment answer)."""
        return sum(1 for t in self.turns if t.observation)


def turn_seed(seed: int | None, sample: int, turn: int) -> int | None:
    """Sampling seed of turn `turn` (>= 1) of sample `sample` of a request seeded `seed`."""
    if seed is None:
        return None
    return ((seed + sample) * MAX_TURNS + turn) % (1 << 62)


class ObservationCodec:
    """Observations -> token ids and turns -> text, with the model folder's tokenizer
    (transformers, with its chat template) or a `tokenizers.Tokenizer` (the toy's)."""

    # a fixed conversation the observation's messages are appended to, so that the chat
    # template renders them as they would follow an assistant turn
    _BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]

    def __init__(self, tokenizer, role: str | None = None):
        self.tok, self.role = tokenizer, role
        self.hf = hasattr(tokenizer, "apply_chat_template")
        if role is not None and not (self.hf and tokenizer.chat_template):
            raise ValueError(f"rollout.env.observation_role={role!r} needs a tokenizer with a "
                             f"chat template (model.path's tokenizer_config.json)")

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def token_id(self, marker: str) -> int:
        """The one id of a stop marker (ValueError when it is several tokens or none)."""
        ids = self.encode_text(marker)
        if len(ids) != 1:
            raise ValueError(f"rollout.env.stop marker {marker!r} is {len(ids)} tokens "
                             f"({ids}); each must be exactly one token")
        return ids[0]

    def encode_text(self, text: str) -> list[int]:
        if self.hf:
            return list(self.tok(text, add_special_tokens=False)["input_ids"])
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def encode(self, obs: Any) -> list[int]:
        """Token ids of a checked observation (rollout/env.py `check_reply`)."""
        if isinstance(obs, str):
            if self.role is None:
                return self.encode_text(obs) if obs else []
            obs = [{"role": self.role, "content": obs}]
        if all(isinstance(t, int) for t in obs):
            return list(obs)
        return self.encode_text(self.render(obs))

    def render(self, messages: list[dict]) -> str:
        """The chat template's text for `messages` after an assistant turn, generation prompt
        included: applied once, to the observation side only."""
        if not (self.hf and self.tok.chat_template):
            raise ValueError("message observations need a tokenizer with a chat template")
        base = self.tok.apply_chat_template(self._BASE, tokenize=False)
        full = self.tok.apply_chat_template(self._BASE + list(messages), tokenize=False,
                                            add_generation_prompt=True)
        if not full.startswith(base):
            raise ValueError("the chat template renders a conversation differently once "
                             "messages are appended; cannot render observations alone")
        return full[len(base):]


@dataclass
class _Live:
    """A trajectory being generated."""

    req: GenerateRequest
    index: int
    problem: dict
    label: str
    name: str  # its id in GenerateRequest.trajectories
    ids: list[int]
    prompt_len: int
    state: dict = field(default_factory=dict)
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    sampling_logprobs: list[torch.Tensor] = field(default_factory=list)
    sampling_mask: list | None = None
    trace: RoutingTrace | None = None
    gates: list[torch.Tensor] = field(default_factory=list)  # per turn, rows as the trace's
    picks: IndexerTrace | None = None  # DSA models: indexer picks, stitched like the routes
    first: GenerationResult | None = None
    info: TrajectoryInfo = field(default_factory=TrajectoryInfo)
    done: bool = False
    lost: str = ""  # why its engine was lost (it is then started again)


class Turns:
    """A run of trajectories (`TrajectoryRunner.turns`) as a sequence of generate calls that
    its driver may pause between: the rollout pipeline runs the first turns of a step ahead,
    then the rest after the next weight push (`rollout.env.turns_before_push`)."""

    def __init__(self, turns):
        self.gen, self.pending, self.calls = turns, None, 0
        self.results: list[GenerationResult] | None = None  # once done

    @property
    def done(self) -> bool:
        return self.results is not None

    def advance(self, generate: Callable[[list[GenerateRequest]], list[GenerationResult]],
                calls: int | None = None) -> bool:
        """Run turns over `generate` until the run is done (True) or `calls` generate calls
        were made in all (False)."""
        try:
            if self.pending is None and not self.done:
                self.pending = next(self.gen)
            while not self.done and (calls is None or self.calls < calls):
                self.calls += 1
                try:
                    got = generate(self.pending)
                except TrajectoriesLost as e:
                    self.pending = self.gen.throw(e)
                    continue
                self.pending = self.gen.send(got)
        except StopIteration as end:
            self.results = end.value
        return self.done


class TrajectoryRunner:
    """Runs multi-turn trajectories over any `generate` (module docstring)."""

    def __init__(self, generate: Callable[[list[GenerateRequest]], list[GenerationResult]],
                 env: EnvPool, codec: ObservationCodec, max_len: int, num_experts: int,
                 eos_id: int | None, vocab_size: int,
                 release: Callable[[list[str]], None] | None = None):
        """`max_len`: the engine's context (prompt + every turn); observation ids are checked
        against `vocab_size`; a turn that samples `eos_id` finishes as "eos"; `release` is
        called with the ids of the trajectories of each run once they ended."""
        self.generate, self.env, self.codec = generate, env, codec
        self.release = release or (lambda ids: None)
        self.cfg: EnvConfig = env.cfg
        self.max_len, self.num_experts, self.eos_id = max_len, num_experts, eos_id
        self.vocab_size = vocab_size
        self.stop_ids = tuple(codec.token_id(m) for m in self.cfg.stop)

    def run(self, requests: Sequence[GenerateRequest], problems: Sequence[dict]
            ) -> list[GenerationResult]:
        """One result per sample (module docstring), over `generate`."""
        turns = Turns(self.turns(requests, problems))
        turns.advance(self.generate)
        return turns.results

    def turns(self, requests: Sequence[GenerateRequest], problems: Sequence[dict],
              restart: bool = True):
        """`run` as a generator (driven by `Turns`): it yields each turn's requests and is
        sent their results (or thrown `TrajectoriesLost`); returns `run`'s results.
        `restart`: start trajectories whose engine was lost again from their first turn
        (False: they end with error `lost`)."""
        if len(requests) != len(problems):
            raise ValueError(f"{len(requests)} requests for {len(problems)} problems")
        first = [dataclasses.replace(r, sampling=self._with_stops(r.sampling), trajectories=tuple(
            f"{r.rid or i}/{j}" for j in range(r.sampling.n))) for i, r in enumerate(requests)]
        trajs = [_Live(r, j, p, f"trajectory {r.trajectories[j]}", r.trajectories[j],
                       list(r.input_ids), len(r.input_ids))
                 for r, p in zip(first, problems) for j in range(r.sampling.n)]
        try:
            yield from self._turns(trajs, first, restart)
        finally:
            self.release([t.name for t in trajs])
        out = [None if t.lost else self._result(t) for t in trajs]
        lost = [k for k, t in enumerate(trajs) if t.lost]
        if lost:  # from the first turn, with the seeds they had: the same when nothing changed
            again = yield from self.turns([self._from_start(trajs[k]) for k in lost],
                                          [trajs[k].problem for k in lost], restart=False)
            for k, res in zip(lost, again):
                res.trajectory.restarts = 1
                out[k] = dataclasses.replace(res, rid=trajs[k].req.rid, index=trajs[k].index)
        return out

    def _turns(self, trajs: list[_Live], first: list[GenerateRequest], restart: bool) -> None:
        reset = self.env.reset([t.problem for t in trajs], [t.label for t in trajs])
        results = yield from self._generate(trajs, first, restart)
        if len(results) != len(trajs):
            raise ValueError(f"generate returned {len(results)} results for {len(trajs)} samples")
        for t, reply, res in zip(trajs, reset.scores, results):
            if res is None:
                continue
            self._take_turn(t, res)
            if reply is None:
                self._fail(t, reset, t.label + ": env reset")
            else:
                t.state = reply["state"]
        for turn in range(1, self.cfg.max_turns + 1):
            last = turn == self.cfg.max_turns  # the env still scores it; nothing is appended
            live = [t for t in trajs if not t.done]
            if live:
                self._observe(live, turn, append=not last)
            live = [t for t in trajs if not t.done]
            if not live or last:
                for t in live:
                    t.done, t.info.end = True, "max_turns"
                break
            reqs = [self._next_request(t, turn) for t in live]
            for t, res in zip(live, (yield from self._generate(live, reqs, restart))):
                if res is not None:
                    self._take_turn(t, res)

    def _generate(self, trajs: list[_Live], requests: list[GenerateRequest], restart: bool
                  ) -> list[GenerationResult | None]:
        """The results of `requests` (yielded to the driver); None for the samples of
        trajectories whose engine was lost (each is then marked to start again, or ends with
        error `lost`)."""
        try:
            return (yield requests)
        except TrajectoriesLost as e:
            by_name = {t.name: t for t in trajs}
            for name, why in e.lost.items():
                t = by_name[name]
                if restart:
                    t.lost, t.done = why, True
                else:  # it ends after its last sampled turn, without the observation
                    self._drop_observation(t)
                    self._error(t, "lost", f"{t.label}: its engine was lost again after a "
                                           f"restart from its first turn: {why}")
            return e.results

    def _drop_observation(self, t: _Live) -> None:
        """Take back the observation appended after the last turn (no turn followed it)."""
        n = t.info.turns[-1].observation if t.info.turns else 0
        if n:
            del t.ids[-n:], t.sampled[-n:]
            t.logprobs.pop()
            t.sampling_logprobs.pop()
            if t.sampling_mask is not None:
                del t.sampling_mask[-n:]
            t.info.turns[-1].observation = 0

    def _from_start(self, t: _Live) -> GenerateRequest:
        """The one-sample first-turn request of a trajectory started again: sample j of n
        was seeded seed + j, and its later turns' seeds follow (`turn_seed`)."""
        sp = t.req.sampling
        sampling = dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + t.index)
        return dataclasses.replace(t.req, rid=f"{t.req.rid}-{t.index}-restart", trajectories=(),
                                   sampling=sampling)

    # -- pieces ------------------------------------------------------------------------------
    def _with_stops(self, sp):
        stops = tuple(sp.stop_token_ids) + tuple(i for i in self.stop_ids
                                                 if i not in sp.stop_token_ids)
        return dataclasses.replace(sp, stop_token_ids=stops)

    def _finish(self, res: GenerationResult) -> str:
        kind = res.finish_reason.get("type")
        if kind == "stop":
            return "eos" if res.finish_reason.get("matched") == self.eos_id else "stop"
        return "abort" if kind == "abort" else "length"

    def _take_turn(self, t: _Live, res: GenerationResult) -> None:
        """Append a generated turn's sampled tokens, log-probs and route rows."""
        if list(res.prompt_ids) != t.ids:
            raise ValueError(f"{t.label}: the engine answered a turn for another prompt")
        t.first = t.first or res
        finish = self._finish(res)
        t.info.turns.append(Turn(len(t.ids), len(res.output_ids), 0, str(res.weight_version),
                                 finish))
        t.ids += list(res.output_ids)
        R = len(res.output_ids)
        t.sampled += [True] * R
        t.logprobs.append(res.output_logprobs.float())
        t.sampling_logprobs.append(res.output_logprobs.float() if res.sampling_logprobs is None
                                   else res.sampling_logprobs.float())
        if res.sampling_mask is not None:
            t.sampling_mask = (t.sampling_mask or []) + list(res.sampling_mask)
        if res.routes_NLK is not None:
            part = RoutingTrace(res.routes_NLK, self.num_experts, start=res.routes_start,
                                sample=None)
            t.trace = part if t.trace is None else t.trace.extend(part)
            if res.gates_NLK is not None:  # replay.gates=engine: the same rows as the routes
                if res.gates_NLK.shape != res.routes_NLK.shape:
                    raise ValueError(f"{t.label}: gate weights {tuple(res.gates_NLK.shape)} "
                                     f"for routes {tuple(res.routes_NLK.shape)}")
                t.gates.append(res.gates_NLK)
        if res.indexer is not None:  # a later turn's rows start where the earlier ones end
            t.picks = res.indexer if t.picks is None else t.picks.extend(res.indexer)
        if finish == "abort":
            self._error(t, "aborted", f"{t.label}: the engine aborted turn "
                                      f"{len(t.info.turns) - 1}")

    def _observe(self, live: list[_Live], turn: int, append: bool = True) -> None:
        """Ask the env about each live trajectory's last turn; append its observations
        (`append=False`: the turn was the last one allowed, only its reward counts)."""
        turns = []
        for t in live:
            last = t.info.turns[-1]
            ids = t.ids[last.start:]
            turns.append({"text": self.codec.decode(ids), "ids": ids, "finish": last.finish,
                          "index": turn - 1})
        replies = self.env.step([t.state for t in live], turns, [t.label for t in live])
        for t, reply in zip(live, replies.scores):
            if reply is None:
                self._fail(t, replies, f"{t.label}: env step")
                continue
            t.info.env_reward += reply["reward"]
            t.state = reply.get("state", t.state)
            if reply["done"]:
                t.done, t.info.end = True, "done"
                continue
            if not append:
                continue
            try:
                obs = self.codec.encode(reply["observation"])
            except Exception as e:  # noqa: BLE001 - a tokenizer may raise anything on odd text
                self._error(t, "bad_value", f"{t.label}: observation could not be tokenised: "
                                            f"{type(e).__name__}: {e}")
                continue
            if not obs:  # nothing to append; the policy would only repeat itself
                self._error(t, "bad_value", f"{t.label}: empty observation without done")
                continue
            V = self.vocab_size
            if any(not 0 <= i < V for i in obs):
                self._error(t, "bad_value", f"{t.label}: observation token ids outside the "
                                            f"vocabulary [0, {V})")
                continue
            if len(t.ids) + len(obs) + 1 > self.max_len:
                self._error(t, "context", f"{t.label}: observation of {len(obs)} tokens after "
                                          f"{len(t.ids)} leaves no room in max_len={self.max_len}")
                continue
            t.info.turns[-1].observation = len(obs)
            t.ids += obs
            t.sampled += [False] * len(obs)
            zeros = torch.zeros(len(obs), dtype=torch.float32)
            t.logprobs.append(zeros)
            t.sampling_logprobs.append(zeros)
            if t.sampling_mask is not None:
                t.sampling_mask += [None] * len(obs)

    def _next_request(self, t: _Live, turn: int) -> GenerateRequest:
        r, sp = t.req, t.req.sampling
        room = self.max_len - len(t.ids)
        sampling = dataclasses.replace(sp, n=1, seed=turn_seed(sp.seed, t.index, turn),
                                       max_new_tokens=min(sp.max_new_tokens, room))
        return dataclasses.replace(
            r, input_ids=list(t.ids), sampling=sampling, rid=f"{r.rid}-{t.index}-t{turn}",
            routes_start=t.trace.end if t.trace is not None else 0, trajectories=(t.name,),
            indexer_start=t.picks.end if t.picks is not None else 0)

    def _fail(self, t: _Live, scores, label: str) -> None:
        kind = next((k for k in ERROR_KINDS if scores.errors.get(k)), "raised")
        msg = next((m for m in scores.messages if m.startswith(label)), label)
        kind = next((k for k in ERROR_KINDS if msg.startswith(f"{label}: {k}:")), kind)
        self._error(t, kind, msg)

    def _error(self, t: _Live, kind: str, message: str) -> None:
        if t.info.error is None:
            t.info.error, t.info.message = kind, message
        t.done, t.info.end = True, "error"

    def _result(self, t: _Live) -> GenerationResult:
        P = t.prompt_len
        R = len(t.ids) - P
        first = t.first
        if t.trace is not None:
            t.trace.check(P, R, t.trace.num_layers, t.trace.top_k, self.num_experts)
        if t.picks is not None:
            t.picks.check(P, R, t.picks.num_layers, t.picks.top_k)
        return GenerationResult(
            rid=first.rid, index=first.index, prompt_ids=t.ids[:P], output_ids=t.ids[P:],
            output_logprobs=torch.cat(t.logprobs), sampling_logprobs=torch.cat(t.sampling_logprobs),
            finish_reason=t.first.finish_reason if len(t.info.turns) == 1 else
            {"type": "trajectory", "end": t.info.end},
            weight_version=first.weight_version,
            routes_NLK=None if t.trace is None else t.trace.ids_NLK, routes_start=0,
            gates_NLK=torch.cat(t.gates) if t.gates and len(t.gates) == len(t.info.turns) else None,
            indexer=t.picks,
            sampling_mask=t.sampling_mask, sampled_mask=torch.tensor(t.sampled, dtype=torch.bool),
            trajectory=t.info)
