"""The run directory: one lockstep process at a time, and never a user's files overwritten.

`claim_run_dir(out, resume)` is called by `lockstep train` before anything is written:

- it takes an exclusive `flock` on `DIR/.lockstep-lock` (holding the PID) for the life of the
  process; a second `lockstep train` or `--resume` on the same directory is refused naming the
  holder's PID. The kernel drops the lock when the holder exits or is killed, so a dead run
  never blocks its own resume;
- a fresh run refuses a directory holding any file a run writes (config.yaml, summary.json,
  metrics.jsonl, checkpoints/, ...) unless the directory carries lockstep's marker
  `DIR/.lockstep-run` (written when a run starts) and has no checkpoint yet: a run killed
  before its first checkpoint can be restarted from scratch, a run with checkpoints needs
  `--resume`, and files lockstep did not create are never written over;
- `--resume` needs a checkpoint and says how to restart when there is none.

Every refusal is a `RunDirError` with a one-line message.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from pathlib import Path

from lockstep.trainer.checkpoint import list_checkpoints

MARKER = ".lockstep-run"
LOCK_FILE = ".lockstep-lock"
# What a run writes into its directory (see docs/training.md).
OUTPUTS = ("config.yaml", "metrics.jsonl", "summary.json", "warmstart.json", "checkpoints",
           "tensorboard", "weights", "reward.png", "flip_rate.png", "k3_kl.png",
           "flip_rate_layers.png")


class RunDirError(RuntimeError):
    """A run directory that cannot be used as asked (in use, someone else's files, no
    checkpoint to resume, not writable)."""


class RunLock:
    """An exclusive advisory lock on a run directory, held until `release` or process exit."""

    def __init__(self, out: Path, fd: int):
        self.out, self._fd = out, fd

    @classmethod
    def acquire(cls, out: str | Path) -> "RunLock":
        out = Path(out)
        path = out / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise RunDirError(f"cannot write to {out}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise RunDirError(f"cannot lock {path}: {e.strerror}") from None
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(f"{out} is in use by another lockstep process (PID {holder}); "
                              f"wait for it to finish, stop it, or choose another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(out, fd)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def is_lockstep_run(out: str | Path) -> bool:
    return (Path(out) / MARKER).is_file()


def _restart_hint(out: Path) -> str:
    return f"lockstep train {out / 'config.yaml'} --out {out}"


def claim_run_dir(out: str | Path, resume: bool) -> RunLock:
    """Check that `out` may be used (see the module doc), create it, lock it, mark it as a
    lockstep run. Returns the held lock; raises `RunDirError`."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file, not a directory")
    if resume:
        if not out.is_dir():
            raise RunDirError(f"--resume: {out} does not exist")
    else:
        clash = [n for n in OUTPUTS if (out / n).exists()]
        if clash and not is_lockstep_run(out):
            raise RunDirError(
                f"--out {out} already holds {', '.join(clash)}, not written by a lockstep run "
                f"(no {MARKER} marker); lockstep never writes over them: choose a new or empty "
                f"--out (or pass --resume if it is a run of an older lockstep)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create --out {out}: {e.strerror}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise RunDirError(f"--out {out} is not writable")
    fresh_lock = not (out / LOCK_FILE).exists()
    lock = RunLock.acquire(out)
    try:
        ckpts = list_checkpoints(out)
        if resume and not ckpts:
            if (out / "config.yaml").exists():
                raise RunDirError(f"--resume: {out} has no checkpoint yet (the run stopped "
                                  f"before its first one); restart it from scratch with "
                                  f"`{_restart_hint(out)}`")
            raise RunDirError(f"--resume: {out} holds no lockstep run (no checkpoints, no "
                              f"config.yaml)")
        if not resume and ckpts:
            raise RunDirError(f"{out} already holds a run with checkpoints (newest "
                              f"{ckpts[-1].name}); pass --resume to continue it or choose "
                              f"another --out")
        if not is_lockstep_run(out):
            (out / MARKER).write_text(json.dumps({"created_by": "lockstep", "pid": os.getpid(),
                                                  "time": time.time()}) + "\n")
    except BaseException:
        if fresh_lock and not is_lockstep_run(out):
            (out / LOCK_FILE).unlink(missing_ok=True)  # leave a foreign directory as it was
        lock.release()
        raise
    return lock
