"""The megatron-core actor: model mapping, HF <-> Megatron weights, the routing-replay adapter.

Import submodules directly (`lockstep.trainer.actor.megatron.model`, ...); importing this
package does not import megatron-core.
"""
