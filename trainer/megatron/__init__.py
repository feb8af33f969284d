"""megatron-core backend: model mapping, HF <-> Megatron weights, the routing-replay adapter.

Import submodules directly (`lockstep.trainer.megatron.model`, ...); importing this package
does not import megatron-core.
"""
