"""megatron-core's context-parallel token layout, in plain torch (no megatron-core import):
which positions of a row each context-parallel (CP) rank holds, the slicing of everything per
token the actor hands a CP rank (input ids, labels, routes `[B, T, L, K]`, masks) and the way
back for what a CP rank computed per token (routes run, natural top-k, log-probs).

The layout is megatron-core's `megatron.core.utils.get_batch_on_this_cp_rank`: a row of T
tokens (T a multiple of 2 x CP) is cut into 2 x CP equal chunks and CP rank r holds chunks r
and 2 x CP - 1 - r, in that order (under causal attention an early chunk costs little and a
late one much, so each rank gets one of each). Under sequence parallelism TP then splits each
CP rank's T / CP local positions as it splits a whole row without CP (replay.to_router_order).

NOTE: slice the labels (the token at t + 1, for position t), never shift after slicing: the
last position of a chunk predicts the first token of the next chunk, which another rank holds.

Shapes: B rows, T time (padded), L MoE layers, K top-k; T_r = T / CP positions per CP rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def cp_padded_length(T: int, cp: int, tp: int = 1) -> int:
    """Length >= T that splits into 2 x CP equal chunks whose halves of a CP rank's positions
    TP (sequence parallelism) splits evenly: the next multiple of 2 x CP x TP."""
    m = 2 * cp * tp
    return -(-T // m) * m


def cp_positions(T: int, cp: int, cp_rank: int, device=None) -> Tensor:
    """int64 [T_r]: the positions of a length-T row that CP rank `cp_rank` holds, in the order
    it holds them (chunk cp_rank, then chunk 2 x CP - 1 - cp_rank)."""
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"context-parallel rank {cp_rank} of {cp} ranks")
    if T % (2 * cp):
        raise ValueError(f"a row of {T} tokens does not split into 2 x context_parallel="
                         f"{2 * cp} equal chunks (pad it: cp_padded_length)")
    n = T // (2 * cp)
    first = torch.arange(cp_rank * n, (cp_rank + 1) * n, device=device)
    return torch.cat([first, first + (2 * cp - 1 - 2 * cp_rank) * n])


def slice_for_cp(x: Tensor, cp: int, cp_rank: int, dim: int = 1) -> Tensor:
    """The positions of `x` (time along `dim`, e.g. ids [B, T], routes [B, T, L, K]) that CP
    rank `cp_rank` holds, in its order (`get_batch_on_this_cp_rank`'s slice)."""
    if cp == 1:
        return x
    return x.index_select(dim, cp_positions(x.shape[dim], cp, cp_rank, device=x.device))


def place_from_cp(x_local: Tensor, T: int, cp: int, cp_rank: int, dim: int = 1) -> Tensor:
    """Inverse of `slice_for_cp` for one rank: a length-T (along `dim`) tensor of zeros with
    `x_local` at the positions CP rank `cp_rank` holds, so that the sum of every CP rank's
    placement is the whole tensor."""
    if cp == 1:
        return x_local
    shape = list(x_local.shape)
    shape[dim] = T
    out = x_local.new_zeros(shape)
    return out.index_copy(dim, cp_positions(T, cp, cp_rank, device=x_local.device), x_local)


def gather_from_cp(x_local: Tensor, T: int, cp: int, group=None, dim: int = 1) -> Tensor:
    """The whole length-T tensor on every rank of the CP `group` from each rank's `x_local`
    (no gradient; integer routes stay exact): all-gather, then each rank's part to its
    positions."""
    if cp == 1:
        return x_local
    parts = [torch.empty_like(x_local) for _ in range(cp)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    out = None
    for r, part in enumerate(parts):
        placed = place_from_cp(part, T, cp, r, dim)
        out = placed if out is None else out + placed
    return out
