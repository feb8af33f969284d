"""The megatron-core actor: same interface as `lockstep.trainer.actor.torch_actor.TorchActor`.

It trains a megatron-core GPTModel (DDP grad buffers, megatron-core's optimizer and
forward-backward schedule) and replays routes through megatron-core's `RouterReplay`, via the
one adapter `RouteReplay`. The megatron-core model is the only copy of the weights: the torch
`MoEModel` or the HF-named mapping (`LazyHF`: only this rank's shard is read) given to the
constructor supplies the initial weights and is not kept;
`export_weights(bucket_bytes)` gathers HF-named tensors across TP/EP ranks on demand (once
per RL step, for the weight push and the HF checkpoint).

Data parallelism: each DP rank takes its share of every mini-batch's rows (and of the
log-prob batch); results are summed over the DP group so every rank returns the full batch.
The loss function sees the full batch's row ids, so it normalises over the whole mini-batch;
megatron-core divides each micro-batch loss by the number of micro-batches and DDP averages
over DP ranks, which `update` undoes (`loss * micro-batches * dp`).

Differences from the torch actor (documented in docs/megatron.md): weight decay skips norms
and biases (megatron-core's rule); `lm_head_dtype` is not supported. The load-balancing loss
and the natural routing of positions without a route are the torch model's (replay.py).

Beside this file: schedule.py (how a pass runs through megatron-core's schedule), reference.py
(the KL reference's shard), checkpoint.py (this actor's checkpoint parts), layout.py (options,
layout rules, the megatron-core arguments).

Shapes: B batch rows, T padded time, L MoE layers, K top-k.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import torch
import torch.distributed as dist

from lockstep.moe.checkpoint import hf_state_dict, load_hf_state_dict
from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.moe.replay_check import ReplayCheck
from lockstep.replay import ReplayMode, compact_dtype, old_logprob_plan
from lockstep.trainer.actor.batch import Batch
from lockstep.trainer.actor.megatron import convert
from lockstep.trainer.actor.megatron.model import (build_model_chunks, initialize_parallel,
                                                   is_last_stage, transformer_config)
from lockstep.trainer.actor.megatron.reference import ShardReference
from lockstep.trainer.actor.megatron.replay import RouteReplay, moe_indices
from lockstep.trainer.actor.megatron.schedule import Schedule, moe_slice
from lockstep.trainer.actor.rank import RankActor
from lockstep.trainer.actor.torch_actor import LogprobResult, LossFn, lr_lambda, run_minibatches
from lockstep.trainer.config.megatron import (actor_options, chunk_layers, ddp_args,
                                              optimizer_args, precision_problems)
from lockstep.trainer.config.megatron import MegatronOptions
from lockstep.trainer.config.sections import ActorConfig



def init_single_process_group() -> None:
    """A world of one process on a free loopback port (the one-machine default): gloo on
    CPU, nccl on GPU 0. Multi-process runs initialise torch.distributed themselves."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)


def ddp_config():
    """megatron-core DDP settings of the actor: gradients are accumulated over micro-batches
    (and reduced over DP) in fp32 grad buffers (`main_grad`) whatever the parameter dtype."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(**ddp_args())


def options_for(cfg: ActorConfig, options: MegatronOptions | None) -> MegatronOptions:
    """MegatronOptions with the precision / aux-loss knobs taken from the ActorConfig, refused
    (ValueError) where megatron-core cannot run them here (`layout.precision_problems`)."""
    problems = precision_problems(cfg, on_gpu=torch.cuda.is_available())
    if problems:
        raise ValueError(problems[0])
    return actor_options(cfg, options)


class MegatronActor(Schedule, RankActor):
    """Policy log-probs and updates on megatron-core (the only copy of the weights)."""

    def __init__(self, source: MoEModel | Mapping[str, torch.Tensor], cfg: ActorConfig,
                 total_updates: int, temperature: float = 1.0,
                 options: MegatronOptions | None = None, model_cfg: ModelConfig | None = None,
                 replay_check: ReplayCheck = ReplayCheck.OFF, min_overlap: float | None = None):
        """`source`: the initial weights, a torch `MoEModel` (not kept) or a mapping of HF
        names (a `LazyHF` over an HF folder; then `model_cfg` gives the architecture), of
        which this rank reads only its shard: its pipeline stage's layers, its EP rank's
        experts, its TP / ETP slices (`convert.load_hf_into_megatron`). `replay_check` /
        `min_overlap`: the replay validator (`replay.check`, moe/replay_check.py)."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if isinstance(source, MoEModel):
            mcfg = source.cfg
            hf = {k: v.detach() for k, v in hf_state_dict(source).items()}
        elif model_cfg is None:
            raise ValueError("MegatronActor: a mapping of HF-named weights needs model_cfg")
        else:
            mcfg, hf = model_cfg, source
        self.cfg, self.temperature, self.model_cfg = cfg, temperature, mcfg
        self.opts = options_for(cfg, options)
        init_single_process_group()
        initialize_parallel(self.opts)
        tc = transformer_config(mcfg, self.opts)
        tc.finalize_model_grads_func = finalize_model_grads
        # one GPTModel per model chunk (one chunk unless actor.megatron.virtual_pipeline_parallel)
        self.chunks = build_model_chunks(mcfg, self.opts, tc=tc)
        convert.load_hf_into_megatron(self.chunks, hf, mcfg)
        del hf
        # megatron-core's rule: only the first chunk's grad buffer is bucketed
        self.ddps = [DistributedDataParallel(config=tc, module=m, ddp_config=ddp_config(),
                                             disable_bucketing=c > 0)
                     for c, m in enumerate(self.chunks)]
        self.optimizer = get_megatron_optimizer(OptimizerConfig(**{
            **optimizer_args(cfg, self.opts), "params_dtype": self.opts.torch_dtype}), self.ddps)
        self.lr_at = lr_lambda(cfg, total_updates)
        self.num_steps = 0
        self.aux_coef, self.num_moe_layers = self.opts.aux_loss_coef, mcfg.num_moe_layers
        # one replay adapter per chunk: each sees exactly its chunk's routers
        self.replays = [RouteReplay(m, mcfg.num_experts, aux_loss_coef=self.aux_coef,
                                    num_moe_layers=mcfg.num_moe_layers, check=replay_check,
                                    min_overlap=min_overlap) for m in self.chunks]
        self.device = next(self.chunks[0].parameters()).device
        self.route_dtype = compact_dtype(mcfg.num_experts)
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size = self.dp  # the rank interface's names
        self.tp = self.opts.tensor_parallel
        self.pp = self.opts.pipeline_parallel
        self.pp_group = ps.get_pipeline_model_parallel_group()
        # each chunk's MoE layers, as a slice of the L axis of [B, T, L, K] routes (under a
        # virtual pipeline a stage's chunks are not next to each other)
        built = [sorted(convert.stage_layers(m).values()) for m in self.chunks]
        planned = chunk_layers(mcfg, self.opts, ps.get_pipeline_model_parallel_rank())
        if built != planned:  # what `lockstep plan` prints and checkpoints assume
            raise RuntimeError(f"megatron-core built decoder layers {built} on pipeline stage "
                               f"{ps.get_pipeline_model_parallel_rank()}, but the layout "
                               f"(layout.chunk_layers) says {planned}")
        self.moe_slices = [moe_slice(mcfg, convert.stage_layers(m)) for m in self.chunks]
        # where each chunk's routes run / natural top-k go back: the L index of each router's
        # own decoder layer (its megatron-core layer_number), independent of the slice above
        stage = ps.get_pipeline_model_parallel_rank()
        for c, r in enumerate(self.replays):  # the validator names the model's MoE layers
            r.moe_ids = moe_indices(r.decoder_layers, mcfg.moe_layer_ids,
                                    f"model chunk {c} of pipeline stage {stage}")
        self.moe_written = [torch.tensor(r.moe_ids, dtype=torch.long, device=self.device)
                            for r in self.replays]
        self.last_chunk = self.chunks[-1]  # holds the LM head on the last stage
        self._update_lp = torch.zeros(0, device=self.device)
        # MoE layers exchange tokens over EP x ETP ranks; more than TP of them = other DP ranks
        self._experts_span_dp = self.opts.expert_parallel * self.opts.etp > self.tp
        # log-probs from the final hidden states with a chunked kernel: no [tokens, V/TP]
        # logits (False: megatron-core's output layer and the unchunked vocab-parallel path)
        self.chunked_logprobs = True
        self._set_lr()

    # -- model chunks ----------------------------------------------------------------------
    def _only(self, name: str):
        xs = getattr(self, name)
        if len(xs) != 1:
            raise AttributeError(f"the actor holds {len(xs)} model chunks (actor.megatron."
                                 f"virtual_pipeline_parallel={self.opts.vpp}): use self.{name}")
        return xs[0]

    @property
    def gpt(self):
        """The GPTModel (one chunk: no virtual pipeline; else use `self.chunks`)."""
        return self._only("chunks")

    @property
    def ddp(self):
        """The DDP-wrapped model (one chunk; else `self.ddps`)."""
        return self._only("ddps")

    @property
    def route_replay(self) -> RouteReplay:
        """The replay adapter (one chunk; else `self.replays`). Not `replay`: that is the
        experiment's replay options (`RankActor.replay`)."""
        return self._only("replays")

    @property
    def moe_slice(self) -> slice:
        """This stage's MoE layers in the routes' L axis (one chunk; else `self.moe_slices`)."""
        return self._only("moe_slices")

    # -- helpers -------------------------------------------------------------------------
    def _set_lr(self, lr_scale: float = 1.0) -> float:
        """The schedule's LR of the next optimiser step, x `lr_scale` (the triggered decay)."""
        lr = self.cfg.lr * self.lr_at(self.num_steps) * lr_scale
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def _my_rows(self, rows: torch.Tensor, sharded: bool) -> torch.Tensor:
        if sharded:  # the rank interface hands each DP rank its own rows
            return rows
        return rows.tensor_split(self.dp)[self.dp_rank]

    def _pp_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.pp > 1:
            dist.all_reduce(x, group=self.pp_group)
        return x

    def _dp_sum(self, x: torch.Tensor, sharded: bool = False) -> torch.Tensor:
        if self.dp > 1 and not sharded:
            dist.all_reduce(x, group=self.dp_group)
        return x

    # -- log-probs -----------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, batch: Batch, routes_BTLK: torch.Tensor | None = None,
                 replay_mask_BT: torch.Tensor | None = None, record: bool = False,
                 margin_BTL: torch.Tensor | None = None, *, sharded: bool = False
                 ) -> LogprobResult:
        """As `TorchActor.logprobs`: replay `routes_BTLK` where `replay_mask_BT` (R3), or route
        naturally; `record` returns the routes the forward ran (R2 replays them). A given
        `margin_BTL` [B, T, L] fp32 receives the router margins of the same forward (every
        MoE layer on every rank: dumps). `sharded`: `batch` is this DP rank's own rows (the
        rank interface), not a whole batch to split over the DP group and sum."""
        if routes_BTLK is None and replay_mask_BT is not None:
            raise ValueError("replay_mask_BT given without routes_BTLK")
        B, T = batch.input_ids_BT.shape
        L, K = self.model_cfg.num_moe_layers, self.model_cfg.num_experts_per_tok
        dev = self.device  # written per micro-batch, summed over DP / PP, then to the host
        lp_BT, ent_BT = torch.zeros(B, T, device=dev), torch.zeros(B, T, device=dev)
        nat = torch.zeros(B, T, L, K, dtype=torch.int64, device=dev)
        used = torch.zeros(B, T, L, K, dtype=torch.int64, device=dev)
        micro = self._micro_batches(self._my_rows(torch.arange(B, device="cpu"), sharded), batch)
        self._run(batch, micro, routes_BTLK, replay_mask_BT, used, nat, lp_BT=lp_BT,
                  ent_BT=ent_BT, margin_BTL=margin_BTL)
        more = () if margin_BTL is None else (margin_BTL,)
        for x in (lp_BT, ent_BT, used, nat, *more):  # rows over DP, layers / logits over PP
            self._dp_sum(x, sharded)
            self._pp_sum(x)
        return LogprobResult(lp_BT.cpu(), ent_BT.cpu(), self._host_routes(nat),
                             self._host_routes(used) if record else None)

    def _host_routes(self, x_BTLK: torch.Tensor) -> torch.Tensor:
        """Routes summed on the device -> compact host tensor (one copy)."""
        return x_BTLK.to(self.route_dtype).cpu()

    # -- update --------------------------------------------------------------------------
    def update(self, batch: Batch, loss_fn: LossFn, routes_BTLK: torch.Tensor | None = None,
               replay_mask_BT: torch.Tensor | None = None, shuffle_seed: int | None = None,
               ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """As `TorchActor.update`: `epochs` passes in mini-batches (one optimiser step each)
        of micro-batches, rows shuffled per epoch with `shuffle_seed` by the schedule the torch
        actor runs too (`run_minibatches`). Returns (metrics averaged over steps, routes run, natural top-k) [B, T, L, K]."""
        cfg = self.cfg
        B, T = batch.input_ids_BT.shape
        L, K = self.model_cfg.num_moe_layers, self.model_cfg.num_experts_per_tok
        if cfg.mini_batch_size % self.dp:
            raise ValueError(f"actor.mini_batch_size={cfg.mini_batch_size} is not divisible by "
                             f"the data-parallel size {self.dp}")
        if routes_BTLK is None and replay_mask_BT is not None:
            raise ValueError("replay_mask_BT given without routes_BTLK")
        used = torch.zeros(B, T, L, K, dtype=torch.int64, device=self.device)
        nat = torch.zeros(B, T, L, K, dtype=torch.int64, device=self.device)

        def step(mini: torch.Tensor) -> dict[str, float]:
            metrics = self._forward_backward(batch, loss_fn, mini, routes_BTLK, replay_mask_BT,
                                             used, nat)
            metrics.update(self._optimizer_step())
            return metrics

        metrics = run_minibatches(B, cfg, shuffle_seed, step)
        for x in (used, nat):
            self._dp_sum(x)
            self._pp_sum(x)
        return metrics, self._host_routes(used), self._host_routes(nat)

    def _forward_backward(self, batch: Batch, loss_fn: LossFn, mini: torch.Tensor,
                          routes_BTLK, replay_mask_BT, used, nat, *, sharded: bool = False,
                          ) -> dict[str, float]:
        """Gradients of one mini-batch (this DP rank's rows, in micro-batches) through
        megatron-core's schedule; metrics are the mini-batch's on every rank. Under PP the
        loss is computed on the last stage; earlier stages then hand `loss_fn` the same
        log-probs (no grad) so its side effects (the loop keeps them) happen on every rank."""
        micro = self._micro_batches(self._my_rows(mini, sharded), batch)
        self._update_lp = torch.zeros(batch.input_ids_BT.shape, device=self.device)
        metrics = self._run(batch, micro, routes_BTLK, replay_mask_BT, used, nat,
                            loss_fn=loss_fn, mini=mini,
                            mini_size=self.cfg.mini_batch_size if sharded else len(mini),
                            weighted=sharded)
        if self.pp > 1:
            parts: list = [None] * self.pp
            dist.all_gather_object(parts, metrics, group=self.pp_group)
            metrics = dict(parts[-1])
            if self.aux_coef > 0:
                metrics["actor/aux_loss"] = sum(p["actor/aux_loss"] for p in parts)
            self._pp_sum(self._update_lp)
            if not is_last_stage(self.last_chunk):
                with torch.no_grad():
                    for idx in micro:
                        lp = self._update_lp[idx]
                        loss_fn(lp, torch.zeros_like(lp), idx, mini)
        if self.aux_coef > 0:
            metrics["actor/aux_loss"] /= self.num_moe_layers
        return metrics if sharded else self._dp_mean_metrics(metrics)

    # -- the rank interface (trainer/actor/rank.py): this DP rank's shard of the batch -------------
    def old_logprobs(self, batch: Batch, mode, step: int):
        """`RankActor.old_logprobs` on this DP rank's rows (`batch` is the shard; TP / PP
        peers of a DP rank get the same shard and answer the same; only one of them counts
        its stats, so the group's sums are not multiplied)."""
        from lockstep.trainer.actor.rank import OldLogprobs
        out = super().old_logprobs(batch, mode, step)
        return OldLogprobs(out.logprobs_BT, self._peer_stats(out.stats))

    def policy_update(self, batch: Batch, inputs, mode, step: int, steps=None):
        """`RankActor.policy_update` on this DP rank's rows (see `old_logprobs`)."""
        from lockstep.trainer.actor.rank import UpdateResult
        out = super().policy_update(batch, inputs, mode, step, steps)
        return UpdateResult(out.logprobs_BT, self._peer_stats(out.stats))

    def _train_steps(self, batch: Batch, objective, steps: list[torch.Tensor], routes_BTLK,
                     replay_mask_BT, gates_BTLK=None):
        """One optimiser step per entry of `steps` (this shard's rows of each global
        mini-batch), the loss normalised by the global mini-batch's counts (`step_norms`)."""
        from lockstep.trainer.actor.torch_actor import OPTIMIZER_METRICS
        _no_gate_replay(gates_BTLK)
        B, T = batch.input_ids_BT.shape
        L, K = self.model_cfg.num_moe_layers, self.model_cfg.num_experts_per_tok
        used = torch.zeros(B, T, L, K, dtype=torch.int64, device=self.device)
        nat = torch.zeros(B, T, L, K, dtype=torch.int64, device=self.device)
        norms = self.step_norms(objective.inputs.loss_mask_BT, steps)
        sums: dict[str, float] = {}
        for i, (local, norm) in enumerate(zip(steps, norms)):
            if not len(local):
                raise ValueError(f"optimiser step {i}: data-parallel rank {self.dp_rank} has no "
                                 "rows of this mini-batch (actor.mini_batch_size must be >= "
                                 f"the data-parallel size {self.dp})")
            m = self._forward_backward(
                batch, lambda lp, ent, idx, mini, n=norm: objective(lp, ent, idx, n), local,
                routes_BTLK, replay_mask_BT, used, nat, sharded=True)
            m.update(self._optimizer_step(objective.inputs.lr_scale))
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
        self._pp_sum(used)
        self._pp_sum(nat)
        first = float(self.dp_rank == 0)
        stats = {k: (v / len(steps), 1.0 if k in OPTIMIZER_METRICS else first)
                 for k, v in sums.items()}
        return stats, self._host_routes(used), self._host_routes(nat)

    def shard_logprobs(self, batch: Batch, routes_BTLK, replay_mask_BT, record: bool = False,
                       gates_BTLK=None):
        """`logprobs` of this DP rank's own rows (the rank interface: no row split, no DP
        sums)."""
        _no_gate_replay(gates_BTLK)
        return self.logprobs(batch, routes_BTLK, replay_mask_BT, record, sharded=True)

    def _peer_stats(self, stats):
        """Stats as they are on the DP rank's representative (TP rank 0 of PP stage 0); zero
        counts and sums on its TP / PP peers."""
        from megatron.core import parallel_state as ps
        if ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0:
            return stats
        return {k: (0.0, 0.0) for k in stats}

    @torch.no_grad()
    def dump_fields(self, batch: Batch, mode: ReplayMode, step: int) -> dict[str, torch.Tensor]:
        """The dump's actor fields (`trainer.observe.dump.ACTOR_FIELDS`) of this DP rank's rows
        (`batch` is its shard; a collective over the whole world, like `old_logprobs`), as
        `trainer.observe.dump.actor_fields` makes them for the torch actor, from megatron-core's own
        routers: the pi_old forward under `mode`'s plan gives the old log-probs, its natural
        top-k and the router margins (`moe.router.router_margin` of each router's logits, in
        that same forward); one more forward gives the natural (R3) or replayed (off / R2)
        log-probs. Per-layer fields are written by the stage that holds each MoE layer and
        summed over the pipeline group, log-probs come from the last stage, TP ranks gather
        their sequence shards: every rank returns every layer of its DP rank's rows."""
        plan = old_logprob_plan(mode, batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT)
        B, T = batch.input_ids_BT.shape
        margin_BTL = torch.zeros(B, T, self.model_cfg.num_moe_layers, device=self.device)
        old = self.logprobs(batch, plan.routes_BTLK, plan.replay_mask_BT, margin_BTL=margin_BTL,
                            sharded=True)
        if plan.replays:
            natural, replayed = self.logprobs(batch, sharded=True).logprobs_BT, old.logprobs_BT
        else:
            natural, replayed = old.logprobs_BT, self.shard_logprobs(
                batch, batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT).logprobs_BT
        return {"old_logprobs": old.logprobs_BT.float(), "natural_logprobs": natural.float(),
                "replayed_logprobs": replayed.float(),
                "actor_routes": old.natural_BTLK.to(batch.rollout_routes_BTLK.dtype),
                "router_margin": margin_BTL.cpu()}

    def gradients(self, batch: Batch, loss_fn: LossFn, routes_BTLK: torch.Tensor | None = None,
                  replay_mask_BT: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Gradients of the loss over the whole batch as one mini-batch, under HF names (no
        optimiser step; buffers are zeroed after). For parity checks against the torch model."""
        B, T = batch.input_ids_BT.shape
        L, K = self.model_cfg.num_moe_layers, self.model_cfg.num_experts_per_tok
        scratch = torch.zeros(B, T, L, K, dtype=torch.int64, device=self.device)
        self._forward_backward(batch, loss_fn, torch.arange(B, device="cpu"), routes_BTLK,
                               replay_mask_BT, scratch, scratch.clone())
        grads = [{n: p.main_grad for n, p in m.named_parameters()} for m in self.chunks]
        out = convert.megatron_to_hf_state_dict(self.chunks, self.model_cfg, grads)
        self.optimizer.zero_grad()
        for m in self.ddps:
            m.zero_grad_buffer()
        return out

    def _dp_mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        # each rank weighted its rows by len(mini): the sum over DP ranks is the mini-batch mean
        if self.dp == 1 or not metrics:
            return metrics
        names = sorted(metrics)
        x = self._dp_sum(torch.tensor([metrics[k] for k in names], dtype=torch.float64,
                                      device=self.device))
        return dict(zip(names, x.tolist()))

    def _optimizer_step(self, lr_scale: float = 1.0) -> dict[str, float]:
        lr = self._set_lr(lr_scale)
        ok, grad_norm, _ = self.optimizer.step()
        self.optimizer.zero_grad()
        for m in self.ddps:
            m.zero_grad_buffer()
        self.num_steps += 1
        self._set_lr()
        return {"actor/grad_norm": float(grad_norm), "actor/lr": lr,
                "actor/skipped_step": float(not ok)}

    def export_weights(self, bucket_bytes: int):
        """The policy's weights under HF names, in buckets (lists of (name, tensor)) of at
        most `bucket_bytes` (`lockstep.moe.buckets`), gathered across TP/EP ranks one layer at
        a time. A collective: every rank iterates it to the end and gets the same buckets."""
        return convert.export_hf(self.chunks, self.model_cfg, bucket_bytes)

    def set_reference(self, reference) -> None:
        """The KL reference: an HF folder (str | Path) becomes a `ShardReference` (this rank's
        shard only); a `ReferencePolicy` (a torch model) is used as given."""
        if isinstance(reference, (str, os.PathLike)):
            reference = ShardReference(self, reference)
        super().set_reference(reference)

    def _version_tensors(self) -> list[torch.Tensor]:
        """This rank's shard of the weights the forward reads (TP / EP / PP slices) and the
        routers' expert biases (buffers; not their token counters)."""
        return [t for m in self.chunks for t in (
            *m.parameters(), *(b for n, b in m.named_buffers() if n.endswith("expert_bias")))]

    def _gen_all_rows(self) -> bool:
        # MoE layers exchange tokens with expert-parallel peers that hold other DP rows
        return self.dp > 1 and self._experts_span_dp

    @property
    def master(self) -> MoEModel:
        """A torch `MoEModel` built from `export_weights` now (a full copy made on each access,
        not kept). Only for callers that still take a model (weight push, HF checkpoint)."""
        model = MoEModel(self.model_cfg)
        load_hf_state_dict(model, {k: v for bucket in self.export_weights(1 << 30)
                                   for k, v in bucket})
        return model

    # -- checkpoint (trainer/actor/checkpoint.py has the format, megatron/checkpoint.py the parts) --
    def checkpoint_parts(self, rank: int = 0, world: int = 1):
        """(the parts this rank writes, the actor state): a collective over the world, which
        decides the writers (`rank` / `world` are the rank interface's; the same here)."""
        from lockstep.trainer.actor.megatron import checkpoint
        return checkpoint.checkpoint_parts(self)

    def load_checkpoint(self, folder, state: dict) -> None:
        """Restore this rank's slices of the optimiser state from checkpoint `folder` written
        on any layout (and, under a mixed-precision optimizer, its fp32 main weights)."""
        from pathlib import Path

        from lockstep.trainer.actor.checkpoint import hf_mapping, read_moments
        from lockstep.trainer.actor.megatron import checkpoint
        folder = Path(folder)
        checkpoint.load_checkpoint(self, read_moments(folder), state,
                                   weights=lambda: hf_mapping(folder / "hf"))

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Optimiser state and step count (the weights are saved as an HF folder)."""
        return {"optimizer": self.optimizer.state_dict(), "num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore optimiser state and step count (the weights come with the model the
        actor was built from, i.e. the checkpoint's HF folder)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.num_steps = state["num_steps"]
        self._set_lr()


def _no_gate_replay(gates_BTLK) -> None:
    """megatron-core's RouterReplay recomputes the gate weights of replayed ids from the current
    scores and has no input for given ones (the config refuses replay.gates=engine with
    actor.backend=megatron; this is the backstop)."""
    if gates_BTLK is not None:
        raise NotImplementedError("the megatron actor cannot replay gate weights "
                                  "(replay.gates=engine): RouterReplay recomputes them")
