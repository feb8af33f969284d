"""The torch actor: log-probs with route replay or recording, and policy updates.

The actor owns the fp32 master weights (the `MoEModel` it is given) and an AdamW optimiser over
them. When `ActorConfig.dtype` (or the router / LM-head dtype) is not fp32, forwards and
backwards run on a cast copy (`model.set_precision`) whose gradients are copied to the fp32
master before the optimiser step, and which is refreshed from the master after it.

Log-probs are of the token at each position given the tokens before it, under
softmax(logits / temperature) over the whole vocabulary (the distribution the rollout engine
samples from; `GenerationResult.output_logprobs`), computed with the chunked kernel from the
final hidden states so no [tokens, V] log-softmax is ever built. With sampling-mask replay
(`Batch.candidates_BTS`, from `collate(..., sampling_mask=True)`) the softmax is renormalised
over each token's kept candidate set instead, the distribution a top-k / top-p sampler drew from
(`GenerationResult.sampling_logprobs`), in the old-log-prob forward and the update forwards alike.

Routes: the caller decides what to replay (`lockstep.replay.old_logprob_plan` / `update_plan`);
the actor passes the ids and per-token mask to the model and reports the routes each forward
ran and the natural top-k its router would have picked (compact dtype, all positions).

Shapes: B batch rows, T padded time (prompt + response), L MoE layers, K top-k, R response,
S most kept candidates of any token in the batch, V vocabulary.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

from lockstep.kernels.logprob import chunked_logprobs
from lockstep.moe.model import MoEModel
from lockstep.replay import RoutingTrace, batch_traces, compact_dtype
from lockstep.rollout.types import GenerationResult
from lockstep.trainer.config import ActorConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Batch:
    """One RL batch, right-padded, every per-token tensor aligned with `input_ids_BT`.

    Position t of a per-token tensor refers to the token at position t (its log-prob is that
    of predicting it from positions < t); routes row t is the routing of the token at t.
    """

    input_ids_BT: torch.Tensor          # long: prompt + response, right-padded with pad id
    response_mask_BT: torch.Tensor      # bool: True at response tokens (the trained positions)
    rollout_logprobs_BT: torch.Tensor   # fp32: the engine's log-prob at response tokens, else 0
    seq_lens_B: torch.Tensor            # long: P + R per row
    rollout_routes_BTLK: torch.Tensor | None = None  # compact: the engine's routes
    rollout_routes_valid_BT: torch.Tensor | None = None  # bool: rows that have an engine route
    candidates_BTS: torch.Tensor | None = None  # int16/int32: kept ids of the token at t, -1 pad;
    # a row of all -1 = whole vocabulary (prompt, padding, untruncated tokens)

    @property
    def size(self) -> int:
        return self.input_ids_BT.shape[0]

    @property
    def token_mask_BT(self) -> torch.Tensor:
        """bool: real (non-padding) tokens."""
        T = self.input_ids_BT.shape[1]
        return torch.arange(T)[None, :] < self.seq_lens_B[:, None]

    def rows(self, idx: torch.Tensor) -> "Batch":
        """The sub-batch of rows `idx` (long [b])."""
        parts = {f.name: getattr(self, f.name) for f in fields(self)}
        return Batch(**{k: None if v is None else v[idx] for k, v in parts.items()})


def collate(results: Sequence[GenerationResult], pad_id: int, num_experts: int,
            num_layers: int, top_k: int, *, sampling_mask: bool = False,
            vocab_size: int | None = None) -> Batch:
    """Right-pad engine results into a Batch; routes are checked against each sample's length
    and the model (an error names the sample).

    `sampling_mask=True` (sampling-mask replay): every result must carry `sampling_mask` and
    `sampling_logprobs` (request them with `return_sampling_mask`); the rollout log-probs are
    then the truncated, renormalised `sampling_logprobs` and `candidates_BTS` holds each
    response token's kept ids. `vocab_size` is required then (ids are checked against it, and a
    support of the whole vocabulary is stored as "no restriction")."""
    if not results:
        raise ValueError("collate needs at least one GenerationResult")
    if sampling_mask and vocab_size is None:
        raise ValueError("collate(sampling_mask=True) needs vocab_size")
    seq_lens = [r.prompt_tokens + r.completion_tokens for r in results]
    B, T = len(results), max(seq_lens)
    ids_BT = torch.full((B, T), pad_id, dtype=torch.long)
    resp_BT = torch.zeros(B, T, dtype=torch.bool)
    rollout_lp_BT = torch.zeros(B, T, dtype=torch.float32)
    traces = []
    for b, r in enumerate(results):
        P, R = r.prompt_tokens, r.completion_tokens
        if R < 1:
            raise ValueError(f"sample {b}: empty response (nothing to train on)")
        if r.output_logprobs.shape != (R,):
            raise ValueError(f"sample {b}: {tuple(r.output_logprobs.shape)} output log-probs for "
                             f"{R} output tokens")
        ids_BT[b, :P + R] = torch.tensor(list(r.prompt_ids) + list(r.output_ids))
        resp_BT[b, P:P + R] = True
        if sampling_mask:
            if r.sampling_logprobs is None or r.sampling_logprobs.shape != (R,):
                got = None if r.sampling_logprobs is None else tuple(r.sampling_logprobs.shape)
                raise ValueError(f"sample {b}: sampling-mask replay needs sampling_logprobs for "
                                 f"its {R} output tokens, got {got}")
            rollout_lp_BT[b, P:P + R] = r.sampling_logprobs.float()
        else:
            rollout_lp_BT[b, P:P + R] = r.output_logprobs.float()
        if r.routes_NLK is not None:
            trace = RoutingTrace(r.routes_NLK, num_experts, sample=b)
            trace.check(P, R, num_layers, top_k, num_experts, sample=b)
            traces.append(trace)
    if traces and len(traces) != B:
        raise ValueError(f"{B - len(traces)} of {B} samples have no routes; all or none must")
    routes, valid = batch_traces(traces, T, seq_lens) if traces else (None, None)
    cand_BTS = _candidates(results, T, vocab_size) if sampling_mask else None
    return Batch(ids_BT, resp_BT, rollout_lp_BT, torch.tensor(seq_lens), routes, valid, cand_BTS)


def _candidates(results: Sequence[GenerationResult], T: int, V: int) -> torch.Tensor:
    """Per-token kept ids [B, T, S] (-1 padded, smallest int dtype that holds V), aligned with
    the response positions; checked: each sampled id is in its own set (an error names the
    sample and the output position). Vectorised per sample: no per-token Python beyond
    collecting the lists."""
    parts: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (b, positions, ids [n, s])
    for b, r in enumerate(results):
        P, R = r.prompt_tokens, r.completion_tokens
        if r.sampling_mask is None or len(r.sampling_mask) != R:
            got = None if r.sampling_mask is None else len(r.sampling_mask)
            raise ValueError(f"sample {b}: sampling-mask replay needs a sampling mask for each "
                             f"of its {R} output tokens, got {got} (request "
                             "return_sampling_mask)")
        at = [i for i, m in enumerate(r.sampling_mask) if m is not None]
        if not at:
            continue
        seqs = [torch.as_tensor(r.sampling_mask[i]).reshape(-1) for i in at]
        n_n = torch.tensor([len(x) for x in seqs])
        flat = torch.cat(seqs).long()
        row = torch.repeat_interleave(torch.arange(len(at)), n_n)
        col = torch.arange(len(flat)) - torch.repeat_interleave(n_n.cumsum(0) - n_n, n_n)
        ids_nS = torch.full((len(at), max(int(n_n.max()), 1)), -1, dtype=torch.long)
        ids_nS[row, col] = flat
        real_nS = torch.arange(ids_nS.shape[1])[None] < n_n[:, None]
        bad_n = (n_n == 0) | ((real_nS & ((ids_nS < 0) | (ids_nS >= V))).any(-1))
        chosen_n = torch.tensor([r.output_ids[i] for i in at])
        bad_n |= ~(ids_nS == chosen_n[:, None]).any(-1)
        if bool(bad_n.any()):
            j = int(bad_n.nonzero()[0])
            raise ValueError(f"sample {b}, output token {at[j]}: kept ids "
                             f"{seqs[j].tolist()[:8]}... are empty, outside [0, {V}) or miss "
                             f"the sampled id {int(chosen_n[j])}")
        part_n = n_n < V  # a full support is stored as "no restriction"
        if bool(part_n.any()):
            pos_n = torch.tensor(at)[part_n] + P
            parts.append((b, pos_n, ids_nS[part_n][:, :int(n_n[part_n].max())]))
    S = max((ids.shape[1] for _, _, ids in parts), default=1)
    dtype = torch.int16 if V <= torch.iinfo(torch.int16).max else torch.int32
    cand_BTS = torch.full((len(results), T, S), -1, dtype=dtype)
    for b, pos_n, ids_nS in parts:
        cand_BTS[b, pos_n, :ids_nS.shape[1]] = ids_nS.to(dtype)
    return cand_BTS


@dataclass
class LogprobResult:
    """Output of `TorchActor.logprobs` for a whole batch."""

    logprobs_BT: torch.Tensor        # fp32, 0 at position 0 (nothing predicts it)
    entropy_BT: torch.Tensor         # fp32, same alignment
    natural_BTLK: torch.Tensor       # compact: the router's own top-k at every position
    routes_BTLK: torch.Tensor | None  # compact: routes the forward ran (when record=True)


LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                  tuple[torch.Tensor, dict[str, float]]]
"""loss_fn(logprobs_bT, entropy_bT, rows_b, minibatch_rows) -> (loss, metrics).

`rows_b` are the batch rows of this micro-batch, `minibatch_rows` those of its mini-batch. The
loss must be this micro-batch's share of the mini-batch loss (the shares are summed into one
gradient), e.g. its token-mean scaled by its share of the mini-batch's tokens."""


def run_minibatches(batch_size: int, cfg: ActorConfig, shuffle_seed: int | None,
                    step_fn: Callable[[torch.Tensor], dict[str, float]]) -> dict[str, float]:
    """The update schedule both actors share: `cfg.epochs` passes over `batch_size` rows in
    mini-batches of `cfg.mini_batch_size`, rows shuffled per epoch by a generator seeded with
    `shuffle_seed` (None keeps their order). `step_fn(mini_rows)` makes one optimiser step on
    those rows and returns its metrics; returns each metric averaged over the steps."""
    if batch_size % cfg.mini_batch_size:
        raise ValueError(f"batch of {batch_size} rows is not a multiple of "
                         f"actor.mini_batch_size={cfg.mini_batch_size}")
    gen = None if shuffle_seed is None else torch.Generator().manual_seed(shuffle_seed)
    sums: dict[str, float] = {}
    n_steps = 0
    for _ in range(cfg.epochs):
        order = (torch.arange(batch_size) if gen is None
                 else torch.randperm(batch_size, generator=gen))
        for mini in order.split(cfg.mini_batch_size):
            for k, v in step_fn(mini).items():
                sums[k] = sums.get(k, 0.0) + v
            n_steps += 1
    return {k: v / n_steps for k, v in sums.items()}


def lr_lambda(cfg: ActorConfig, total_updates: int) -> Callable[[int], float]:
    """LR multiplier per optimiser step: linear warm-up, then constant / cosine / linear."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, total_updates - cfg.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.lr_schedule == "cosine" else 1 - frac
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay
    return f


class TorchActor:
    """Policy log-probs and updates on our torch `MoEModel` (fp32 master weights)."""

    def __init__(self, model: MoEModel, cfg: ActorConfig, total_updates: int,
                 temperature: float = 1.0):
        if any(p.dtype != torch.float32 for p in model.parameters()):
            raise ValueError("the actor's master model must be fp32 (set_precision on a copy)")
        self.cfg, self.temperature = cfg, temperature
        self.master = model
        low = [cfg.dtype, cfg.router_dtype or cfg.dtype, cfg.lm_head_dtype or cfg.dtype]
        if all(d == "fp32" for d in low):
            self.compute = model
        else:
            self.compute = copy.deepcopy(model).set_precision(
                DTYPES[cfg.dtype], DTYPES[cfg.router_dtype] if cfg.router_dtype else None,
                DTYPES[cfg.lm_head_dtype] if cfg.lm_head_dtype else None)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                           eps=cfg.eps, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lr_lambda(cfg, total_updates))
        mcfg = model.cfg
        self.route_dtype = compact_dtype(mcfg.num_experts)

    # -- forward -------------------------------------------------------------------------
    def _forward(self, batch: Batch, routes_BTLK, replay_mask_BT):
        """One forward of `batch` -> (logprobs_BT, entropy_BT, ModelOutput)."""
        model = self.compute
        out = model(batch.input_ids_BT,
                    routed_experts_BTLK=routes_BTLK,
                    replay_mask_BT=replay_mask_BT if routes_BTLK is not None else None,
                    compute_logits=False)
        # position t-1's hidden state predicts the token at t
        cand = None if batch.candidates_BTS is None else batch.candidates_BTS[:, 1:]
        lp, ent = chunked_logprobs(out.hidden_BTD[:, :-1], model.lm_head_weight,
                                   batch.input_ids_BT[:, 1:], temperature=self.temperature,
                                   candidates_NS=cand, chunk_size=self.cfg.logprob_chunk)
        zero = lp.new_zeros(lp.shape[0], 1)
        return torch.cat([zero, lp], 1), torch.cat([zero, ent], 1), out

    def _micro_batches(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return list(rows.split(self.cfg.micro_batch_size))

    @staticmethod
    def _replay_args(routes_BTLK, replay_mask_BT, idx):
        if routes_BTLK is None:
            if replay_mask_BT is not None:
                raise ValueError("replay_mask_BT given without routes_BTLK")
            return None, None
        return routes_BTLK[idx], None if replay_mask_BT is None else replay_mask_BT[idx]

    @torch.no_grad()
    def logprobs(self, batch: Batch, routes_BTLK: torch.Tensor | None = None,
                 replay_mask_BT: torch.Tensor | None = None, record: bool = False,
                 ) -> LogprobResult:
        """Log-probs of every token of `batch` (old log-probs before an update), in
        micro-batches. `routes_BTLK`/`replay_mask_BT` replay (R3); `record` keeps the routes
        this forward ran (R2 replays them in `update`)."""
        B, T = batch.input_ids_BT.shape
        L, K = self.master.cfg.num_moe_layers, self.master.cfg.num_experts_per_tok
        lp_BT = torch.zeros(B, T)
        ent_BT = torch.zeros(B, T)
        nat_BTLK = torch.zeros(B, T, L, K, dtype=self.route_dtype)
        used_BTLK = torch.zeros(B, T, L, K, dtype=self.route_dtype) if record else None
        for idx in self._micro_batches(torch.arange(B)):
            r, m = self._replay_args(routes_BTLK, replay_mask_BT, idx)
            lp, ent, out = self._forward(batch.rows(idx), r, m)
            lp_BT[idx], ent_BT[idx] = lp.float(), ent.float()
            nat_BTLK[idx] = out.natural_BTLK.to(self.route_dtype)
            if record:
                used_BTLK[idx] = out.routes_BTLK.to(self.route_dtype)
        return LogprobResult(lp_BT, ent_BT, nat_BTLK, used_BTLK)

    # -- update --------------------------------------------------------------------------
    def update(self, batch: Batch, loss_fn: LossFn, routes_BTLK: torch.Tensor | None = None,
               replay_mask_BT: torch.Tensor | None = None, shuffle_seed: int | None = None,
               ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """`epochs` passes over `batch` in mini-batches of `mini_batch_size` rows (one optimiser
        step each), each accumulated over micro-batches. Rows are shuffled per epoch with
        `shuffle_seed` (None keeps their order). Returns (metrics averaged over optimiser
        steps, routes the last pass ran [B,T,L,K], natural top-k of the last pass [B,T,L,K])."""
        B, T = batch.input_ids_BT.shape
        L, K = self.master.cfg.num_moe_layers, self.master.cfg.num_experts_per_tok
        used_BTLK = torch.zeros(B, T, L, K, dtype=self.route_dtype)
        nat_BTLK = torch.zeros(B, T, L, K, dtype=self.route_dtype)
        self.compute.train()
        metrics = run_minibatches(
            B, self.cfg, shuffle_seed,
            lambda mini: self._train_step(batch, loss_fn, mini, routes_BTLK, replay_mask_BT,
                                          used_BTLK, nat_BTLK))
        return metrics, used_BTLK, nat_BTLK

    def _train_step(self, batch: Batch, loss_fn: LossFn, mini: torch.Tensor, routes_BTLK,
                    replay_mask_BT, used_BTLK, nat_BTLK) -> dict[str, float]:
        """One optimiser step on rows `mini`, gradients accumulated over micro-batches; writes
        the routes run and the natural top-k of those rows into `used_BTLK` / `nat_BTLK`."""
        cfg = self.cfg
        step_metrics: dict[str, float] = {}
        for idx in self._micro_batches(mini):
            r, m = self._replay_args(routes_BTLK, replay_mask_BT, idx)
            mb = batch.rows(idx)
            lp, ent, out = self._forward(mb, r, m)
            loss, metrics = loss_fn(lp, ent, idx, mini)
            if cfg.aux_loss_coef > 0:
                aux = self.compute.load_balancing_loss(out, mb.token_mask_BT)
                loss = loss + cfg.aux_loss_coef * aux * (len(idx) / len(mini))
                metrics["actor/aux_loss"] = float(aux)
            loss.backward()
            used_BTLK[idx] = out.routes_BTLK.detach().to(self.route_dtype)
            nat_BTLK[idx] = out.natural_BTLK.detach().to(self.route_dtype)
            for k, v in metrics.items():  # metrics are micro-batch means: weight them
                step_metrics[k] = step_metrics.get(k, 0.0) + v * len(idx) / len(mini)
        step_metrics.update(self._optimizer_step())
        return step_metrics

    def _optimizer_step(self) -> dict[str, float]:
        if self.compute is not self.master:
            for pm, pc in zip(self.master.parameters(), self.compute.parameters()):
                pm.grad = None if pc.grad is None else pc.grad.float()
                pc.grad = None
        params = [p for p in self.master.parameters() if p.grad is not None]
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.sync_compute()
        return {"actor/grad_norm": float(grad_norm), "actor/lr": lr,
                "actor/skipped_step": float(not torch.isfinite(grad_norm))}

    @torch.no_grad()
    def sync_compute(self) -> None:
        """Refresh the low-precision compute copy from the fp32 master weights."""
        if self.compute is not self.master:
            for pm, pc in zip(self.master.parameters(), self.compute.parameters()):
                pc.copy_(pm)

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Optimiser and LR-schedule state (the weights are saved as an HF folder)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sync_compute()
