"""Run metrics: one JSON line per step, TensorBoard scalars, a progress bar, and end-of-run plots.

`DIR/metrics.jsonl` holds one object per RL step (keys documented in docs/training.md). On
resume from the checkpoint of step s, lines of steps > s (written by the killed run after its
last checkpoint) are dropped first, so the file ends up exactly as an uninterrupted run's.

Each checkpoint keeps its own gzipped copy of the history (`HISTORY_FILE`, covered by its
manifest). On resume the rows of steps 1..s must be there, in order, once, and equal to that
copy: a torn, missing, doubled, reordered or emptied history is restored from the copy (said
on the log), or, for a checkpoint without one (earlier versions), refused naming the problem.
"""

from __future__ import annotations

import gzip
import json
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

PLOTS = {  # file name -> (title, metric keys)
    "reward.png": ("reward", ["reward/mean"]),
    "flip_rate.png": ("routing flip rate (rollout vs trainer router)",
                      ["routing/flip_rate", "routing/token_any_flip"]),
    "k3_kl.png": ("train/infer mismatch k3 KL", ["rollout_corr/k3_kl"]),
}


HISTORY_FILE = "metrics.jsonl.gz"  # a checkpoint's copy of metrics.jsonl


class MetricKeyCollision(ValueError):
    """Two parts of a step wrote the same metric key: one would silently replace the other."""


def merge_metrics(**parts: Mapping[str, Any]) -> dict[str, Any]:
    """One metrics row from the step's named parts, in order; a key two parts both write is
    refused naming the key and both parts (a dict merge would keep the last one's value)."""
    row: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for part, metrics in parts.items():
        for k, v in metrics.items():
            if k in owner:
                raise MetricKeyCollision(f"metric {k!r} is written by both {owner[k]} and {part}")
            owner[k] = part
            row[k] = v
    return row


class MetricsFileError(ValueError):
    """A metrics.jsonl file that is not one step record per line (or not the run's history)."""


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All step records of a metrics.jsonl file (a torn last line is ignored; any other bad
    line is a `MetricsFileError` naming the file and line)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError:
        raise MetricsFileError(f"{path} is not a text file") from None
    return _parse(lines, path)


def _parse(lines: list[str], path: Path) -> list[dict[str, Any]]:
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            if i == len(lines) - 1:
                break  # only the last line of a killed run can be torn
            raise MetricsFileError(f"{path}:{i + 1}: not a JSON line") from None
        if not (isinstance(row, dict) and isinstance(row.get("step"), int)):
            raise MetricsFileError(f"{path}:{i + 1}: not a step record (no integer 'step')")
        rows.append(row)
    return rows


def history_problem(rows: list[dict[str, Any]], upto: int | None = None) -> str | None:
    """What is wrong with `rows` as the history of steps 1..`upto` (default: the last row's
    step), one step each, in order; None when nothing is."""
    steps = [r["step"] for r in rows]
    upto = steps[-1] if upto is None and steps else upto or 0
    if steps == list(range(1, upto + 1)):
        return None
    seen: set[int] = set()
    for i, s in enumerate(steps):
        if s in seen:
            return f"step {s} appears more than once (again at row {i + 1})"
        if i and s < steps[i - 1]:
            return f"steps out of order at row {i + 1} (step {s} after {steps[i - 1]})"
        seen.add(s)
    missing = [s for s in range(1, upto + 1) if s not in seen]
    if not steps:
        return f"it holds no rows, the run is at step {upto}"
    return (f"{len(missing)} of steps 1..{upto} missing (first: step {missing[0]})" if missing
            else f"it has rows past step {upto}")


def save_history(metrics_path: str | Path, folder: str | Path) -> Path:
    """Copy `metrics_path` into checkpoint folder `folder` as `HISTORY_FILE` (gzipped)."""
    out = Path(folder) / HISTORY_FILE
    out.write_bytes(gzip.compress(Path(metrics_path).read_bytes(), mtime=0))
    return out


def _checkpoint_history(out_dir: Path, step: int) -> list[dict[str, Any]] | None:
    """The rows kept by the checkpoint of `step` (verified with it on load), or None when it
    has no copy (checkpoints of earlier versions)."""
    copy = out_dir / "checkpoints" / f"step_{step}" / HISTORY_FILE
    if not copy.is_file():
        return None
    text = gzip.decompress(copy.read_bytes()).decode()
    return [r for r in _parse(text.splitlines(), copy) if r["step"] <= step]


def resumed_history(path: Path, step: int, log: Callable[[str], None] | None = None,
                    ) -> list[dict[str, Any]]:
    """The rows of steps 1..`step` a resume from the checkpoint of `step` continues: those of
    `path`, checked against the checkpoint's copy (restored from it, with a line on `log`,
    when they differ); raises `MetricsFileError` when they are wrong and there is no copy."""
    # a torn last line is dropped by read_metrics: a missing step if it was checkpointed
    try:
        rows = [r for r in read_metrics(path) if r["step"] <= step] if path.exists() else []
        problem = history_problem(rows, step)
    except MetricsFileError as e:
        rows, problem = None, str(e)
    copy = _checkpoint_history(path.parent, step)
    if rows is None and copy is None:
        raise MetricsFileError(f"{problem} (checkpoint step_{step} keeps no copy to restore "
                               f"from; repair the file or start a new run)")
    if copy is not None:  # the history as it was when the checkpoint was written
        if rows != copy:
            why = problem or ("missing" if not path.exists() else "rows differ from it")
            if log is not None:
                log(f"warning: {path} does not match checkpoint step_{step} ({why}); "
                    f"restored its {step} rows from the checkpoint's copy")
            return copy
        return rows
    if not path.exists():
        raise FileNotFoundError(f"resuming at step {step} but {path} is missing (and "
                                f"checkpoint step_{step} keeps no copy of it)")
    if problem is not None:
        raise MetricsFileError(f"{path} is not the history of steps 1..{step} of the "
                               f"checkpoint: {problem} (checkpoint step_{step} keeps no copy "
                               f"to restore from; repair the file or start a new run)")
    return rows


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null reads as "not measured"
    return v


class MetricsWriter:
    """Writes step metrics to JSONL (+ TensorBoard) and drives a tqdm progress bar."""

    def __init__(self, out_dir: str | Path, total_steps: int, start_step: int = 0,
                 tensorboard: bool = True, progress: bool = True,
                 log: Callable[[str], None] | None = None):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / "metrics.jsonl"
        if start_step:  # resume: the checkpointed history, checked (see the module doc)
            kept = resumed_history(self.path, start_step, log)
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif self.path.exists():
            self.path.write_text("")
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # purge_step drops events a killed run wrote after its last checkpoint
            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"),
                                     purge_step=start_step + 1 if start_step else None)
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                         disable=not progress, dynamic_ncols=True)
        self.total_steps, self._start_step = total_steps, start_step
        self._line_fn: Callable[[str], None] | None = None
        self._line_every = 0
        self._t0 = time.monotonic()

    def log_lines(self, fn: Callable[[str], None], every: int) -> None:
        """Also report progress as one text line every `every` steps (and at the first and
        last step) through `fn`: for logs, where no progress bar is drawn."""
        self._line_fn, self._line_every = fn, every

    def progress_line(self, metrics: dict[str, Any]) -> str:
        """`step 20/200 reward 0.412 k3_kl 3.1e-04 flip 0.0021 step_time 0.41s ETA 1m13s`"""
        step = int(metrics["step"])
        done = step - self._start_step
        per_step = (time.monotonic() - self._t0) / max(done, 1)
        eta = int(per_step * (self.total_steps - step))

        def f(key: str, fmt: str) -> str:
            v = metrics.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) else "n/a"
        return (f"step {step}/{self.total_steps} reward {f('reward/mean', '.3f')} "
                f"k3_kl {f('rollout_corr/k3_kl', '.1e')} flip {f('routing/flip_rate', '.4f')} "
                f"step_time {f('time/step_s', '.2f')}s ETA {eta // 60}m{eta % 60:02d}s")

    def log(self, metrics: dict[str, Any]) -> None:
        step = int(metrics["step"])
        self._file.write(json.dumps({k: _jsonable(v) for k, v in metrics.items()}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
        if self._line_fn is not None and self._line_every > 0 and (
                step % self._line_every == 0 or step == self.total_steps
                or step == self._start_step + 1):
            self._line_fn(self.progress_line(metrics))
        self._bar.update(1)
        self._bar.set_postfix({"reward": f"{metrics.get('reward/mean', float('nan')):.3f}",
                               "k3_kl": f"{metrics.get('rollout_corr/k3_kl', float('nan')):.1e}",
                               "flip": f"{metrics.get('routing/flip_rate', float('nan')):.4f}"})

    def close(self) -> None:
        self._bar.close()
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def summarize(rows: list[dict[str, Any]], window: int = 20) -> dict[str, float]:
    """Run summary: reward over the first and last `window` steps, run means of the mismatch
    metrics, total step time."""
    def mean(key: str, part: list[dict[str, Any]]) -> float:
        vals = [r[key] for r in part if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else float("nan")

    first, last = rows[:window], rows[-window:]
    out = {"steps": len(rows), "window": window,
           "reward/first_mean": mean("reward/mean", first),
           "reward/last_mean": mean("reward/mean", last),
           "rollout_corr/k3_kl_mean": mean("rollout_corr/k3_kl", rows),
           "rollout_corr/kl_mean": mean("rollout_corr/kl", rows),
           "routing/flip_rate_mean": mean("routing/flip_rate", rows),
           "routing/token_any_flip_mean": mean("routing/token_any_flip", rows),
           "time/steps_total_s": sum(r.get("time/step_s") or 0.0 for r in rows)}
    if any("indexer/flip_rate" in r for r in rows):  # DSA models (replay.indexer)
        for key in ("indexer/flip_rate", "indexer/token_any_flip", "replay/mismatch"):
            out[f"{key}_mean"] = mean(key, rows)
    if any("agent/turns_mean" in r for r in rows):  # multi-turn runs (rollout.env)
        for key in ("agent/turns_mean", "agent/tool_call_rate", "agent/errors"):
            out[f"{key}_first"], out[f"{key}_last"] = mean(key, first), mean(key, last)
    return out


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (NaN/None entries skipped)."""
    out, buf = [], []
    for v in values:
        if v is not None and math.isfinite(v):
            buf.append(v)
        buf = buf[-window:]
        out.append(sum(buf) / len(buf) if buf else float("nan"))
    return out


def write_plots(out_dir: str | Path, runs: dict[str, list[dict[str, Any]]] | None = None,
                window: int = 10) -> list[Path]:
    """PNG plots of reward, flip rate and k3 KL per step (raw, faint, and smoothed) into
    `out_dir`. `runs` maps a label to step records (default: this directory's metrics.jsonl),
    so several runs (e.g. replay off / R2 / R3) can share one figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    runs = runs or {"": read_metrics(out_dir / "metrics.jsonl")}
    written = []
    for name, (title, keys) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for label, rows in runs.items():
            steps = [r["step"] for r in rows]
            for key in keys:
                ys = [r.get(key) for r in rows]
                if all(y is None for y in ys):
                    continue
                tag = " ".join(x for x in (label, key) if x)
                line, = ax.plot(steps, smooth(ys, window), label=f"{tag} (avg {window})")
                ax.plot(steps, [float("nan") if y is None else y for y in ys],
                        color=line.get_color(), alpha=0.25, linewidth=0.8)
        ax.set_title(title)
        ax.set_xlabel("step")
        if name == "k3_kl.png":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(out_dir / name)
    for label, rows in runs.items():
        path = write_flip_heatmap(plt, rows, out_dir, label)
        if path is not None:
            written.append(path)
    path = write_expert_load_plot(plt, runs, out_dir, window)
    if path is not None:
        written.append(path)
    return written


LOAD_SOURCES = (("rollout/moe", "engine", "-"), ("actor/moe", "actor", "--"))
LOAD_PLOT = "expert_load_layers.png"


def load_layers(rows: list[dict[str, Any]]) -> list[int]:
    """Decoder layer ids that have expert-load metrics (`<source>/max_vio/layer_<i>`)."""
    found = set()
    for prefix, _, _ in LOAD_SOURCES:
        head = f"{prefix}/max_vio/layer_"
        found |= {int(k[len(head):]) for r in rows for k in r if k.startswith(head)}
    return sorted(found)


def write_expert_load_plot(plt, runs: dict[str, list[dict[str, Any]]], out_dir: Path,
                           window: int = 10):
    """One panel per MoE layer: max load / mean load - 1 (verl's `max_vio`) per step of the
    engine's routes (solid) and the actor's own (dashed), smoothed, for every run; the
    panels' titles are also written into the PNG's `Description` text (what the figure
    holds). None when no run has expert-load metrics."""
    layers = sorted({i for rows in runs.values() for i in load_layers(rows)})
    if not layers:
        return None
    cols = min(3, len(layers))
    nrows = -(-len(layers) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.4 * cols, 2.4 * nrows + 0.6),
                             squeeze=False, sharex=True)
    titles = []
    for ax, i in zip(axes.flat, layers):
        for c, (label, rows) in enumerate(runs.items()):
            steps = [r["step"] for r in rows]
            for prefix, who, style in LOAD_SOURCES:
                ys = [r.get(f"{prefix}/max_vio/layer_{i}") for r in rows]
                if all(y is None for y in ys):
                    continue
                tag = " ".join(x for x in (label, who) if x)
                ax.plot(steps, smooth(ys, window), style, color=f"C{c}", label=tag)
        titles.append(f"layer {i}")
        ax.set_title(titles[-1], fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(layers):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("expert load per MoE layer: max / mean - 1 (max_vio)", fontsize=10)
    fig.tight_layout()
    path = out_dir / LOAD_PLOT
    fig.savefig(path, dpi=110, metadata={"Description": "panels: " + ", ".join(titles)})
    plt.close(fig)
    return path


def layer_flip_matrix(rows: list[dict[str, Any]]) -> tuple[list[int], list[int], list[list[float]]]:
    """(decoder layer ids, steps, matrix[layer][step]) of `routing/flip_rate/layer_<i>`;
    NaN where a step has no value."""
    prefix = "routing/flip_rate/layer_"
    layers = sorted({int(k[len(prefix):]) for r in rows for k in r if k.startswith(prefix)})
    steps = [r["step"] for r in rows]
    matrix = [[float("nan") if r.get(f"{prefix}{i}") is None else r[f"{prefix}{i}"]
               for r in rows] for i in layers]
    return layers, steps, matrix


def write_flip_heatmap(plt, rows: list[dict[str, Any]], out_dir: Path, label: str = ""):
    """Heatmap of the rollout-vs-trainer flip rate per MoE layer (rows) and step (columns):
    which layers disagree, and whether it grows as training moves the router."""
    layers, steps, matrix = layer_flip_matrix(rows)
    if not layers or not steps:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 1.2 + 0.35 * len(layers)))
    im = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="magma",
                   extent=(steps[0] - 0.5, steps[-1] + 0.5, len(layers) - 0.5, -0.5))
    ax.set_yticks(range(len(layers)), [f"layer {i}" for i in layers])
    ax.set_xlabel("step")
    ax.set_title(" ".join(x for x in (label, "routing flip rate per MoE layer") if x))
    fig.colorbar(im, ax=ax, label="flip rate")
    fig.tight_layout()
    name = f"flip_rate_layers{'_' + label if label else ''}.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return out_dir / name
