"""The frozen reference policy of the KL loss (`loss.kl_coef > 0`): the initial RL weights.

`ref_logprobs` are computed once per step on the actor's side (`RankActor.set_reference`;
`policy_update` calls `logprobs` before its optimiser steps), with the routes the update
forwards replay (`replay.update_plan`: the engine's routes under R3, the old-log-prob forward's
recorded routes under R2, free routing when replay is off). So the KL term compares pi_theta and
pi_ref on the same experts and sees no routing flips; on-policy at the first update of step 1
(fp32 engine and actor) it is exactly 0.

The reference always runs on the torch model, also when the actor is megatron-core (its
log-probs then differ from the megatron actor's by the backends' numerical difference, <= 1e-4,
instead of 0 at the first update).

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
from lockstep.trainer.actor import Batch, TorchActor
from lockstep.trainer.config import ActorConfig, ExperimentConfig

REFERENCE_DIR = "reference"


def reference_source(cfg: ExperimentConfig, run_dir: Path) -> Path:
    """The HF folder holding the reference weights of a run."""
    if cfg.model.path and not cfg.warmstart.enabled:
        return Path(cfg.model.path)
    return Path(run_dir) / REFERENCE_DIR


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
        src = reference_source(cfg, run_dir)
        if initial is None:
            if not (src / "config.json").exists():
                raise FileNotFoundError(f"--resume with loss.kl_coef > 0: the reference weights "
                                        f"{src} are missing")
            model = load_hf(src)
        else:
            if src == Path(run_dir) / REFERENCE_DIR:
                save_hf(initial, src)
            model = copy.deepcopy(initial)
        return cls(model, cfg.actor, cfg.rollout.temperature, device)

    @torch.no_grad()
    def logprobs(self, batch: Batch, routes_BTLK: torch.Tensor | None,
                 replay_mask_BT: torch.Tensor | None) -> torch.Tensor:
        """fp32 [B, T] log-probs of `batch` under the reference, replaying `routes_BTLK`."""
        return self.actor.logprobs(batch, routes_BTLK, replay_mask_BT).logprobs_BT
