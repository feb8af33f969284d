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
- `--resume` needs a checkpoint and says how to restart when there is none;
- no file is written through a symbolic link: a run file, the marker or the lock that is a
  link (planted, e.g. in a shared /tmp) is refused, and the marker counts only as a regular
  file (the run's folders, such as checkpoints/ on another disk, may be links, but not links
  into another run's tree; a marker or lock that is not a regular file is refused);
- `--out` inside another run's directory tree (e.g. `runs/x/checkpoints/step_6`) is refused:
  its files would break that run's checkpoints; so is a fresh `--out` directly holding a run
  (`--out runs` next to `runs/x`), which would put that run inside this one.

Every refusal is a `RunDirError` with a one-line message.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import time
from pathlib import Path

from lockstep.trainer.state.checkpoint import list_checkpoints

MARKER = ".lockstep-run"
LOCK_FILE = ".lockstep-lock"
# What a run writes into its directory (see docs/training.md).
OUTPUTS = ("config.yaml", "metrics.jsonl", "summary.json", "warmstart.json", "checkpoints",
           "tensorboard", "weights", "reward.png", "flip_rate.png", "k3_kl.png",
           "flip_rate_layers.png", "wandb", "wandb.json")
OUTPUT_DIRS = ("checkpoints", "tensorboard", "weights", "wandb")
# A checkpoint folder (trainer/state/checkpoint.py) is recognised by these files.
CHECKPOINT_FILES = ("manifest.json", "state.json")


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
        try:  # O_NOFOLLOW: a planted link to someone's file is refused, never truncated
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RunDirError(_link_msg(path)) from None
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
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RunDirError(f"{path} is not a regular file; remove it or choose another --out")
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


def _link_msg(path: Path) -> str:
    return (f"{path} is a symbolic link; lockstep never writes through links in a run "
            f"directory (one planted there could point at anyone's file): remove it or "
            f"choose another --out")


def _is_regular(path: Path) -> bool:
    """`path` is a regular file itself (not a link to one)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_lockstep_run(out: str | Path) -> bool:
    """`out` carries lockstep's marker, as a regular file (a link does not count)."""
    return _is_regular(Path(out) / MARKER)


def _owning_run(path: Path) -> Path | None:
    """The lockstep run directory (marker) that `path`, links resolved, is or lies inside."""
    path = path.resolve()
    return next((p for p in (path, *path.parents) if is_lockstep_run(p)), None)


def _check_no_links(out: Path) -> None:
    """Refuse a run directory whose lock, marker or run files are symbolic links or not
    regular files, or whose folders (which may be links, e.g. checkpoints/ on another disk)
    or checkpoint folders are links into another run's tree (this run would write there)."""
    for name in (LOCK_FILE, MARKER, *(n for n in OUTPUTS if n not in OUTPUT_DIRS)):
        path = out / name
        if path.is_symlink():
            raise RunDirError(_link_msg(path))
        if name in (LOCK_FILE, MARKER) and path.exists() and not _is_regular(path):
            raise RunDirError(f"{path} is not a regular file; remove it or choose another --out")
    links = [out / n for n in OUTPUT_DIRS if (out / n).is_symlink()]
    if (out / "checkpoints").is_dir():
        links += [p for p in (out / "checkpoints").iterdir() if p.is_symlink()]
    own = out.resolve()
    for link in links:
        owner = _owning_run(link)
        if owner is not None and owner != own:
            raise RunDirError(f"{link} is a link into the lockstep run {owner}; this run would "
                              f"write its files there and break that run: remove the link or "
                              f"choose another --out")


def _holds_run(out: Path) -> Path | None:
    """A lockstep run directly inside `out` (a fresh run there would make that run lie inside
    another one, so it could not resume)."""
    try:
        return next((p for p in sorted(out.iterdir()) if p.is_dir() and is_lockstep_run(p)),
                    None)
    except OSError:
        return None


def enclosing_run(out: Path) -> Path | None:
    """The lockstep run directory (marker) or checkpoint folder that `out` lies inside (or
    is, for a checkpoint folder), if any."""
    def is_checkpoint(d: Path) -> bool:
        return all(_is_regular(d / f) for f in CHECKPOINT_FILES)

    out = out.resolve()
    if is_checkpoint(out):
        return out
    return next((p for p in out.parents if is_lockstep_run(p) or is_checkpoint(p)), None)


def report_dir_problem(out: str | Path) -> str | None:
    """Why `out` may not take a report's files (`lockstep compare` / `diagnose --out`): it is a
    lockstep run directory (its own plots would be overwritten) or lies inside a checkpoint
    folder (which would then fail verification); None when it may."""
    out = Path(out)
    if is_lockstep_run(out) or (out / "metrics.jsonl").exists():
        return (f"--out {out} is a run directory; its files would be overwritten: choose "
                f"another --out")
    real = out.resolve()
    ckpt = next((p for p in (real, *real.parents)
                 if all(_is_regular(p / f) for f in CHECKPOINT_FILES)), None)
    if ckpt is not None:
        return (f"--out {out} lies inside the checkpoint {ckpt}; files there would make it "
                f"fail verification: choose another --out")
    return None


def _write_marker(out: Path) -> None:
    fd = os.open(out / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"created_by": "lockstep", "pid": os.getpid(),
                            "time": time.time()}) + "\n")


def _restart_hint(out: Path) -> str:
    return f"lockstep train {out / 'config.yaml'} --out {out}"


def claim_run_dir(out: str | Path, resume: bool) -> RunLock:
    """Check that `out` may be used (see the module doc), create it, lock it, mark it as a
    lockstep run. Returns the held lock; raises `RunDirError`."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file, not a directory")
    inside = enclosing_run(out)
    if inside is not None:
        raise RunDirError(f"--out {out} lies inside the lockstep run or checkpoint {inside}; "
                          f"its files there would break that run (and its checkpoints): "
                          f"choose an --out outside it")
    if out.is_dir():
        _check_no_links(out)
    if resume:
        if not out.is_dir():
            raise RunDirError(f"--resume: {out} does not exist")
    else:
        held = _holds_run(out) if out.is_dir() and not is_lockstep_run(out) else None
        if held is not None:
            raise RunDirError(f"--out {out} holds the lockstep run {held}; a run here would put "
                              f"that run inside this one (it could no longer resume): choose "
                              f"an --out next to it, not above it")
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
            _write_marker(out)
    except BaseException:
        if fresh_lock and not is_lockstep_run(out):
            (out / LOCK_FILE).unlink(missing_ok=True)  # leave a foreign directory as it was
        lock.release()
        raise
    return lock
