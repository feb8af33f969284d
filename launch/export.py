"""`lockstep export SRC --out DIR --dtype fp8`: write an HF folder in the form an engine loads.

    lockstep export runs/x/checkpoints/step_200/hf --out serve/x-fp8 --dtype fp8
    python -m sglang.launch_server --model-path serve/x-fp8 ...     # block FP8, from config.json

SRC is any HF folder lockstep reads (a run's `checkpoints/step_N/hf` with its fp32 master
weights, a block-FP8 folder, one written by transformers). `--dtype fp8` writes block FP8 in
DeepSeek-V3's layout (every attention/MLP/expert projection as float8_e4m3fn plus an fp32
`weight_scale_inv` per 128x128 block, the rest bf16, `quantization_config` in config.json;
docs/precision.md); bf16 / fp16 / fp32 write plain weights in that dtype. The tokenizer and
generation files of SRC are copied along. DIR must not exist yet (nothing is overwritten), nor
lie inside SRC or inside any lockstep run directory or checkpoint (its files would break that
run's checkpoints, outside their manifest). A SRC inside a checkpoint is verified against the
checkpoint's manifest before it is read (flipped or truncated bytes are refused, as
`--resume` refuses them).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from lockstep.kernels.dtypes import ENGINE_PRECISIONS, FP8

_WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "config.json")


class ExportError(ValueError):
    """A bad SRC or --out, one line."""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="write an HF folder in block FP8 (or another dtype)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="HF folder to read")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write (must not exist)")
    p.add_argument("--dtype", required=True, choices=list(ENGINE_PRECISIONS),
                   help="fp8: block FP8 (DeepSeek-V3 layout); bf16, fp16, fp32: plain")
    p.set_defaults(run=run)
    return p


def enclosing_checkpoint(path: Path) -> Path | None:
    """The checkpoint folder (manifest.json and state.json) `path` is or lies inside."""
    from lockstep.trainer.state.rundir import CHECKPOINT_FILES
    return next((p for p in (path, *path.parents)
                 if all((p / f).is_file() for f in CHECKPOINT_FILES)), None)


def run(args: argparse.Namespace) -> int:
    import torch

    from lockstep.kernels.dtypes import torch_dtype
    from lockstep.moe.checkpoint import load_hf, save_hf

    from lockstep.trainer.state.checkpoint import verify_manifest
    from lockstep.trainer.state.rundir import enclosing_run

    src, out = Path(args.src), Path(args.out)
    if not src.exists():
        raise ExportError(f"{src} does not exist")
    if not (src / "config.json").is_file():
        hint = (f"; a run's checkpoint keeps it in {src / 'hf'}"
                if (src / "hf" / "config.json").is_file() else "")
        raise ExportError(f"{src} is not an HF folder (no config.json){hint}")
    if out.exists() or out.is_symlink():
        raise ExportError(f"--out {out} exists; export writes a new folder")
    real_src, real_out = src.resolve(), out.resolve()
    if real_src in real_out.parents:
        raise ExportError(f"--out {out} lies inside the source {src}; export writes a new "
                          f"folder outside it")
    owner = enclosing_run(out)
    if owner is not None:
        raise ExportError(f"--out {out} lies inside the lockstep run or checkpoint {owner}; "
                          f"files there would break its checkpoints: choose a folder outside it")
    ckpt = enclosing_checkpoint(real_src)
    if ckpt is not None:  # the bytes --resume would trust, or nothing
        verify_manifest(ckpt, under=real_src.relative_to(ckpt).as_posix())
    model = load_hf(src)  # block-FP8 folders come back dequantised, fp32
    fp8 = args.dtype == FP8
    save_hf(model, out, dtype=torch.bfloat16 if fp8 else torch_dtype(args.dtype), fp8=fp8)
    for f in sorted(src.iterdir()):  # tokenizer, chat template, generation config
        if f.is_file() and not any(f.match(p) for p in _WEIGHT_FILES):
            shutil.copyfile(f, out / f.name)
    print(f"lockstep export: {src} -> {out} ({args.dtype})")
    return 0
