"""How the megatron actor's passes run through megatron-core's forward-backward schedule: its
micro-batches (packed as the torch actor's, split to a count where a collective or the
interleaved schedule needs it), one replay session per pass on every model chunk, the log-probs
from the final hidden states (chunked, no [tokens, V] logits), and the routes each stage ran
written back per MoE layer. `Schedule` is a part of `MegatronActor` (trainer/actor/megatron/actor.py),
which holds the state these methods read.

Shapes: B batch rows, T padded time, L MoE layers, K top-k, S candidates.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist

from lockstep.kernels.logprob import chunked_logprobs
from lockstep.moe.replay_check import LOGPROB_FORWARD, UPDATE_FORWARD
from lockstep.moe.router import router_margin
from lockstep.trainer.actor.batch import Batch
from lockstep.trainer.actor.batch import micro_batches, trim, trim_batch
from lockstep.trainer.actor.megatron.logprob import vocab_parallel_logprobs
from lockstep.trainer.actor.megatron.model import (forward_logits, is_last_stage, padded_length,
                                                   token_logprobs_entropy)
from lockstep.trainer.actor.megatron.replay import Mode
from lockstep.trainer.actor.torch_actor import LossFn
from lockstep.trainer.objective.stats import to_floats


def _keep_candidates(logits_BTV: torch.Tensor, cand_BTS: torch.Tensor) -> torch.Tensor:
    """fp32 logits with every id outside each token's kept set (cand, -1 padded; all -1 = no
    restriction) pushed to -1e30: its probability is then exactly 0 and, unlike -inf, it keeps
    `token_logprobs_entropy`'s sum of p * logit finite. Handles a TP vocabulary shard."""
    from megatron.core import parallel_state as ps

    v_local = logits_BTV.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * v_local
    local_BTS = cand_BTS.long() - start
    here_BTS = (cand_BTS >= 0) & (local_BTS >= 0) & (local_BTS < v_local)
    keep_BTV = torch.zeros(*logits_BTV.shape[:-1], v_local + 1, dtype=torch.bool,
                           device=logits_BTV.device)  # the extra column takes misses
    keep_BTV.scatter_(-1, torch.where(here_BTS, local_BTS, v_local), True)
    keep_BTV = keep_BTV[..., :v_local] | (cand_BTS < 0).all(-1, keepdim=True)
    return logits_BTV.float().masked_fill(~keep_BTV, -1e30)


@contextlib.contextmanager
def _hidden_out(gpt, on: bool, tp: int = 1):
    """While `on`: the GPTModel's output layer passes its input through, so the model returns
    its final (normed) hidden states [B, S, D] instead of logits (the log-prob kernel applies
    the output layer's weight itself, chunk by chunk). Under TP the hidden states come back
    whole on every TP rank, through the TP mapping megatron-core's output layer applies to its
    input (sequence-parallel all-gather, or copy): its backward sums the ranks' vocabulary
    shares of the hidden-state gradient."""
    if not on:
        yield
        return
    from megatron.core import tensor_parallel as tpar

    layer = gpt.output_layer

    def passthrough(hidden, weight=None, runtime_gather_output=None):
        if tp > 1:
            hidden = (tpar.gather_from_sequence_parallel_region(hidden, True)
                      if layer.sequence_parallel
                      else tpar.copy_to_tensor_model_parallel_region(hidden))
        return hidden, None
    layer.forward = passthrough
    try:
        yield
    finally:
        del layer.forward


def split_to_count(micro: list[torch.Tensor], n: int, seq_lens_B: torch.Tensor,
                   ) -> list[torch.Tensor]:
    """`micro` (row ids per micro-batch) with its costliest micro-batches (rows x longest row)
    halved until there are `n` of them, keeping each one's row order."""
    micro = list(micro)
    while len(micro) < n:
        cost = [len(m) * int(seq_lens_B[m].max()) if len(m) > 1 else -1 for m in micro]
        i = max(range(len(micro)), key=lambda j: cost[j])
        if cost[i] < 0:
            raise ValueError(f"cannot run {n} micro-batches on {sum(len(m) for m in micro)} "
                             "rows: another rank of the expert-parallel group needs that many "
                             "(actor.max_tokens_per_micro_batch); raise the budget")
        half = (len(micro[i]) + 1) // 2
        micro[i:i + 1] = [micro[i][:half], micro[i][half:]]
    return micro


def moe_slice(cfg, layers: dict[int, int]) -> slice:
    """The MoE layers among `layers` (local -> global decoder layer, one model chunk's), as a
    slice of the L axis of [B, T, L, K] routes (L counts MoE layers only). A chunk's layers
    are consecutive, so its MoE layers are too."""
    moe_ids = [i for i in layers.values() if cfg.is_moe_layer(i)]
    first = sum(1 for i in range(moe_ids[0]) if cfg.is_moe_layer(i)) if moe_ids else 0
    return slice(first, first + len(moe_ids))


def vp_group_size(n_micro: int, pp: int) -> int:
    """megatron-core's `microbatch_group_size_per_vp_stage` for `n_micro` micro-batches: the
    interleaved schedule runs groups of this many micro-batches through a chunk before the
    next chunk, needs it in [PP, n_micro] and the last group either full or >= PP. The
    smallest such size (PP when it divides n_micro; n_micro always works)."""
    for g in range(pp, n_micro + 1):
        if n_micro % g == 0 or n_micro % g >= pp:
            return g
    raise ValueError(f"{n_micro} micro-batches < pipeline_parallel={pp}")


class Schedule:
    """The schedule side of `MegatronActor` (module docstring)."""

    def _run(self, batch: Batch, micro: list[torch.Tensor], routes_BTLK, mask_BT, used, nat,
             *, lp_BT=None, ent_BT=None, loss_fn: LossFn | None = None,
             mini: torch.Tensor | None = None, mini_size: int | None = None,
             weighted: bool = False, margin_BTL: torch.Tensor | None = None) -> dict[str, float]:
        """Micro-batches `micro` (rows of `batch`) through megatron-core's schedule, on every
        pipeline stage, inside one replay session. Writes this stage's MoE layers of the routes
        run / natural top-k into `used` / `nat` [B, T, L, K]; on the last stage writes the
        log-probs and entropies into `lp_BT` / `ent_BT` (log-prob pass) or gives them to
        `loss_fn` (update: backward too; grads end up DP-reduced in the DDP buffers). Returns
        the update's metrics (row-weighted over this rank's micro-batches; last stage), and
        `actor/aux_loss` summed over this stage's MoE layers (not yet over stages).
        `margin_BTL` [B, T, L]: this stage's layers of the router margins (rollout dumps)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        train = loss_fn is not None
        if train and mini_size is None:
            mini_size = len(mini)
        T = batch.input_ids_BT.shape[1]
        last = is_last_stage(self.last_chunk)
        metrics: dict[str, torch.Tensor | float] = {}  # on the device until the schedule ends
        aux_sum = torch.zeros((), device=self.device)  # read once, after the schedule

        def forward_step(data_iterator, model):
            nonlocal aux_sum
            c, idx = next(data_iterator)  # model chunk c (one data iterator per chunk)
            replay, moe = self.replays[c], self.moe_slices[c]
            mb = trim_batch(batch, idx)  # cut to its own longest row: padding is not compute
            b, t = mb.input_ids_BT.shape
            if train:
                # the torch actor adds aux_loss_coef * (layer mean) * len(idx) / len(mini); the
                # schedule and DDP divide what is attached by micro-batches * dp (undone here)
                replay.begin_micro_batch(
                    mb.token_mask_BT, self.aux_coef / self.num_moe_layers * b / mini_size
                    * len(micro) * self.dp)
            if routes_BTLK is not None and replay.num_layers:
                replay.set_routes(trim(routes_BTLK, idx, t)[:, :, moe],
                                  None if mask_BT is None else trim(mask_BT, idx, t),
                                  tokens_BT=mb.token_mask_BT, rows=idx,
                                  what=UPDATE_FORWARD if train else LOGPROB_FORWARD)
            ids = mb.input_ids_BT.to(self.device)
            out = replay.backward_replays(forward_logits(model, ids))  # hidden if chunked
            replay.finish_forward()  # the replay validator (replay.check)
            if replay.num_layers:
                rows, at = idx.to(self.device)[:, None], self.moe_written[c]
                used[rows, :t, at] = replay.used(b, t).transpose(1, 2)
                nat[rows, :t, at] = replay.natural(b, t).transpose(1, 2)
                if margin_BTL is not None:
                    margin_BTL[rows, :t, at] = replay.margins(b, t).transpose(1, 2)
            if train and self.aux_coef > 0 and replay.num_layers:
                aux_sum += replay.aux_loss_sum() * (b / mini_size)
            if not (last and c == len(self.chunks) - 1):
                return out, None  # hidden states for the next stage; no loss here
            cand = None if mb.candidates_BTS is None else mb.candidates_BTS[:, 1:].to(self.device)
            if chunked:  # position t-1's hidden state predicts the token at t
                lp, ent = self._chunked_logprobs(out[:, :-1], ids[:, 1:], cand)
            else:
                logits = out[:, :-1]
                if cand is not None:  # sampling-mask replay: softmax over kept ids
                    logits = _keep_candidates(logits, cand)
                lp, ent = token_logprobs_entropy(logits, ids[:, 1:], self.temperature)
            # [b, T] as the loss function takes them: 0 at position 0 and past the trimmed
            # time; on the actor's device, like the torch actor's (rank.Objective holds its
            # inputs there)
            lp, ent = (torch.nn.functional.pad(x, (1, T - t)) for x in (lp, ent))

            def loss_func(_output):
                if not train:
                    lp_BT[idx], ent_BT[idx] = lp, ent
                    return lp.new_zeros(()), {}
                loss, m = loss_fn(lp, ent, idx, mini)
                self._update_lp[idx] = lp.detach()
                for k, v in m.items():  # micro-batch means (unless weighted): weight by rows
                    v = v.detach().double() if torch.is_tensor(v) else v  # on the device, fp64
                    metrics[k] = metrics.get(k, 0.0) + (v if weighted else v * b / mini_size)
                # megatron-core divides by the micro-batch count and DDP averages over DP
                # ranks; our loss already is this micro-batch's share of the mini-batch loss
                return loss * (len(micro) * self.dp), {}
            return lp, loss_func

        for m in self.ddps:
            m.train(train)
        mode = Mode.RECORD if routes_BTLK is None else Mode.REPLAY
        chunked = last and self.chunked_logprobs
        margins = None if margin_BTL is None else partial(router_margin, cfg=self.model_cfg)
        with contextlib.ExitStack() as stack:
            for replay in self.replays:
                stack.enter_context(replay.session(mode, margins))
            stack.enter_context(_hidden_out(self.last_chunk, chunked, self.tp))
            if len(self.chunks) > 1:
                self._set_vp_group_size(len(micro))
            get_forward_backward_func()(
                forward_step_func=forward_step, model=self.ddps,
                data_iterator=[iter([(c, m) for m in micro]) for c in range(len(self.chunks))]
                if len(self.chunks) > 1 else iter([(0, m) for m in micro]),
                num_microbatches=len(micro),
                seq_length=padded_length(int(batch.seq_lens_B[torch.cat(micro)].max()), self.tp),
                micro_batch_size=max(len(m) for m in micro), forward_only=not train)
        if train and self.aux_coef > 0:
            metrics["actor/aux_loss"] = aux_sum
        return to_floats(metrics)  # the step's one read of its metrics

    def _chunked_logprobs(self, hidden_BTD, targets_BT, cand_BTS):
        """(log-probs, entropies) [b, t] from the final hidden states without [tokens, V]
        logits: TP = 1 chunks the vocabulary (`chunked_logprobs`); TP > 1 chunks the tokens
        over this rank's vocabulary shard (`vocab_parallel_logprobs`)."""
        if self.tp == 1:
            return chunked_logprobs(hidden_BTD, self._lm_head_weight(), targets_BT,
                                    temperature=self.temperature, candidates_NS=cand_BTS,
                                    chunk_size=self.cfg.logprob_chunk)
        from megatron.core import parallel_state as ps
        w = self._lm_head_weight()
        return vocab_parallel_logprobs(
            hidden_BTD, w, targets_BT, vocab_start=ps.get_tensor_model_parallel_rank() * len(w),
            group=ps.get_tensor_model_parallel_group(), temperature=self.temperature,
            candidates_NS=cand_BTS, chunk_tokens=self.opts.logprob_chunk_tokens)

    def _lm_head_weight(self) -> torch.Tensor:
        head = self.last_chunk
        return head.shared_embedding_or_output_weight() \
            if self.model_cfg.tie_word_embeddings else head.output_layer.weight

    def _vp_micro_batches(self, micro: list[torch.Tensor], batch: Batch
                          ) -> list[torch.Tensor]:
        """Under a virtual pipeline megatron-core's interleaved schedule needs at least PP
        micro-batches: fewer are split (`split_to_count`; the same rows, so the same loss and
        log-probs; only a load-balancing loss, which balances each micro-batch's own tokens,
        sees the smaller micro-batches)."""
        if len(self.chunks) == 1 or len(micro) >= self.pp:
            return micro
        rows = sum(len(m) for m in micro)
        if rows < self.pp:
            raise ValueError(f"actor.megatron.virtual_pipeline_parallel={self.opts.vpp}: "
                             f"megatron-core's interleaved schedule needs at least "
                             f"pipeline_parallel={self.pp} micro-batches, but this pass has "
                             f"{rows} row(s) (raise actor.mini_batch_size)")
        return split_to_count(micro, self.pp, batch.seq_lens_B)

    def _set_vp_group_size(self, n_micro: int) -> None:
        for m in self.ddps:
            m.config.microbatch_group_size_per_vp_stage = vp_group_size(n_micro, self.pp)

    def _micro_batches(self, rows: torch.Tensor, batch: Batch) -> list[torch.Tensor]:
        """Micro-batches of `rows` as the torch actor takes them (`batch.micro_batches`:
        micro_batch_size rows, or packed by actor.max_tokens_per_micro_batch); each runs
        trimmed to its own longest row (under PP every micro-batch travels with its own
        shape: megatron-core's `variable_seq_lengths`, set in `transformer_config`)."""
        micro = micro_batches(rows, batch.seq_lens_B, self.cfg)
        if self.cfg.max_tokens_per_micro_batch is not None and self._experts_span_dp:
            # every micro-batch's forward is a collective over the expert-parallel group,
            # whose ranks hold other rows: all ranks run as many micro-batches as the busiest
            n = torch.tensor([len(micro)], device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            micro = split_to_count(micro, int(n), batch.seq_lens_B)
        return self._vp_micro_batches(micro, batch)
