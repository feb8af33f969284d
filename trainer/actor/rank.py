"""The rank-side actor interface: what one data-parallel rank of the policy does in an RL step.

The step loop (`Trainer.step`) talks to its actor only through these calls. An in-process
actor (`TorchActor`, `MegatronActor`: a world of one, the batch is its one shard) and the Ray
actor group (`lockstep.trainer.actor.group.ActorGroup`: N ranks; the driver collates once and sends
each rank only its rows, `lockstep.trainer.actor.batch.plan_shards`) answer them alike, so the loop
is the same lines for one process and for a cluster. This is also what `MegatronActor` has to
implement natively for multi-rank layouts.

  old_logprobs(batch, mode, step) -> OldLogprobs
      pi_old of this shard's rows under the replay plan of `mode` (R3: the rollout routes; R2:
      natural routing, *recorded*; off: natural). The routes the forward ran and the router's
      natural top-k stay on the rank, keyed by `step`, for `policy_update` (R2 replays them,
      the staleness metrics compare against them); they never travel back. Returns the
      shard's log-probs [b, t] fp32 (the driver's rollout correction needs batch-wide
      statistics of them: max, std, batch-normalised IS), the `routing/*` divergence stats
      (rollout routes vs the trainer's natural top-k) and the natural top-k's expert-load
      counts (trainer/observe/expert_load.py: `moe_load_count/*`, the driver's `actor/moe/*`).
  policy_update(batch, inputs, mode, step, steps=None) -> UpdateResult
      One optimiser step per entry of `steps`: this shard's local rows of each global
      mini-batch (maybe none; None = a world of one, the whole `minibatch_schedule`), in
      micro-batches, the loss normalised by the mini-batch's *global* token / sequence counts
      (`step_norms`: all-reduced over DP), gradients summed over DP before each step.
      `inputs` are per-token tensors of this shard's rows only (old log-probs, advantages, IS
      weights, loss mask; `UpdateInputs`). Returns the log-probs the update forwards saw
      [b, t] (for the driver's staleness split) and stats: actor/* metrics, `routing_stale/*`
      (old natural vs update natural top-k) and the replay check `replay/replayed_fraction`,
      `replay/mismatch` (routes run vs routes given, every layer; with replay.partial only the
      pairs it replayed, and `replay/partial_fraction*`), and the replay bias meter
      `replay_bias/*` (trainer/actor/replay_bias.py).
  export_weights(bucket_bytes) -> iterator of buckets of (hf_name, tensor) (`moe/buckets.py`)
      The policy's weights under Hugging Face names, once per RL step; with DP every rank
      holds them all and rank 0 exports; sharded backends gather across TP/EP/PP here.
  gen_logprobs(batch, versions, mode, step, max_staleness, stale) -> [b, t] | None
      loop.max_staleness >= 1: pi_gen of this shard's rows of an older weight version, under
      the rank's own kept copy of its tensors for that version (`trainer/actor/versions.py`); then
      keeps the current version. `kept_versions()`: what the rank keeps (version -> bytes).
  write_checkpoint(folder, tokenizer) -> (state, files) / load_checkpoint(folder, state)
      The actor's part of a checkpoint: the weights (`hf/`) and Adam's moments under HF names
      (`optim/`), written by the ranks themselves; loadable on any layout
      (trainer/actor/checkpoint.py).
  rank_state() -> dict / load_rank_state(dict)
      This rank's optimiser and LR-schedule state: a plain nested dict of tensors, numbers,
      strings and lists (checkpoints of earlier versions kept one per rank).
  close()
      Release what the actor holds (nothing in-process; the group's Ray actors).

Stats: every metric a rank returns is a `(sum, count)` pair; `add_stats` adds ranks' pairs
and `stats_values` turns them into numbers (sum / count; NaN for count 0, like the
one-process metrics). Route metrics count their tokens (or (token, layer) pairs). Actor
metrics are averages over optimiser steps: a value every rank holds in full (grad norm, lr)
is counted 1 by every rank, so sum / count is the value; a loss metric is each rank's
additive part of the mini-batch's value (`Objective`: loss terms are shares of the
mini-batch loss, token means are weighted by the rank's share of its loss tokens), counted
once, by rank 0. So the metrics do not depend on micro-batch size or DP layout.

Shapes: B global batch rows, b this rank's rows, t its padded time, L MoE layers, K top-k.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, fields
import torch

from lockstep.moe.buckets import Bucket, bucketize
from lockstep.moe.checkpoint import hf_state_dict
from lockstep.moe.replay_check import ReplayCheckError
from lockstep.replay import ReplayMode, ReplayOptions, old_logprob_plan, update_plan
from lockstep.trainer.actor.batch import Batch, minibatch_schedule, trim_batch
from lockstep.trainer.actor.versions import KeptVersions, positions, stale_versions, versions_of
from lockstep.trainer.objective.correction import CorrectionConfig
from lockstep.trainer.objective.losses import LossConfig, policy_loss
from lockstep.trainer.objective.stats import Stats, indexer_stats, route_stats
from lockstep.trainer.observe.expert_load import counted_tokens, load_count_stats

SHARE_METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy")
"""Loss terms normalised by the whole mini-batch's counts: a micro-batch's value is its share,
and the shares add up to the mini-batch's value (the other metrics are token means)."""


def split_route_stats(batch: Batch, natural_BTLK: torch.Tensor, layer_names, first: bool,
                      max_turns: int = 8) -> Stats:
    """routing/{sampled,observation,turn_<t>}/{flip_rate,token_any_flip} of a multi-turn
    batch: the rollout-vs-trainer flip rate over sampled tokens, observation tokens, and each
    turn's tokens (its sampled ones and the observation answering it), t < `max_turns`."""
    valid_BT = batch.rollout_routes_valid_BT
    turn_BT = batch.turn_BT.to(valid_BT.device)
    resp_BT = batch.response_mask_BT.to(valid_BT.device)
    parts = {"sampled": resp_BT, "observation": (turn_BT >= 0) & ~resp_BT}
    parts.update({f"turn_{t}": turn_BT == t
                  for t in range(min(int(turn_BT.max()) + 1, max_turns))})
    out: Stats = {}
    for name, m_BT in parts.items():
        if not bool((valid_BT & m_BT).any()):  # nothing of that kind on this rank: no NaN
            continue
        st = route_stats(batch.rollout_routes_BTLK, natural_BTLK, valid_BT & m_BT,
                         f"routing/{name}", layer_names, first)
        out.update({k: v for k, v in st.items() if k.rsplit("/", 1)[1] in
                    ("flip_rate", "token_any_flip")})
    return out


@dataclass
class OldLogprobs:
    """`old_logprobs`' answer for a shard (or, from the group, the whole batch)."""

    logprobs_BT: torch.Tensor  # fp32 pi_old, 0 at position 0
    stats: Stats               # routing/* (rollout routes vs the trainer's natural top-k)


@dataclass
class UpdateResult:
    """`policy_update`'s answer for a shard (or, from the group, the whole batch)."""

    logprobs_BT: torch.Tensor  # fp32 pi_theta as the update forwards saw it (last pass)
    stats: Stats               # actor/*, routing_stale/*, replay/*


@dataclass
class UpdateInputs:
    """Per-token inputs of the policy loss, made by the driver for the whole batch; the group
    sends each rank its rows (`rows`)."""

    old_logprobs_BT: torch.Tensor    # fp32 pi_old (the PPO ratio's denominator)
    advantages_BT: torch.Tensor      # fp32, 0 off the response
    loss_mask_BT: torch.Tensor       # fp32 1/0: response tokens kept by rejection sampling
    is_weights_BT: torch.Tensor | None  # fp32 detached IS weights (None: bypass / IS off)
    shuffle_seed: int | None         # mini-batch shuffle of the global batch
    loss: LossConfig
    correction: CorrectionConfig
    ref_logprobs_BT: torch.Tensor | None = None  # fp32 pi_ref (loss.kl_coef > 0): set on the
    # rank by policy_update, whose reference replays the update's routes
    lr_scale: float = 1.0            # x the schedule's LR in this update (trainer/driver/lr_trigger.py)

    def rows(self, idx: torch.Tensor) -> UpdateInputs:
        parts = {f.name: getattr(self, f.name) for f in fields(self)}
        return UpdateInputs(**{k: v[idx] if isinstance(v, torch.Tensor) else v
                               for k, v in parts.items()})

    def to(self, device: torch.device) -> UpdateInputs:
        parts = {f.name: getattr(self, f.name) for f in fields(self)}
        return UpdateInputs(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                               for k, v in parts.items()})


def shuffle_seed(loop_seed: int, step: int) -> int:
    """Seed of step `step`'s mini-batch shuffle (the group plans its shards with it)."""
    return loop_seed * 1_000_003 + step


@contextlib.contextmanager
def _step_context(step: int, what: str):
    """A replay-check failure names the RL step and pass it happened in."""
    try:
        yield
    except ReplayCheckError as e:
        raise ReplayCheckError(f"step {step} ({what}): {e}") from None


class RankActor:
    """The rank-side interface (module docstring) on top of an actor that has
    `logprobs(batch, routes, mask, record)`, `model_cfg`, `cfg`, `state_dict`/`load_state_dict`
    and either `_train_steps` (native: explicit per-rank schedule) or `update(batch, loss_fn,
    routes, mask, shuffle_seed)` (world of one only)."""

    dp_rank: int = 0
    dp_size: int = 1
    reference = None  # a ReferencePolicy once set_reference was called (loss.kl_coef > 0)
    replay_options = ReplayOptions()  # replay beyond the mode (gates, partial, bias meter)
    last_replayed_BTL = None  # bool: where the last update pass ran the given ids, per layer

    def shard_logprobs(self, batch: Batch, routes_BTLK, replay_mask_BT, record: bool = False,
                       gates_BTLK=None):
        """`logprobs` of `batch`, this rank's shard of the step's rows: an actor that splits a
        whole batch over its own data-parallel group (megatron) is told not to. `gates_BTLK`:
        gate weights to replay with the routes (replay.gates=engine)."""
        return self.logprobs(batch, routes_BTLK, replay_mask_BT, record=record,
                             gates_BTLK=gates_BTLK)

    def _rollout_gates(self, batch: Batch, mode: ReplayMode):
        """The engine's gate weights to replay under R3 with replay.gates=engine, else None."""
        if not self.replay_options.replays_gates or ReplayMode.parse(mode) is not ReplayMode.R3:
            return None
        if batch.rollout_gates_BTLK is None:
            raise ValueError("replay.gates=engine under R3 needs the engine's gate weights, but "
                             "the batch has none (the rollout backend did not return them)")
        return batch.rollout_gates_BTLK

    def _kept_routes(self) -> dict:
        if not hasattr(self, "_kept"):
            self._kept: dict[int, tuple] = {}
        return self._kept

    @torch.no_grad()
    def old_logprobs(self, batch: Batch, mode: ReplayMode, step: int) -> OldLogprobs:
        plan = old_logprob_plan(mode, batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT,
                                self._rollout_gates(batch, mode))
        with _step_context(step, "pi_old"):
            res = self.shard_logprobs(batch, plan.routes_BTLK, plan.replay_mask_BT, record=True,
                                      gates_BTLK=plan.gates_BTLK)
        kept = self._kept_routes()
        kept.clear()  # a step never updated (a failed run) leaves nothing behind
        kept[step] = (res.routes_BTLK, res.natural_BTLK,
                      res.gates_BTLK if self.replay_options.replays_gates else None)
        picks = getattr(res, "indexer_BTLK", None)  # DSA models (the torch actor)
        if self.replay_options.indexer == "r2":
            self._kept_picks = (step, picks)
        stats: Stats = {}
        if batch.rollout_routes_BTLK is not None:
            stats = route_stats(batch.rollout_routes_BTLK, res.natural_BTLK,
                                batch.rollout_routes_valid_BT, "routing", self._layer_names(),
                                self.dp_rank == 0)
            if batch.turn_BT is not None:  # multi-turn: by sampled / observation token, by turn
                stats.update(split_route_stats(batch, res.natural_BTLK, self._layer_names(),
                                               self.dp_rank == 0))
        if picks is not None and batch.rollout_indexer_BTLK is not None:  # beside the routes'
            stats.update(indexer_stats(batch.rollout_indexer_BTLK, picks,
                                       batch.rollout_indexer_valid_BT,
                                       self.model_cfg.indexer_layer_ids, self.dp_rank == 0))
        # the actor's own expert load (its natural top-k), summed over ranks by the driver
        stats.update(load_count_stats(res.natural_BTLK, counted_tokens(
            batch.response_mask_BT, batch.seq_lens_B), self._layer_names(),
            self.model_cfg.num_experts, self.dp_rank == 0))
        return OldLogprobs(res.logprobs_BT, stats)

    def policy_update(self, batch: Batch, inputs: UpdateInputs, mode: ReplayMode, step: int,
                      steps: list[torch.Tensor] | None = None) -> UpdateResult:
        kept = self._kept_routes()
        if step not in kept:
            raise RuntimeError(f"policy_update(step={step}) without old_logprobs of that step "
                               f"on rank {self.dp_rank} (kept: {sorted(kept)})")
        recorded_BTLK, old_natural_BTLK, recorded_gates_BTLK = kept.pop(step)
        if self.replay_options.indexer == "r2":  # the updates replay pi_old's own picks
            kept_step, picks = getattr(self, "_kept_picks", (None, None))
            if kept_step != step or picks is None:
                raise RuntimeError(f"replay.indexer=r2: no indexer picks of step {step}'s "
                                   f"old-logprob forward on rank {self.dp_rank}")
            batch = dataclasses.replace(batch, recorded_indexer_BTLK=picks)
        up = update_plan(mode, batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT,
                         recorded_routes_BTLK=recorded_BTLK, recorded_valid_BT=batch.token_mask_BT,
                         rollout_gates_BTLK=self._rollout_gates(batch, mode),
                         recorded_gates_BTLK=recorded_gates_BTLK)
        if self.reference is not None:  # pi_ref on the update's routes: no routing flips
            inputs = dataclasses.replace(inputs, ref_logprobs_BT=self.reference.logprobs(
                batch, up.routes_BTLK, up.replay_mask_BT))
        if steps is None:  # a world of one: the whole schedule
            steps = minibatch_schedule(batch.size, self.cfg.mini_batch_size, self.cfg.epochs,
                                       inputs.shuffle_seed)
        inputs = inputs.to(self._device())  # once per update, not per micro-batch
        current_BT = torch.zeros_like(inputs.old_logprobs_BT)
        with _step_context(step, "update"):
            stats, used_BTLK, natural_BTLK = self._train_steps(
                batch, Objective(batch, inputs, current_BT), steps, up.routes_BTLK,
                up.replay_mask_BT, gates_BTLK=up.gates_BTLK)
        first = 1.0 if self.dp_rank == 0 else 0.0
        token_BT = batch.token_mask_BT
        stats.update(route_stats(old_natural_BTLK, natural_BTLK, token_BT, "routing_stale",
                                 self._layer_names(), self.dp_rank == 0))
        stats.update(self._bias_meter(batch, up, used_BTLK, natural_BTLK, step))
        if up.routes_BTLK is not None:
            replayed_BT = up.replay_mask_BT & token_BT
            differs = (used_BTLK[replayed_BT].long() != up.routes_BTLK[replayed_BT].long())
            n_rep = float(replayed_BT.sum())
            stats["replay/replayed_fraction"] = (n_rep, float(token_BT.sum()))
            if self.replay_options.partial is None:
                # (token, layer) pairs whose routes differ from the given ones, over every layer
                stats["replay/mismatch"] = (float(differs.any(-1).sum()),
                                            n_rep * differs.shape[1])
            else:  # only the pairs partial replay replayed must run the given ids
                stats.update(self._partial_stats(differs, self.last_replayed_BTL[replayed_BT],
                                                 n_rep))
        else:
            stats["replay/replayed_fraction"] = (0.0, float(token_BT.sum()))
            stats["replay/mismatch"] = (0.0, first)
        return UpdateResult(current_BT.cpu(), stats)

    def _bias_meter(self, batch: Batch, up, used_BTLK, natural_BTLK, step: int) -> Stats:
        """The replay bias meter's stats (trainer/actor/replay_bias.py), under the updated weights."""
        from lockstep.trainer.actor import replay_bias
        first = self.dp_rank == 0
        replays = up.routes_BTLK is not None
        out = replay_bias.flip_stats(used_BTLK, natural_BTLK, batch.token_mask_BT,
                                     self._layer_names(), replays, first)
        frac = self.replay_options.bias_meter_rows
        if frac > 0:
            rows = (torch.arange(batch.size) if self._gen_all_rows() and replays
                    else replay_bias.sampled_rows(batch.size, frac, step))
            out.update(replay_bias.kl_stats(self, batch, up.routes_BTLK, up.replay_mask_BT,
                                            up.gates_BTLK, rows, first))
        return out

    def _partial_stats(self, differs_NLK, replayed_NL, n_rep: float) -> Stats:
        """replay/mismatch over the (token, layer) pairs partial replay replayed, and the
        replayed fraction of the positions that had a route, overall and per layer."""
        L = replayed_NL.shape[-1]
        out: Stats = {"replay/mismatch": (float((differs_NLK.any(-1) & replayed_NL).sum()),
                                          float(replayed_NL.sum())),
                      "replay/partial_fraction": (float(replayed_NL.sum()), n_rep * L)}
        for name, n in zip(self._layer_names(), replayed_NL.sum(0, dtype=torch.float64).tolist()):
            out[f"replay/partial_fraction/layer_{int(name)}"] = (n, n_rep)
        return out

    @torch.no_grad()
    def gen_logprobs(self, batch: Batch, versions: list, mode: ReplayMode, step: int,
                     max_staleness: int, stale: list[str] | None = None) -> torch.Tensor | None:
        """pi_gen [b, t] fp32 of this shard's rows whose weight version (`versions`, one per
        row, or its spans by position for a trajectory that spans pushes: `versions.Spans`) is
        in `stale` (the batch's stale versions, the same list on every rank; default: this
        shard's own), 0 on the other rows, None when nothing is stale: each token under
        this rank's kept copy of its own tensors for its version, with pi_old's replay plan.
        Then keeps the current version (step - 1) for the coming steps, at most
        `max_staleness` versions (`trainer/actor/versions.py`). Call it between `old_logprobs` and
        `policy_update` of `step`, every step."""
        if getattr(self, "_versions", None) is None or self._versions.k != max_staleness:
            self._versions = KeptVersions(max_staleness)
        store = self._versions
        stale = stale_versions(versions, step) if stale is None else stale
        live = self._version_tensors()
        host = torch.device("cpu")  # results and row bookkeeping
        out_bT = torch.zeros(batch.input_ids_BT.shape, device=host) if stale else None
        for v in stale:
            mine = torch.tensor([i for i, x in enumerate(versions) if v in versions_of(x)],
                                dtype=torch.long, device=host)
            rows = torch.arange(batch.size, device=host) if self._gen_all_rows() else mine
            if not len(rows):
                continue
            store.check(v, step, f"{type(self).__name__} (DP rank {self.dp_rank})")
            sub = trim_batch(batch, rows)
            plan = old_logprob_plan(mode, sub.rollout_routes_BTLK, sub.rollout_routes_valid_BT,
                                    self._rollout_gates(sub, mode))
            with store.swapped_in(v, live):
                lp = self.shard_logprobs(sub, plan.routes_BTLK, plan.replay_mask_BT,
                                         gates_BTLK=plan.gates_BTLK).logprobs_BT
            if not len(mine):  # ran only for the collective (another rank holds v's rows)
                continue
            keep = torch.isin(rows, mine)
            t = lp.shape[1]  # a row's tokens of version v only (a trajectory may span pushes)
            at_mT = torch.stack([positions(versions[i], v, t) for i in mine.tolist()])
            out_bT[mine, :t] = torch.where(at_mT, lp[keep].to(host), out_bT[mine, :t])
        store.advance(step, live)
        return out_bT

    def kept_versions(self) -> dict[str, int]:
        """The past weight versions this rank keeps for pi_gen, oldest first, with the bytes
        of each (CPU) copy of its own tensors."""
        store = getattr(self, "_versions", None)
        return {} if store is None else store.versions

    def _version_tensors(self) -> list[torch.Tensor]:
        """The tensors this rank's log-prob forward reads (what a kept version copies)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no weight versions")

    def _gen_all_rows(self) -> bool:
        """Whether a pi_gen forward must run on every row of the shard (the forward is a
        collective over ranks that hold other rows, so all run the same calls)."""
        return False

    def dump_fields(self, batch: Batch, mode: ReplayMode, step: int) -> dict[str, torch.Tensor]:
        """The actor's fields of a rollout dump (`trainer.observe.dump.ACTOR_FIELDS`) for this rank's
        rows, [b, t, ...] host tensors; called between `old_logprobs` and `policy_update`."""
        from lockstep.trainer.observe.dump import actor_fields
        return actor_fields(self, batch, mode)

    def set_reference(self, reference) -> None:
        """Use `reference` (`trainer.actor.reference.ReferencePolicy`: `logprobs(batch, routes,
        mask)`) for the KL loss; policy_update then computes pi_ref of the rank's rows."""
        self.reference = reference

    def export_weights(self, bucket_bytes: int) -> Iterator[Bucket]:
        """HF-named weights in buckets of at most `bucket_bytes` (views: consume each bucket
        before the next optimiser step)."""
        return bucketize(((k, v.detach()) for k, v in hf_state_dict(self.master).items()),
                         bucket_bytes)

    def write_checkpoint(self, folder, tokenizer=None) -> tuple[dict, dict]:
        """Write the actor's part of a checkpoint into `folder` (`hf/` and the HF-named Adam
        moments `optim/`, trainer/actor/checkpoint.py); returns (the actor's small state for
        trainer_state["actor"], {} : the files are hashed by the manifest)."""
        from pathlib import Path

        from lockstep.trainer.actor.checkpoint import write_in_process
        return write_in_process(Path(folder), self, self.model_cfg, tokenizer), {}

    # each actor owns its checkpoint parts: `checkpoint_parts(rank, world)` -> (parts, state)
    # and `load_checkpoint(folder, state)` (TorchActor, MegatronActor)

    def rank_state(self) -> dict:
        return self.state_dict()

    def load_rank_state(self, state: dict) -> None:
        self.load_state_dict(state)

    def close(self) -> None:
        """Release what the actor holds (the group: its Ray actors); nothing in-process."""

    # -- pieces --------------------------------------------------------------------------
    def _layer_names(self) -> list[int]:
        return self.model_cfg.moe_layer_ids

    def step_norms(self, loss_mask_bT: torch.Tensor, steps: list[torch.Tensor]) -> list:
        """(num_tokens, num_seqs) of every global mini-batch, this shard holding `steps[i]` of
        mini-batch i: float32 token and long sequence counts over all DP ranks (one
        all-reduce for all steps), each at least 1."""
        out = []
        for rows in steps:
            mask = loss_mask_bT[rows]
            out.append((mask.sum(), (mask.sum(-1) > 0).sum()))
        if self.dp_size > 1:  # on the actor's device (NCCL), no wait for the host
            both = torch.stack([torch.stack([t.double(), s.double()]) for t, s in out])
            both = both.to(self._device())
            self._all_reduce(both)
            out = [(row[0].float(), row[1].long()) for row in both]
        return [(t.clamp(min=1), s.clamp(min=1)) for t, s in out]

    def _device(self) -> torch.device:
        return torch.device(getattr(self, "device", "cpu"))

    def _all_reduce(self, t: torch.Tensor) -> None:
        import torch.distributed as dist
        dist.all_reduce(t, group=getattr(self, "dp_group", None))

    def _train_steps(self, batch: Batch, objective: Objective, steps, routes_BTLK,
                     replay_mask_BT, gates_BTLK=None) -> tuple[Stats, torch.Tensor, torch.Tensor]:
        """Fallback for actors with only `update` (world of one): the same schedule through
        their own `run_minibatches`, normalisers from the whole mini-batch."""
        if self.dp_size > 1:
            raise NotImplementedError(f"{type(self).__name__} has no multi-rank policy_update")
        mask = objective.inputs.loss_mask_BT

        def loss_fn(lp, ent, rows, mini):
            norms = (mask[mini].sum().clamp(min=1), (mask[mini].sum(-1) > 0).sum().clamp(min=1))
            loss, metrics = objective(lp, ent, rows, norms)
            share = len(rows) / len(mini)  # `update` weights each micro-batch by its rows
            return loss, {k: v / share for k, v in metrics.items()}
        metrics, used, natural = self.update(batch, loss_fn, routes_BTLK, replay_mask_BT,
                                             shuffle_seed=objective.inputs.shuffle_seed,
                                             gates_BTLK=gates_BTLK)
        return {k: (v, 1.0) for k, v in metrics.items()}, used, natural


class Objective:
    """The corrected policy loss of one micro-batch as its share of its mini-batch:
    `objective(lp_bT, ent_bT, rows_b, norms) -> (loss, metrics)`, `norms` = the global
    mini-batch's (num_tokens, num_seqs). Keeps the micro-batch's log-probs in `current_BT`."""

    def __init__(self, batch: Batch, inputs: UpdateInputs, current_BT: torch.Tensor):
        self.batch, self.inputs, self.current_BT = batch, inputs, current_BT
        self.rollout_logprobs_BT = batch.rollout_logprobs_BT.to(current_BT.device)

    def __call__(self, lp_BT, ent_BT, rows, norms):
        """Metrics come back weighted, so that adding them over micro-batches and ranks gives
        the mini-batch's value: loss terms (SHARE_METRICS) already are the micro-batch's share;
        token means are weighted by the micro-batch's share of the mini-batch's loss tokens."""
        x = self.inputs
        self.current_BT[rows] = lp_BT.detach().float()
        out = policy_loss(
            x.loss, lp_BT, x.old_logprobs_BT[rows], x.advantages_BT[rows], x.loss_mask_BT[rows],
            is_weights=None if x.is_weights_BT is None else x.is_weights_BT[rows],
            entropy=ent_BT, correction=x.correction,
            rollout_logprobs=self.rollout_logprobs_BT[rows],
            ref_logprobs=None if x.ref_logprobs_BT is None else x.ref_logprobs_BT[rows],
            num_tokens=norms[0], num_seqs=norms[1])
        # float64, the products and sums a Python float would make
        w = (x.loss_mask_BT[rows].sum() / norms[0]).double()
        m = {k: v.double() if torch.is_tensor(v) else v for k, v in out.metrics.items()}
        return out.loss, {k: v if k in SHARE_METRICS else v * w for k, v in m.items()}
