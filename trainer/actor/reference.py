"""The frozen reference policy of the KL loss (`loss.kl_coef > 0`): the initial RL weights.

`ref_logprobs` are computed once per step on the actor's side (`RankActor.set_reference`;
`policy_update` calls `logprobs` before its optimiser steps), with the routes the update
forwards replay (`replay.update_plan`: the engine's routes under R3, the old-log-prob forward's
recorded routes under R2, free routing when replay is off). So the KL term compares pi_theta and
pi_ref on the same experts and sees no routing flips; on-policy at the first update of step 1
(fp32 engine and actor) it is exactly 0.

With the torch actor the reference is a `ReferencePolicy` (a frozen torch model). With the
megatron actor (in one process or on a group's ranks) it is `ShardReference`
(trainer/actor/megatron/actor.py): each rank keeps a CPU copy of only ITS OWN shard of the reference
weights, read from the reference's HF folder, and swaps it into its model for the reference
forward, so no rank holds a whole extra model and pi_ref is megatron's own forward (the KL term
is exactly 0 at the first update, as with the torch actor).

Where the initial weights come from: `model.path` itself when it is the RL starting point (no
warm start); otherwise they are written once to `RUN/reference/` (an HF folder) at the start of
the run, so `--resume` rebuilds the same reference.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from lockstep.moe.checkpoint import load_hf, save_hf
from lockstep.moe.model import MoEModel
from lockstep.trainer.actor.batch import Batch
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.experiment import ExperimentConfig
from lockstep.trainer.config.sections import ActorConfig

REFERENCE_DIR = "reference"


def reference_source(cfg: ExperimentConfig, run_dir: Path) -> Path:
    """The HF folder holding the reference weights of a run."""
    if cfg.model.path and not cfg.warmstart.enabled:
        return Path(cfg.model.path)
    return Path(run_dir) / REFERENCE_DIR


def reference_folder_for_run(cfg: ExperimentConfig, run_dir: Path,
                             initial: MoEModel | None) -> Path:
    """The reference's HF folder: `initial` written to the run's own folder first when the
    reference lives there (a fresh run); on resume (`initial` None) checked to exist."""
    src = reference_source(cfg, run_dir)
    if initial is None:
        if not (src / "config.json").exists():
            raise FileNotFoundError(f"--resume with loss.kl_coef > 0: the reference weights "
                                    f"{src} are missing")
    elif src == Path(run_dir) / REFERENCE_DIR:
        save_hf(initial, src)
    return src


class ReferencePolicy:
    """Log-probs of the frozen initial policy, in the actor's compute precision."""

    def __init__(self, model: MoEModel, actor_cfg: ActorConfig, temperature: float,
                 device: str = "cpu"):
        model = model.requires_grad_(False)
        self.actor = TorchActor(model, actor_cfg, total_updates=1, temperature=temperature,
                                device=device)

    @classmethod
    def for_run(cls, cfg: ExperimentConfig, run_dir: Path, initial: MoEModel | None,
                device: str = "cpu") -> "ReferencePolicy":
        """The run's reference: from `initial` (a fresh run; saved first when the folder is
        the run's own) or, on resume (`initial` None), from where the fresh run put it."""
        src = reference_folder_for_run(cfg, run_dir, initial)
        model = load_hf(src) if initial is None else copy.deepcopy(initial)
        return cls(model, cfg.actor, cfg.rollout.temperature, device)

    @torch.no_grad()
    def logprobs(self, batch: Batch, routes_BTLK: torch.Tensor | None,
                 replay_mask_BT: torch.Tensor | None) -> torch.Tensor:
        """fp32 [B, T] log-probs of `batch` under the reference, replaying `routes_BTLK`."""
        return self.actor.logprobs(batch, routes_BTLK, replay_mask_BT).logprobs_BT
