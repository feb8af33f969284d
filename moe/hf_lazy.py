"""A read-only, lazy view of a Hugging Face checkpoint folder: `LazyHF(folder)` is a
`Mapping[str, Tensor]` of HF tensor names whose `__getitem__` reads one tensor from disk
(nothing is cached), so a process can take only the part of a model it holds: a pipeline
stage's layers, an EP rank's experts, a TP slice (`part`).

    hf = LazyHF("runs/x/weights/initial")          # config.json + safetensors (+ index)
    hf["model.embed_tokens.weight"]                # one read, cast to fp32
    hf.part("lm_head.weight", dim=0, n=2, r=1)     # rows of TP rank 1 only (safetensors slice)
    hf.bytes_read                                  # bytes taken from disk so far

The folder is a single `model.safetensors`, or shards listed by `model.safetensors.index.json`
(every tensor the index names must be in the file it names), or, without either, every
`*.safetensors` file. Stacked expert tensors as some transformers versions save them
(`model.layers.{i}.mlp.experts.gate_up_proj` [E, 2I, D], `...down_proj` [E, D, I]) show as HF's
per-expert names and are read one expert at a time. Only regular files are opened; a damaged
file or a missing tensor is named in the error (`CheckpointError`).

The file handles stay open (safetensors maps each tensor it returns on its own; the handle
holds no tensor data); a LazyHF is meant to live in the process that reads it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class CheckpointError(ValueError):
    """A checkpoint folder or state dict that does not match the model."""


def regular_file(path: Path) -> Path:
    """`path` if it is a regular file; CheckpointError otherwise (a FIFO or a device would
    block the reader forever, a directory cannot be read as one)."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise CheckpointError(f"{path} is {kind}; expected a regular file")
    return path


def weight_files(folder: Path) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors file names of an HF folder and the index's weight map (None without
    an index), checked: the folder exists, the index parses, it names files inside it."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a directory (an HF checkpoint folder)")
    weight_map = None
    if (folder / INDEX_FILE).exists():
        try:
            index = json.loads(regular_file(folder / INDEX_FILE).read_text())
            weight_map = dict(index["weight_map"])
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{folder / INDEX_FILE} is not a valid index: {e!r}") from None
    elif (folder / SINGLE_FILE).exists() or (folder / SINGLE_FILE).is_symlink():
        files = [SINGLE_FILE]
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no safetensors weights in {folder}")
    for name in files:
        if not isinstance(name, str) or Path(name).name != name:
            raise CheckpointError(f"{folder / INDEX_FILE} names {name!r}; expected a file name "
                                  f"inside {folder}")
    return files, weight_map


class LazyHF(Mapping[str, torch.Tensor]):
    """HF-named tensors of `folder`, each read from disk when asked (module docstring).
    `dtype`: floating-point tensors are returned in it (None: as stored); others as stored."""

    def __init__(self, folder: str | os.PathLike, dtype: torch.dtype | None = torch.float32):
        self.folder, self.dtype = Path(folder), dtype
        self.bytes_read = 0
        self._handles: dict[Path, object] = {}
        # HF name -> (file, stored name, expert or None, kind: "" | "gate" | "up" | "down")
        self._where: dict[str, tuple[Path, str, int | None, str]] = {}
        self._shapes: dict[str, torch.Size] = {}
        files, weight_map = weight_files(self.folder)
        stored: dict[str, Path] = {}
        for name in files:
            path = regular_file(self.folder / name)
            f = self._open(path)
            for k in f.keys():
                stored[k] = path
                self._add(k, path, f.get_slice(k).get_shape())
        if weight_map is not None:
            wrong = sorted(k for k, file in weight_map.items()
                           if stored.get(k) != self.folder / file)
            if wrong:
                k = wrong[0]
                raise CheckpointError(
                    f"{self.folder / INDEX_FILE} maps {len(wrong)} tensor(s) to a file that does "
                    f"not hold them, e.g. {k!r} -> {weight_map[k]!r}")

    # -- Mapping ---------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        return self.part(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    # -- reading ---------------------------------------------------------------------------
    def shape(self, name: str) -> torch.Size:
        """The tensor's shape, from the file header (nothing read)."""
        self._check(name)
        return self._shapes[name]

    def nbytes(self, name: str) -> int:
        """Bytes of the whole tensor as stored (nothing read)."""
        path, key, _, _ = self._where[name]
        sl = self._open(path).get_slice(key)
        n = 1
        for s in self._shapes[name]:
            n *= s
        return n * _itemsize(sl.get_dtype())

    def part(self, name: str, dim: int | None = None, n: int = 1, r: int = 0) -> torch.Tensor:
        """Tensor `name`, or with `dim` only its `r`-th of `n` equal chunks along `dim` (a TP
        shard): only those bytes are read from disk where the chunk is a contiguous run of
        rows (dim 0) or a strided block (dim 1); a copy, in `dtype`."""
        self._check(name)
        path, key, expert, kind = self._where[name]
        shape = list(self._shapes[name])
        index: list = [slice(None)] * len(shape)
        if dim is not None and n > 1:
            if shape[dim] % n:
                raise ValueError(f"{name}: dim {dim} of shape {tuple(shape)} not divisible by {n}")
            size = shape[dim] // n
            index[dim] = slice(r * size, (r + 1) * size)
        if expert is not None:  # a stacked expert tensor [E, ...]: this expert's rows
            if kind in ("gate", "up"):
                rows = self._shapes[name][0]
                lo = 0 if kind == "gate" else rows
                s = index[0]
                index[0] = slice(lo + (s.start or 0), lo + (rows if s.stop is None else s.stop))
            index = [slice(expert, expert + 1)] + index
        try:
            t = self._open(path).get_slice(key)[tuple(index)]
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{path}: cannot read tensor {key!r} (truncated or damaged?): "
                                  f"{e}") from None
        if expert is not None:
            t = t[0]
        self.bytes_read += t.numel() * t.element_size()
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t

    def close(self) -> None:
        self._handles.clear()

    # -- helpers ---------------------------------------------------------------------------
    def _check(self, name: str) -> None:
        if name not in self._where:
            raise KeyError(f"{self.folder}: no tensor {name!r}")

    def _open(self, path: Path):
        f = self._handles.get(path)
        if f is None:
            try:
                f = safe_open(path, framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{path} is not a readable safetensors file (truncated or "
                                      f"damaged?): {e}") from None
            self._handles[path] = f
        return f

    def _add(self, key: str, path: Path, shape: list[int]) -> None:
        m = _FUSED.match(key)
        if not m:
            self._where[key] = (path, key, None, "")
            self._shapes[key] = torch.Size(shape)
            return
        prefix, kind = m.groups()
        for e in range(shape[0]):
            if kind == "down_proj":
                self._where[f"{prefix}.{e}.down_proj.weight"] = (path, key, e, "")
                self._shapes[f"{prefix}.{e}.down_proj.weight"] = torch.Size(shape[1:])
            else:
                if shape[1] % 2:
                    raise CheckpointError(f"{path}: {key} has shape {shape}; the stacked "
                                          f"gate_up_proj needs an even dim 1")
                half = torch.Size([shape[1] // 2, *shape[2:]])
                for part in ("gate", "up"):
                    self._where[f"{prefix}.{e}.{part}_proj.weight"] = (path, key, e, part)
                    self._shapes[f"{prefix}.{e}.{part}_proj.weight"] = half


def _itemsize(dtype: str) -> int:
    return {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
            "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1,
            "F8_E5M2": 1}.get(dtype, 4)
