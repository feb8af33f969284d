"""Resumable training checkpoints: `DIR/checkpoints/step_<n>/`, and the pickle-free state-tree
format they (and any per-rank actor state) are stored in.

Each checkpoint holds
  hf/                          the policy (fp32 master weights) as a Hugging Face Qwen3-MoE
                               folder with the tokenizer (`lockstep.moe.checkpoint.load_hf`,
                               transformers or SGLang load it)
  optim/exp_avg/, exp_avg_sq/  Adam's moments under the same HF names, as HF folders: any
                               layout reads its slices (trainer/actor/checkpoint.py)
  trainer_state.safetensors    step count and LR schedule (`actor`), RNG states (python,
  trainer_state.json           numpy, torch) as a state tree: tensors / structure (`save_tree`)
  state.json                   step, data cursor, config hash, engine weight version
  manifest.json                sha256 and size of every file above (written last)

With an actor group the ranks write `hf/` and `optim/` themselves (`save_actor_checkpoint`);
this process writes the rest. Checkpoints of earlier versions hold each rank's whole optimiser
state in `trainer_state` instead (no `optim/`); they still load, on their own layout.

A checkpoint is written to `step_<n>.tmp/` and renamed into place, so a run killed mid-save
leaves no half checkpoint under a final name; a failed write (disk full) removes the `.tmp`
and raises one `CheckpointError`, earlier checkpoints untouched. Loading verifies every file
against the manifest, so flipped or truncated bytes are named instead of trained on;
`load_latest` falls back to the newest checkpoint that verifies. Nothing is unpickled: a
checkpoint of the old format (`trainer_state.pt`) is refused with a clear error.

State trees (`save_tree` / `load_tree`): nested dicts (any str/int/float/bool/None keys),
lists, tuples, str, int, float (NaN/inf included), bool, None, torch tensors and numpy arrays.
Tensors go to `<stem>.safetensors` (moved to CPU; dtype and shape kept), everything else to
`<stem>.json`. Loading builds only these types, whatever the files hold: a malformed or
hostile file gives a `CheckpointError`, never code execution.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import random
import shutil
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lockstep.moe.checkpoint import load_hf, save_hf, save_hf_state_dict
from lockstep.moe.config import ModelConfig
from lockstep.moe.hf_lazy import CheckpointError
from lockstep.moe.hf_lazy import LazyHF
from lockstep.moe.model import MoEModel

__all__ = ["CheckpointError", "LoopState", "save_tree", "load_tree", "write_manifest",
           "verify_manifest", "save_checkpoint", "save_actor_checkpoint", "load_checkpoint", "load_latest",
           "list_checkpoints", "latest_checkpoint", "rng_state", "set_rng_state"]

STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
TRAINER_STATE = "trainer_state"
LEGACY_STATE = "trainer_state.pt"
TREE_FORMAT = "lockstep-state-tree/1"
MANIFEST_FORMAT = "lockstep-manifest/1"


# -- state trees -----------------------------------------------------------------------------
def _encode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """JSON-able form of `obj`; tensors are moved into `tensors` and referenced by key."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        arr = np.ascontiguousarray(obj)
        # torch has no uint16/32/64 arithmetic worth trusting across versions: widen to int64
        # (exact for these) and record the numpy dtype to restore.
        t = torch.from_numpy(arr.astype(np.int64) if arr.dtype.kind == "u" and arr.itemsize > 1
                             else arr).clone()
        tensors[key] = t
        return {"__ndarray__": key, "dtype": arr.dtype.str}
    if isinstance(obj, np.generic):
        return _encode(obj.item(), tensors, where)
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not (k is None or isinstance(k, (str, int, float, bool))):
                raise CheckpointError(f"state tree {where or '<root>'}: key {k!r} of type "
                                      f"{type(k).__name__} cannot be stored (str/int/float/bool)")
            items.append([_encode(k, tensors, where), _encode(v, tensors, f"{where}.{k}" if where else str(k))])
        return {"__dict__": items}
    raise CheckpointError(f"state tree {where or '<root>'}: a {type(obj).__name__} cannot be "
                          f"stored (dict/list/tuple/str/int/float/bool/None/tensor/ndarray)")


def _decode(obj: Any, tensors: dict[str, torch.Tensor], where: str, used: set[str]) -> Any:
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"{where}: {msg}")

    if obj is None or isinstance(obj, (bool, str, int, float)):
        return obj
    if isinstance(obj, list):
        return [_decode(v, tensors, where, used) for v in obj]
    if not isinstance(obj, dict) or len(obj) not in (1, 2):
        raise bad(f"malformed node {str(obj)[:80]!r}")
    tag = next(iter(obj))
    val = obj[tag]
    if tag == "__float__" and len(obj) == 1:
        if val not in ("nan", "inf", "-inf"):
            raise bad(f"bad float {val!r}")
        return float(val)
    if tag in ("__tensor__", "__ndarray__"):
        if not isinstance(val, str) or val not in tensors:
            raise bad(f"references tensor {val!r}, which the safetensors file does not hold")
        used.add(val)
        t = tensors[val]
        if tag == "__tensor__":
            if len(obj) != 1:
                raise bad(f"malformed node {str(obj)[:80]!r}")
            return t
        dtype = obj.get("dtype")
        try:
            return t.numpy().astype(np.dtype(dtype))
        except (TypeError, ValueError) as e:
            raise bad(f"bad ndarray dtype {dtype!r} ({e})") from None
    if tag == "__tuple__" and len(obj) == 1 and isinstance(val, list):
        return tuple(_decode(v, tensors, where, used) for v in val)
    if tag == "__dict__" and len(obj) == 1 and isinstance(val, list):
        out = {}
        for item in val:
            if not (isinstance(item, list) and len(item) == 2):
                raise bad(f"malformed dict item {str(item)[:80]!r}")
            k = _decode(item[0], tensors, where, used)
            if not (k is None or isinstance(k, (str, int, float, bool))):
                raise bad(f"dict key {str(k)[:80]!r} is not a str/int/float/bool")
            out[k] = _decode(item[1], tensors, where, used)
        return out
    raise bad(f"malformed node {str(obj)[:80]!r}")


def _tree_paths(path: str | Path) -> tuple[Path, Path]:
    p = Path(path)
    return p.with_name(p.name + ".json"), p.with_name(p.name + ".safetensors")


def save_tree(path: str | Path, tree: Any) -> list[Path]:
    """Write a state tree as `<path>.json` (structure, scalars) and `<path>.safetensors`
    (tensors), e.g. `save_tree(folder / "rank0_actor", actor.state_dict())`. Raises
    `CheckpointError` naming the first value that cannot be stored. Returns the two files."""
    tensors: dict[str, torch.Tensor] = {}
    body = {"format": TREE_FORMAT, "tree": _encode(tree, tensors, "")}
    jpath, spath = _tree_paths(path)
    save_file(tensors, str(spath), metadata={"format": TREE_FORMAT})
    jpath.write_text(json.dumps(body, allow_nan=False) + "\n")
    return [jpath, spath]


def load_tree(path: str | Path) -> Any:
    """Read what `save_tree(path, tree)` wrote. Never unpickles; any malformed, truncated or
    mismatched file raises `CheckpointError` naming it."""
    jpath, spath = _tree_paths(path)
    for p in (jpath, spath):
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (a state tree is a .json + .safetensors pair)")
    try:
        body = json.loads(jpath.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{jpath}: not a valid state-tree JSON file ({e})") from None
    if not isinstance(body, dict) or body.get("format") != TREE_FORMAT or "tree" not in body:
        raise CheckpointError(f"{jpath}: not a lockstep state tree (format {TREE_FORMAT})")
    try:
        tensors = load_file(str(spath))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{spath}: unreadable safetensors file ({e})") from None
    used: set[str] = set()
    try:
        tree = _decode(body["tree"], tensors, str(jpath), used)
    except RecursionError:
        raise CheckpointError(f"{jpath}: state tree nested too deeply") from None
    if set(tensors) - used:
        raise CheckpointError(f"{spath}: holds tensors the tree does not reference: "
                              f"{sorted(set(tensors) - used)[:5]}")
    return tree


# -- manifests -------------------------------------------------------------------------------
def file_sha256(path: Path) -> str:
    """sha256 hex digest of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: str | Path, known: dict[str, dict] | None = None) -> Path:
    """Write `folder/manifest.json`: sha256 and size of every regular file below `folder`.
    Call it last, once everything else is written. `known` = {relative path: {sha256,
    bytes}} of files whose writers hashed them already (the actor ranks' parts): those are
    not read again (their size is still checked)."""
    folder = Path(folder)
    known = known or {}
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST_FILE:
            rel = p.relative_to(folder).as_posix()
            size = p.stat().st_size
            k = known.get(rel)
            if k is not None and k["bytes"] != size:
                raise CheckpointError(f"{p}: {size} bytes, its writer reported {k['bytes']}")
            files[rel] = {"sha256": k["sha256"] if k is not None else file_sha256(p), "bytes": size}
    unseen = sorted(set(known) - set(files))
    if unseen:
        raise CheckpointError(f"{folder}: {len(unseen)} file(s) the actor ranks wrote are not "
                              f"visible here, e.g. {unseen[0]}: the ranks need the run directory "
                              f"on shared storage (the same path on every node)")
    out = folder / MANIFEST_FILE
    out.write_text(json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1) + "\n")
    return out


def verify_manifest(folder: str | Path, under: str | None = None) -> None:
    """Check every file of `folder/manifest.json` (present, size, sha256) and that no file was
    added. Raises `CheckpointError` naming the first file that fails. `under` (a relative
    folder, e.g. "hf"): only the files below it (what a reader of that folder reads)."""
    folder = Path(folder)
    prefix = () if under in (None, "", ".") else Path(under).parts
    top = folder.joinpath(*prefix)
    mpath = folder / MANIFEST_FILE
    if not mpath.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST_FILE} (incomplete checkpoint)")
    try:
        body = json.loads(mpath.read_text())
        files = body["files"]
        assert body["format"] == MANIFEST_FORMAT and isinstance(files, dict)
        entries = [(str(k), str(v["sha256"]), int(v["bytes"])) for k, v in files.items()]
    except Exception as e:  # noqa: BLE001 - any malformation means the same thing
        raise CheckpointError(f"{mpath}: malformed manifest ({type(e).__name__}: {e})") from None
    entries = [e for e in entries if Path(e[0]).parts[:len(prefix)] == prefix]
    for rel, sha, size in entries:
        p = folder / rel
        if ".." in Path(rel).parts or not p.is_file():
            raise CheckpointError(f"{p}: missing (listed in {MANIFEST_FILE})")
        if p.stat().st_size != size:
            raise CheckpointError(f"{p}: {p.stat().st_size} bytes, the manifest says {size} "
                                  f"(truncated or overwritten)")
        if file_sha256(p) != sha:
            raise CheckpointError(f"{p}: sha256 does not match the manifest (corrupted)")
    listed = {rel for rel, _, _ in entries}
    extra = [p.relative_to(folder).as_posix() for p in top.rglob("*")
             if p.is_file() and p.name != MANIFEST_FILE
             and p.relative_to(folder).as_posix() not in listed]
    if extra:
        raise CheckpointError(f"{folder}: files not in the manifest: {sorted(extra)[:5]}")


# -- training checkpoints --------------------------------------------------------------------
@dataclass
class LoopState:
    """Where the loop stands (everything needed to continue besides weights and optimiser)."""

    step: int
    """Last completed RL step."""
    cursor: int
    """Index of the next problem of the task stream."""
    config_hash: str
    """Hash of the experiment config the run was started with."""
    weight_version: str
    """The engine's weight version after the step."""


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    try:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"trainer state: bad RNG state ({type(e).__name__}: {e})") from None


def save_checkpoint(run_dir: str | Path, model: MoEModel | dict[str, torch.Tensor],
                    trainer_state: dict, state: LoopState, tokenizer=None, keep: int = 0,
                    model_cfg: ModelConfig | None = None) -> Path:
    """Write `run_dir/checkpoints/step_<state.step>/`; then delete all but the newest `keep`
    (0 = keep all). Returns the checkpoint folder. `model` is a model or its HF-named weights
    (an actor's export; then `model_cfg` is needed). An OSError while writing (disk full,
    permissions) removes the partial write and raises `CheckpointError`; earlier checkpoints
    are left as they were."""
    def write(tmp: Path) -> None:
        if isinstance(model, MoEModel):
            save_hf(model, tmp / "hf", tokenizer=tokenizer)
        else:
            save_hf_state_dict(model, model_cfg, tmp / "hf", tokenizer=tokenizer)
        save_tree(tmp / TRAINER_STATE, {**trainer_state, "rng": rng_state()})
    return _save(run_dir, state, keep, write)


def save_actor_checkpoint(run_dir: str | Path, write_actor: Callable[[Path], tuple[dict, dict]],
                          trainer_state: dict, state: LoopState, keep: int = 0) -> Path:
    """`save_checkpoint` where the actor writes its own part: `write_actor(tmp)` writes `hf/`
    and `optim/` into the temporary folder (the actor ranks do, in a group;
    trainer/actor/checkpoint.py) and returns (its state, stored as trainer_state["actor"], {path:
    {sha256, bytes}} of the files it hashed already). This process then writes only the
    trainer state (with the RNG), state.json and the manifest, with the same temporary folder,
    rename, error handling and `keep` as `save_checkpoint`."""
    def write(tmp: Path) -> dict:
        actor_state, known = write_actor(tmp)
        save_tree(tmp / TRAINER_STATE, {**trainer_state, "actor": actor_state, "rng": rng_state()})
        return known
    return _save(run_dir, state, keep, write)


def _save(run_dir: str | Path, state: LoopState, keep: int,
          write: Callable[[Path], dict | None]) -> Path:
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{state.step}"
    tmp = root / f"step_{state.step}.tmp"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        known = write(tmp)
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")
        write_manifest(tmp, known)
        old = root / f"step_{state.step}.old"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tmp.with_name(tmp.name + ".tmp"), ignore_errors=True)  # save_hf's own
        why = os.strerror(e.errno) if e.errno else str(e)
        hint = " (free some space)" if e.errno == errno.ENOSPC else ""
        raise CheckpointError(f"could not write checkpoint {final}: {why}{hint}; earlier "
                              f"checkpoints are kept") from e
    except BaseException:  # a rank failed, weights not finite: no half checkpoint stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep > 0:
        for stale in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint folders of a run that were completely written (they may still fail
    verification), oldest first. Old-format ones (no manifest) are listed too, so loading can
    say why it refuses them."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()
            and ((p / MANIFEST_FILE).exists() or (p / LEGACY_STATE).exists())]
    return sorted(done, key=lambda p: int(p.name[5:]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def load_checkpoint(folder: str | Path, weights: bool = True,
                    ) -> tuple[MoEModel | Path, dict, LoopState]:
    """(fp32 model, trainer state with 'rng', loop state) of one checkpoint folder, every file
    verified against the manifest first. The caller restores the RNG with
    `set_rng_state(trainer_state['rng'])` once everything is built. Raises `CheckpointError`.
    `weights=False`: the model's HF folder (its headers checked) instead of the model, for
    an actor group whose ranks read it themselves (the driver holds no weights)."""
    folder = Path(folder)
    if (folder / LEGACY_STATE).exists() and not (folder / MANIFEST_FILE).exists():
        raise CheckpointError(
            f"{folder} has the old checkpoint format ({LEGACY_STATE}, a pickle); lockstep no "
            f"longer unpickles checkpoints (loading one can run arbitrary code). Start a new "
            f"run, or load only the weights from {folder / 'hf'}")
    verify_manifest(folder)
    try:
        raw = json.loads((folder / STATE_FILE).read_text())
        names = {f.name for f in fields(LoopState)}
        if not isinstance(raw, dict) or set(raw) != names:
            raise ValueError(f"keys {sorted(raw) if isinstance(raw, dict) else raw!r}")
        state = LoopState(**raw)
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{folder / STATE_FILE}: not a loop state ({e})") from None
    trainer_state = load_tree(folder / TRAINER_STATE)
    if not isinstance(trainer_state, dict) or "rng" not in trainer_state:
        raise CheckpointError(f"{folder / TRAINER_STATE}.json: no 'rng' entry")
    try:
        if not weights:
            LazyHF(folder / "hf")
            return folder / "hf", trainer_state, state
        model = load_hf(folder / "hf")
    except CheckpointError:
        raise
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        raise CheckpointError(f"{folder / 'hf'}: {type(e).__name__}: {e}") from None
    return model, trainer_state, state


def load_latest(run_dir: str | Path, warn: Callable[[str], None] | None = None,
                weights: bool = True) -> tuple[Path, MoEModel | Path, dict, LoopState] | None:
    """The newest checkpoint of `run_dir` that verifies and loads, as (folder, model, trainer
    state, loop state); None when the run has none. Each newer one that fails is reported
    through `warn` (default: `warnings.warn`) naming the file. When checkpoints exist but
    none loads, raises `CheckpointError` listing every failure."""
    warn = warn or (lambda msg: warnings.warn(msg, stacklevel=2))
    failures = []
    for folder in reversed(list_checkpoints(run_dir)):
        try:
            return (folder, *load_checkpoint(folder, weights))
        except CheckpointError as e:
            failures.append(str(e))
            warn(f"warning: checkpoint {folder.name} is not usable: {e}; trying the one before")
    if failures:
        raise CheckpointError(f"no usable checkpoint under {Path(run_dir) / 'checkpoints'}: "
                              + " | ".join(failures))
    return None
