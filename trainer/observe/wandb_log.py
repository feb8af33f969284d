"""Weights & Biases logging of a run (`loop.wandb`): every metric row, the plots, the config.

    loop:
      wandb: {project: moe-rl, name: r3-toy, mode: online}   # or offline / disabled

`WandbRun.start(cfg, out)` opens the W&B run with the resolved experiment config; the trainer
then logs each step's numeric metrics at that step (the rows of metrics.jsonl), the PNG plots
whenever it writes them (each checkpoint and the end), and the summary at the end. The W&B
run's id is kept in `DIR/wandb.json`, so `--resume` continues the same W&B run; its files go
under `DIR/wandb/` (or `WANDB_DIR` when set). `mode: offline` writes them without a network
(`wandb sync DIR/wandb/offline-run-*` uploads them later). Needs the `wandb` package (extra
'wandb'); W&B's own settings (API key, entity, `WANDB_MODE`) come from its environment.
"""

from __future__ import annotations

import json
import secrets
import os
from pathlib import Path
from typing import Any

ID_FILE = "wandb.json"


class WandbRun:
    """An open W&B run of one lockstep run directory."""

    def __init__(self, run: Any, wandb: Any):
        self._run, self._wandb = run, wandb
        self._finished = False

    @classmethod
    def start(cls, cfg, out: Path, resume: bool) -> "WandbRun | None":
        """The W&B run of `cfg.loop.wandb` (None when unset): a new one, or with `resume` the
        one whose id `out/wandb.json` holds."""
        w = cfg.loop.wandb
        if w is None:
            return None
        import wandb  # the extra 'wandb'

        id_file = out / ID_FILE
        run_id = json.loads(id_file.read_text())["id"] if resume and id_file.is_file() else None
        run_id = run_id or secrets.token_hex(4)
        run = wandb.init(project=w.project, name=w.name, mode=w.mode, id=run_id,
                         resume="allow", config=cfg.to_dict(),
                         dir=os.environ.get("WANDB_DIR") or str(out))
        id_file.write_text(json.dumps({"id": run_id, "project": w.project}) + "\n")
        return cls(run, wandb)

    def log(self, metrics: dict[str, Any]) -> None:
        """One step's numeric metrics, at its step."""
        step = int(metrics["step"])
        self._run.log({k: v for k, v in metrics.items()
                       if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)},
                      step=step)

    def plots(self, paths: list[Path], step: int) -> None:
        """The PNG plots just written, under `plots/<name>`, at `step`."""
        self._run.log({f"plots/{p.stem}": self._wandb.Image(str(p)) for p in paths}, step=step)

    def finish(self, summary: dict[str, Any] | None = None, failed: bool = False) -> None:
        """End the W&B run (once: later calls do nothing), with the run's summary."""
        if self._finished:
            return
        self._finished = True
        if summary:
            self._run.summary.update({f"summary/{k}": v for k, v in summary.items()})
        self._run.finish(exit_code=1 if failed else 0)
