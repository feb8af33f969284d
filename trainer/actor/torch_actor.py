"""The torch actor: log-probs with route replay or recording, and policy updates.

The actor owns the fp32 master weights (the `MoEModel` it is given) and an AdamW optimiser over
them. When `ActorConfig.dtype` (or the router / LM-head dtype) is not fp32, forwards and
backwards run on a cast copy (`model.set_precision`) whose gradients are added into the fp32
master's after every micro-batch (so they accumulate in fp32), and which is refreshed from the
master after each optimiser step. `ActorConfig.fp8`: the forward's matmuls run in block FP8
(moe/layers.py fp8_linear) and their gradients pass straight through the quantisers.

Data parallelism (`dp_group`, the Ray group's ranks) is torch's DistributedDataParallel over
the master weights: every micro-batch but a step's last runs under `no_sync`, the last one's
backward all-reduces the accumulated gradients in DDP's buckets, summed (`_sum_hook`: each rank's
loss is already its share of the global mini-batch mean). With a low-precision compute copy the
DDP forward runs the copy's module with casts of the master's parameters
(`torch.func.functional_call`), so gradients land on the fp32 master directly; in one process
the copy keeps its own parameters and `_accumulate_fp32` moves their gradients.

Log-probs are of the token at each position given the tokens before it, under
softmax(logits / temperature) over the whole vocabulary (the distribution the rollout engine
samples from; `GenerationResult.output_logprobs`), computed with the chunked kernel from the
final hidden states so no [tokens, V] log-softmax is ever built. With sampling-mask replay
(`Batch.candidates_BTS`, from `collate(..., sampling_mask=True)`) the softmax is renormalised
over each token's kept candidate set instead, the distribution a top-k / top-p sampler drew from
(`GenerationResult.sampling_logprobs`), in the old-log-prob forward and the update forwards alike.

Routes: the caller decides what to replay (`lockstep.replay.old_logprob_plan` / `update_plan`);
the actor passes the ids and per-token mask to the model and reports the routes each forward
ran and the natural top-k its router would have picked (compact dtype, every position up to
its micro-batch's longest row, 0 past it: micro-batches run trimmed, `trainer/actor/batch.py`).

Shapes: B batch rows, T padded time (prompt + response), L MoE layers, K top-k, R response,
S most kept candidates of any token in the batch, V vocabulary.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from lockstep.kernels import exact as exact_kernels
from lockstep.kernels.dtypes import torch_dtype
from lockstep.kernels.logprob import chunked_logprobs
from lockstep.moe.checkpoint import hf_state_dict
from lockstep.moe.hf_lazy import CheckpointError
from lockstep.moe.model import MoEModel
from lockstep.moe.replay_check import (LOGPROB_FORWARD, UPDATE_FORWARD, ReplayCheck, RouteCheck,
                                       sample_slice)
from lockstep.replay import ReplayOptions, compact_dtype
from lockstep.trainer.actor.batch import (Batch, micro_batches, minibatch_schedule, trim, trim_batch)
from lockstep.trainer.actor.checkpoint import (check_adam, common_step, MOMENTS, num_parts, Part,
                                               part_of, read_moments)
from lockstep.trainer.actor.rank import RankActor
from lockstep.trainer.config.sections import ActorConfig
from lockstep.trainer.objective.stats import Stats, to_floats


@dataclass
class LogprobResult:
    """Output of `TorchActor.logprobs` for a whole batch."""

    logprobs_BT: torch.Tensor        # fp32, 0 at position 0 (nothing predicts it)
    entropy_BT: torch.Tensor         # fp32, same alignment
    natural_BTLK: torch.Tensor       # compact: the router's own top-k at every position
    routes_BTLK: torch.Tensor | None  # compact: routes the forward ran (when record=True)
    gates_BTLK: torch.Tensor | None = None  # their gate weights, compute dtype (record=True)
    indexer_BTLK: torch.Tensor | None = None  # int32, DSA models: the indexers' own picks


LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                  tuple[torch.Tensor, dict[str, torch.Tensor | float]]]
"""loss_fn(logprobs_bT, entropy_bT, rows_b, minibatch_rows) -> (loss, metrics).

`rows_b` are the batch rows of this micro-batch, `minibatch_rows` those of its mini-batch. The
loss must be this micro-batch's share of the mini-batch loss (the shares are summed into one
gradient), e.g. its token-mean scaled by its share of the mini-batch's tokens. Metrics are
0-dim tensors (or floats): the actor adds them on the device, in float64, and reads them once
per optimiser step."""


OPTIMIZER_METRICS = ("actor/grad_norm", "actor/lr", "actor/skipped_step")
"""Metrics of the optimiser step itself: every DP rank has the same value."""


def run_minibatches(batch_size: int, cfg: ActorConfig, shuffle_seed: int | None,
                    step_fn: Callable[[torch.Tensor], dict[str, float]]) -> dict[str, float]:
    """The update schedule both actors share (`minibatch_schedule`): `cfg.epochs` passes over
    `batch_size` rows in mini-batches of `cfg.mini_batch_size`, rows shuffled per epoch by a
    generator seeded with `shuffle_seed` (None keeps their order). `step_fn(mini_rows)` makes one
    optimiser step on those rows and returns its metrics; returns each metric averaged over the
    steps."""
    steps = minibatch_schedule(batch_size, cfg.mini_batch_size, cfg.epochs, shuffle_seed)
    sums: dict[str, float] = {}
    for mini in steps:
        for k, v in step_fn(mini).items():
            sums[k] = sums.get(k, 0.0) + v
    return {k: v / len(steps) for k, v in sums.items()}


def lr_lambda(cfg: ActorConfig, total_updates: int) -> Callable[[int], float]:
    """LR multiplier per optimiser step: linear warm-up, then constant / cosine / linear
    (triggered: constant here; the driver's `UpdateInputs.lr_scale` multiplies it,
    trainer/driver/lr_trigger.py)."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule in ("constant", "triggered"):
            return 1.0
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, total_updates - cfg.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.lr_schedule == "cosine" else 1 - frac
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay
    return f


def _sum_hook(group, bucket):
    """DDP communication hook: sum a gradient bucket over `group` (DDP's own hook averages)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class _ComputeForward(torch.nn.Module):
    """The actor's forward with the compute copy as its module `model`, for `functional_call`
    to run on casts of the master's parameters."""

    def __init__(self, actor: "TorchActor"):
        super().__init__()
        self.model = actor.compute
        self.run = actor._forward

    def forward(self, *args):
        return self.run(*args)


class _UpdateForward(torch.nn.Module):
    """What DDP wraps: the master model's parameters, and the actor's update forward
    (log-probs, entropy, model output of one micro-batch). `forward(None, ...)` is a zero loss
    over one parameter, for a rank with no rows in a step to join its gradient all-reduce."""

    def __init__(self, actor: "TorchActor"):
        super().__init__()
        self.master = actor.master
        self.actor = actor
        # not a submodule: the compute copy's own parameters stay out of DDP's
        object.__setattr__(self, "compute",
                           None if actor.compute is actor.master else _ComputeForward(actor))
        self.casts = [(f"model.{n}", c.dtype) for n, c in actor.compute.named_parameters()]

    def forward(self, mb: Batch | None, routes, mask, gates, rows):
        if mb is None:
            return (self.master.embed_tokens.weight * 0).sum()
        if self.compute is None:
            return self.actor._forward(mb, routes, mask, gates, rows, UPDATE_FORWARD)
        cast = {n: p.to(d) for (n, d), p in zip(self.casts, self.master.parameters())}
        return torch.func.functional_call(self.compute, cast,
                                          (mb, routes, mask, gates, rows, UPDATE_FORWARD))


def _hf_views(model, per_param: Mapping[torch.nn.Parameter, torch.Tensor]) -> dict[str, torch.Tensor]:
    """For every HF name whose parameter has a tensor in `per_param` (same shape and strides
    as the parameter), the same view of that tensor as `hf_state_dict(model)` takes of the
    parameter (e.g. expert e's gate rows of the stacked gate_up_proj). Buffers (the expert
    bias) have no optimiser state and are left out."""
    by_storage = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    out = {}
    for name, v in hf_state_dict(model).items():
        p = by_storage.get(v.untyped_storage().data_ptr())
        t = None if p is None else per_param.get(p)
        if t is None:
            continue
        if t.shape != p.shape or t.stride() != p.stride():
            raise CheckpointError(f"{name}: optimiser tensor {tuple(t.shape)}/{t.stride()} does not "
                                  f"match its parameter {tuple(p.shape)}/{p.stride()}")
        out[name] = t.as_strided(v.size(), v.stride(),
                                 t.storage_offset() + v.storage_offset() - p.storage_offset())
    return out


class TorchActor(RankActor):
    """Policy log-probs and updates on our torch `MoEModel` (fp32 master weights).

    With `dp_group` (a torch.distributed group of several ranks, the Ray actor group's world)
    it is one data-parallel rank: every rank holds the whole model and optimiser; gradients
    are summed over the group before each optimiser step (torch DDP, module docstring), so the
    ranks stay equal. The rank-side interface is `lockstep.trainer.actor.rank`."""

    def __init__(self, model: MoEModel, cfg: ActorConfig, total_updates: int,
                 temperature: float = 1.0, dp_group=None, device: str | torch.device = "cpu",
                 replay: ReplayOptions | None = None,
                 replay_check: ReplayCheck = ReplayCheck.OFF, min_overlap: float | None = None,
                 exact: bool = False):
        if any(p.dtype != torch.float32 for p in model.parameters()):
            raise ValueError("the actor's master model must be fp32 (set_precision on a copy)")
        self.cfg, self.temperature = cfg, temperature
        self.replay_options = replay or ReplayOptions()
        self.replay_check, self.min_overlap = ReplayCheck(replay_check), min_overlap
        self._checked_forwards = 0  # moves `sample`'s offset (moe/replay_check.py)
        self.device = torch.device(device)
        self.master = model.to(self.device)
        self.model_cfg = model.cfg
        low = [cfg.dtype, cfg.router_dtype or cfg.dtype, cfg.lm_head_dtype or cfg.dtype]
        if all(d == "fp32" for d in low):
            self.compute = model
            if cfg.fp8:  # FP8 forward, straight-through backward into the fp32 weights
                model.set_precision(torch.float32, fp8=True)
        else:
            self.compute = copy.deepcopy(model).set_precision(
                torch_dtype(cfg.dtype), torch_dtype(cfg.router_dtype) if cfg.router_dtype else None,
                torch_dtype(cfg.lm_head_dtype) if cfg.lm_head_dtype else None, fp8=cfg.fp8)
        self.exact = exact  # batch-invariant forwards and log-probs (rollout.exact)
        if exact:
            self.compute.set_exact(True)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                           eps=cfg.eps, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lr_lambda(cfg, total_updates))
        mcfg = model.cfg
        self.route_dtype = compact_dtype(mcfg.num_experts)
        # uint16 has no index_put on CPU: route buffers hold int16 bits (ids < 65536 round-trip
        # exactly), viewed as uint16 when returned.
        self._route_store = torch.int16 if self.route_dtype == torch.uint16 else self.route_dtype
        self.dp_group, self._ddp = dp_group, None
        if dp_group is not None:
            self.dp_size, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)

    # -- forward -------------------------------------------------------------------------
    def _forward(self, batch: Batch, routes_BTLK, replay_mask_BT, gates_BTLK,
                 rows: torch.Tensor, what: str):
        """One forward of `batch` (rows `rows` of the step's batch; `what` forward, for the
        replay check's messages) -> (logprobs_BT, entropy_BT, ModelOutput)."""
        model, dev = self.compute, self.device
        ids = batch.input_ids_BT.to(dev)  # the micro-batch goes to the actor's device once
        routes = None if routes_BTLK is None else routes_BTLK.to(dev)
        mask = (replay_mask_BT.to(dev) if routes_BTLK is not None
                and replay_mask_BT is not None else None)
        picks, picks_mask = self._indexer_replay(batch, what)
        out = model(ids, routed_experts_BTLK=routes, replay_mask_BT=mask, compute_logits=False,
                    routed_gates_BTLK=None if gates_BTLK is None else gates_BTLK.to(dev),
                    replay_check=None if routes is None else self._route_check(
                        routes, mask, batch.token_mask_BT.to(dev), rows, what),
                    partial_replay=self.replay_options.partial,
                    indexer_topk_BTLK=None if picks is None else picks.to(dev),
                    indexer_mask_BT=None if picks_mask is None else picks_mask.to(dev))
        # position t-1's hidden state predicts the token at t
        cand = None if batch.candidates_BTS is None else batch.candidates_BTS[:, 1:].to(dev)
        if self.exact:
            lp, ent = self._exact_logprobs(out.hidden_BTD[:, :-1], ids[:, 1:], cand)
        else:
            lp, ent = chunked_logprobs(out.hidden_BTD[:, :-1], model.lm_head_weight,
                                       ids[:, 1:], temperature=self.temperature,
                                       candidates_NS=cand, chunk_size=self.cfg.logprob_chunk)
        zero = lp.new_zeros(lp.shape[0], 1)
        return torch.cat([zero, lp], 1), torch.cat([zero, ent], 1), out

    def _indexer_replay(self, batch: Batch, what: str):
        """(picks, mask) the forward replays (replay.indexer): the engine's in every forward
        under r3, the old-logprob forward's in the updates under r2; (None, None) otherwise."""
        mode = self.replay_options.indexer
        if mode == "r3":
            if batch.rollout_indexer_BTLK is None:
                raise ValueError("replay.indexer=r3 needs the engine's indexer picks, but the "
                                 "batch has none (the rollout backend did not return them)")
            return batch.rollout_indexer_BTLK, batch.rollout_indexer_valid_BT
        if mode == "r2" and what == UPDATE_FORWARD:
            if batch.recorded_indexer_BTLK is None:
                raise ValueError("replay.indexer=r2: the update has no recorded picks of the "
                                 "old-logprob forward")
            return batch.recorded_indexer_BTLK, batch.token_mask_BT
        return None, None

    def _exact_logprobs(self, hidden_BTD, ids_BT, cand):
        """The exact engine's log-softmax at the tokens (kernels/exact.py `logprobs`), the
        default kernel's gradient."""
        if cand is not None:
            raise ValueError("exact mode does not cover sampling-mask replay (truncated "
                             "sampling: top_p < 1 or top_k set)")
        B, T, D = hidden_BTD.shape
        w = self.compute.lm_head_weight.to(self.compute.lm_head_dtype)
        lp, ent = exact_kernels.logprobs(
            hidden_BTD.reshape(B * T, D).to(self.compute.lm_head_dtype), w, ids_BT.reshape(-1),
            self.temperature, self.cfg.logprob_chunk,
            lambda h, w_, i, t, c: chunked_logprobs(h, w_, i, temperature=t, chunk_size=c))
        return lp.view(B, T), ent.view(B, T)

    def _route_check(self, routes_BTLK, mask_BT, tokens_BT, rows, what) -> RouteCheck | None:
        """The replay validator's ledger of one forward (`replay.check`; None when off)."""
        if self.replay_check is ReplayCheck.OFF:
            return None
        B, T, L, K = routes_BTLK.shape
        checked_BT = tokens_BT if mask_BT is None else tokens_BT & mask_BT
        self._checked_forwards += 1
        # the overlap floor only where the weights are those the routes were made with: an
        # update's forwards run moved weights (a fresh router can move a lot in one step)
        return RouteCheck(routes_BTLK.reshape(B * T, L, K), checked_BT.reshape(-1),
                          sample_slice(self.replay_check, self._checked_forwards),
                          self.model_cfg.moe_layer_ids, lambda n: (int(rows[n // T]), n % T),
                          num_experts=self.model_cfg.num_experts,
                          min_overlap=self.min_overlap if what == LOGPROB_FORWARD else 0.0,
                          what=what)

    @staticmethod
    def _replay_args(routes_BTLK, replay_mask_BT, idx, t, gates_BTLK=None):
        """Rows `idx` of the replay inputs, cut to the micro-batch's time `t`."""
        if routes_BTLK is None:
            if replay_mask_BT is not None or gates_BTLK is not None:
                raise ValueError("replay_mask_BT / gates_BTLK given without routes_BTLK")
            return None, None, None
        return (trim(routes_BTLK, idx, t),
                None if replay_mask_BT is None else trim(replay_mask_BT, idx, t),
                None if gates_BTLK is None else trim(gates_BTLK, idx, t))

    @torch.no_grad()
    def logprobs(self, batch: Batch, routes_BTLK: torch.Tensor | None = None,
                 replay_mask_BT: torch.Tensor | None = None, record: bool = False,
                 gates_BTLK: torch.Tensor | None = None) -> LogprobResult:
        """Log-probs of every token of `batch` (old log-probs before an update), in
        micro-batches. `routes_BTLK`/`replay_mask_BT` replay (R3), with `gates_BTLK` their gate
        weights too; `record` keeps the routes this forward ran and their gate weights (R2
        replays them in `update`)."""
        B, T = batch.input_ids_BT.shape
        L, K = self.master.cfg.num_moe_layers, self.master.cfg.num_experts_per_tok
        host = torch.device("cpu")  # results: one copy back per micro-batch
        lp_BT = torch.zeros(B, T, device=host)
        ent_BT = torch.zeros(B, T, device=host)
        nat_BTLK = torch.zeros(B, T, L, K, dtype=self._route_store, device=host)
        used_BTLK = torch.zeros(B, T, L, K, dtype=self._route_store, device=host) \
            if record else None
        used_gates_BTLK = torch.zeros(B, T, L, K, dtype=self.compute.compute_dtype,
                                      device=host) if record else None
        mcfg = self.master.cfg
        picks_BTLK = torch.full((B, T, mcfg.num_indexer_layers, mcfg.index_topk), -1,
                                dtype=torch.int32, device=host) if mcfg.is_dsa else None
        for idx in micro_batches(torch.arange(B, device="cpu"), batch.seq_lens_B, self.cfg):
            mb = trim_batch(batch, idx)  # cut to its own longest row: padding is not compute
            t = mb.input_ids_BT.shape[1]
            r, m, g = self._replay_args(routes_BTLK, replay_mask_BT, idx, t, gates_BTLK)
            lp, ent, out = self._forward(mb, r, m, g, idx, LOGPROB_FORWARD)
            lp_BT[idx, :t], ent_BT[idx, :t] = lp.float().cpu(), ent.float().cpu()
            nat_BTLK[idx, :t] = out.natural_BTLK.to(self._route_store).cpu()
            if record:
                used_BTLK[idx, :t] = out.routes_BTLK.to(self._route_store).cpu()
                used_gates_BTLK[idx, :t] = out.gates_BTLK.cpu()
            if picks_BTLK is not None:
                picks_BTLK[idx, :t] = out.indexer_natural_BTLK.to(torch.int32).cpu()
        return LogprobResult(lp_BT, ent_BT, nat_BTLK.view(self.route_dtype),
                             None if used_BTLK is None else used_BTLK.view(self.route_dtype),
                             used_gates_BTLK, picks_BTLK)

    # -- update --------------------------------------------------------------------------
    def update(self, batch: Batch, loss_fn: LossFn, routes_BTLK: torch.Tensor | None = None,
               replay_mask_BT: torch.Tensor | None = None, shuffle_seed: int | None = None,
               steps: list[torch.Tensor] | None = None, mini_size: int | None = None,
               lr_scale: float = 1.0, gates_BTLK: torch.Tensor | None = None,
               ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """`epochs` passes over `batch` in mini-batches of `mini_batch_size` rows (one optimiser
        step each), each accumulated over micro-batches. Rows are shuffled per epoch with
        `shuffle_seed` (None keeps their order). Returns (metrics averaged over optimiser
        steps, routes the last pass ran [B,T,L,K], natural top-k of the last pass [B,T,L,K]).

        A DP rank (`policy_update`) passes `steps` instead: its local rows of each global
        optimiser step (maybe none), with `mini_size` the global mini-batch's rows; `loss_fn`'s
        metrics are then already weighted to add up over micro-batches and ranks. `lr_scale`
        multiplies the schedule's LR of these steps (the triggered decay)."""
        B, T = batch.input_ids_BT.shape
        L, K = self.master.cfg.num_moe_layers, self.master.cfg.num_experts_per_tok
        # routes run and natural top-k: filled on the device, host results once per update
        # (R2's replay plan is made on the host)
        used_BTLK = torch.zeros(B, T, L, K, dtype=self._route_store, device=self.device)
        nat_BTLK = torch.zeros(B, T, L, K, dtype=self._route_store, device=self.device)
        # where each layer ran the given ids in the last pass (partial replay's stats)
        replayed_BTL = None if routes_BTLK is None else \
            torch.zeros(B, T, L, dtype=torch.bool, device=self.device)
        self.compute.train()
        if steps is None:
            metrics = run_minibatches(
                B, self.cfg, shuffle_seed,
                lambda mini: self._train_step(batch, loss_fn, mini, routes_BTLK, replay_mask_BT,
                                              used_BTLK, nat_BTLK, replayed_BTL,
                                              lr_scale=lr_scale, gates_BTLK=gates_BTLK))
        else:
            sums: dict[str, float] = {}
            for local in steps:
                for k, v in self._train_step(batch, loss_fn, local, routes_BTLK, replay_mask_BT,
                                             used_BTLK, nat_BTLK, replayed_BTL,
                                             mini_size=mini_size, weighted=True,
                                             lr_scale=lr_scale, gates_BTLK=gates_BTLK).items():
                    sums[k] = sums.get(k, 0.0) + v
            metrics = {k: v / len(steps) for k, v in sums.items()}
        self.last_replayed_BTL = None if replayed_BTL is None else replayed_BTL.cpu()
        return (metrics, used_BTLK.cpu().view(self.route_dtype),
                nat_BTLK.cpu().view(self.route_dtype))

    def _train_steps(self, batch: Batch, objective, steps: list[torch.Tensor], routes_BTLK,
                     replay_mask_BT, gates_BTLK=None) -> tuple[Stats, torch.Tensor, torch.Tensor]:
        """The rank side of `policy_update`: `update` over this shard's part of every optimiser
        step, the loss normalised by the whole mini-batch's counts (`step_norms`, one
        all-reduce for all steps). Returns (stats, routes run, natural top-k) of the shard."""
        norms = self.step_norms(objective.inputs.loss_mask_BT, steps)
        by_step = {id(local): n for local, n in zip(steps, norms)}
        metrics, used_BTLK, nat_BTLK = self.update(
            batch, lambda lp, ent, idx, local: objective(lp, ent, idx, by_step[id(local)]),
            routes_BTLK, replay_mask_BT, steps=steps, mini_size=self.cfg.mini_batch_size,
            lr_scale=objective.inputs.lr_scale, gates_BTLK=gates_BTLK)
        # optimiser metrics are replicated (every rank counts them); the loss metrics are this
        # rank's share of each mini-batch (added over ranks, counted once)
        first = float(self.dp_rank == 0)
        return ({k: (v, 1.0 if k in OPTIMIZER_METRICS else first) for k, v in metrics.items()},
                used_BTLK, nat_BTLK)

    def _train_step(self, batch: Batch, loss_fn: LossFn, mini: torch.Tensor, routes_BTLK,
                    replay_mask_BT, used_BTLK, nat_BTLK, replayed_BTL,
                    mini_size: int | None = None, weighted: bool = False, lr_scale: float = 1.0,
                    gates_BTLK=None) -> dict[str, float]:
        """One optimiser step on rows `mini`, gradients accumulated over micro-batches; writes
        the routes run, the natural top-k and where the given ids ran (partial replay) of those
        rows into `used_BTLK` / `nat_BTLK` / `replayed_BTL` (on the device). Metrics are added
        on the device in float64 (the sums a Python float would make) and read once.
        `mini_size`: rows of the whole mini-batch when `mini` is one DP rank's part of it.
        `weighted`: loss_fn's metrics are already weighted to add up (`rank.Objective`);
        otherwise each micro-batch's metrics are weighted by its share of the rows."""
        cfg = self.cfg
        mini_size = len(mini) if mini_size is None else mini_size
        step_metrics: dict[str, torch.Tensor | float] = {}
        mcfg = self.master.cfg
        load_LE = torch.zeros(mcfg.num_moe_layers, mcfg.num_experts, device=self.device) \
            if cfg.expert_bias_update_rate > 0 else None  # on device: NCCL all-reduces it
        T = batch.input_ids_BT.shape[1]
        ddp = self._data_parallel()
        idxs = list(micro_batches(mini, batch.seq_lens_B, cfg)) if len(mini) else []
        if ddp is not None and not idxs:  # no rows here this step: join the all-reduce
            ddp(None, None, None, None, None).backward()
        for i, idx in enumerate(idxs):
            mb = trim_batch(batch, idx)  # cut to its own longest row: padding is not compute
            t = mb.input_ids_BT.shape[1]
            r, m, g = self._replay_args(routes_BTLK, replay_mask_BT, idx, t, gates_BTLK)
            # DDP all-reduces in the backward of a step's last micro-batch only
            with ddp.no_sync() if ddp is not None and i < len(idxs) - 1 else contextlib.nullcontext():
                lp, ent, out = (self._forward(mb, r, m, g, idx, UPDATE_FORWARD) if ddp is None
                                else ddp(mb, r, m, g, idx))
                lp, ent = (torch.nn.functional.pad(x, (0, T - t)) for x in (lp, ent))  # [b, T]
                loss, metrics = loss_fn(lp, ent, idx, mini)
                if cfg.aux_loss_coef > 0:
                    aux = self.compute.load_balancing_loss(out, mb.token_mask_BT.to(self.device))
                    loss = loss + cfg.aux_loss_coef * aux * (len(idx) / mini_size)
                    metrics["actor/aux_loss"] = aux.detach().double() * (len(idx) / mini_size if weighted else 1)
                loss.backward()
            self._accumulate_fp32()
            used_BTLK[idx, :t] = out.routes_BTLK.detach().to(self._route_store)
            nat_BTLK[idx, :t] = out.natural_BTLK.detach().to(self._route_store)
            if out.replayed_BTL is not None:
                replayed_BTL[idx, :t] = out.replayed_BTL
            if cfg.expert_bias_update_rate > 0:  # the load of the routes that ran
                load_LE += self.compute.expert_loads(out.routes_BTLK,
                                                     mb.token_mask_BT.to(self.device))
            for k, v in metrics.items():  # metrics are micro-batch means: weight them
                v = v.detach().double() if torch.is_tensor(v) else v
                step_metrics[k] = step_metrics.get(k, 0.0) + (
                    v if weighted else v * len(idx) / mini_size)
        step_metrics.update(self._optimizer_step(lr_scale))
        if load_LE is not None:
            if self.dp_size > 1:  # every rank applies the same update: the global load
                self._all_reduce(load_LE)
            for model in {id(self.master): self.master, id(self.compute): self.compute}.values():
                model.apply_expert_bias_update(load_LE, cfg.expert_bias_update_rate)
            step_metrics["actor/expert_load_max_over_mean"] = (
                load_LE.max(-1).values / load_LE.mean(-1).clamp(min=1e-9)).mean()
        return to_floats(step_metrics)  # the step's one read of its metrics

    def _data_parallel(self) -> torch.nn.parallel.DistributedDataParallel | None:
        """The DDP module of a data-parallel rank (built at its first update; None in one
        process). MoE experts a rank's tokens did not reach get no gradient there:
        `find_unused_parameters`. A parameter no rank touched keeps grad None (AdamW skips it,
        as in one process). The expert bias buffer is equal on every rank by construction."""
        if self.dp_size == 1:
            return None
        if self._ddp is None:
            self._ddp = torch.nn.parallel.DistributedDataParallel(
                _UpdateForward(self), process_group=self.dp_group,
                device_ids=[self.device] if self.device.type == "cuda" else None,
                find_unused_parameters=True, broadcast_buffers=False)
            self._ddp.register_comm_hook(self.dp_group, _sum_hook)
        return self._ddp

    @torch.no_grad()
    def _accumulate_fp32(self) -> None:
        """Move a low-precision compute copy's gradients into the fp32 master's after every
        micro-batch, so they accumulate in fp32 (a bf16 sum of micro-batch gradients would
        lose ~3 significant digits)."""
        if self.compute is self.master:
            return
        for pm, pc in zip(self.master.parameters(), self.compute.parameters()):
            if pc.grad is not None:
                g = pc.grad.float()
                pm.grad = g if pm.grad is None else pm.grad.add_(g)
                pc.grad = None

    def _optimizer_step(self, lr_scale: float = 1.0) -> dict[str, float]:
        """Clip, step at the schedule's LR x `lr_scale`, advance the schedule."""
        params = [p for p in self.master.parameters() if p.grad is not None]
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if lr_scale != 1.0:  # the scheduler's next step sets the LR from its base again
            for g in self.optimizer.param_groups:
                g["lr"] *= lr_scale
        lr = self.optimizer.param_groups[0]["lr"]
        norm = float(grad_norm)  # the step's one wait for the device before stepping
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.sync_compute()
        return {"actor/grad_norm": norm, "actor/lr": lr,
                "actor/skipped_step": float(not math.isfinite(norm))}

    @torch.no_grad()
    def sync_compute(self) -> None:
        """Refresh the low-precision compute copy from the fp32 master weights."""
        if self.compute is not self.master:
            for pm, pc in zip(self.master.parameters(), self.compute.parameters()):
                pc.copy_(pm)

    def _version_tensors(self) -> list[torch.Tensor]:
        """What the log-prob forward reads: the compute model's parameters and buffers (a
        kept version is in the compute precision, as pi_old saw it)."""
        return [*self.compute.parameters(), *self.compute.buffers()]

    # -- checkpoint (trainer/actor/checkpoint.py has the format) ----------------------------------
    def checkpoint_parts(self, rank: int = 0, world: int = 1) -> tuple[Iterator[Part], dict]:
        """Its part of a checkpoint (trainer/actor/checkpoint.py): (the parts rank `rank` of `world`
        writes, the actor state). Every data-parallel rank holds the whole model and optimiser,
        so nothing is exchanged."""
        model, opt = self.master, self.optimizer
        weights = {k: v.detach() for k, v in hf_state_dict(model).items()}
        states = {p: opt.state[p] for g in opt.param_groups for p in g["params"] if opt.state.get(p)}
        for p, s in states.items():
            check_adam(s, "torch actor")
        moments = {m: _hf_views(model, {p: s[m] for p, s in states.items()}) for m in MOMENTS}
        step = common_step([s["step"] for s in states.values()], "torch actor")
        n = num_parts(self.model_cfg)

        def parts() -> Iterator[Part]:
            for p in range(rank, n, world):
                names = [k for k in weights if part_of(k) == p]
                no_state = {k for k in names if k not in moments["exp_avg"]}
                yield Part(p, {k: weights[k] for k in names},
                           {m: {k: (torch.zeros_like(weights[k]) if k in no_state else moments[m][k])
                                for k in names} for m in MOMENTS}, no_state)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        return parts(), {"step": step, "scheduler": self.scheduler.state_dict(),
                         "param_groups": groups}

    def load_checkpoint(self, folder, state: dict) -> None:
        """Restore the optimiser from checkpoint `folder` written on any layout (`state`: what
        `write_checkpoint` returned): the HF-named moments `optim/<m>/`, viewed as the master
        model's parameters."""
        moments = read_moments(Path(folder))
        model, opt = self.master, self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        per = {m: {p: torch.zeros_like(p) for p in params} for m in MOMENTS}
        no_state = set(state.get("no_state", ()))
        have: dict[torch.nn.Parameter, bool] = {}
        views = {m: _hf_views(model, per[m]) for m in MOMENTS}
        by_storage = {p.untyped_storage().data_ptr(): p for p in params}
        with torch.no_grad():
            for m in MOMENTS:
                for name, view in views[m].items():
                    view.copy_(moments[m][name])
            for name, v in hf_state_dict(model).items():
                p = by_storage.get(v.untyped_storage().data_ptr())
                if p is not None:
                    have[p] = have.get(p, False) or name not in no_state
        opt.state.clear()
        step = state.get("step")
        if step is not None:
            for p in params:
                if have.get(p):
                    opt.state[p] = {"step": torch.tensor(step["step"], dtype=getattr(torch, step["dtype"]),
                                                         device=p.device),
                                    **{m: per[m][p] for m in MOMENTS}}
        for g, saved in zip(opt.param_groups, state["param_groups"]):
            g.update(saved)
        self.scheduler.load_state_dict(state["scheduler"])
        self.sync_compute()

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Optimiser and LR-schedule state (the weights are saved as an HF folder)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sync_compute()
