"""The generate requests of an RL step: one per prompt with its samples, sampling parameters,
seeds and what the engine must return (sampling masks, gate weights). The loop and
`lockstep diagnose` (which regenerates a step's samples) build them here alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from lockstep.replay import ReplayMode
from lockstep.rollout.seeds import sampling_seed
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.config.experiment import ExperimentConfig
from lockstep.trainer.config.replay import wants_indexer_picks


def step_requests(cfg: ExperimentConfig, prompts: Sequence, step: int,
                  max_new_tokens: int) -> list[GenerateRequest]:
    """One request per prompt (`.ids`), rollout.samples_per_prompt samples each; seeds are a
    function of (loop.seed, step) (rollout/seeds.py). With sampling-mask replay each request
    also asks for the kept candidate sets; with replay.gates=engine under R3, for the engine's
    gate weights (R2 records the actor's own)."""
    ro, n = cfg.rollout, cfg.rollout.samples_per_prompt
    gates = cfg.replay.gates == "engine" and cfg.replay.mode is ReplayMode.R3
    picks = wants_indexer_picks(cfg)  # sparse attention's key positions (replay.indexer)
    return [GenerateRequest(list(p.ids), SamplingParams(
        temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
        max_new_tokens=max_new_tokens, n=n, seed=sampling_seed(cfg.loop.seed, step, i * n)),
        rid=f"s{step}p{i}",
        return_sampling_mask=ro.mask_replay, return_gates=gates, return_indexer_topk=picks)
        for i, p in enumerate(prompts)]
