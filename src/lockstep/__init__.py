"""lockstep: RL for MoE policies with the trainer and the inference engine in lockstep."""

__version__ = "0.1.0"
