"""Trainer side of disk-free weight sync: broadcast HF-named weight buckets to every engine of
a group joined through SGLang's `/init_weights_update_group` (our `lockstep serve` or a real
SGLang server: the same requests), and the check that samples carry the versions asked for.

    sync = DistributedWeightSync(["http://a:30000", "http://b:30000"])   # joins the group
    stats = sync.push(actor.export_weights(bucket_bytes), "7")           # streamed, in order
    sync.close()                                                         # destroys it

The trainer is rank 0; engine i joins as ranks `rank_offset_i .. rank_offset_i + tp_i - 1`
with rank_offset_i = 1 + the TP sizes of the engines before it (`tp_size` from /server_info,
1 when absent). Per bucket the trainer POSTs `/update_weights_from_distributed` (names, dtypes,
shapes, `load_format="flattened_bucket"`; `flush_cache` and `weight_version` on the last bucket
only) to every engine concurrently with the broadcast of the bucket's bytes as one uint8
buffer (`moe/buckets.py`). Buckets are consumed once, one at a time (one bucket of look-ahead
to know which is last): the whole model is never in one place.

Every wait is bounded by `timeout_s`: an engine that dies or hangs gives a `RolloutError`
naming it, and the sync is then broken (`close` it and build a new one). A failed push may
leave engines at different versions (a real SGLang server loads each bucket as it arrives;
ours loads nothing until the last): push again before generating.
"""

from __future__ import annotations

import base64
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from safetensors.torch import save as save_safetensors
from safetensors.torch import save_file

from ..moe.buckets import Bucket, bucketize, flatten_bucket, tensor_bytes
from ..moe.checkpoint import INDEX_FILE, hf_state_dict
from ..moe.config import ModelConfig
from ..moe.model import MoEModel
from .client import RolloutError
from .types import GenerationResult
from .weight_group import WeightGroup, free_port


def check_versions(results: list[GenerationResult], allowed: set[str]) -> None:
    """Refuse results generated with a weight version the caller did not ask for (a sample
    carries the version that generated every one of its tokens)."""
    for r in results:
        if r.weight_version not in allowed:
            raise RolloutError(f"request {r.rid} sample {r.index} was generated with weight "
                               f"version {r.weight_version!r}; this step accepts "
                               f"{sorted(allowed)}")


def as_buckets(source: Any, bucket_bytes: int) -> Iterable[Bucket]:
    """A model, a dict of HF-named tensors or an iterable of buckets, as an iterable of
    buckets (a model's and a dict's tensors are views: nothing is copied)."""
    if isinstance(source, MoEModel):
        source = hf_state_dict(source)
    if isinstance(source, dict):
        if any(not k.startswith(("model.", "lm_head.")) for k in source):
            raise ValueError("weight push: a dict source must hold HF-named tensors "
                             "(model.*, lm_head.weight)")
        return bucketize(((k, v.detach()) for k, v in source.items()), bucket_bytes)
    return source


def tensor_payload(bucket: Bucket, last: bool, weight_version: str) -> tuple[dict, int]:
    """The /update_weights_from_tensor body of one bucket in our safe format (base64 of a
    safetensors file) and its tensor bytes."""
    sd = {name: t.detach().to("cpu").contiguous() for name, t in bucket}
    body: dict[str, Any] = {
        "serialized_named_tensors": [base64.b64encode(save_safetensors(sd)).decode()],
        "load_format": "safetensors", "flush_cache": last, "abort_all_requests": False}
    if last:
        body["weight_version"] = str(weight_version)
    return body, sum(tensor_bytes(t) for t in sd.values())


def write_hf_buckets(buckets: Iterable[Bucket], cfg: ModelConfig,
                     folder: str | Path) -> tuple[Path, int, int]:
    """An HF folder written bucket by bucket (one safetensors shard each, then the index and
    config): the whole model is never in memory at once. Written to a temporary sibling and
    renamed into place. Returns (folder, tensor bytes, shards)."""
    out = Path(folder)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map, total, count = {}, 0, 0
    for bucket in buckets:
        name = f"model-{count + 1:05d}.safetensors"
        sd = {k: t.detach().to("cpu").contiguous() for k, t in bucket}
        save_file(sd, tmp / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in sd})
        total += sum(tensor_bytes(t) for t in sd.values())
        count += 1
    (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": weight_map}, indent=2))
    cfg.save_json(tmp / "config.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out, total, count


def dtype_name(dt: torch.dtype) -> str:
    """SGLang's spelling of a dtype (`getattr(torch, name)` on its side)."""
    return str(dt).removeprefix("torch.")


class DistributedWeightSync:
    """Rank 0 of a weight-update group over `urls` (module docstring)."""

    def __init__(self, urls: list[str], *, backend: str = "gloo", master_addr: str = "127.0.0.1",
                 master_port: int | None = None, group_name: str = "lockstep-weights",
                 api_key: str | None = None, timeout_s: float = 600.0):
        if not urls:
            raise ValueError("DistributedWeightSync needs at least one engine URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.backend, self.group_name, self.api_key = backend, group_name, api_key
        self.timeout_s = timeout_s
        self.group: WeightGroup | None = None
        self.broken: str | None = None  # why the group can no longer be used
        self._idle = threading.Event()  # set while no collective of ours is running
        self._idle.set()
        self._pool = ThreadPoolExecutor(len(self.urls), thread_name_prefix="lockstep-wsync")
        try:
            sizes = list(self._pool.map(self._tp_size, range(len(self.urls))))
            self.rank_offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
            self.world_size = 1 + sum(sizes)
            port = master_port or free_port(master_addr)
            body = lambda i: {"master_address": master_addr, "master_port": port,  # noqa: E731
                              "rank_offset": self.rank_offsets[i], "world_size": self.world_size,
                              "group_name": group_name, "backend": backend}
            posts = [self._pool.submit(self._post, i, "/init_weights_update_group", body(i))
                     for i in range(len(self.urls))]
            self.group = self._run_with(posts, "init_weights_update_group", lambda: WeightGroup(
                master_addr, port, 0, self.world_size, group_name, backend, timeout_s))
        except BaseException:
            self._pool.shutdown(wait=False, cancel_futures=True)
            raise

    def engine(self, i: int) -> str:
        return f"engine {i} ({self.urls[i]})"

    # -- push ------------------------------------------------------------------------------
    def push(self, buckets: Iterable[Bucket], weight_version: str) -> dict:
        """Broadcast `buckets` (consumed once, in order) to every engine; the last bucket
        carries `weight_version` and flushes. Returns {"bytes", "seconds", "buckets"}."""
        if self.group is None or self.broken:
            raise RolloutError(f"weight sync group {self.group_name!r} is unusable "
                               f"({self.broken or 'closed'}): build a new DistributedWeightSync")
        t0, total, count = time.perf_counter(), 0, 0
        it = iter(buckets)
        cur = next(it, None)
        if cur is None:
            raise ValueError("push: no buckets to send")
        while cur is not None:
            nxt = next(it, None)  # one bucket of look-ahead: is this the last?
            last = nxt is None
            flat, names, dtypes, shapes = flatten_bucket(cur)
            flat = flat.to(self.group.device)
            body: dict[str, Any] = {
                "names": names, "dtypes": [dtype_name(d) for d in dtypes],
                "shapes": [list(s) for s in shapes], "group_name": self.group_name,
                "flush_cache": last, "abort_all_requests": False,
                "load_format": "flattened_bucket"}
            if last:
                body["weight_version"] = str(weight_version)
            posts = [self._pool.submit(self._post, i, "/update_weights_from_distributed", body)
                     for i in range(len(self.urls))]
            self._run_with(posts, f"update_weights_from_distributed (bucket {count})",
                           lambda: self.group.broadcast(flat))
            total += flat.numel()
            count += 1
            cur = nxt
        return {"bytes": total, "seconds": time.perf_counter() - t0, "buckets": count}

    def close(self) -> None:
        """Destroy the group on every engine that answers and here (idempotent)."""
        if self.group is None:
            return
        self._release_group()
        # A fresh pool: the sync's own threads may still wait on a failed push's answers.
        with ThreadPoolExecutor(len(self.urls)) as pool:
            for f in [pool.submit(self._post, i, "/destroy_weights_update_group",
                                  {"group_name": self.group_name}, 5.0)
                      for i in range(len(self.urls))]:
                try:
                    f.result(10)
                except Exception:  # a dead engine, or one that already dropped the group
                    pass
        self.group = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _release_group(self) -> None:
        """Close our end of the group unless a collective of ours still runs in it (a hung
        peer); closing it makes every engine still waiting on a broadcast fail at once."""
        if self.group is not None and self._idle.is_set():
            self.group.close()

    def __enter__(self) -> "DistributedWeightSync":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------------------
    def _run_with(self, posts: list[Future], what: str, collective):
        """Run `collective` (this rank's side) on a thread while the engines answer `posts`;
        the first failure of either raises naming the engine, within timeout_s."""
        done = self._idle
        done.clear()
        box: dict[str, Any] = {}

        def run():
            try:
                box["value"] = collective()
            except BaseException as e:  # reported below
                box["error"] = e
            done.set()
        threading.Thread(target=run, daemon=True, name="lockstep-wsync-collective").start()
        deadline = time.monotonic() + self.timeout_s
        pending = dict(enumerate(posts))
        while pending or not done.is_set():
            for i, f in list(pending.items()):
                if f.done():
                    del pending[i]
                    try:
                        f.result()
                    except RolloutError as e:
                        self._fail(f"{what}: {e}")
            if "error" in box:
                e = box["error"]
                dead = self._dead_engines()
                who = ", ".join(dead) if dead else "every engine still answers /health"
                self._fail(f"{what}: the broadcast failed ({type(e).__name__}: "
                           f"{str(e)[:300]}); not answering: {who}")
            if time.monotonic() > deadline:
                slow = [self.engine(i) for i in pending] or ["the broadcast"]
                self._fail(f"{what}: no answer within {self.timeout_s:.0f}s from "
                           f"{', '.join(slow)}")
            time.sleep(0.002)
        return box.get("value")

    def _fail(self, message: str) -> None:
        self.broken = message
        self._release_group()
        raise RolloutError(f"weight sync: {message}")

    def _dead_engines(self) -> list[str]:
        def alive(i: int) -> bool:
            try:
                self._request(i, "GET", "/health", None, 5.0)
                return True
            except RolloutError:
                return False
        return [self.engine(i) for i, ok in zip(range(len(self.urls)),
                                                self._pool.map(alive, range(len(self.urls))))
                if not ok]

    def _tp_size(self, i: int) -> int:
        """The engine's TP size from /server_info (SGLang and lockstep serve report
        `tp_size`); 1 when the field is absent."""
        info = self._request(i, "GET", "/server_info", None, min(self.timeout_s, 60.0))
        tp = info.get("tp_size", 1) if isinstance(info, dict) else 1
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise RolloutError(f"{self.engine(i)}: /server_info reports tp_size={tp!r}")
        return tp

    def _post(self, i: int, path: str, body: dict, timeout_s: float | None = None) -> Any:
        resp = self._request(i, "POST", path, body, timeout_s or self.timeout_s)
        if not isinstance(resp, dict) or resp.get("success") is not True:
            raise RolloutError(f"{self.engine(i)}: POST {path} answered {resp!r}"[:800])
        return resp

    def _request(self, i: int, method: str, path: str, body: dict | None,
                 timeout_s: float) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.urls[i] + path, data=data, method=method,
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            raise RolloutError(f"{self.engine(i)}: {method} {path} -> HTTP {e.code}: "
                               f"{text[:500]}") from None
        except (OSError, TimeoutError) as e:  # refused, reset, timed out
            raise RolloutError(f"{self.engine(i)}: {method} {path} failed: "
                               f"{type(e).__name__}: {e}") from None
        try:
            return json.loads(text) if text.strip() else None
        except ValueError:
            return text
