"""Gate weights on the wire: lockstep's extension for gate-weight replay (`replay.gates: engine`).

SGLang returns expert ids only. A lockstep server (`lockstep serve`) also returns the gate
weights its MoE layers combined those experts with, when a request sets the top-level field
`lockstep_return_routed_gates: true` (`GATES_REQUEST_FIELD`), in `meta_info.routed_expert_gates`
(`GATES_RESPONSE_FIELD`): base64 of a 4-byte header and the raw little-endian values of the
MoE layers only, row-major `[rows, L, K]`, in the engine's compute dtype (bf16 / fp16: 2 bytes a
value; fp32: 4), so the trainer gets exactly the numbers the engine multiplied with.

| offset | bytes | field |
| --- | --- | --- |
| 0 | 1 | magic `0x47` ("G") |
| 1 | 1 | version (1) |
| 2 | 1 | dtype: 1 bf16, 2 fp16, 3 fp32 |
| 3 | 1 | layout check: `crc32(struct.pack("<II", L, K)) & 0xFF` |

Rows are those of the routes (`routed_experts_start_len` applies alike); the decoder is told
how many to expect. Shapes: N rows, L MoE layers, K top-k.
"""

from __future__ import annotations

import base64
import struct
import zlib

import torch

from ..kernels.routes import RouteError
from .codec import _b64decode, _who

GATES_REQUEST_FIELD = "lockstep_return_routed_gates"
GATES_RESPONSE_FIELD = "routed_expert_gates"
_MAGIC, _VERSION = 0x47, 1
_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_DTYPES = {v: k for k, v in _CODES.items()}


def _layout(L: int, K: int) -> int:
    return zlib.crc32(struct.pack("<II", L, K)) & 0xFF


def encode_gates(gates_NLK: torch.Tensor) -> str:
    """[N, L, K] bf16/fp16/fp32 gate weights -> the base64 payload."""
    if gates_NLK.dtype not in _CODES or gates_NLK.dim() != 3:
        raise RouteError(f"gate weights must be a bf16/fp16/fp32 [N, L, K] tensor, got "
                         f"{gates_NLK.dtype} {tuple(gates_NLK.shape)}")
    _, L, K = gates_NLK.shape
    head = bytes([_MAGIC, _VERSION, _CODES[gates_NLK.dtype], _layout(L, K)])
    # the raw bits: bf16 has no numpy dtype, so go through int16 (same 2 bytes, little endian)
    x = gates_NLK.contiguous().cpu()
    raw = x.view(torch.int16 if x.element_size() == 2 else torch.int32).numpy().astype(
        "<i2" if x.element_size() == 2 else "<i4").tobytes()
    return base64.b64encode(head + raw).decode("ascii")


def decode_gates(payload: str, num_rows: int, num_layers: int, top_k: int,
                 sample: int | None = None) -> torch.Tensor:
    """The base64 payload -> [num_rows, num_layers, top_k] gate weights in the sender's dtype.
    Errors (RouteError naming the sample) on bad base64, another header, a body of another
    length, and non-finite or negative weights."""
    who = _who(sample, "gate weights")
    data = _b64decode(payload, sample, "gate weights")
    if len(data) < 4 or data[0] != _MAGIC:
        raise RouteError(f"{who}: not a lockstep gate payload (header {data[:4].hex()})")
    if data[1] != _VERSION:
        raise RouteError(f"{who}: payload version {data[1]}, this decoder reads {_VERSION}")
    dtype = _DTYPES.get(data[2])
    if dtype is None:
        raise RouteError(f"{who}: unknown dtype code {data[2]} (valid: {sorted(_DTYPES)})")
    if data[3] != _layout(num_layers, top_k):
        raise RouteError(f"{who}: the server's model has another number of MoE layers or "
                         f"top-k than L={num_layers}, K={top_k}")
    size = 2 if dtype != torch.float32 else 4
    want = num_rows * num_layers * top_k * size
    if len(data) - 4 != want:
        raise RouteError(f"{who}: {len(data) - 4} bytes, expected {num_rows} rows x "
                         f"{num_layers} layers x {top_k} x {size} = {want}")
    if not want:
        return torch.zeros(num_rows, num_layers, top_k, dtype=dtype)
    # NOTE: little-endian hosts only (torch.frombuffer reads native order)
    raw = torch.frombuffer(bytearray(data[4:]), dtype=torch.int16 if size == 2 else torch.int32)
    gates = raw.view(dtype).view(num_rows, num_layers, top_k)
    bad = ~torch.isfinite(gates) | (gates < 0)
    if bool(bad.any()):
        n, l, k = (int(i) for i in bad.nonzero()[0])
        raise RouteError(f"{who}: row {n}, layer {l}, slot {k} is {float(gates[n, l, k])} "
                         f"(gate weights are finite and >= 0)")
    return gates
