"""Trainer side of disk-free weight sync: broadcast HF-named weight buckets to every engine of
a group joined through SGLang's `/init_weights_update_group` (our `lockstep serve` or a real
SGLang server: the same requests), and the check that samples carry the versions asked for.

    sync = DistributedWeightSync(["http://a:30000", "http://b:30000"])   # joins the group
    stats = sync.push(actor.export_weights(bucket_bytes), "7")           # streamed, in order
    sync.close()                                                         # destroys it

Each push runs inside a weight-update session on every engine (`/begin_weight_update` before
the first bucket, `/end_weight_update` after the last, and after a failed push too): SGLang
0.5.23 refuses pushes outside one. A push refused before any weight changed (a begin or the
first bucket refused) raises `PushRefused`. The group name is unique per sync
(`lockstep-<12 hex>`): a group a dead client never destroyed cannot block the next one. A
failed join destroys the group on every engine before raising. The backend is gloo unless
every engine serves on a GPU and this process has one (NCCL; `backend=` overrides).

The trainer is rank 0; engine i joins as ranks `rank_offset_i .. rank_offset_i + tp_i - 1`
with rank_offset_i = 1 + the TP sizes of the engines before it (`tp_size` from /server_info,
1 when absent). Per bucket the trainer POSTs `/update_weights_from_distributed` (names, dtypes,
shapes, `load_format="flattened_bucket"`; `flush_cache` and `weight_version` on the last bucket
only) to every engine concurrently with the broadcast of the bucket's bytes as one uint8
buffer (`moe/buckets.py`). Buckets are consumed once, one at a time (one bucket of look-ahead
to know which is last): the whole model is never in one place.

A session left open by a trainer killed between begin and end makes every later begin a
refusal (SGLang: "a weight-update session is already open"). The sync closes it only on the
URLs in `own_stale` (its own process's, as `WeightPush` knows from its push marker) and
notes them in `closed_stale`; on any other URL the refusal says the exact command that
closes it (`stale_session_help`), since another trainer may be mid-push there.

Every wait is bounded by `timeout_s`: an engine that dies or hangs gives a `RolloutError`
naming it, and the sync is then broken (`close` it and build a new one). A failed push may
leave engines at different versions (a real SGLang server loads each bucket as it arrives;
ours loads nothing until the last): push again before generating.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import threading
import time
import uuid
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from safetensors.torch import save as save_safetensors
from safetensors.torch import save_file

from ..cluster.ports import free_port
from ..moe.buckets import Bucket, bucketize, flatten_bucket, tensor_bytes
from ..moe.checkpoint import hf_state_dict, read_hf_state_dict
from ..moe.config import ModelConfig
from ..moe.hf_lazy import INDEX_FILE
from ..moe.model import MoEModel
from .types import GenerationResult, PushRefused, RolloutError
from .weight_group import WeightGroup


def check_versions(results: list[GenerationResult], allowed: set[str]) -> None:
    """Refuse results generated with a weight version the caller did not ask for (a sample
    carries the version that generated every one of its tokens)."""
    for r in results:
        if r.weight_version not in allowed:
            raise RolloutError(f"request {r.rid} sample {r.index} was generated with weight "
                               f"version {r.weight_version!r}; this step accepts "
                               f"{sorted(allowed)}")


def as_buckets(source: Any, bucket_bytes: int, native: bool = False) -> Iterable[Bucket]:
    """Any weight source as an iterable of buckets: a model, a dict of HF-named tensors, an HF
    folder (read here), or an iterable of buckets (passed through, consumed once). A model's
    and a dict's tensors are views: nothing is copied. `native`: a dict of the model's own
    names passes too (an embedded engine loads either)."""
    if isinstance(source, (str, Path)):
        source = read_hf_state_dict(source)
    if isinstance(source, MoEModel):
        source = hf_state_dict(source)
    if isinstance(source, dict):
        hf = all(k.startswith(("model.", "lm_head.")) for k in source)
        if not hf and not (native and not any(k.startswith("model.") for k in source)):
            raise ValueError("weight push: a dict source must hold HF-named tensors "
                             "(model.*, lm_head.weight)")
        return bucketize(((k, v.detach()) for k, v in source.items()), bucket_bytes)
    return source


TENSOR_FORMAT = "safetensors"  # /update_weights_from_tensor load_format of lockstep serve


def tensor_payload(bucket: Bucket, last: bool, weight_version: str) -> tuple[dict, int]:
    """The /update_weights_from_tensor body of one bucket in our safe format (base64 of a
    safetensors file) and its tensor bytes."""
    sd = {name: t.detach().to("cpu").contiguous() for name, t in bucket}
    body: dict[str, Any] = {
        "serialized_named_tensors": [base64.b64encode(save_safetensors(sd)).decode()],
        "load_format": TENSOR_FORMAT, "flush_cache": last, "abort_all_requests": False}
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


def choose_backend(server_infos: list[Any]) -> str:
    """NCCL when every engine reports a CUDA device (SGLang's /server_info `device`; lockstep
    serve's `engine.device`) and this process has a GPU; gloo otherwise (CPU servers)."""
    def device(info: Any) -> str:
        if not isinstance(info, dict):
            return "cpu"
        engine = info.get("engine")
        d = info.get("device") or (engine.get("device") if isinstance(engine, dict) else None)
        return str(d or "cpu")
    on_gpu = all(device(info).startswith("cuda") for info in server_infos)
    return "nccl" if on_gpu and torch.cuda.is_available() else "gloo"


def dtype_name(dt: torch.dtype) -> str:
    """SGLang's spelling of a dtype (`getattr(torch, name)` on its side)."""
    return str(dt).removeprefix("torch.")


SESSION_OPEN = "weight-update session is already open"
"""The words of SGLang's (and our server's) refusal of a second /begin_weight_update."""


def curl_post(url: str, path: str, api_key: str | None) -> str:
    """The command line that POSTs to `url + path` (with the API key header when one is set)."""
    auth = ' -H "Authorization: Bearer $API_KEY"' if api_key else ""
    return f"curl -X POST{auth} {url}{path}"


def stale_session_help(url: str, api_key: str | None,
                       session: tuple[str, str] = ("/begin_weight_update", "/end_weight_update"),
                       then: tuple[str, ...] = ()) -> str:
    """What a user runs to close the session a killed trainer left open on `url`: `session`'s
    closing route, then `then` (vLLM: /resume, since the killed push had paused the server)."""
    cmd = " && ".join(curl_post(url, p, api_key) for p in (session[1], *then))
    return (f"{url} holds a weight-update session this run did not open (a trainer killed "
            f"between {session[0]} and {session[1]} leaves one open). If no other trainer is "
            f"pushing to it, close it with `{cmd}` and start again; `lockstep train --resume` "
            f"of the killed run closes its own")


class DistributedWeightSync:
    """Rank 0 of a weight-update group over `urls` (module docstring)."""

    def __init__(self, urls: list[str], *, backend: str | None = None,
                 master_addr: str = "127.0.0.1", master_port: int | None = None,
                 group_name: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0):
        if not urls:
            raise ValueError("DistributedWeightSync needs at least one engine URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.group_name = group_name or f"lockstep-{uuid.uuid4().hex[:12]}"
        self.api_key, self.timeout_s = api_key, timeout_s
        self.group: WeightGroup | None = None
        self.broken: str | None = None  # why the group can no longer be used
        self.own_stale: set[str] = set()  # URLs where an open session is our killed push's
        self.closed_stale: list[str] = []  # where such a session was closed
        self._idle = threading.Event()  # set while no collective of ours is running
        self._idle.set()
        self._pool = ThreadPoolExecutor(len(self.urls), thread_name_prefix="lockstep-wsync")
        asked = False
        try:
            infos = list(self._pool.map(self._server_info, range(len(self.urls))))
            sizes = [self._tp_size(i, info) for i, info in enumerate(infos)]
            self.backend = backend or choose_backend(infos)
            self.rank_offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
            self.world_size = 1 + sum(sizes)
            port = master_port or free_port(master_addr)
            asked = True
            posts = [self._pool.submit(self._post, i, *self._join_request(i, master_addr, port))
                     for i in range(len(self.urls))]
            self.group = self._run_with(posts, "init_weights_update_group", lambda: WeightGroup(
                master_addr, port, 0, self.world_size, self.group_name, self.backend,
                timeout_s))
        except BaseException:
            if asked:  # engines that joined would keep the name: destroy it everywhere
                self._destroy_everywhere()
            self._pool.shutdown(wait=False, cancel_futures=True)
            raise

    def engine(self, i: int) -> str:
        return f"engine {i} ({self.urls[i]})"

    # -- the wire (SGLang's; VLLMWeightSync overrides these) ---------------------------------
    SESSION_ROUTES = ("/begin_weight_update", "/end_weight_update")
    """The routes that open and close a weight-update session."""
    STALE_THEN: tuple[str, ...] = ()
    """What a user runs after closing a killed push's session (stale_session_help)."""

    def _join_request(self, i: int, master_addr: str, port: int) -> tuple[str, dict]:
        return "/init_weights_update_group", {
            "master_address": master_addr, "master_port": port,
            "rank_offset": self.rank_offsets[i], "world_size": self.world_size,
            "group_name": self.group_name, "backend": self.backend}

    def _bucket_request(self, names: list[str], dtypes: list, shapes: list, last: bool,
                        weight_version: str) -> tuple[str, dict]:
        body: dict[str, Any] = {
            "names": names, "dtypes": [dtype_name(d) for d in dtypes],
            "shapes": [list(s) for s in shapes], "group_name": self.group_name,
            "flush_cache": last, "abort_all_requests": False,
            "load_format": "flattened_bucket"}
        if last:
            body["weight_version"] = str(weight_version)
        return "/update_weights_from_distributed", body

    def _send(self, flat, bucket: Bucket) -> None:
        """This rank's side of one bucket: one broadcast of its bytes."""
        self.group.broadcast(flat)

    def _leave_request(self) -> tuple[str, dict]:
        return "/destroy_weights_update_group", {"group_name": self.group_name}

    def _answered(self, resp: Any) -> bool:
        """Whether a 200 answer reports success (SGLang: `success: true`)."""
        return isinstance(resp, dict) and resp.get("success") is True

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
        self.version = str(weight_version)  # what the sessions close with (vLLM's finish)
        self._begin_sessions(lambda: itertools.chain([cur], it))
        try:
            total, count = self._push_buckets(cur, it, weight_version)
        except BaseException:
            self._end_sessions(strict=False)
            raise
        self._end_sessions(strict=True)
        return {"bytes": total, "seconds": time.perf_counter() - t0, "buckets": count}

    def _push_buckets(self, cur: Bucket, it, weight_version: str) -> tuple[int, int]:
        total = count = 0
        while cur is not None:
            nxt = next(it, None)  # one bucket of look-ahead: is this the last?
            last = nxt is None
            flat, names, dtypes, shapes = flatten_bucket(cur)
            flat = flat.to(self.group.device)
            path, body = self._bucket_request(names, dtypes, shapes, last, weight_version)
            posts = [self._pool.submit(self._post, i, path, body)
                     for i in range(len(self.urls))]
            try:
                self._run_with(posts, f"{path.lstrip('/')} (bucket {count})",
                               lambda: self._send(flat, cur))
            except PushRefused as e:
                if count:  # earlier buckets may be loaded (SGLang loads each as it arrives)
                    raise RolloutError(str(e)) from None
                rest = itertools.chain([cur] + ([] if last else [nxt]), it)
                raise PushRefused(str(e), rest) from None
            total += flat.numel()
            count += 1
            cur = nxt
        return total, count

    def _begin_sessions(self, rest) -> None:
        """Open a weight-update session on every engine; a refusal closes those opened and
        raises PushRefused (nothing was sent); `rest()` gives the buckets not sent."""
        futs = [self._pool.submit(self._open_session, i) for i in range(len(self.urls))]
        errors, opened = [], []
        for i, f in enumerate(futs):
            try:
                f.result(self.timeout_s)
                opened.append(i)
            except Exception as e:
                errors.append(e)
        if errors:
            for i in opened:
                self._quiet_close(i)
            refused = all(isinstance(e, PushRefused) for e in errors)
            raise (PushRefused(f"weight sync: {errors[0]}", rest()) if refused
                   else RolloutError(f"weight sync: {errors[0]}"))

    def _end_sessions(self, strict: bool) -> None:
        """Close every engine's session; after a good push, a refusal is an error."""
        futs = [self._pool.submit(self._close_session, i, 30.0)
                for i in range(len(self.urls))] if strict else [
                self._pool.submit(self._quiet_close, i) for i in range(len(self.urls))]
        for f in futs:
            try:
                f.result(60)
            except RolloutError as e:
                raise RolloutError(f"weight sync: {e}") from None
            except Exception:  # a pool shut down by a failed collective: best effort
                if strict:
                    raise

    def _open_session(self, i: int) -> None:
        try:
            self._post(i, "/begin_weight_update", {})
        except PushRefused as e:
            if SESSION_OPEN not in str(e):
                raise
            self._close_stale(i, e)
            self._post(i, "/begin_weight_update", {})

    def _close_stale(self, i: int, refusal: Exception) -> None:
        """A session a killed push left open refused ours: close it when that push was this
        run's (`own_stale`; noted in `closed_stale`), else raise PushRefused with the commands
        that close it (another trainer may be mid-push there)."""
        url = self.urls[i]
        if url not in self.own_stale:
            raise PushRefused(f"{refusal}; " + stale_session_help(
                url, self.api_key, self.SESSION_ROUTES, self.STALE_THEN)) from None
        # vLLM: only the finish; the server stays paused for the push that follows
        self._post(i, self.SESSION_ROUTES[1], {}, self.timeout_s)
        self.closed_stale.append(url)

    def _close_session(self, i: int, timeout_s: float) -> None:
        self._post(i, "/end_weight_update", {}, timeout_s)

    def _quiet_close(self, i: int) -> None:
        try:
            self._close_session(i, 5.0)
        except Exception:  # a dead engine, or one that already dropped it
            pass

    def _quiet_post(self, i: int, path: str, body: dict | None = None) -> None:
        try:
            self._post(i, path, body or {}, 5.0)
        except Exception:  # a dead engine, or one that already dropped it
            pass

    def close(self) -> None:
        """Destroy the group on every engine that answers and here (idempotent)."""
        if self.group is None:
            return
        self._release_group()
        self._destroy_everywhere()
        self.group = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _destroy_everywhere(self) -> None:
        """/destroy_weights_update_group on every engine that answers (best effort), from a
        fresh pool: the sync's own threads may still wait on a failed call's answers."""
        with ThreadPoolExecutor(len(self.urls)) as pool:
            for f in [pool.submit(self._quiet_post, i, *self._leave_request())
                      for i in range(len(self.urls))]:
                f.result(15)

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
            self._reap(pending, what)
            if "error" in box:
                e = box["error"]
                # An engine that refused the bucket before receiving (a name or shape the
                # model lacks) leaves the group at once: its answer names the tensor.
                grace = min(time.monotonic() + 5.0, deadline)
                while pending and time.monotonic() < grace:
                    self._reap(pending, what)
                    time.sleep(0.002)
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

    def _reap(self, pending: dict[int, Future], what: str) -> None:
        """Drop the engines' answers that came; the first that failed raises, naming it (a
        refusal of the bucket stays a PushRefused)."""
        for i, f in list(pending.items()):
            if f.done():
                del pending[i]
                try:
                    f.result()
                except RolloutError as e:
                    self._fail(f"{what}: {e}", refused=isinstance(e, PushRefused))

    def _fail(self, message: str, refused: bool = False) -> None:
        self.broken = message
        self._release_group()
        raise (PushRefused if refused else RolloutError)(f"weight sync: {message}")

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

    def _server_info(self, i: int) -> Any:
        return self._request(i, "GET", "/server_info", None, min(self.timeout_s, 60.0))

    def _tp_size(self, i: int, info: Any) -> int:
        """The engine's TP size from /server_info (SGLang and lockstep serve report
        `tp_size`); 1 when the field is absent."""
        tp = info.get("tp_size", 1) if isinstance(info, dict) else 1
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise RolloutError(f"{self.engine(i)}: /server_info reports tp_size={tp!r}")
        return tp

    def _post(self, i: int, path: str, body: dict, timeout_s: float | None = None) -> Any:
        resp = self._request(i, "POST", path, body, timeout_s or self.timeout_s)
        if not self._answered(resp):
            raise PushRefused(f"{self.engine(i)}: POST {path} answered {resp!r}"[:800])
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
            # An answer (4xx) is a refusal; 5xx: the server broke on it, its state is unknown.
            raise (PushRefused if e.code < 500 else RolloutError)(
                f"{self.engine(i)}: {method} {path} -> HTTP {e.code}: {text[:500]}") from None
        except (OSError, TimeoutError) as e:  # refused, reset, timed out
            raise RolloutError(f"{self.engine(i)}: {method} {path} failed: "
                               f"{type(e).__name__}: {e}") from None
        try:
            return json.loads(text) if text.strip() else None
        except ValueError:
            return text
