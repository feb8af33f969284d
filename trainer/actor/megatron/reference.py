"""The megatron actor's KL reference: this rank's own shard of pi_ref's weights, swapped in for
the reference forward (`ShardReference`)."""

from __future__ import annotations

import os

import torch

from lockstep.trainer.actor.batch import Batch
from lockstep.trainer.actor.megatron import convert


class ShardReference:
    """The frozen KL reference of a megatron actor (`loss.kl_coef > 0`): a CPU copy of this
    rank's own shard of the reference weights (the tensors of `_version_tensors`: its TP / EP /
    PP slices and the routers' expert biases), read from the reference's HF folder once. The
    reference forward swaps the copy into the live model, runs the actor's own log-prob forward
    and swaps back (bit-exact: copies only), so no rank holds a whole extra model and pi_ref
    comes from megatron's forward, like pi_old. Every rank of the group must call `logprobs`
    together (its forward has the actor's collectives)."""

    def __init__(self, actor, folder: str | os.PathLike):
        from lockstep.moe.hf_lazy import LazyHF
        from lockstep.trainer.actor.versions import exchange

        self.actor, self.folder = actor, str(folder)
        live = actor._version_tensors()
        self.kept = [t.detach().to("cpu", copy=True) for t in live]  # the actor's weights now
        convert.load_hf_into_megatron(actor.chunks, LazyHF(self.folder), actor.model_cfg)
        exchange(live, self.kept)  # live: the actor again; kept: the reference's shard

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kept)

    @torch.no_grad()
    def logprobs(self, batch: Batch, routes_BTLK: torch.Tensor | None,
                 replay_mask_BT: torch.Tensor | None) -> torch.Tensor:
        """fp32 [B, T] log-probs of `batch` under the reference, replaying `routes_BTLK`."""
        from lockstep.trainer.actor.versions import exchange

        live = self.actor._version_tensors()
        exchange(live, self.kept)
        try:
            return self.actor.shard_logprobs(batch, routes_BTLK, replay_mask_BT).logprobs_BT
        finally:
            exchange(live, self.kept)
