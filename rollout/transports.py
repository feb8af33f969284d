"""How the dispatcher (rollout/dispatch.py) talks to its engines: all that differs between its backends.

- `RayCalls`: embedded engines as Ray actors (`EngineActor`); a run of requests is one Ray
  call, weights travel through the object store (each bucket cast to the engines' dtypes and
  `ray.put` once; the refs of the last push are what a relaunched engine is built from).
- `HTTPCalls`: SGLang-wire servers (`lockstep serve`, real SGLang, or given URLs); every
  request is a POST (fanned out into single-sample requests for sampling masks or
  `fan_out_samples`), weights go by `/update_weights_from_distributed` (one torch.distributed
  group with the trainer as rank 0) or `/update_weights_from_disk` (an HF folder written once):
  `rollout/weight_push.py`, the same push as one `HTTPBackend`'s.

Each raises `EngineDown` for an engine that died or did not answer in time, `EnginesDown` for
the engines a push did not reach, and `RolloutError` for an answer that breaks the contract.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import aiohttp

from lockstep.moe.buckets import tensor_bytes
from lockstep.moe.config import ModelConfig
from lockstep.rollout.client import HTTPBackend
from lockstep.rollout.dispatch import reiterable
from lockstep.rollout.slots import Aborted, EnginesDown, EngineSlot, Group
from lockstep.rollout.types import (EngineDown, FleetError, GenerateRequest, PushRefused,
                                    RolloutError)
from lockstep.rollout.weight_push import WeightPush
from lockstep.rollout.weight_sync import as_buckets


async def _all_or_none(coros: list) -> None:
    """Run `coros` together; the first to raise cancels the others, then raises."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class RayCalls:
    """Embedded engines called through Ray (`rollout.backend: ray`). `replay` is what a
    (re)started engine is built from: an HF folder, or the object refs of the buckets of the
    last push (at first those of the initial weights) at `replay_version`."""

    weight_sync = "object_store"

    def __init__(self, replay: str | list, replay_version: str, bucket_bytes: int,
                 routes_by_reference: bool = False):
        self.replay, self.replay_version = replay, str(replay_version)
        self.bucket_bytes = bucket_bytes
        # routes by reference: one RouteStore per engine node (rollout/route_refs.py)
        self.by_ref, self.stores = routes_by_reference, {}
        self.dtypes: dict = {}  # the engines' dtype of every weight (native and HF names)
        self.model_cfg: ModelConfig | None = None
        self.last_push: dict = {}

    def attach(self, fleet: Any, slot: EngineSlot, info: dict | None = None) -> None:
        if info is not None:
            self.dtypes, self.model_cfg = info["dtypes"], self.model_cfg or info["model_cfg"]
            if self.by_ref and slot.node not in self.stores:  # a store on the engine's node
                from lockstep.rollout.route_refs import start_store
                self.stores[slot.node] = start_store(slot.node)

    def wire(self, req: GenerateRequest) -> list[tuple[int, GenerateRequest]]:
        return [(0, req)]

    async def run(self, fleet: Any, slot: EngineSlot, run: list[Group], store: dict) -> None:
        from ray.exceptions import RayTaskError

        from lockstep.cluster.ray_ops import DIED, death_reason, task_error
        routes_to = self.stores.get(slot.node) if self.by_ref else None
        attempts = {g.req.rid: g.tries for g in run} if routes_to is not None else None
        ref = slot.actor.generate.remote([g.req for g in run], attempts, routes_to)
        timeout = fleet.request_timeout_s
        try:
            got = await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)
        except asyncio.TimeoutError:
            raise EngineDown(f"did not answer within {timeout:g}s and was killed") from None
        except DIED as e:
            raise EngineDown(f"died ({death_reason(e)})") from None
        except RayTaskError as e:
            raise RolloutError(f"{slot} failed in generate: {task_error(e)}") from None
        want = [(g.req.rid, j) for g in run for j in range(g.samples)]
        if [(r.rid, r.index) for r in got] != want:
            raise RolloutError(f"{slot}: answered {len(got)} results out of request order "
                               f"(asked {len(want)})")
        for r in got:
            if r.weight_version != fleet.weight_version:  # a push realigns every engine
                raise RolloutError(f"{slot}: request {r.rid} sample {r.index} was generated "
                                   f"with weight version {r.weight_version!r}, expected "
                                   f"{fleet.weight_version!r}")
            fleet.keep(slot, (r.rid, r.index), r, store)

    def catch_up(self, fleet: Any, slot: EngineSlot, version: str) -> bool:
        if slot.version != self.replay_version:
            raise FleetError(f"{slot}: restarted at weight version {slot.version!r}, "
                             f"expected {self.replay_version!r}")
        return slot.version == version

    def can_repeat(self, source: Any) -> bool:
        return True  # a relaunched engine is built from the push's refs: nothing to re-read

    def forget(self, slot: EngineSlot) -> None:
        """A dead engine needs nothing undone here (the fleet kills its actor)."""

    def push(self, fleet: Any, source: Any, version: str, targets: list[EngineSlot]) -> None:
        """Each bucket cast to the engines' dtypes and `ray.put` once, every engine fetching it
        as soon as it is put (the driver holds one bucket at a time); then every engine
        validates the whole push and swaps. The refs are kept until the next push: an engine
        relaunched before then is built from them, at this version (one copy of the weights
        in the engines' dtypes in the object store; during a push, the old and the new)."""
        import ray
        from ray.exceptions import RayTaskError

        from lockstep.cluster.ray_ops import DIED, death_reason, task_error
        t0, nbytes, refs = time.perf_counter(), 0, []
        for bucket in as_buckets(source, self.bucket_bytes, native=True):
            if isinstance(bucket, ray.ObjectRef):  # already put where it was made (a rank)
                ref = bucket
            else:  # a name the engines do not hold ships as it is (the engine casts or refuses)
                cast = [(k, t.detach().to(self.dtypes.get(k, t.dtype))) for k, t in bucket]
                nbytes += sum(tensor_bytes(t) for _, t in cast)
                ref = ray.put(cast)
                del cast
            del bucket
            for s in targets:  # answered with commit_weights (an actor's calls run in order)
                s.actor.load_bucket.remote(len(refs), ref)
            refs.append(ref)
        self.replay, self.replay_version = refs, version
        calls = {s.actor.commit_weights.remote(version, len(refs)): s for s in targets}
        deadline = time.monotonic() + fleet.request_timeout_s
        dead: list[EngineSlot] = []
        why: list[str] = []
        pending = list(calls)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=max(0.0, deadline - time.monotonic()))
            if not ready:  # the rest are hung
                dead += [calls[r] for r in pending]
                why.append(f"no answer within {fleet.request_timeout_s:g}s")
                break
            s = calls[ready[0]]
            try:
                got = ray.get(ready[0])
            except DIED as e:
                dead.append(s)
                why.append(f"engine {s.index} died ({death_reason(e)})")
                continue
            except RayTaskError as e:
                raise RolloutError(f"{s} failed in update_weights: {task_error(e)}") from None
            if got != version:
                raise RolloutError(f"{s}: reports weight version {got!r} after loading "
                                   f"{version!r}")
            s.version = version
        self.last_push = {"mode": "object_store", "bytes": nbytes, "buckets": len(refs),
                          "seconds": time.perf_counter() - t0}
        fleet.stats.push_bytes = nbytes
        if dead:
            raise EnginesDown("; ".join(why), dead)

    def close(self) -> None:
        self.replay = []
        from lockstep.cluster.ray_ops import kill
        for store in self.stores.values():  # their routes go with them
            kill(store)
        self.stores = {}


class HTTPCalls:
    """SGLang-wire servers over HTTP. `weight_sync`: "distributed" (one weight-update group
    over the servers, re-created whenever its members change), "disk" (an HF folder under
    `weights_dir` that every server loads), or "auto": distributed, and disk for good (said
    once, this push included) once an engine refuses to join or refuses a push before any
    weight changed (`PushRefused`)."""

    def __init__(self, model_cfg: ModelConfig, api_key: str | None = None,
                 weight_sync: str = "distributed", weights_dir: str | Path | None = None,
                 max_concurrency: int = 64,
                 fan_out_samples: bool = False, sampling_mask_max_tokens: int = 4096,
                 bucket_bytes: int = 64 << 20, client_cls: type[HTTPBackend] = HTTPBackend,
                 push_marker: str | Path | None = None):
        if weight_sync not in ("auto", "distributed", "disk"):
            raise ValueError(f"Fleet: weight_sync must be 'auto', 'distributed' or 'disk', got "
                             f"{weight_sync!r}")
        if weight_sync in ("auto", "disk") and weights_dir is None:
            raise ValueError(f"Fleet: weight_sync={weight_sync!r} needs weights_dir (a folder "
                             f"every server can read)")
        self.cfg, self.api_key = model_cfg, api_key
        self.client_cls = client_cls  # the servers' wire: HTTPBackend (SGLang) or VLLMBackend
        self.max_concurrency, self.fan_out_samples = max_concurrency, fan_out_samples
        self.sampling_mask_max_tokens, self.bucket_bytes = sampling_mask_max_tokens, bucket_bytes
        # the weight push, the same code as one HTTPBackend's (rollout/weight_push.py)
        self.pusher = WeightPush(model_cfg, weight_sync, client_cls.SYNC_CLS,
                                 weights_dir=weights_dir, api_key=api_key,
                                 bucket_bytes=bucket_bytes, who="fleet: ", marker=push_marker)

    @property
    def weight_sync(self) -> str:
        """distributed (also while `auto` has not fallen back) or disk."""
        return "distributed" if self.pusher.mode == "auto" else self.pusher.mode

    @property
    def last_push(self) -> dict:
        return self.pusher.last_push

    def attach(self, fleet: Any, slot: EngineSlot, info: dict | None = None) -> None:
        """A client for the slot's server (a new one after a relaunch: a new URL). `info`
        comes with a server the fleet launched (at the start or as a relaunch)."""
        if slot.url:
            slot.client = self.client_cls(
                slot.url, self.cfg, api_key=self.api_key, max_concurrency=self.max_concurrency,
                timeout_s=fleet.request_timeout_s, retries=1, backoff_s=0.2,
                sampling_mask_max_tokens=self.sampling_mask_max_tokens,
                fan_out_samples=self.fan_out_samples, launched=info is not None)
            if slot.version is not None and slot.version != UNKNOWN:
                slot.client.expect_version(slot.version)  # it started with these weights

    def wire(self, req: GenerateRequest) -> list[tuple[int, GenerateRequest]]:
        """The HTTP requests one request is sent as, each with the index of its first sample:
        fanned out into single-sample requests with seeds seed + j like HTTPBackend does (for
        sampling-mask requests, which SGLang fails with n > 1, or with `fan_out_samples`)."""
        if req.sampling.n > 1 and (req.return_sampling_mask or self.fan_out_samples):
            base, sp = req.rid, req.sampling
            return [(j, dataclasses.replace(req, rid=f"{base}-{j}", sampling=dataclasses.replace(
                sp, n=1, seed=None if sp.seed is None else sp.seed + j))) for j in range(sp.n)]
        return [(0, req)]

    async def run(self, fleet: Any, slot: EngineSlot, run: list[Group], store: dict) -> None:
        """Send the run's wire requests to one server at once; store each answer under (rid,
        index) as it comes (a resent group's samples already held are dropped)."""
        client = slot.client
        await client.prepare()  # vLLM: its /server_info, read once (the request bodies need it)

        async def one(session: aiohttp.ClientSession, g: Group, j0: int,
                      wreq: GenerateRequest) -> None:
            resp = await client._post(session, client.GENERATE_PATH, client.request_body(wreq))
            items = client.items(resp)
            if len(items) != wreq.sampling.n:
                raise RolloutError(f"{slot}: request {wreq.rid} asked n={wreq.sampling.n}, "
                                   f"answered {len(items)} results")
            for j, item in enumerate(items):
                if client.aborted(item):  # not a finished sample (it may lack routes)
                    raise Aborted(f"{slot}: request {wreq.rid} sample {j} was aborted")
                res = client.parse(item, wreq, g.pos, j0 + j)
                res = dataclasses.replace(res, rid=g.req.rid, index=j0 + j)
                fleet.keep(slot, (g.req.rid, j0 + j), res, store)

        async with aiohttp.ClientSession(
                timeout=client.timeout,
                connector=aiohttp.TCPConnector(limit=self.max_concurrency)) as session:
            await _all_or_none([one(session, g, j0, w) for g in run for j0, w in g.wire])

    def catch_up(self, fleet: Any, slot: EngineSlot, version: str) -> bool:
        """Disk sync: the relaunched server loads the last folder now; distributed: it joins
        the group at the next push."""
        folder = self.pusher.last_folder
        if folder is None or version != self.pusher.last_version:
            return False
        self.pusher.load_folder([slot.client], folder, version)
        slot.version = version
        return True

    def can_repeat(self, source: Any) -> bool:
        return reiterable(source)

    def forget(self, slot: EngineSlot) -> None:
        """A dead server leaves the weight group: the next push forms a new one (also when a
        server comes back at the same URL)."""
        self.pusher.forget(slot.url)

    def push(self, fleet: Any, source: Any, version: str, targets: list[EngineSlot]) -> None:
        """`WeightPush.push` to the targets' servers; a server that did not take it is found
        (/health) and reported dead (`EnginesDown`), so the fleet relaunches it."""
        self.pusher.timeout_s = fleet.request_timeout_s
        try:
            stats = self.pusher.push([s.client for s in targets], source, version, fleet.log)
        except (EngineDown, PushRefused) as e:
            dead = self._find_dead(fleet, targets)
            if not dead:
                raise FleetError(f"weight push {version!r} failed ({e}); no engine was found "
                                 f"dead") from e
            raise EnginesDown(str(e), dead, [s for s in targets if s.version != version]) from e
        for s in targets:
            s.version = version
        fleet.stats.push_bytes = int(stats.get("bytes", 0))
        fleet.stats.disk_bytes_written += int(stats.get("disk_bytes", 0))

    def _find_dead(self, fleet: Any, targets: list[EngineSlot]) -> list[EngineSlot]:
        async def health(s: EngineSlot) -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                    total=min(10.0, fleet.request_timeout_s))) as sess:
                async with sess.get(s.url + "/health") as r:
                    if r.status != 200:
                        raise RolloutError(f"/health -> {r.status}")
        dead = []
        for s in targets:
            try:
                asyncio.run(health(s))
            except Exception:  # noqa: BLE001 - any failure to answer /health means dead here
                dead.append(s)
        return dead

    def close(self) -> None:
        """Leave the weight-update group (a dead member: the group is gone either way)."""
        self.pusher.close()


UNKNOWN = "unknown"  # the version of servers given by URL until the first push
