"""The sampling seeds of a run's requests: one derivation from (loop.seed, step, sample).

A step's samples are seeded `base + i` (i: the sample's index in the step, request r's sample
j at i = r * n + j; the engines seed sample j of a request seeded s with s + j), validation's
at `base + 2^23 + i`, with

    base = ((loop.seed * 1_000_003 + step) mod 2^39) * 2^24

so every seed lies in [0, 2^63) for every loop.seed and step: an int64, which SGLang, vLLM
and the embedded engine take as it is. Where `loop.seed * 1_000_003 + step` < 2^39 (every step
of a loop.seed below 549,754) this is the unreduced formula, so runs within that range sample
what they always did. Above it the key wraps mod 2^39; 1_000_003 is odd, so within one step
distinct seeds still get distinct keys.
"""

from __future__ import annotations

MAX_LOOP_SEED = 2**31 - 1
"""The largest loop.seed (it also seeds numpy and Python's RNGs, which take 32-bit seeds)."""
MAX_STEPS = 2**31 - 1
"""The largest step count or step interval a config may give (loop.steps, checkpoint_every,
...): every step number then keeps the sampling and shuffle seeds exact int64s."""
SEED_MULTIPLIER = 1_000_003
STREAM_BITS = 24
"""A step's seeds span 2^24 values: training's first half, validation's second."""
MAX_SAMPLES = 1 << (STREAM_BITS - 1)
"""Samples one step (or one validation pass) can seed without reaching the next stream."""
_KEY_MOD = 1 << (63 - STREAM_BITS)


def sampling_seed(loop_seed: int, step: int, index: int = 0, validation: bool = False) -> int:
    """Seed of sample `index` of step `step` under `loop_seed` (module doc): in [0, 2^63)."""
    if not 0 <= loop_seed <= MAX_LOOP_SEED:
        raise ValueError(f"loop.seed={loop_seed} is outside [0, {MAX_LOOP_SEED}]")
    if not 0 <= index < MAX_SAMPLES:
        raise ValueError(f"sample index {index} is outside [0, {MAX_SAMPLES}): one step seeds "
                         f"at most {MAX_SAMPLES} samples")
    key = (loop_seed * SEED_MULTIPLIER + step) % _KEY_MOD
    return (key << STREAM_BITS) + (MAX_SAMPLES if validation else 0) + index
