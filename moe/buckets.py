"""Weight buckets: how weights travel from the actor to the rollout engines.

A weight export is an iterable of *buckets*, each a list of `(hf_name, tensor)` pairs whose
tensors together hold at most `bucket_bytes` (a single tensor larger than that is a bucket of
its own). Every exporter (the in-process actors, the Ray actor group) yields this type and
every consumer (engine, SGLang-wire server, Ray engines, HF checkpoint writer) accepts it, so
a push never needs the whole model in one place.

`flatten_bucket` / `unflatten_bucket` are the `load_format="flattened_bucket"` layout of SGLang's
`/update_weights_from_distributed`: one uint8 tensor, the concatenation of each tensor's bytes
(contiguous, in list order), described by its names, dtypes and shapes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

Bucket = list[tuple[str, torch.Tensor]]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucketize(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group `(name, tensor)` pairs, in order, into buckets of at most `bucket_bytes`."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0
    for name, t in named:
        n = tensor_bytes(t)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def flatten_bucket(bucket: Bucket) -> tuple[torch.Tensor, list[str], list[torch.dtype],
                                            list[tuple[int, ...]]]:
    """One uint8 tensor holding every tensor's bytes in order, and (names, dtypes, shapes)."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return (flat, [n for n, _ in bucket], [t.dtype for _, t in bucket],
            [tuple(t.shape) for _, t in bucket])


def unflatten_bucket(flat: torch.Tensor, names: list[str], dtypes: list[torch.dtype],
                     shapes: list[tuple[int, ...]]) -> Bucket:
    """Inverse of `flatten_bucket`; views into `flat` (no copies). The sizes must add up."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"flattened bucket: {len(names)} names, {len(dtypes)} dtypes and "
                         f"{len(shapes)} shapes")
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"flattened bucket must be a 1-D uint8 tensor, got {flat.dtype} "
                         f"{tuple(flat.shape)}")
    out: Bucket = []
    offset = 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        numel = 1
        for s in shape:
            numel *= int(s)
        n = numel * torch.empty((), dtype=dtype).element_size()
        if offset + n > flat.numel():
            raise ValueError(f"flattened bucket: {name} {dtype} {tuple(shape)} needs bytes "
                             f"[{offset}, {offset + n}) of {flat.numel()}")
        out.append((name, flat[offset:offset + n].view(dtype).view(shape)))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flattened bucket: the tensors hold {offset} bytes, the buffer "
                         f"{flat.numel()}")
    return out
