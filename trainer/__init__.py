"""The trainer: `loop.py` runs the RL step; each sub-package is one job.

config/     the experiment file: strict section models, YAML, --set overrides
objective/  the math of the loss: advantages, policy losses, rollout correction, shared stats
actor/      what computes log-probs and updates the policy: the rank interface, the torch
            and megatron-core actors, batches, versions, the Ray actor group
driver/     what the loop drives besides the actor: rollout backends, prompt sources,
            async generation, multi-turn glue, warm start, the LR trigger
observe/    what a run shows: metrics, plots, W&B, expert load, NaN checks, dumps, diagnosis
state/      what a run leaves on disk: checkpoints and the run directory
"""
