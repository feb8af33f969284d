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

Block-FP8 folders (DeepSeek-V3's layout: config.json `quantization_config` {quant_method: fp8,
fmt: e4m3, weight_block_size: [128, 128]}, `X.weight` float8_e4m3fn with `X.weight_scale_inv`
fp32 of shape [ceil(O/128), ceil(D/128)]) read the same way: `X.weight` comes back
dequantised (q * scale, fp32, then `dtype`); the `weight_scale_inv` tensors are not listed.

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

from ..kernels.fp8 import dequantize_weight

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
SCALE_SUFFIX = "_scale_inv"
"""`X.weight` + this: the dequantisation scales of a block-FP8 weight (DeepSeek-V3's name)."""
FP8_STORED = "F8_E4M3"  # safetensors' name of float8_e4m3fn


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


def fp8_block_size(folder: Path) -> tuple[int, int] | None:
    """weight_block_size of a block-FP8 folder's config.json `quantization_config`; None when
    config.json has none. Anything but e4m3 FP8 with a 2-number block size is refused."""
    try:
        qc = json.loads(regular_file(folder / "config.json").read_text()).get(
            "quantization_config")
    except (CheckpointError, ValueError, AttributeError):
        return None  # no (readable) config.json: the weights alone say what they are
    if qc is None:
        return None
    where = f"{folder / 'config.json'}: quantization_config"
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        raise CheckpointError(f"{where} = {qc!r}: only block FP8 (quant_method fp8) is read")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where}.fmt = {qc['fmt']!r}: only e4m3 weights are read")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{where}.weight_block_size = {block!r}: expected two positive "
                              "integers such as [128, 128] (per-tensor FP8 is not read)")
    return block[0], block[1]


def _model_type(folder: Path) -> str | None:
    """config.json's model_type, None when there is no readable config.json."""
    try:
        return json.loads(regular_file(folder / "config.json").read_text()).get("model_type")
    except (CheckpointError, ValueError, AttributeError):
        return None


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
    `dtype`: floating-point tensors are returned in it (None: as stored, but block-FP8 weights
    dequantised to fp32); others as stored."""

    def __init__(self, folder: str | os.PathLike, dtype: torch.dtype | None = torch.float32):
        self.folder, self.dtype = Path(folder), dtype
        self.bytes_read = 0
        self._handles: dict[Path, object] = {}
        # HF name -> (file, stored name, expert or None, kind: "" | "gate" | "up" | "down")
        self._where: dict[str, tuple[Path, str, int | None, str]] = {}
        self._shapes: dict[str, torch.Size] = {}
        self._scales: dict[str, tuple[Path, str]] = {}  # FP8 weight -> where its scales are
        self._block = fp8_block_size(self.folder) or (128, 128)
        # gpt-oss's HF names are the stacked expert tensors themselves: nothing to split
        self._split_stacked = _model_type(self.folder) != "gpt_oss"
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
        self._pair_fp8_scales()

    def _pair_fp8_scales(self) -> None:
        """Hide each `X.weight_scale_inv` behind its `X.weight` (checked: an FP8 weight, scales
        of the block shape); an FP8 weight without scales is refused."""
        for k in [k for k in self._where if k.endswith(SCALE_SUFFIX)]:
            w = k[:-len(SCALE_SUFFIX)]
            path, key, _, _ = self._where.pop(k)
            shape = self._shapes.pop(k)
            if w not in self._where or self._stored_dtype(w) != FP8_STORED:
                raise CheckpointError(f"{path}: {k} has no float8_e4m3fn tensor {w!r} to scale")
            (bo, bd), (O, D) = self._block, self._shapes[w][-2:]
            want = torch.Size([-(-O // bo), -(-D // bd)])
            if self._where[w][2] is not None or shape != want:
                raise CheckpointError(f"{path}: {k} has shape {tuple(shape)}; {w} of shape "
                                      f"{tuple(self._shapes[w])} in {bo}x{bd} blocks needs "
                                      f"{tuple(want)}")
            self._scales[w] = (path, key)
        bare = [k for k in self._where if k not in self._scales
                and self._stored_dtype(k) == FP8_STORED]
        if bare:
            more = f" ({len(bare)} such tensors)" if len(bare) > 1 else ""
            raise CheckpointError(f"{self.folder}: float8 tensor {bare[0]!r} has no "
                                  f"{bare[0] + SCALE_SUFFIX!r}: block-FP8 weights need their "
                                  f"scales{more}")

    def _stored_dtype(self, name: str) -> str:
        path, key, _, _ = self._where[name]
        return self._open(path).get_slice(key).get_dtype()
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
        if name in self._scales:  # an FP8 weight: its fp32 scales too
            spath, skey = self._scales[name]
            scales = torch.Size(self._open(spath).get_slice(skey).get_shape()).numel()
            return n + 4 * scales
        return n * _itemsize(sl.get_dtype())

    def part(self, name: str, dim: int | None = None, n: int = 1, r: int = 0) -> torch.Tensor:
        """Tensor `name`, or with `dim` only its `r`-th of `n` equal chunks along `dim` (a TP
        shard): only those bytes are read from disk where the chunk is a contiguous run of
        rows (dim 0) or a strided block (dim 1); a copy, in `dtype`."""
        self._check(name)
        if name in self._scales:
            return self._part_fp8(name, dim, n, r)
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

    def _part_fp8(self, name: str, dim: int | None, n: int, r: int) -> torch.Tensor:
        """A block-FP8 weight dequantised whole (its blocks need not align with a TP chunk),
        then chunked as `part` does."""
        (path, key, _, _), (spath, skey) = self._where[name], self._scales[name]
        try:
            q = self._open(path).get_tensor(key)
            scale = self._open(spath).get_tensor(skey)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{path}: cannot read tensor {key!r} or its scales (truncated "
                                  f"or damaged?): {e}") from None
        self.bytes_read += q.numel() + scale.numel() * scale.element_size()
        t = dequantize_weight(q, scale, block=self._block)
        if dim is not None and n > 1:
            if t.shape[dim] % n:
                raise ValueError(f"{name}: dim {dim} of shape {tuple(t.shape)} not divisible "
                                 f"by {n}")
            t = t.chunk(n, dim)[r].clone()
        return t if self.dtype is None else t.to(self.dtype)

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
        m = _FUSED.match(key) if self._split_stacked else None
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
