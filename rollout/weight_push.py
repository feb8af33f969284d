"""The weight push to HTTP servers, in one place for one server (`HTTPBackend.update_weights`)
and for a fleet (`HTTPCalls.push`, rollout/transports.py): `rollout.weight_sync` says how.

- `distributed`: one weight-update group over the servers with the trainer as rank 0
  (`DistributedWeightSync`: SGLang's /update_weights_from_distributed; `VLLMWeightSync`: vLLM's
  native weight transfer; the clients' `SYNC_CLS`), re-formed whenever its members change;
- `tensor`: each bucket POSTed as safetensors (lockstep serve only; one server);
- `disk`: an HF folder under `weights_dir`, written once bucket by bucket and loaded by every
  server (`client.aload_folder`); only the newest folder is kept;
- `auto`: distributed, and disk for good (said once, this push included) when a server refuses
  to join or refuses a push before any weight changed (`PushRefused`).

With a `marker` file (the trainer's: RUN/push_in_flight.json), a distributed push writes it
(the URLs, the version, this process's id) before its sessions open and removes it when they
close, failed pushes included: only a killed process leaves it. A WeightPush that
finds one from a process that is gone (`--resume` of a killed run: the same run directory)
closes the sessions that push left open on those URLs, and says so; elsewhere an open
session is refused with the command that closes it (weight_sync.stale_session_help).

Errors: `PushRefused` (nothing changed) only escapes in `distributed`; a server that did not
answer is `EngineDown` (the fleet finds and relaunches it); anything else a `RolloutError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from ..moe.config import ModelConfig
from .types import EngineDown, PushRefused, RolloutError
from .weight_sync import as_buckets, write_hf_buckets

MODES = ("auto", "distributed", "tensor", "disk")
MARKER = "push_in_flight.json"
"""The marker's name in a run directory."""


class WeightPush:
    """How weights reach a set of servers (module docstring). `clients` of one push are
    `HTTPBackend`s (or `VLLMBackend`s) of those servers."""

    def __init__(self, model_cfg: ModelConfig, mode: str, sync_cls: type, *,
                 weights_dir: str | Path | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0, bucket_bytes: int = 256 << 20,
                 log: Callable[[str], None] | None = None, who: str = "",
                 marker: str | Path | None = None):
        if mode not in MODES:
            raise ValueError(f"weight_sync={mode!r}; valid: {list(MODES)}")
        self.cfg, self.mode, self.sync_cls = model_cfg, mode, sync_cls
        self.weights_dir = None if weights_dir is None else Path(weights_dir)
        self.marker = None if marker is None else Path(marker)  # the push in flight's file
        self.api_key, self.timeout_s, self.bucket_bytes = api_key, timeout_s, bucket_bytes
        self._log, self._who = log or (lambda s: None), who
        self.sync = None  # the weight-update group, over `sync_urls`
        self.sync_urls: list[str] = []
        self.last_folder: Path | None = None  # the folder of the last disk push, and its version
        self.last_version: str | None = None
        self.last_push: dict = {}  # {"mode", "bytes", "seconds", "buckets"}
        self.killed_push = self._killed_push()  # URLs a killed process left mid-push

    # -- one push ---------------------------------------------------------------------------
    def push(self, clients: list, source: Any, version: str,
             log: Callable[[str], None] | None = None) -> dict:
        """Push `source` (an HF folder every server can read, a model, HF-named tensors or an
        iterable of buckets, consumed once) to every client's server at `version`; `log`
        (else the constructor's) hears the join and a fallback."""
        if log is not None:
            self._log = log
        t0 = time.perf_counter()
        if isinstance(source, (str, Path)):
            self.load_folder(clients, Path(source), version)
            stats = {"mode": "disk", "bytes": 0, "buckets": 0}
        elif self.mode in ("auto", "distributed"):
            with self._in_flight(clients, version):
                stats = self._distributed(clients, as_buckets(source, self.bucket_bytes),
                                          version)
        elif self.mode == "tensor":
            if len(clients) != 1:
                raise ValueError("weight_sync=tensor pushes to one server only")
            stats = asyncio.run(clients[0].apush_tensor(
                as_buckets(source, self.bucket_bytes), version))
        else:
            stats = self._disk(clients, as_buckets(source, self.bucket_bytes), version)
        self.last_push = {**stats, "seconds": time.perf_counter() - t0}
        return self.last_push

    def _distributed(self, clients: list, buckets, version: str) -> dict:
        urls = [c.url for c in clients]
        if self.sync is None or self.sync_urls != urls:  # a new member: a new group
            self.close()
            try:  # auto: a server that never answers the join is given a minute
                self.sync = self.sync_cls(urls, master_addr=master_addr(urls),
                                          api_key=self.api_key, timeout_s=min(
                                              self.timeout_s, 60.0) if self.mode == "auto"
                                          else self.timeout_s)
            except PushRefused as e:  # a server refused to join: nothing changed
                if self.mode != "auto":
                    raise
                return self._fall_back(clients, f"joining the weight group failed ({e})",
                                       buckets, version)
            self.sync.timeout_s, self.sync_urls = self.timeout_s, urls
            self._log(f"{self._who}rollout.weight_sync: joined {', '.join(urls)} in weight "
                      f"group {self.sync.group_name!r} (distributed)")
        self.sync.own_stale = self.killed_push & set(urls)
        try:
            stats = self.sync.push(buckets, version)
        except PushRefused as e:  # refused before any weight changed
            self.close()
            if self.mode != "auto":
                raise
            return self._fall_back(clients, f"the server refused the push before any weight "
                                            f"changed ({e})", e.buckets, version)
        except Exception as e:  # the group is unusable; a server may have died mid-push
            self.close()
            raise EngineDown(f"distributed weight push to {urls}: {e}") from e
        except BaseException:
            self.close()
            raise
        for url in self.sync.closed_stale:
            self._log(f"{self._who}rollout.weight_sync: closed the weight-update session a "
                      f"killed push of this run left open on {url}")
        self.killed_push -= set(self.sync.closed_stale)
        self.sync.closed_stale = []
        for c in clients:
            c.confirm_version(version, "the distributed push")
        return {"mode": "distributed", **{k: stats[k] for k in ("bytes", "buckets")}}

    # -- the marker of a push in flight (module docstring) ----------------------------------
    def _killed_push(self) -> set[str]:
        try:
            d = json.loads(self.marker.read_text())
            pid, urls = int(d["pid"]), {str(u) for u in d["urls"]}
        except (AttributeError, TypeError, OSError, ValueError, KeyError):  # none: none killed
            return set()
        return set() if pid == os.getpid() or _alive(pid) else urls

    @contextlib.contextmanager
    def _in_flight(self, clients: list, version: str):
        file = self.marker
        if file is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"urls": [c.url for c in clients],
                                       "version": str(version), "pid": os.getpid()}))
            os.replace(tmp, file)
        try:
            yield
        finally:  # a failed push closed its sessions too; only a kill skips this
            if file is not None:
                file.unlink(missing_ok=True)

    def _fall_back(self, clients: list, why: str, buckets, version: str) -> dict:
        """auto: disk from now on (said once), this push included."""
        self._log(f"{self._who}rollout.weight_sync=auto: {why}; pushing weights through disk "
                  f"from now on")
        self.mode = "disk"
        self.close()
        return self._disk(clients, buckets, version)

    def _disk(self, clients: list, buckets, version: str) -> dict:
        if self.weights_dir is None:
            raise RolloutError("pushing weights through disk needs weights_dir (a folder every "
                               "server can read)")
        folder, nbytes, count = write_hf_buckets(buckets, self.cfg,
                                                 self.weights_dir / f"weights_{version}")
        old, self.last_folder = self.last_folder, folder
        if old is not None and old != folder and old.parent == self.weights_dir:
            shutil.rmtree(old, ignore_errors=True)  # the servers hold the weights in memory
        self.load_folder(clients, folder, version)
        return {"mode": "disk", "bytes": nbytes, "buckets": count,
                "disk_bytes": sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())}

    def load_folder(self, clients: list, folder: Path, version: str) -> None:
        """Every client's server loads `folder` at `version` (concurrently). A server that
        did not answer: EngineDown (after the others finished); one that refused it: a
        RolloutError naming it."""
        self.last_folder = self.last_folder if folder.parent == self.weights_dir else folder
        self.last_version = version

        async def all_() -> list:
            return await asyncio.gather(*(c.aload_folder(folder, version) for c in clients),
                                        return_exceptions=True)
        got = asyncio.run(all_())
        errors = [(c, e) for c, e in zip(clients, got) if isinstance(e, BaseException)]
        refused = [(c, e) for c, e in errors if not isinstance(e, EngineDown)]
        if refused:
            c, e = refused[0]
            raise RolloutError(f"{c.url}: loading {folder}: {e}") from e
        if errors:
            raise EngineDown(f"{len(errors)} engine(s) did not load {folder}: {errors[0][1]}")

    def forget(self, url: str) -> None:
        """A server left (died): the next distributed push forms a new group."""
        if url in self.sync_urls:
            self.sync_urls = []

    def close(self) -> None:
        """Leave the weight-update group (the servers destroy their side)."""
        if self.sync is not None:
            try:
                self.sync.close()
            except Exception:  # noqa: BLE001 - a dead member: the group is gone either way
                pass
            self.sync, self.sync_urls = None, []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def master_addr(urls: list[str]) -> str:
    """The trainer's address for the weight group's rendezvous: loopback when every server is
    on this machine's loopback, else the local interface that routes to the first server."""
    hosts = [urlsplit(u).hostname or "127.0.0.1" for u in urls]
    if all(h in ("127.0.0.1", "localhost", "::1") for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((hosts[0], 9))  # UDP: no packet is sent, only a route is chosen
        return s.getsockname()[0]
