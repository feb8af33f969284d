"""Batch-invariant kernels: the same bits for a token whatever else shares its batch.

Exact mode (`rollout.exact`, docs/precision.md "Exact mode") runs the embedded engine and the
torch actor through these kernels, so a token's bf16 log-prob and routes are bitwise equal on
both sides, whatever the batch composition, the padding, and whether the engine reached the
token by prefill or by decoding from its KV cache. Torch's own kernels are not so: a CPU GEMM
picks its blocking (hence its reduction order) from the number of rows (1-4 rows give other
bits than 5+), SDPA's causal, masked and one-query paths reduce over the keys differently, and
`sigmoid`'s vector and scalar loops differ in the last bit (tests/test_exact.py shows each).

How each reduction is made order-free:
- **Matmuls** (`linear`, `grouped_linear`, attention's q.k) are *exact*: each row of the left
  operand and each row of the weight is rounded onto its own fixed-point grid (a power-of-two
  scale from its largest element; `a + b + log2(K) <= 53` bits, so 22 + 22 bits for K <= 512),
  and the integer-valued operands are multiplied in fp64, where every partial sum is an exact
  integer: any summation order, any BLAS, gives the same number, then rounded once. Grid
  rounding moves only elements 2^-22 below their row's largest (bf16 keeps 8 bits), so the
  result is at least as accurate as an fp32-accumulating GEMM of the same bf16 operands.
- **Sums** (norms, softmax denominators, the log-softmax over the vocabulary) are integer sums
  (`fixed_sum`): terms on one fixed-point grid as int64, summed exactly.
- **Attention over the keys**: the softmax weights and the values go onto fixed-point grids
  that depend only on the query's own valid keys (causal, <= its position), and P @ V runs as an
  exact fp64 product, so padded keys, stale cache entries and the key count change nothing.
- **Elementwise** ops are IEEE-exact per element (+, -, *, /, sqrt, round, where) or, for exp
  and log, torch's kernels, whose vector and scalar loops agree on every value we checked
  (`tests/test_exact.py::test_exp_and_log_are_position_invariant` guards that on each build);
  sigmoid / SiLU are written as x / (1 + exp(-x)) with those.
- **Selection** (top-k) is a stable sort: ties go to the lower index.

Bit widths that bound a reduction over keys come from the model's context (`max_len`), never
from a batch's padded length, so they are the same on every path.

Gradients: each exact op's backward is torch's own for the same function (linear: the two
GEMMs; attention, norms, softmax, log-probs: recomputed through the reference op), so exact
mode trains like the default path, with exact forwards.

Shape legend: N rows (tokens), K contraction, O outputs, E experts, B batch, H query heads,
G key/value heads, T queries, M keys, D width, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FP64_BITS = 53
INT64_BITS = 62  # headroom under 2^63


def _ceil_log2(n: int) -> int:
    return max(0, math.ceil(math.log2(max(1, n))))


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0 ** e for integer tensor e, exactly (built from the fp64 exponent bits; e clamped to
    the normal range [-1022, 1023])."""
    e = e.to(torch.int64).clamp(-1022, 1023)
    return torch.bitwise_left_shift(e + 1023, 52).view(torch.float64)


def row_exponent(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """int64 e with max |x| along `dim` < 2^e (keepdim); 0 for an all-zero row."""
    amax = x.detach().abs().amax(dim=dim, keepdim=True)
    return torch.frexp(amax.double())[1].to(torch.int64)


def _pow2f(e: torch.Tensor) -> torch.Tensor:
    """2.0 ** e as fp32 for integer e in [-126, 127], exactly (from the exponent bits)."""
    return torch.bitwise_left_shift(e.to(torch.int32) + 127, 23).view(torch.float32)


def on_grid(x: torch.Tensor, bits: int) -> torch.Tensor:
    """fp64 x rounded onto its row's grid 2^(e - bits) (max |x| of the row < 2^e, rows along
    the last axis): at most `bits` significant bits above the grid, so products of two such
    operands summed over K terms are exact in fp64 when their bits + log2(K) <= 53. Rounds in
    fp32 (exact there for bits <= 24; bf16/fp16/fp32 inputs), then widens."""
    x32 = x.detach().float()
    e = torch.frexp(x32.abs().amax(-1, keepdim=True))[1].clamp_(min=bits - 126 + 1, max=127)
    q = torch.round(x32 * _pow2f(bits - e))
    return q.double() * pow2(e - bits)


def _weight_on_grid(w: torch.Tensor, bits: int) -> torch.Tensor:
    """`on_grid` of a weight, kept on the tensor while it is unchanged (same storage, shape and
    in-place version): the engine's weights change once per step, not once per forward."""
    key = (w.data_ptr(), w._version, tuple(w.shape), tuple(w.stride()), w.dtype, bits)
    cached = getattr(w, "_exact_on_grid", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    g = on_grid(w, bits)
    try:
        w._exact_on_grid = (key, g)
    except (AttributeError, RuntimeError):  # a tensor that takes no attributes: no cache
        pass
    return g


def fixed_sum(x: torch.Tensor, dim: int, max_terms: int) -> torch.Tensor:
    """Sum along `dim` (keepdim) independent of order and of trailing zeros: the terms go onto
    one power-of-two grid per slice (from its largest |term|, `62 - log2(max_terms)` bits) and
    are summed as int64. fp64 result; `max_terms` bounds the terms of any call that must agree
    (a model size, never a batch's padding). No gradient."""
    bits = INT64_BITS - _ceil_log2(max_terms)
    e = row_exponent(x, dim)
    q = torch.round(x.detach().double() * pow2(bits - e)).to(torch.int64)
    return q.sum(dim=dim, keepdim=True).double() * pow2(e - bits)


def exp(x: torch.Tensor) -> torch.Tensor:
    """torch.exp (position-invariant on the builds we run; see the module docstring)."""
    return torch.exp(x)


def log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), per element the same bits anywhere in a tensor (torch.sigmoid's vector
    and scalar loops differ). Differentiable."""
    return 1.0 / (1.0 + exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) in x's precision (computed in fp32 for bf16/fp16, as F.silu does)."""
    x32 = x.float()
    return (x32 * sigmoid(x32)).to(x.dtype)


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, largest first, ties to the lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def sum_in_order(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Left-to-right sum along a short `dim` (keepdim), one add per element. Differentiable."""
    parts = x.unbind(dim)
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc.unsqueeze(dim)


# -- linear ------------------------------------------------------------------------------------
def _bits(K: int) -> tuple[int, int]:
    """Grid bits of the two operands of a K-term exact product (at most fp32's 24 each)."""
    total = FP64_BITS - _ceil_log2(K)
    return min(24, total // 2), min(24, total - total // 2)


def linear_forward(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ w.T (+ bias), exact (no gradient); the result rounded once to `out_dtype` (x's)."""
    K = x.shape[-1]
    a, b = _bits(K)
    y = on_grid(x, a) @ _weight_on_grid(w, b).t()   # every partial sum exact: any order
    if bias is not None:
        y = y + bias.detach().double()
    return y.to(out_dtype or x.dtype)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, out_dtype):
        ctx.save_for_backward(x, w)
        ctx.has_bias = bias is not None
        return linear_forward(x, w, bias, out_dtype)

    @staticmethod
    def backward(ctx, g):
        # the gradients of F.linear(x.float(), w.float()) cast back: the default path's
        x, w = ctx.saved_tensors
        g32 = g.float().reshape(-1, w.shape[0])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g32 @ w.float()).to(x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:
            gw = (g32.t() @ x.float().reshape(-1, x.shape[-1])).to(w.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g32.sum(0)
        return gx, gw, gb, None


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Exact x @ w.T (+ bias) in x's dtype (or `out_dtype`); torch's linear gradients."""
    if _needs_grad(x, w, bias):
        return _Linear.apply(x, w, bias, out_dtype)
    return linear_forward(x, w, bias, out_dtype)


def grouped_forward(x_XD: torch.Tensor, w_EOD: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Rows offs_E[e-1]:offs_E[e] of x times w_EOD[e].T, exact, in x's dtype (no gradient)."""
    X, D = x_XD.shape
    E, O = w_EOD.shape[:2]
    a, b = _bits(D)
    xg = on_grid(x_XD, a)
    wg = _weight_on_grid(w_EOD, b)                     # (E, O, D)
    out = torch.empty(X, O, dtype=torch.float64, device=x_XD.device)
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            out[start:end] = xg[start:end] @ wg[e].t()
        start = end
    return out.to(x_XD.dtype)


class _Grouped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, ref):
        ctx.save_for_backward(x, w, offs)
        ctx.ref = ref
        return grouped_forward(x, w, offs)

    @staticmethod
    def backward(ctx, g):
        x, w, offs = ctx.saved_tensors
        return (*_recompute_grads(ctx.ref, (x, w), ctx.needs_input_grad[:2], g, offs), None, None)


def grouped_linear(x_XD: torch.Tensor, w_EOD: torch.Tensor, offs_E: torch.Tensor, ref):
    """Exact grouped matmul; the gradient is that of `ref(x, w, offs)` (the default kernel)."""
    if _needs_grad(x_XD, w_EOD):
        return _Grouped.apply(x_XD, w_EOD, offs_E, ref)
    return grouped_forward(x_XD, w_EOD, offs_E)


def _recompute_grads(ref, inputs, needs, g, *extra):
    """Gradients of ref(*inputs, *extra) w.r.t. the inputs that need one, by recomputing it."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(bool(n)) for t, n in zip(inputs, needs)]
        out = ref(*leaves, *extra)
        want = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(out, want, g, allow_unused=True)) if want else iter(())
        return [next(grads) if t.requires_grad else None for t in leaves]


# -- norms, softmax ----------------------------------------------------------------------------
def rms_norm_forward(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last axis with an order-free sum of squares; normalised in fp64,
    rounded to fp32, then (bf16/fp16 input) to x's dtype and scaled there, as moe.layers does."""
    D = x.shape[-1]
    xd = x.detach().double()
    ss = fixed_sum(xd * xd, -1, D)            # x^2 is exact in fp64 for bf16 and fp32
    r = 1.0 / torch.sqrt(ss / D + eps)
    y32 = (xd * r).float()
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return y32 * w.detach()
    return w.detach() * y32.to(x.dtype)


def _rms_norm_ref(x, w, eps):
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return rms_norm_forward(x, w, eps)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return (*_recompute_grads(_rms_norm_ref, (x, w), ctx.needs_input_grad[:2], g, ctx.eps),
                None)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if _needs_grad(x, w):
        return _RMSNorm.apply(x, w, eps)
    return rms_norm_forward(x, w, eps)


def softmax_forward(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis in fp32 with an order-free denominator."""
    x32 = x.detach().float()
    e = exp(x32 - x32.amax(-1, keepdim=True))
    return (e.double() / fixed_sum(e, -1, x.shape[-1])).float()


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = softmax_forward(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        y, = ctx.saved_tensors
        return y * (g - (g * y).sum(-1, keepdim=True))


def softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last axis, batch-invariant; torch's softmax gradient."""
    if _needs_grad(x):
        return _Softmax.apply(x)
    return softmax_forward(x)


def log_softmax(z: torch.Tensor, max_terms: int | None = None) -> torch.Tensor:
    """fp32 log-softmax over the last axis, batch-invariant (no gradient): z - (m + log S) with
    m the row max and S the order-free sum of exp(z - m) (terms in (0, 1])."""
    z = z.detach().float()
    m = z.amax(-1, keepdim=True)
    s = fixed_sum(exp(z - m), -1, max_terms or z.shape[-1])
    return (z.double() - (m.double() + log(s))).float()


# -- log-probs of chosen tokens (the actor's side of the engine's log_softmax) ------------------
def logprobs_forward(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, ids_N: torch.Tensor,
                     temperature: torch.Tensor, chunk_size: int = 8192):
    """(log-prob of `ids`, entropy) under softmax((hidden @ weight.T) / T), fp32, no gradient.
    The log-prob is bitwise `log_softmax(linear(hidden, weight, out_dtype=fp32) / T)` at ids
    (what the exact engine samples with), computed in vocabulary chunks: one pass for the row
    max and the chosen logit, one for the order-free sum of exp(z - max) (terms in (0, 1], on
    `fixed_sum`'s grid for a row whose largest term is 1). The entropy uses ordinary fp32 sums
    (a metric, not compared with the engine). `temperature`: a 0-dim fp32 tensor."""
    h, w = hidden_ND.detach(), weight_VD.detach()
    N, V = h.shape[0], w.shape[0]
    chunks = [(lo, min(lo + chunk_size, V)) for lo in range(0, V, chunk_size)]
    m = torch.full((N, 1), float("-inf"), device=h.device)
    chosen = torch.zeros(N, device=h.device)
    for lo, hi in chunks:
        z = linear_forward(h, w[lo:hi], out_dtype=torch.float32) / temperature
        m = torch.maximum(m, z.amax(-1, keepdim=True))
        idx = ((ids_N >= lo) & (ids_N < hi)).nonzero(as_tuple=True)[0]
        chosen[idx] = z[idx, ids_N[idx] - lo]
    bits = INT64_BITS - _ceil_log2(V)
    total = torch.zeros(N, 1, dtype=torch.int64, device=h.device)
    ez = torch.zeros(N, 1, device=h.device)
    es = torch.zeros(N, 1, device=h.device)
    for lo, hi in chunks:
        z = linear_forward(h, w[lo:hi], out_dtype=torch.float32) / temperature
        e = exp(z - m)
        total += torch.round(e.double() * 2.0 ** (bits - 1)).to(torch.int64).sum(-1, keepdim=True)
        es += e.sum(-1, keepdim=True)
        ez += (e * z).sum(-1, keepdim=True)
    lse = m.double() + log(total.double() * 2.0 ** (1 - bits))
    logprob = (chosen.double() - lse[:, 0]).float()
    entropy = (lse[:, 0] - (ez / es)[:, 0].double()).float()
    return logprob, entropy


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature, chunk_size, ref):
        ctx.save_for_backward(hidden, weight, ids)
        ctx.temperature, ctx.chunk_size, ctx.ref = temperature, chunk_size, ref
        return logprobs_forward(hidden, weight, ids, temperature, chunk_size)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, ids = ctx.saved_tensors
        with torch.enable_grad():
            h = hidden.detach().requires_grad_(ctx.needs_input_grad[0])
            w = weight.detach().requires_grad_(ctx.needs_input_grad[1])
            lp, ent = ctx.ref(h, w, ids, float(ctx.temperature), ctx.chunk_size)
            want = [t for t in (h, w) if t.requires_grad]
            outs = [(o, g) for o, g in ((lp, g_lp), (ent, g_ent)) if g is not None]
            grads = iter(torch.autograd.grad([o for o, _ in outs], want, [g for _, g in outs],
                                             allow_unused=True))
            gh = next(grads) if h.requires_grad else None
            gw = next(grads) if w.requires_grad else None
        return gh, gw, None, None, None, None


def logprobs(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, ids_N: torch.Tensor,
             temperature: float, chunk_size: int, ref):
    """`logprobs_forward` with the gradient of `ref(hidden, weight, ids, temperature,
    chunk_size) -> (logprobs, entropy)` (kernels.logprob.chunked_logprobs)."""
    t = torch.tensor(float(temperature), dtype=torch.float32, device=hidden_ND.device)
    if _needs_grad(hidden_ND, weight_VD):
        return _LogProbs.apply(hidden_ND, weight_VD, ids_N, t, chunk_size, ref)
    return logprobs_forward(hidden_ND, weight_VD, ids_N, t, chunk_size)


# -- attention ----------------------------------------------------------------------------------
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      valid: torch.Tensor | None, scale: float | None,
                      max_len: int) -> torch.Tensor:
    """softmax(q k^T * scale, over valid keys) v, exact in every reduction (no gradient).

    q [B, H, T, Dk]; k [B, G, M, Dk], v [B, G, M, Dv] (G divides H: grouped-query heads);
    valid bool broadcastable to [B, H, T, M] (None: causal, key j <= query i, M == T);
    `max_len` bounds the keys of any call that must agree (the model's context), so the
    fixed-point grids of the weights and values are the same for a padded prefill, a full
    forward and a decode step. Each query sees only its valid keys: the softmax weights and
    the value rows go onto grids fixed by the largest value row among those keys, and P @ V is
    an exact fp64 product of integers (`attention` in the module docstring)."""
    B, H, T, Dk = q.shape
    G, M = k.shape[1], k.shape[2]
    if G != H:
        k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    if valid is None:
        valid = torch.ones(T, M, dtype=torch.bool, device=q.device).tril(M - T)
    a, b = _bits(Dk)
    s = on_grid(q, a) @ on_grid(k, b).transpose(-1, -2)       # [B, H, T, M]: exact q.k
    s = (s * (Dk ** -0.5 if scale is None else scale)).float().masked_fill_(~valid, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = exp(s.sub_(m))                                        # 0 at invalid keys, 1 at the max
    total = FP64_BITS - _ceil_log2(max_len)
    # denominator: every e on the grid 2^-total, an integer sum (< 2^53): exact in any order
    den = torch.round(e.double() * 2.0 ** total).sum(-1, keepdim=True) * 2.0 ** -total
    # numerator: value row j on its own grid 2^(ev_j - bv); weight e_ij on the grid
    # 2^(ev_j - top_i - ap), top_i the largest ev_j over the query's valid keys, so every
    # term pq_ij * vq_jd is an integer multiple of 2^(top_i - ap - bv): exact, any order
    ap, bv = min(24, total // 2), min(24, total - total // 2)
    ev = row_exponent(v).to(torch.int32)                       # [B, H, M, 1]: |v_j| < 2^ev_j
    evT = ev.transpose(-1, -2)                                 # [B, H, 1, M]
    low = -(1 << 20)
    top = torch.where(valid, evT, low).amax(-1, keepdim=True)  # [B, H, T, 1]
    top = torch.where(top == low, torch.zeros_like(top), top)
    shift = (evT - top).clamp_(min=-126 - ap).add_(ap)         # <= ap at valid keys
    pq = torch.round(e * _pow2f(shift.clamp_(max=127)))        # 0 at invalid keys (e = 0)
    vq = torch.round(v.detach().float() * _pow2f(bv - ev))     # |vq| <= 2^bv
    num = (pq.double() @ vq.double()) * pow2((top - ap - bv).long())
    return (num / den).to(q.dtype)


def _attention_ref(q, k, v, valid, scale):
    q32, k32, v32 = q.float(), k.float(), v.float()
    if valid is None:
        o = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True,
                                           scale=scale)
    else:
        o = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=valid, enable_gqa=True,
                                           scale=scale)
    return o.to(q.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, valid, scale, max_len):
        ctx.save_for_backward(q, k, v)
        ctx.valid, ctx.scale = valid, scale
        return attention_forward(q, k, v, valid, scale, max_len)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        grads = _recompute_grads(lambda q_, k_, v_: _attention_ref(q_, k_, v_, ctx.valid,
                                                                   ctx.scale),
                                 (q, k, v), ctx.needs_input_grad[:3], g)
        return (*grads, None, None, None)


def attention(q, k, v, valid=None, scale=None, *, max_len: int):
    """Exact attention (`attention_forward`); gradients of torch's SDPA on the same inputs."""
    if _needs_grad(q, k, v):
        return _Attention.apply(q, k, v, valid, scale, max_len)
    return attention_forward(q, k, v, valid, scale, max_len)
