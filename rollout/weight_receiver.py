"""Server side of disk-free weight sync: SGLang's `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`,
`/update_weights_from_tensor` and the weight-update session around pushes
(`/begin_weight_update`, `/end_weight_update`), with SGLang's request fields and
`{success, message}` answers (HTTP 200, or 400 with success=false).

As in SGLang 0.5.23, `/update_weights_from_distributed` and `/update_weights_from_tensor` are
refused unless a session is open (one per server, whoever opened it); a second begin and an
end without a begin are refused; `/update_weights_from_disk` needs none. A push staged but not
flushed when the session ends is discarded.

How a push works (docs/rollout.md, "Weight sync"): the trainer is rank 0 of a process group
this server joins as rank `rank_offset` (`rollout/weight_group.py`); per bucket it POSTs the
names, dtypes and shapes and broadcasts the tensors (one uint8 buffer with
`load_format="flattened_bucket"`, else one broadcast per tensor in list order).

Where we differ from SGLang, on purpose:
- Check before receiving. A distributed push's declared names and shapes are checked against
  the model before its broadcast is received: gloo aborts the whole process (not just the call)
  when a broadcast is longer than the receive buffer. Receive buffers are prefilled with NaN
  bytes (a shorter broadcast is named by the finiteness check) and, in a gloo group of two,
  have room for a longer one (named as such); a failed receive destroys the group, never the
  server.
- Validate, then swap. Each bucket is checked (known name, shape, floating dtype, finite after
  the cast to the engine's dtype: fp8 and float64 are taken, values beyond the engine dtype's
  range are refused) and *staged*; staged tensors take effect together at the first call with `flush_cache=true`
  (SGLang's default; a streaming client sends false on every bucket but the last), in one swap
  that waits for running samples and holds queued ones (as `/update_weights_from_disk`), so
  no sample mixes weight versions. A bad bucket discards the whole staged push and names the
  tensor; the weights and version stay as they were (SGLang leaves them partly updated).
- `/update_weights_from_tensor` takes only `load_format="safetensors"`: each entry of
  `serialized_named_tensors` is base64 of a safetensors file. SGLang's own formats are pickled
  torch-multiprocessing payloads; unpickling request bytes would let any client run code on the
  server, so they are refused with HTTP 400 saying so.
- A group whose broadcast failed or that a bad request put out of step is destroyed; the
  answer says so (the trainer then joins a new one).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import difflib
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from ..kernels.dtypes import DTYPES as _TABLE
from ..moe.buckets import Bucket, unflatten_bucket
from ..moe.checkpoint import hf_state_dict, nonfinite
from .types import RequestError
from .weight_group import BACKENDS, WeightGroup

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
JOIN_THREADS = 4  # group joins waiting for an answer at once (more: HTTP 503, retry)
JOIN_THREADS_ALIVE = 16  # join threads alive, with those still blocked after their answer
# Weights are floating point; SGLang names dtypes as torch attributes ("bfloat16") and takes
# any of them: fp8 and float64 tensors are cast to the engine's dtype like the others.
DTYPES = {d.hf: d.torch for d in _TABLE}
_BASE = ("rid", "http_worker_ipc")  # SGLang's BaseReq fields, accepted and ignored
INIT_FIELDS = ("master_address", "master_port", "rank_offset", "world_size", "group_name",
               "backend") + _BASE
DESTROY_FIELDS = ("group_name",) + _BASE
DISTRIBUTED_FIELDS = ("names", "dtypes", "shapes", "group_name", "flush_cache",
                      "abort_all_requests", "weight_version", "load_format", "torch_empty_cache") + _BASE
TENSOR_FIELDS = ("serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                 "weight_version", "disable_draft_model") + _BASE
BEGIN_FIELDS = ("selector",) + _BASE
END_FIELDS = _BASE
SELECTORS = ("target", "draft", "all")
TENSOR_FORMAT = "safetensors"


class WeightError(ValueError):
    """A pushed tensor the model cannot take (named in the message)."""


def check_fields(body: Any, endpoint: str, valid: tuple[str, ...]) -> dict:
    """The body as a dict with only `valid` keys; an unknown one is named with its closest."""
    if not isinstance(body, dict):
        raise RequestError(f"{endpoint} needs a JSON object, got {type(body).__name__}")
    for k in body:
        if k not in valid:
            close = difflib.get_close_matches(str(k), valid, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise RequestError(f"{endpoint}: unknown field {str(k)[:100]!r}{hint} valid: {list(valid)}")
    return body


def _typed(body: dict, key: str, kind: type, default: Any = ..., none_ok: bool = False) -> Any:
    if key not in body or (body[key] is None and default is not ...):
        if default is ...:
            raise RequestError(f"{key} is required")
        return default
    v = body[key]
    if v is None and none_ok:
        return None
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise RequestError(f"{key} must be {kind.__name__}, got {type(v).__name__} {v!r}"[:200])
    return v


@dataclass
class PushMeta:
    """One `/update_weights_from_distributed` call, checked."""

    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    group_name: str
    flush_cache: bool
    abort_all_requests: bool
    weight_version: str | None
    flattened: bool

    @property
    def nbytes(self) -> int:
        return sum(self.size_of(dt, shape) for dt, shape in zip(self.dtypes, self.shapes))

    @staticmethod
    def size_of(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
        n = 1
        for s in shape:
            n *= s
        return n * torch.empty((), dtype=dtype).element_size()


def parse_push(body: Any) -> PushMeta:
    body = check_fields(body, "update_weights_from_distributed", DISTRIBUTED_FIELDS)
    names = _typed(body, "names", list)
    dtypes = _typed(body, "dtypes", list)
    shapes = _typed(body, "shapes", list)
    if not (len(names) == len(dtypes) == len(shapes)):
        raise RequestError(f"names, dtypes and shapes must have one entry per tensor: got "
                           f"{len(names)}, {len(dtypes)} and {len(shapes)}")
    for i, n in enumerate(names):
        if not isinstance(n, str) or not n:
            raise RequestError(f"names[{i}] must be a non-empty string, got {n!r}"[:200])
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise RequestError(f"tensor {dup!r} appears twice in names")
    dts = []
    for n, d in zip(names, dtypes):
        if d not in DTYPES:
            raise RequestError(f"tensor {n!r}: dtype {d!r}; valid: {list(DTYPES)}"[:300])
        dts.append(DTYPES[d])
    shp = []
    for n, s in zip(names, shapes):
        if not isinstance(s, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                              and x >= 0 for x in s):
            raise RequestError(f"tensor {n!r}: shape must be a list of non-negative integers, "
                               f"got {s!r}"[:300])
        shp.append(tuple(s))
    load_format = body.get("load_format")
    if load_format not in (None, "flattened_bucket"):
        raise RequestError(f"load_format={load_format!r}; valid: null (one broadcast per tensor) "
                           f"or 'flattened_bucket' (one uint8 buffer)"[:300])
    version = _typed(body, "weight_version", str, None, none_ok=True)
    return PushMeta(names, dts, shp, _typed(body, "group_name", str, DEFAULT_GROUP),
                    _typed(body, "flush_cache", bool, True),
                    _typed(body, "abort_all_requests", bool, False),
                    version, load_format == "flattened_bucket")


class WeightReceiver:
    """The weight-sync endpoints of one server: its groups, its staged push, the swap."""

    def __init__(self, engine, worker, weights_lock: asyncio.Lock, timeout_s: float = 600.0):
        self.engine, self.worker, self.lock = engine, worker, weights_lock
        self.timeout_s = timeout_s
        self.groups: dict[str, WeightGroup] = {}
        self.staged: dict[str, torch.Tensor] = {}
        self.staged_version: str | None = None
        self._targets: dict[str, torch.Tensor] | None = None
        self.session = False  # a /begin_weight_update without its /end_weight_update yet
        # Joins wait for a master that may never answer (torch's TCPStore client then blocks
        # until the master closes, whatever its timeout): each on its own daemon thread, never
        # on the default executor that reads disk updates and big bodies; answered by
        # timeout_s, and at most JOIN_THREADS answers / JOIN_THREADS_ALIVE threads at once.
        self._joining: set[str] = set()
        self._join_threads = 0
        self._join_lock = threading.Lock()

    # -- state -----------------------------------------------------------------------------
    @property
    def targets(self) -> dict[str, torch.Tensor]:
        """The engine's weights by HF name (views; the swap copies into them in place)."""
        if self._targets is None:
            self._targets = hf_state_dict(self.engine.model)
        return self._targets

    def discard(self) -> None:
        """Forget a staged push (a failed bucket, a disk update, a destroyed group)."""
        self.staged, self.staged_version = {}, None

    def close(self) -> None:
        for g in self.groups.values():
            g.close()
        self.groups.clear()
        self.discard()

    def _drop_group(self, name: str) -> None:
        g = self.groups.pop(name, None)
        if g is not None:
            g.close()
        self.discard()

    # -- checks ----------------------------------------------------------------------------
    def check_declared(self, names: list[str], shapes: list[tuple[int, ...]]) -> None:
        """WeightError naming the first tensor the model cannot take by name or shape. Run on
        a distributed push's declared names and shapes BEFORE its broadcast is received: a
        receive buffer of another size than the trainer's tensor makes gloo abort the whole
        process (a C++ `EnforceNotMet` on its own thread), so it is never posted."""
        targets, tied = self.targets, self.engine.model.lm_head is None
        for name, shape in zip(names, shapes):
            key = name
            if name not in targets:
                if tied and name == "lm_head.weight":  # tied: checked as the embedding
                    key = "model.embed_tokens.weight"
                else:
                    close = difflib.get_close_matches(name, list(targets), n=1)
                    hint = f" (closest: {close[0]!r})" if close else ""
                    raise WeightError(f"tensor {name!r} is not a weight of this model{hint}")
            if name in self.staged:
                raise WeightError(f"tensor {name!r} was already sent in this push")
            want = tuple(targets[key].shape)
            if tuple(shape) != want:
                raise WeightError(f"tensor {name!r} has shape {tuple(shape)}, the model's is {want}")

    def check_bucket(self, bucket: Bucket, short_hint: bool = False) -> Bucket:
        """The bucket's tensors to stage, cast to the engine's dtypes (a tied model's
        lm_head.weight is dropped), or WeightError naming the first tensor the model cannot
        take. Finiteness is checked after the cast (a finite fp32 value can be inf in bf16).
        `short_hint`: the tensors came from a broadcast into buffers prefilled with NaN."""
        self.check_declared([n for n, _ in bucket], [tuple(t.shape) for _, t in bucket])
        targets = self.targets
        out = []
        for name, t in bucket:
            if name not in targets:  # a tied model's lm_head.weight
                continue
            if not t.is_floating_point():
                raise WeightError(f"tensor {name!r} has dtype {t.dtype}; weights are floating point")
            dtype = targets[name].dtype
            problem = nonfinite(t, dtype)
            if problem:
                hint = (" (or the trainer broadcast fewer bytes than the declared names, "
                        "dtypes and shapes)") if short_hint and "NaN" in problem else ""
                raise WeightError(f"tensor {name!r} {problem}{hint}")
            # Staged in the engine's dtype (the swap would cast the same way): a bf16 engine
            # holds a bf16 copy of a pushed fp32 tensor, and the received buffer is freed.
            out.append((name, t.to(dtype)))
        return out

    # -- the swap --------------------------------------------------------------------------
    async def stage_or_commit(self, bucket: Bucket, flush: bool, version: str | None,
                              abort: bool, received: bool = False) -> web.Response:
        try:
            bucket = self.check_bucket(bucket, short_hint=received)
        except WeightError as e:
            self.discard()
            return fail(f"{e}; nothing was loaded (the staged push is discarded: send it "
                        f"again from its first bucket)")
        self.staged.update(bucket)
        if version is not None:
            self.staged_version = version
        if not flush:
            return ok(f"staged {len(bucket)} tensors ({len(self.staged)} in this push); they "
                      f"take effect with the next flush_cache=true call")
        staged, version = self.staged, self.staged_version
        self.discard()
        aborted = await self.worker.abort(None) if abort else 0
        # As /update_weights_from_disk: wait for running samples, hold queued ones.
        new = await self.worker.when_idle(self._swap, staged, version)
        return ok(f"loaded {len(staged)} tensors; weight_version={new}"
                  + (f"; aborted {aborted} requests" if aborted else ""))

    def _swap(self, staged: dict[str, torch.Tensor], version: str | None) -> str:
        """On the engine thread, no sample running."""
        if not staged:
            if version is not None:
                self.engine.weight_version = str(version)
            return self.engine.weight_version
        return self.engine.swap_weights({**self.targets, **staged}, version)

    # -- handlers --------------------------------------------------------------------------
    def routes(self, body_of) -> list[tuple[str, Any]]:
        return [("/init_weights_update_group", self._wrap(body_of, self.init_group)),
                ("/destroy_weights_update_group", self._wrap(body_of, self.destroy_group)),
                ("/update_weights_from_distributed", self._wrap(body_of, self.from_distributed)),
                ("/update_weights_from_tensor", self._wrap(body_of, self.from_tensor)),
                ("/begin_weight_update", self._wrap(body_of, self.begin)),
                ("/end_weight_update", self._wrap(body_of, self.end))]

    async def begin(self, body: Any) -> web.Response:
        body = check_fields(body, "begin_weight_update", BEGIN_FIELDS)
        selector = body.get("selector", "all")
        if selector not in SELECTORS:
            raise RequestError(f"selector={selector!r}; valid: {list(SELECTORS)}"[:200])
        if self.session:
            return fail("a weight-update session is already open; call end_weight_update() "
                        "first")
        self.session = True
        return ok("weight-update session opened")

    async def end(self, body: Any) -> web.Response:
        check_fields(body, "end_weight_update", END_FIELDS)
        if not self.session:
            return fail("no weight-update session is open; call begin_weight_update() first")
        async with self.lock:  # after a push in flight
            self.session = False
            dropped = len(self.staged)
            self.discard()
        return ok("weight-update session closed" + (
            f"; {dropped} staged tensors never flushed were discarded" if dropped else ""))

    def _need_session(self, endpoint: str) -> None:
        if not self.session:
            raise RequestError(f"{endpoint} must run between begin_weight_update() and "
                               f"end_weight_update()")

    @staticmethod
    def _wrap(body_of, fn):
        async def handler(request: web.Request) -> web.Response:
            try:
                return await fn(await body_of(request))
            except RequestError as e:
                return fail(str(e))
        return handler

    async def init_group(self, body: Any) -> web.Response:
        body = check_fields(body, "init_weights_update_group", INIT_FIELDS)
        addr = _typed(body, "master_address", str)
        port = _typed(body, "master_port", int)
        offset = _typed(body, "rank_offset", int)
        world = _typed(body, "world_size", int)
        name = _typed(body, "group_name", str, DEFAULT_GROUP)
        backend = _typed(body, "backend", str, "nccl")  # SGLang's default
        if not addr or not 0 < port < 65536:
            raise RequestError(f"master_address={addr!r}, master_port={port}: need a host and a "
                               f"port in 1..65535")
        # This server is one rank (tp_size 1): it joins as rank_offset; rank 0 is the trainer.
        if not 1 <= offset < world:
            raise RequestError(f"rank_offset={offset} with world_size={world}: this server is "
                               f"one rank (tp_size 1) and needs 1 <= rank_offset < world_size "
                               f"(rank 0 is the trainer)")
        if backend not in BACKENDS:
            raise RequestError(f"backend={backend!r}; valid: {list(BACKENDS)}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise RequestError("backend='nccl' (SGLang's default) needs a GPU and this server "
                               "runs on CPU: send backend='gloo'")
        if name in self.groups:
            raise RequestError(f"group {name!r} is already joined; call "
                               f"/destroy_weights_update_group first")
        if name in self._joining:
            raise RequestError(f"a join of group {name!r} is already in flight")
        if len(self._joining) >= JOIN_THREADS or self._join_threads >= JOIN_THREADS_ALIVE:
            return fail(f"{len(self._joining)} group joins are in flight and "
                        f"{self._join_threads - len(self._joining)} more wait on masters that "
                        f"never answered (at most {JOIN_THREADS} / {JOIN_THREADS_ALIVE}; each is "
                        f"answered within {self.timeout_s:g}s, lockstep serve "
                        f"--weight-sync-timeout): retry when one ends", status=503)
        self._joining.add(name)
        job = self._start_join(addr, port, offset, world, name, backend)
        try:
            group = await asyncio.wait_for(asyncio.wrap_future(job), self.timeout_s)
        except asyncio.TimeoutError:  # the thread ends when the master answers or closes
            job.add_done_callback(lambda f: f.exception() is None and f.result().close())
            return fail(f"could not join group {name!r} at {addr}:{port} as rank {offset} of "
                        f"{world}: no answer from the master within {self.timeout_s:g}s")
        except Exception as e:  # store/connect failure or timeout (DistStoreError, RuntimeError)
            return fail(f"could not join group {name!r} at {addr}:{port} as rank {offset} of "
                        f"{world} within {self.timeout_s:.0f}s: {type(e).__name__}: {e}"[:1000])
        finally:
            self._joining.discard(name)
        self.groups[name] = group
        return ok(f"joined group {name!r} as rank {offset} of {world} ({backend})")

    def _start_join(self, *args) -> Future:
        """WeightGroup(*args, timeout_s) on a daemon thread of its own."""
        job: Future = Future()
        job.set_running_or_notify_cancel()  # running: a timed-out wait cannot cancel it
        with self._join_lock:
            self._join_threads += 1

        def run() -> None:
            try:
                job.set_result(WeightGroup(*args, self.timeout_s))
            except BaseException as e:  # answered by init_group
                job.set_exception(e)
            finally:
                with self._join_lock:
                    self._join_threads -= 1
        threading.Thread(target=run, daemon=True, name="lockstep-join").start()
        return job

    async def destroy_group(self, body: Any) -> web.Response:
        body = check_fields(body, "destroy_weights_update_group", DESTROY_FIELDS)
        name = _typed(body, "group_name", str, DEFAULT_GROUP)
        if name not in self.groups:
            return fail(f"group {name!r} does not exist (joined: {sorted(self.groups)})")
        self._drop_group(name)
        return ok(f"destroyed group {name!r}")

    async def from_distributed(self, body: Any) -> web.Response:
        name = body.get("group_name", DEFAULT_GROUP) if isinstance(body, dict) else DEFAULT_GROUP
        group = self.groups.get(name) if isinstance(name, str) else None
        try:
            meta = parse_push(body)
            self._need_session("update_weights_from_distributed")
            if group is None:
                raise RequestError(f"no weight-update group {name!r} (joined: "
                                   f"{sorted(self.groups)}): call /init_weights_update_group first")
            try:  # every check before the receive: a mismatched one aborts the process
                self.check_declared(meta.names, meta.shapes)
            except WeightError as e:
                self.discard()
                raise RequestError(f"{e}; nothing was received or loaded (the staged push is "
                                   f"discarded)") from None
        except RequestError as e:
            if group is None or not self.session:  # no session: as SGLang, the group stays
                return fail(str(e))
            # The trainer's broadcast of this bucket is in flight: the group is out of step.
            self._drop_group(name)
            return fail(f"{e}; group {name!r} destroyed (its broadcast cannot be matched): "
                        f"join a new one")
        async with self.lock:  # one update at a time (disk or distributed)
            try:
                bucket = await asyncio.to_thread(self._receive, group, meta)
            except Exception as e:  # a peer died, a timeout
                self._drop_group(name)
                return fail(f"receiving {len(meta.names)} tensors over group {name!r} failed: "
                            f"{type(e).__name__}: {e}; nothing was loaded and the group is "
                            f"destroyed: join a new one"[:1000])
            return await self.stage_or_commit(bucket, meta.flush_cache, meta.weight_version,
                                              meta.abort_all_requests, received=True)

    @staticmethod
    def _receive(group: WeightGroup, meta: PushMeta) -> Bucket:
        """Receive the declared tensors. Buffers are prefilled with 0xFF bytes, a NaN in every
        floating dtype: a broadcast shorter than declared leaves NaNs that the finiteness
        check names. A longer one makes gloo abort the process unless the buffer has room:
        in a gloo group of two (the trainer and this server: no rank forwards to another, so
        a bigger buffer here changes nothing for other receivers) each buffer is twice the
        declared size and bytes landing in the second half are an error (RuntimeError)."""
        spare = 2 if group.world_size == 2 and group.backend == "gloo" else 1

        def receive(nbytes: int) -> torch.Tensor:
            buf = torch.full((nbytes * spare,), 255, dtype=torch.uint8, device=group.device)
            group.broadcast(buf)
            if spare > 1 and not bool((buf[nbytes:] == 255).all()):
                raise RuntimeError(f"the trainer broadcast more than the {nbytes} bytes that "
                                   f"the declared names, dtypes and shapes hold")
            return buf[:nbytes]

        if meta.flattened:
            return [(n, t.cpu()) for n, t in
                    unflatten_bucket(receive(meta.nbytes), meta.names, meta.dtypes, meta.shapes)]
        out = []
        for n, dt, shape in zip(meta.names, meta.dtypes, meta.shapes):
            buf = receive(PushMeta.size_of(dt, shape))
            out.append((n, buf.view(dt).view(shape).cpu()))
        return out

    async def from_tensor(self, body: Any) -> web.Response:
        body = check_fields(body, "update_weights_from_tensor", TENSOR_FIELDS)
        self._need_session("update_weights_from_tensor")
        fmt = body.get("load_format")
        if fmt != TENSOR_FORMAT:
            raise RequestError(
                f"load_format={fmt!r} is refused: SGLang's formats (null, 'direct', "
                f"'flattened_bucket', a custom loader) carry pickled torch-multiprocessing "
                f"payloads, and unpickling request bytes would let any client run code on this "
                f"server. Send load_format='safetensors' with serialized_named_tensors = "
                f"[base64 of a safetensors file]")
        entries = _typed(body, "serialized_named_tensors", list)
        if len(entries) != 1 or not isinstance(entries[0], str):
            raise RequestError(f"serialized_named_tensors must hold one base64 string (one per "
                               f"TP rank; this server is one rank), got {len(entries)} entries")
        version = _typed(body, "weight_version", str, None, none_ok=True)
        flush = _typed(body, "flush_cache", bool, True)
        abort = _typed(body, "abort_all_requests", bool, False)

        def decode() -> Bucket:
            try:
                raw = base64.b64decode(entries[0], validate=True)
                return list(load_safetensors(raw).items())
            except (binascii.Error, ValueError, SafetensorError) as e:
                raise RequestError(f"serialized_named_tensors[0] is not base64 of a safetensors "
                                   f"file: {e}"[:300]) from None
        bucket = await asyncio.to_thread(decode)
        async with self.lock:
            return await self.stage_or_commit(bucket, flush, version, abort)


RECEIVER = web.AppKey("weight_receiver", WeightReceiver)  # the app's receiver (tests look in)


def ok(message: str) -> web.Response:
    return web.json_response({"success": True, "message": message})


def fail(message: str, status: int = 400) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=status)
