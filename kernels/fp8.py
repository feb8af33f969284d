"""Block FP8 (the DeepSeek-V3 / SGLang recipe): e4m3 values with fp32 scales.

- Weights (O, D) are cut into 128 x 128 blocks; each block b has one scale
  s_b = amax(|w_b|) / 448 and stores q = round_e4m3(w / s_b) (round to nearest even, clamped to
  +-448, the largest finite e4m3fn value). The checkpoint keeps s under the name
  `weight_scale_inv` (DeepSeek-V3's name: the factor that *dequantises*, w ~= q * s), shape
  (ceil(O/128), ceil(D/128)). Stacked expert weights (E, O, D) are blocked per expert.
- Activations (..., D) are quantised per token in groups of 128 along D (1 x 128), scale
  max(amax, eps) / 448 per group, at every linear's input, dynamically.
- A block or group at an edge is smaller when the dimension is not a multiple of 128 (a
  dimension below 128 is then one partial block): its scale is its own amax.

On CPU the matmul is emulated: both operands dequantised to fp32 (q * s), an fp32 matmul, the
result cast to the compute dtype; the real kernels also accumulate in fp32 and scale per
block. `scaled_mm_blockwise` is the GPU path (torch._scaled_mm with row-wise scales, one call
per 128-wide K block), used only where the device has FP8 tensor cores.

`weight_qdq` / `act_qdq` are quantise-dequantise with a straight-through backward (the
gradient passes unchanged to the fp32 master values), which is what FP8 training with fp32
master weights (TE's recipes, `actor.fp8`) does to the forward.

Shape legend: O output rows, D input width (the contraction), N tokens, E experts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value; values are clamped to it before the cast (e4m3fn has no
infinity; what a cast does out of range is the device's choice)."""
BLOCK = 128
"""Weight block side and activation group width."""
ACT_EPS = 1e-10
"""Floor of an activation group's amax (SGLang's per-token-group quantiser): an all-zero group
gets a tiny scale, not a division by zero."""
WEIGHT_EPS = 1e-12
"""Floor of a weight block's amax, for all-zero blocks only (real weights never reach it)."""


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -x.shape[dim] % multiple
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad)


def _to_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(E4M3)


def block_scales_shape(shape: tuple[int, ...], block: tuple[int, int] = (BLOCK, BLOCK)
                       ) -> tuple[int, ...]:
    """Scale shape of a weight of `shape` (..., O, D): (..., ceil(O/128), ceil(D/128))."""
    *lead, O, D = shape
    return (*lead, math.ceil(O / block[0]), math.ceil(D / block[1]))


def quantize_weight(w: torch.Tensor, scale_inv: torch.Tensor | None = None):
    """(q float8_e4m3fn (..., O, D), scale_inv fp32 (..., ceil(O/128), ceil(D/128))).

    `scale_inv` given: quantise with those scales (values beyond +-448 of a block then
    saturate at +-448) instead of each block's amax / 448."""
    if w.dim() < 2:
        raise ValueError(f"block FP8 quantises matrices (..., O, D), got shape {tuple(w.shape)}")
    *lead, O, D = w.shape
    wp = _pad_to(_pad_to(w.float(), -2, BLOCK), -1, BLOCK)
    Ob, Db = wp.shape[-2] // BLOCK, wp.shape[-1] // BLOCK
    blocks = wp.reshape(*lead, Ob, BLOCK, Db, BLOCK)
    if scale_inv is None:
        amax = blocks.abs().amax(dim=(-3, -1))  # (..., Ob, Db)
        scale_inv = amax.clamp(min=WEIGHT_EPS) / FP8_MAX
    elif tuple(scale_inv.shape) != (*lead, Ob, Db):
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not fit a "
                         f"weight of shape {tuple(w.shape)} in {BLOCK}x{BLOCK} blocks: expected "
                         f"{(*lead, Ob, Db)}")
    scale_inv = scale_inv.float()
    q = _to_e4m3(blocks / scale_inv[..., :, None, :, None])
    q = q.reshape(*lead, Ob * BLOCK, Db * BLOCK)[..., :O, :D]
    return q.contiguous(), scale_inv


def dequantize_weight(q: torch.Tensor, scale_inv: torch.Tensor,
                      dtype: torch.dtype = torch.float32,
                      block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """q * scale_inv blockwise (blocks of `block`, a checkpoint's weight_block_size), in fp32,
    then cast to `dtype`."""
    *lead, O, D = q.shape
    want = block_scales_shape(tuple(q.shape), block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not fit a "
                         f"weight of shape {tuple(q.shape)} in {block[0]}x{block[1]} blocks: "
                         f"expected {want}")
    s = scale_inv.float().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return (q.float() * s[..., :O, :D]).to(dtype)


def quantize_act(x: torch.Tensor):
    """(q float8_e4m3fn (..., D), scale fp32 (..., ceil(D/128))): 1 x 128 groups per token."""
    D = x.shape[-1]
    xp = _pad_to(x.float(), -1, BLOCK)
    groups = xp.reshape(*x.shape[:-1], xp.shape[-1] // BLOCK, BLOCK)  # may have 0 tokens
    scale = groups.abs().amax(-1).clamp(min=ACT_EPS) / FP8_MAX
    q = _to_e4m3(groups / scale[..., None]).reshape(xp.shape)[..., :D]
    return q.contiguous(), scale


def dequantize_act(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    D = q.shape[-1]
    return q.float() * scale.repeat_interleave(BLOCK, -1)[..., :D]


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantise-dequantised fp32 value; backward: the gradient unchanged."""

    @staticmethod
    def forward(ctx, x, kind):
        ctx.dtype = x.dtype
        if kind == "weight":
            return dequantize_weight(*quantize_weight(x))
        return dequantize_act(*quantize_act(x))

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def weight_qdq(w: torch.Tensor) -> torch.Tensor:
    """w on the block-FP8 grid, fp32; straight-through gradient."""
    return _StraightThrough.apply(w, "weight")


def act_qdq(x: torch.Tensor) -> torch.Tensor:
    """x on the 1x128-group FP8 grid, fp32; straight-through gradient."""
    return _StraightThrough.apply(x, "act")


# -- the GPU path ------------------------------------------------------------------------------
def has_scaled_mm(device: torch.device) -> bool:
    """FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell) for torch._scaled_mm."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_fits(N: int, D: int, O: int) -> bool:
    """torch._scaled_mm wants the contraction and output widths in multiples of 16."""
    return N > 0 and D % 16 == 0 and O % 16 == 0


def scaled_mm_blockwise(x_ND: torch.Tensor, w_deq_OD: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """x @ w.T with x quantised in 1x128 groups and w re-quantised in 128x128 blocks, on FP8
    tensor cores: for each 128-wide K block, one torch._scaled_mm with the rows' group scales
    (N, 1) and the weight block scales spread over their 128 output columns (1, O), summed in
    fp32. GPU only (`has_scaled_mm`); tests/gpu checks it against the CPU emulation."""
    N, D = x_ND.shape
    O = w_deq_OD.shape[0]
    xq, xs = quantize_act(x_ND)                     # (N, D), (N, Db)
    wq, ws = quantize_weight(w_deq_OD)              # (O, D), (Ob, Db)
    ws_col = ws.repeat_interleave(BLOCK, 0)[:O]     # (O, Db): each output row's block scale
    out = torch.zeros(N, O, dtype=torch.float32, device=x_ND.device)
    for kb, k0 in enumerate(range(0, D, BLOCK)):
        k1 = min(k0 + BLOCK, D)
        a = xq[:, k0:k1].contiguous()
        b = wq[:, k0:k1].contiguous().t()           # column-major (K, O), as _scaled_mm wants
        out += torch._scaled_mm(a, b, scale_a=xs[:, kb:kb + 1].contiguous(),
                                scale_b=ws_col[:, kb][None].contiguous(),
                                out_dtype=torch.float32)
    return out.to(out_dtype)
