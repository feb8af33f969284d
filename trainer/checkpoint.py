"""Resumable training checkpoints: `DIR/checkpoints/step_<n>/`.

Each holds
  hf/                 the policy (fp32 master weights) as a Hugging Face Qwen3-MoE folder with
                      the tokenizer, loadable by `lockstep.moe.checkpoint.load_hf`, transformers
                      or SGLang
  trainer_state.pt    optimiser and LR-schedule state, RNG states (python, numpy, torch)
  state.json          step, data cursor, config hash, engine weight version (written last)

A checkpoint is written to `step_<n>.tmp/` and renamed into place, so a run killed mid-save
leaves no half checkpoint under a final name; `latest_checkpoint` only sees complete ones.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from lockstep.moe.checkpoint import load_hf, save_hf
from lockstep.moe.model import MoEModel

STATE_FILE = "state.json"


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
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir: str | Path, model: MoEModel, trainer_state: dict, state: LoopState,
                    tokenizer=None, keep: int = 0) -> Path:
    """Write `run_dir/checkpoints/step_<state.step>/`; then delete all but the newest `keep`
    (0 = keep all). Returns the checkpoint folder."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{state.step}"
    tmp = root / f"step_{state.step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_hf(model, tmp / "hf", tokenizer=tokenizer)
    torch.save({**trainer_state, "rng": rng_state()}, tmp / "trainer_state.pt")
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    if keep > 0:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
            and (p / STATE_FILE).exists() and p.name[5:].isdigit()]
    return sorted(done, key=lambda p: int(p.name[5:]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def load_checkpoint(folder: str | Path) -> tuple[MoEModel, dict, LoopState]:
    """(fp32 model, trainer state with 'rng', loop state) of one checkpoint folder. The caller
    restores the RNG with `set_rng_state(trainer_state['rng'])` once everything is built."""
    folder = Path(folder)
    if not (folder / STATE_FILE).exists():
        raise FileNotFoundError(f"{folder} is not a complete checkpoint (no {STATE_FILE})")
    state = LoopState(**json.loads((folder / STATE_FILE).read_text()))
    model = load_hf(folder / "hf")
    trainer_state = torch.load(folder / "trainer_state.pt", weights_only=False)
    return model, trainer_state, state
