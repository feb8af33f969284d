"""Memory a model or an engine's buffers would take, checked before anything is allocated, so
a size typo (`model.hidden_size=1000000000`, `max_position_embeddings=1000000000`) is a
one-line "would need N GB" error with a hint instead of an allocator traceback.
"""

from __future__ import annotations

import os

import torch

from lockstep.moe.checks import ConfigError
from lockstep.moe.config import ModelConfig


def param_count(cfg: ModelConfig) -> int:
    """Parameters of the model `cfg` describes, counted on the meta device (no memory)."""
    from lockstep.moe.model import MoEModel

    with torch.device("meta"):
        return sum(p.numel() for p in MoEModel(cfg).parameters())


def kv_cache_bytes(cfg: ModelConfig, slots: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of `moe.cache.allocate_cache(cfg, slots, max_len, dtype)`: the KV cache, and the
    linear-attention states and indexer keys of the families that have them."""
    heads, dk, dv = cfg.kv_cache_dims
    n = cfg.num_hidden_layers * slots * heads * max_len * (dk + dv) * dtype.itemsize
    L = len(cfg.linear_layer_ids)
    if L:
        C = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
            cfg.linear_num_value_heads * cfg.linear_value_head_dim
        n += L * slots * (C * (cfg.linear_conv_kernel_dim - 1) * dtype.itemsize
                          + cfg.linear_num_value_heads * cfg.linear_key_head_dim
                          * cfg.linear_value_head_dim * 4)
    if cfg.is_dsa:
        n += cfg.num_indexer_layers * slots * max_len * cfg.index_head_dim * dtype.itemsize
    return n


def memory_of(device: str | torch.device) -> tuple[int, str]:
    """(bytes, what) of the memory `device` allocates from: the GPU's, else the machine's RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device.index or 0)
        return props.total_memory, f"GPU {device.index or 0} ({props.name})"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"


def check_fits(what: str, nbytes: int, device: str | torch.device, hint: str) -> None:
    """Raise ConfigError naming `what` when `nbytes` exceed the memory of `device`."""
    have, where = memory_of(device)
    if nbytes > have:
        raise ConfigError(f"{what} would need {nbytes / 1e9:,.1f} GB but {where} is "
                          f"{have / 1e9:,.1f} GB; {hint}")
