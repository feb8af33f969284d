"""Rollout dumps: one RL step's samples, as the engine and the actor saw them, in one file.

`loop.dump_every: N` writes every N-th step to `DIR/dumps/step_<n>.safetensors` (plus
`step_<n>.json`, the same header for people), before the update changes the weights. `lockstep
diagnose --dump FILE` reads one back on any machine and reports where the engine and the actor
disagree (docs/diagnose.md); the reader checks everything and names the sample and field of
anything inconsistent (`DumpError`).

A dump holds, per sample b (all per-token tensors aligned with `input_ids`, as in `Batch`):
  input_ids [B, T] int64      prompt + response, right-padded
  seq_lens, prompt_lens [B]   P + R and P
  rollout_logprobs [B, T]     mu_old, the engine's log-prob of each response token (else 0)
  old_logprobs [B, T]         pi_old under the run's replay mode (what the correction used)
  natural_logprobs [B, T]     the actor with its own routing (no replay)
  replayed_logprobs [B, T]    the actor replaying the engine's routes (R3's forward)
  rollout_routes [B, T, L, K] the engine's routes (compact), rollout_routes_valid [B, T] bool
  actor_routes [B, T, L, K]   the actor's natural top-k in the pi_old forward (what
                              `routing/flip_rate` compares the engine's routes with)
  router_margin [B, T, L]     in that forward: router prob of the k-th minus the (k+1)-th expert
  candidates [B, T, S]        kept candidate ids (-1 padded), only with sampling-mask replay
  sampled_mask [B, T] bool    multi-turn trajectories only (rollout.env): the tokens the policy
                              sampled (the trained ones); the others after the prompt are
                              observations, which have routes but no rollout log-prob
  turns [B, T] int8           multi-turn only: each token's turn index (-1 at the prompt)
  rollout_indexer, actor_indexer [B, T, Li, Ki] int32   DSA models only: the engine's
                              lightning-indexer picks and the actor's own in the pi_old forward
                              (request-local key positions, -1 padded; replay/indexer.py),
                              rollout_indexer_valid [B, T] bool
  rewards [B] fp32
and the header (safetensors metadata key `lockstep`, JSON): format, version, step,
weight_version, replay_mode, model shape, task, engine (`rollout` section), actor, correction.

Shapes: B samples, T padded time, L MoE layers, K top-k, S candidates.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lockstep.replay import ReplayMode, RouteError, compact_dtype, old_logprob_plan
from lockstep.replay.trace import validate_ids

FORMAT, VERSION = "lockstep-rollout-dump", 1
HEADER_KEY = "lockstep"
REQUIRED = ("input_ids", "seq_lens", "prompt_lens", "rollout_logprobs", "old_logprobs",
            "natural_logprobs", "replayed_logprobs", "rollout_routes", "rollout_routes_valid",
            "actor_routes", "router_margin", "rewards")
HEADER_FIELDS = ("format", "version", "step", "weight_version", "replay_mode", "model", "task",
                 "engine", "actor", "correction", "source")
MODEL_FIELDS = ("num_experts", "num_moe_layers", "top_k", "vocab_size", "moe_layer_ids")
LOGPROB_FIELDS = ("rollout_logprobs", "old_logprobs", "natural_logprobs", "replayed_logprobs")


class DumpError(ValueError):
    """A dump file that is missing, truncated or inconsistent; the message names the file, and
    the sample and field where there is one."""


@dataclass
class StepRecord:
    """One step's samples with the engine's and the actor's view of them (see module doc)."""

    header: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getattr__(self, name: str) -> torch.Tensor:
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)

    @property
    def size(self) -> int:
        return self.tensors["input_ids"].shape[0]

    @property
    def response_mask(self) -> torch.Tensor:
        """bool [B, T]: response positions (of a multi-turn dump: the sampled tokens)."""
        if "sampled_mask" in self.tensors:
            return self.tensors["sampled_mask"]
        t_T = torch.arange(self.input_ids.shape[1])
        return (t_T[None] >= self.prompt_lens[:, None]) & (t_T[None] < self.seq_lens[:, None])

    @property
    def token_mask(self) -> torch.Tensor:
        return torch.arange(self.input_ids.shape[1])[None] < self.seq_lens[:, None]

    @property
    def layer_names(self) -> list[int]:
        return list(self.header["model"]["moe_layer_ids"])


# ---------------------------------------------------------------- building a record
def model_header(cfg) -> dict[str, Any]:
    """The model fields a dump needs (from a `ModelConfig`)."""
    out = {"num_experts": cfg.num_experts, "num_moe_layers": cfg.num_moe_layers,
           "top_k": cfg.num_experts_per_tok, "vocab_size": cfg.vocab_size,
           "moe_layer_ids": list(cfg.moe_layer_ids)}
    if cfg.is_dsa:  # (left out otherwise: older dumps' headers read as before)
        out["indexer_layer_ids"] = list(cfg.indexer_layer_ids)
    return out


def run_header(cfg, step: int, weight_version: str, source: str) -> dict[str, Any]:
    """Header of a dump of `cfg` (an `ExperimentConfig`) at `step`."""
    d = json.loads(json.dumps(cfg.to_dict(), default=lambda o: getattr(o, "value", str(o))))
    return {"format": FORMAT, "version": VERSION, "step": int(step),
            "weight_version": str(weight_version), "replay_mode": ReplayMode.parse(cfg.replay.mode).value,
            "model": model_header(cfg.model), "task": d["task"], "engine": d["rollout"],
            "actor": d["actor"], "correction": d["correction"], "source": source,
            "samples_per_prompt": cfg.rollout.samples_per_prompt}


@torch.no_grad()
def router_margins(model, batch, routes_BTLK, replay_mask_BT) -> tuple[torch.Tensor, torch.Tensor]:
    """(natural top-k [B, T, L, K] int64, margin [B, T, L] fp32) of one forward of `model` (a
    `MoEModel`) over `batch` with the given replay: the router's k-th minus (k+1)-th expert
    probability at each (token, layer), how far the router was from picking another set
    (`moe.router.router_margin`: for the sigmoid family normalised scores, without its
    selection bias and group limit). The megatron actor computes the same from its routers'
    logits in its own pi_old forward (`MegatronActor.dump_fields`)."""
    from lockstep.moe.router import router_margin

    dev = next(model.parameters()).device  # the actor's device; the batch is on the host
    out = model(batch.input_ids_BT.to(dev),
                routed_experts_BTLK=None if routes_BTLK is None else routes_BTLK.to(dev),
                replay_mask_BT=replay_mask_BT.to(dev) if routes_BTLK is not None else None,
                compute_logits=False)
    B, T = batch.input_ids_BT.shape
    margins = [router_margin(logits_NE, model.cfg).view(B, T)
               for logits_NE in out.router_logits_LNE]
    return out.natural_BTLK, torch.stack(margins, -1)


ACTOR_FIELDS = ("old_logprobs", "natural_logprobs", "replayed_logprobs", "actor_routes",
                "router_margin")
"""The per-token fields of a dump that come from the actor (the rest is the batch's)."""


@torch.no_grad()
def actor_fields(actor, batch, mode: ReplayMode, old=None) -> dict[str, torch.Tensor]:
    """ACTOR_FIELDS of `batch` (host tensors), from an actor with `logprobs` and `compute` /
    `master` (before its update). `old` is the `LogprobResult` of the step's pi_old forward
    when the caller has it; otherwise it is computed here exactly as the loop does. Adds up to
    two actor forwards (natural / replayed log-probs, whichever pi_old is not) and one model
    forward (margins). A rank of the actor group calls this on its own rows."""
    plan = old_logprob_plan(mode, batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT)
    if old is None:
        old = actor.logprobs(batch, plan.routes_BTLK, plan.replay_mask_BT, record=True)
    natural = old.logprobs_BT if not plan.replays else actor.logprobs(batch).logprobs_BT
    replayed = old.logprobs_BT if plan.replays else actor.logprobs(
        batch, batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT).logprobs_BT
    model = actor.compute if hasattr(actor, "compute") else actor.master
    _, margin_BTL = router_margins(model, batch, plan.routes_BTLK, plan.replay_mask_BT)
    out = {"old_logprobs": old.logprobs_BT.float().cpu(), "natural_logprobs": natural.float().cpu(),
           "replayed_logprobs": replayed.float().cpu(),
           "actor_routes": old.natural_BTLK.to("cpu", batch.rollout_routes_BTLK.dtype),
           "router_margin": margin_BTL.float().cpu()}
    if getattr(old, "indexer_BTLK", None) is not None:  # DSA models: the actor's own picks
        out["actor_indexer"] = old.indexer_BTLK.to("cpu", torch.int32)
    return out


def record_step(actor, batch, rewards_B: torch.Tensor, header: dict[str, Any],
                old=None) -> StepRecord:
    """Everything a dump holds for `batch`, from `actor` (before its update). The actor's
    fields come from `actor.dump_fields(batch, mode, step)` where it has one (the rank
    interface: an in-process actor, or the actor group, whose ranks compute their own rows),
    else from `actor_fields` (with `old`, the pi_old forward's `LogprobResult`, if given)."""
    mode = ReplayMode.parse(header["replay_mode"])
    if old is None and hasattr(actor, "dump_fields"):
        a = actor.dump_fields(batch, mode, int(header["step"]))
    else:
        a = actor_fields(actor, batch, mode, old)
    prompt_lens = batch.response_mask_BT.int().argmax(1).long()  # the first response token
    t = {"input_ids": batch.input_ids_BT.long(), "seq_lens": batch.seq_lens_B.long(),
         "prompt_lens": prompt_lens, "rollout_logprobs": batch.rollout_logprobs_BT.float(),
         **a, "rollout_routes": batch.rollout_routes_BTLK,
         "rollout_routes_valid": batch.rollout_routes_valid_BT, "rewards": rewards_B.float()}
    if batch.candidates_BTS is not None:
        t["candidates"] = batch.candidates_BTS
    if batch.rollout_indexer_BTLK is not None and "actor_indexer" in t:
        t["rollout_indexer"] = batch.rollout_indexer_BTLK.to(torch.int32)
        t["rollout_indexer_valid"] = batch.rollout_indexer_valid_BT
    if batch.turn_BT is not None:
        t["sampled_mask"], t["turns"] = batch.response_mask_BT, batch.turn_BT
    return StepRecord(header, {k: v.detach().cpu().clone() for k, v in t.items()})


def maybe_dump(trainer, step: int, batch, rewards_B: torch.Tensor, old) -> Path | None:
    """The loop's hook: write step `step` when `loop.dump_every` says so (before the update)."""
    every = trainer.cfg.loop.dump_every
    if not every or step % every:
        return None
    header = run_header(trainer.cfg, step, trainer.state.weight_version, "train")
    return write_dump(trainer.out / "dumps" / f"step_{step}.safetensors",
                      record_step(trainer.actor, batch, rewards_B, header, old))


# ---------------------------------------------------------------- writing / reading
def write_dump(path: str | Path, record: StepRecord) -> Path:
    """Write `record` (validated first) to `path` and its header to `path` with `.json`."""
    from safetensors.torch import save_file

    path = Path(path)
    validate(record, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record.header, sort_keys=True)
    tmp = path.with_suffix(".tmp")
    save_file(record.tensors, str(tmp), metadata={HEADER_KEY: text})
    tmp.replace(path)
    path.with_suffix(".json").write_text(json.dumps(record.header, indent=2, sort_keys=True) + "\n")
    return path


def read_dump(path: str | Path) -> StepRecord:
    """Read and validate a dump; any problem is a `DumpError` naming the file (and the sample
    and field where there is one)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise DumpError(f"{path}: no such dump file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own types for truncated / garbled files
        raise DumpError(f"{path}: not a readable safetensors file (truncated or corrupt?): "
                        f"{e}") from None
    if HEADER_KEY not in meta:
        raise DumpError(f"{path}: missing field 'header' (no '{HEADER_KEY}' metadata); "
                        f"not a lockstep dump")
    try:
        header = json.loads(meta[HEADER_KEY])
    except json.JSONDecodeError as e:
        raise DumpError(f"{path}: field 'header' is not valid JSON: {e}") from None
    record = StepRecord(header, tensors)
    validate(record, str(path))
    return record


def _fail(where: str, msg: str) -> None:
    raise DumpError(f"{where}: {msg}")


def validate(rec: StepRecord, where: str = "dump") -> None:
    """Check header and tensors against each other; raise `DumpError` naming sample and field."""
    h = rec.header
    if not isinstance(h, dict):
        _fail(where, "field 'header' must be a JSON object")
    for k in HEADER_FIELDS:
        if k not in h:
            _fail(where, f"missing header field '{k}'")
    if h["format"] != FORMAT or h["version"] != VERSION:
        _fail(where, f"header format {h['format']!r} version {h['version']!r}; this reader "
                     f"reads {FORMAT!r} version {VERSION}")
    model = h["model"]
    for k in MODEL_FIELDS:
        if k not in model:
            _fail(where, f"missing header field 'model.{k}'")
    E, L, K, V = (int(model[k]) for k in ("num_experts", "num_moe_layers", "top_k", "vocab_size"))
    if len(model["moe_layer_ids"]) != L:
        _fail(where, f"header model.moe_layer_ids has {len(model['moe_layer_ids'])} entries "
                     f"for {L} MoE layers")
    ReplayMode.parse(h["replay_mode"])
    t = rec.tensors
    for k in REQUIRED:
        if k not in t:
            _fail(where, f"missing field '{k}'")
    ids = t["input_ids"]
    if ids.dim() != 2 or ids.dtype.is_floating_point:
        _fail(where, f"field 'input_ids' must be an integer [B, T] tensor, got {ids.dtype} "
                     f"{tuple(ids.shape)}")
    B, T = ids.shape
    want = {"seq_lens": (B,), "prompt_lens": (B,), "rewards": (B,),
            "rollout_routes_valid": (B, T), "rollout_routes": (B, T, L, K),
            "actor_routes": (B, T, L, K), "router_margin": (B, T, L),
            **{k: (B, T) for k in LOGPROB_FIELDS}}
    for k, shape in want.items():
        if tuple(t[k].shape) != shape:
            _fail(where, f"field '{k}' has shape {tuple(t[k].shape)}, expected {shape} "
                         f"(B={B} samples, T={T}, L={L} MoE layers, K={K})")
    for k in ("rollout_routes", "actor_routes"):
        if t[k].dtype != compact_dtype(E):
            _fail(where, f"field '{k}' has dtype {t[k].dtype}; routes of {E} experts are "
                         f"stored as {compact_dtype(E)}")
    if t["rollout_routes_valid"].dtype != torch.bool:
        _fail(where, f"field 'rollout_routes_valid' must be bool, got {t['rollout_routes_valid'].dtype}")
    for k in (*LOGPROB_FIELDS, "router_margin", "rewards"):
        if not t[k].dtype.is_floating_point:
            _fail(where, f"field '{k}' must be floating point, got {t[k].dtype}")
    seq, prompt = t["seq_lens"].tolist(), t["prompt_lens"].tolist()
    if "sampled_mask" in t:
        _check_multi_turn(t, B, T, where)
    resp = rec.response_mask
    for b in range(B):
        s = f"{where}: sample {b}"
        if not 2 <= seq[b] <= T:
            raise DumpError(f"{s}, field 'seq_lens': {seq[b]} tokens, outside [2, T={T}]")
        if not 1 <= prompt[b] < seq[b]:
            raise DumpError(f"{s}, field 'prompt_lens': {prompt[b]} prompt tokens for a "
                            f"sequence of {seq[b]} (needs 1 <= P < P + R)")
        row = ids[b, :seq[b]]
        bad = ((row < 0) | (row >= V)).nonzero()
        if len(bad):
            p = int(bad[0])
            raise DumpError(f"{s}, field 'input_ids': id {int(row[p])} at position {p} is "
                            f"outside the vocabulary [0, {V})")
        n_routed = int(t["rollout_routes_valid"][b].sum())
        if n_routed != seq[b] - 1 or not bool(t["rollout_routes_valid"][b, :seq[b] - 1].all()):
            raise DumpError(f"{s}, field 'rollout_routes_valid': {n_routed} routed rows for "
                            f"{seq[b]} tokens; expected rows 0..{seq[b] - 2} (P + R - 1 = "
                            f"{seq[b] - 1})")
        for k in ("rollout_routes", "actor_routes"):
            try:
                validate_ids(t[k][b, :seq[b] - 1], E)
            except RouteError as e:
                raise DumpError(f"{s}, field '{k}': {e}") from None
        for k in LOGPROB_FIELDS:
            v = t[k][b][resp[b]]
            bad = (~torch.isfinite(v) | (v > 1e-4)).nonzero()
            if len(bad):
                p = int(bad[0]) + prompt[b]
                raise DumpError(f"{s}, field '{k}': {float(t[k][b, p])} at position {p} is not "
                                f"a log-probability (finite, <= 0)")
        m = t["router_margin"][b, :seq[b] - 1]
        bad = (~torch.isfinite(m) | (m < 0) | (m > 1)).nonzero()
        if len(bad):
            p, layer = (int(x) for x in bad[0])
            raise DumpError(f"{s}, field 'router_margin': {float(m[p, layer])} at position {p}, "
                            f"layer {layer} is not a probability gap in [0, 1]")
        if not math.isfinite(float(t["rewards"][b])):
            raise DumpError(f"{s}, field 'rewards': {float(t['rewards'][b])} is not finite")
    if any(k in t for k in INDEXER_FIELDS):
        _check_indexer(t, B, T, seq, where)
    if "candidates" in t:
        c = t["candidates"]
        if c.dim() != 3 or c.shape[:2] != (B, T) or c.dtype.is_floating_point:
            _fail(where, f"field 'candidates' must be an integer [B={B}, T={T}, S] tensor, got "
                         f"{c.dtype} {tuple(c.shape)}")
        bad = ((c < -1) | (c >= V)).nonzero()
        if len(bad):
            b, p, j = (int(x) for x in bad[0])
            raise DumpError(f"{where}: sample {b}, field 'candidates': id {int(c[b, p, j])} at "
                            f"position {p} is outside [-1, {V})")


INDEXER_FIELDS = ("rollout_indexer", "actor_indexer", "rollout_indexer_valid")


def _check_indexer(t: dict[str, torch.Tensor], B: int, T: int, seq: list[int],
                   where: str) -> None:
    """The DSA fields: all three or none, shapes alike, rows valid (replay/indexer.py)."""
    from lockstep.replay.indexer import validate_picks

    missing = [k for k in INDEXER_FIELDS if k not in t]
    if missing:
        _fail(where, f"indexer fields {missing} are missing (a DSA dump has all of "
                     f"{list(INDEXER_FIELDS)})")
    a, r = t["actor_indexer"], t["rollout_indexer"]
    if a.dim() != 4 or a.shape != r.shape or a.shape[:2] != (B, T):
        _fail(where, f"fields 'rollout_indexer' {tuple(r.shape)} and 'actor_indexer' "
                     f"{tuple(a.shape)} must both be [B={B}, T={T}, indexer layers, index_topk]")
    for b in range(B):
        for k in ("rollout_indexer", "actor_indexer"):
            try:
                validate_picks(t[k][b, :seq[b] - 1], 0)
            except RouteError as e:
                raise DumpError(f"{where}: sample {b}, field '{k}': {e}") from None


def _check_multi_turn(t: dict[str, torch.Tensor], B: int, T: int, where: str) -> None:
    """sampled_mask / turns of a multi-turn dump: shapes, dtypes, sampled tokens only after
    the prompt and within the sequence, turns -1 exactly at the prompt and padding."""
    m = t["sampled_mask"]
    if m.dtype != torch.bool or tuple(m.shape) != (B, T):
        _fail(where, f"field 'sampled_mask' must be bool [B={B}, T={T}], got {m.dtype} "
                     f"{tuple(m.shape)}")
    turns = t.get("turns")
    if turns is None or turns.dtype != torch.int8 or tuple(turns.shape) != (B, T):
        _fail(where, f"field 'turns' must be int8 [B={B}, T={T}] with sampled_mask, got "
                     f"{None if turns is None else (turns.dtype, tuple(turns.shape))}")
    t_T = torch.arange(T)
    after_BT = (t_T[None] >= t["prompt_lens"][:, None]) & (t_T[None] < t["seq_lens"][:, None])
    bad = (m & ~after_BT).nonzero()
    if len(bad):
        b, p = (int(x) for x in bad[0])
        _fail(where, f"sample {b}, field 'sampled_mask': position {p} is outside the response")
    bad = ((turns >= 0) != after_BT).nonzero()
    if len(bad):
        b, p = (int(x) for x in bad[0])
        _fail(where, f"sample {b}, field 'turns': {int(turns[b, p])} at position {p} (-1 exactly "
                     f"at the prompt and padding)")
