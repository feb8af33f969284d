"""The rollout dispatcher: M engines behind one `RolloutBackend` that survives dead and hung
engines. Every multi-engine backend is one (a `Fleet`, rollout/fleet.py); only the engine
slots' transport differs (rollout/transports.py):

    fleet = Fleet.ray(model, EngineConfig(dtype="bf16"), num_engines=4)    # embedded engines, Ray calls
    fleet = Fleet.serve(model, EngineConfig(dtype="bf16"), num_engines=2)  # lockstep serve x M
    fleet = Fleet.sglang(options, model_path, 2, model_cfg)                # real SGLang x M
    fleet = Fleet.http(["http://10.0.0.5:30000", ...], model_cfg)          # running servers
    results = fleet.generate(requests)      # request order, sample index minor
    fleet.update_weights(weights, "7")      # object store (ray), or distributed / disk (HTTP)
    fleet.close()

Dispatch. Requests are split into contiguous runs of whole requests (a prompt and its n samples,
the GRPO group, stay on one engine: one prefill, prefix cache), balanced by sample count, one
run per live engine; every request carries its rid and results are keyed by (rid, sample
index), the first answer wins, so every sample comes back exactly once and in request order.

Faults. An engine that dies (killed, crashed, connection refused or lost) or does not answer
within `request_timeout_s` (it is then killed) is marked dead: the requests of its run that are
not fully answered are split over the live engines at once (answers already held are kept: a
resent group's duplicates are dropped), and the engine is relaunched in its own bundle at once.
A relaunched engine serves as soon as it holds the current weights: an embedded Ray engine is
built from the last push's object-store buckets, a server with disk sync loads the last folder,
a server with distributed sync joins at the next push. A call returns only when every
relaunch it started is over. Each engine may be relaunched `max_engine_restarts` times; past
that the fleet closes and a `FleetError` names the engine (index, pid, node) and the requests it
left unanswered. Servers given by URL are not relaunched: a dead one is probed (`/health`) at
each push and rejoins when it answers. A call that raised inside a live engine (a bad request)
or an answer with an unexpected weight version is not a fault: it raises `RolloutError`.

Trajectories. Every turn of a multi-turn trajectory goes to the engine that answered its first
turn while that engine lives; a trajectory whose engine is lost mid-trajectory is not sent
elsewhere but reported (`TrajectoriesLost`) to be started again from its first turn
(rollout/pins.py).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import aiohttp

from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.rollout.client import RolloutBackend
from lockstep.rollout.engine_actors import UNLOADED
from lockstep.rollout.pins import Pins, TrajectoriesLost, check_trajectories
from lockstep.rollout.slots import (START_GRACE_S, Aborted, EngineSlot, EnginesDown, FleetStats,
                                    Group, shard)
from lockstep.rollout.types import (EngineDown, FleetError, GenerateRequest, GenerationResult,
                                    RolloutError)


class Dispatcher(RolloutBackend):
    """M engines behind one fault-tolerant dispatcher (module docstring). `transport` runs
    requests and weight pushes on the slots (rollout/transports.py); `launch(i, first)` (None
    for servers given by URL) starts engine i's Ray actor in its bundle of `pg`. Built as a
    `Fleet` (rollout/fleet.py: `Fleet.ray`, `.serve`, `.sglang`, `.http`)."""

    def __init__(self, slots: list[EngineSlot], model_cfg: ModelConfig, transport: Any, *,
                 launch: Callable[[int, bool], Any] | None = None, pg: Any = None,
                 owns_pg: bool = True, owns_ray: bool = False, weight_version: str = "0",
                 request_timeout_s: float = 600.0, max_engine_restarts: int = 3,
                 startup_timeout_s: float = 300.0, colocate: bool = False,
                 log: Callable[[str], None] | None = None, bundles: Any = None):
        if not request_timeout_s > 0:
            raise ValueError(f"Fleet: request_timeout_s must be > 0, got {request_timeout_s!r}")
        if not (isinstance(max_engine_restarts, int) and max_engine_restarts >= 0):
            raise ValueError(f"Fleet: max_engine_restarts must be an integer >= 0, "
                             f"got {max_engine_restarts!r}")
        self.slots, self.cfg, self.transport = slots, model_cfg, transport
        self._launch, self.pg, self._owns_pg, self._owns_ray = launch, pg, owns_pg, owns_ray
        self.bundles = bundles  # rollout/bundles.EngineBundles: where `launch` starts each
        self.weight_version = str(weight_version)
        self.max_engine_restarts = max_engine_restarts
        self.startup_timeout_s = float(startup_timeout_s)
        self.colocate = colocate
        self.log = log or (lambda s: None)
        self.stats = FleetStats()
        self.placement: dict[tuple[str, int], int] = {}  # (rid, index) -> engine, last generate
        self.pins = Pins()  # trajectory -> the engine (and its life) that holds it
        self._answered: dict[tuple[str, int], tuple[int, int]] = {}  # key -> (engine, life)
        self._released: set[str] = set()  # memory tags released on the servers (colocate)
        self._refusals: dict[str, str | None] = {}  # url -> why it takes no release/resume
        self.closed = False
        self._lock = threading.Lock()
        self._timeout_s = float(request_timeout_s)
        self.request_timeout_s = request_timeout_s  # the transport's clients follow it
        for s in slots:
            transport.attach(self, s)

    @property
    def request_timeout_s(self) -> float:
        """Seconds a request or push may go unanswered before its engine is marked dead."""
        return self._timeout_s

    @request_timeout_s.setter
    def request_timeout_s(self, seconds: float) -> None:
        self._timeout_s = float(seconds)
        for s in self.slots:
            if s.client is not None:
                s.client.timeout = aiohttp.ClientTimeout(total=self._timeout_s)

    @property
    def engines(self) -> list[EngineSlot]:
        return self.slots

    @property
    def weight_sync(self) -> str:
        return self.transport.weight_sync

    @property
    def last_push(self) -> dict:
        """{"mode", "bytes", "buckets", "seconds"} of the last push."""
        return self.transport.last_push

    # -- generate --------------------------------------------------------------------------
    def generate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        """Results in request order, sample index minor (module docstring). Calls from
        several threads run one at a time (a push waits for the generate in flight)."""
        with self._lock:
            return asyncio.run(self._generate(requests))

    async def agenerate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        return await asyncio.to_thread(self.generate, requests)

    async def _generate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        self._check_open()
        if not any(s.state == "live" for s in self.slots):
            await asyncio.to_thread(self._probe_urls)
        prefix = uuid.uuid4().hex[:8]
        seen: set[str] = set()
        for k, r in enumerate(requests):  # rids must be unique across engines and retries
            r.rid = r.rid or f"fleet-{prefix}-{k}"
            if r.rid in seen:
                raise RolloutError(f"two requests share rid {r.rid!r}: results are matched by "
                                   f"(rid, sample index), so rids must be unique")
            seen.add(r.rid)
        check_trajectories(requests)
        if self._released:  # colocated: take the memory back before generating
            await asyncio.to_thread(self.resume_memory)
        groups, lost = [], {}
        for k, r in enumerate(requests):
            g = Group(k, r, self.transport.wire(r))
            g.target, why = self.pins.target(r, self.slots)
            if why:
                lost.update((t, why) for t in r.trajectories)
            else:
                groups.append(g)
        store: dict[tuple[str, int], GenerationResult] = {}
        self.placement, self._answered = {}, {}
        await self._dispatch(groups, store, lost)
        gone = {r.rid for r in requests if lost.keys() & set(r.trajectories)}
        for r in requests:
            if r.rid in gone:  # partial answers of a lost request are not kept
                self.pins.drop(r.trajectories)
            else:
                self.pins.pin(r, self._answered)
        every = [(r.rid, j) for r in requests for j in range(r.sampling.n)]
        want = [k for k in every if k[0] not in gone]
        missing = [k for k in want if k not in store]
        extra = sorted(set(store) - set(every))
        if missing or extra:
            raise RolloutError(f"fleet: results do not match the requests: missing (rid, index) "
                               f"{missing[:5]}, unexpected {extra[:5]}")
        if self.colocate:  # the actor's phase comes next: give the accelerator back
            await asyncio.to_thread(self.release_memory)
        if lost:
            self.stats.trajectories_lost += len(lost)
            raise TrajectoriesLost(lost, [None if k[0] in gone else store[k] for k in every])
        return [store[k] for k in want]

    def release_trajectories(self, trajectories) -> None:
        """Forget the pins of trajectories that ended (their engine may serve anything)."""
        self.pins.drop(trajectories)

    async def _dispatch(self, groups: list[Group], store: dict, lost: dict) -> None:
        """Run every group to completion: one run of groups at a time per live engine; a run
        whose engine goes down is split over the live ones and the engine relaunched, except
        groups pinned to it (their trajectories go to `lost`)."""
        todo = [run for run in self._split(groups) if run]
        tasks: dict[asyncio.Future, tuple[str, EngineSlot, list[Group]]] = {}
        try:
            while todo or tasks:
                busy = {s.index for _, s, _ in tasks.values()}
                for s in self.slots:
                    mine = [r for r in todo if r[0].target in (None, s.index)]
                    if mine and s.state == "live" and s.index not in busy:
                        run = mine[0]
                        todo.remove(run)
                        s.load += sum(g.samples for g in run)
                        t = asyncio.ensure_future(self.transport.run(self, s, run, store))
                        tasks[t] = ("run", s, run)
                if not tasks:
                    raise FleetError("no live rollout engine left: " + "; ".join(
                        f"{s}: {s.last_error[:200]}" for s in self.slots))
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    kind, s, run = tasks.pop(t)
                    err = None if t.cancelled() else t.exception()
                    if kind == "launch":
                        if err is not None:  # the relaunch failed: another loss of the engine
                            self._lost(s, f"failed to restart ({err})", [], todo, tasks,
                                       "restart")
                        continue
                    s.load -= sum(g.samples for g in run)
                    if err is None:
                        continue
                    left = [g for g in run if any((g.req.rid, j) not in store
                                                  for j in range(g.samples))]
                    if isinstance(err, Aborted):  # the engine is fine: send them again
                        self._requeue(left, todo, s)
                    elif isinstance(err, EngineDown):
                        left = self._strand(s, str(err), left, todo, lost)
                        self._lost(s, str(err), left, todo, tasks, "generate")
                    else:
                        raise err
        finally:
            for t, (kind, _, _) in tasks.items():
                if kind == "run":
                    t.cancel()
            if tasks:  # relaunches run to the end (bounded by startup_timeout_s)
                await asyncio.gather(*tasks, return_exceptions=True)

    def _split(self, groups: list[Group]) -> list[list[Group]]:
        """One run per engine for the groups pinned to it; the others in balanced runs."""
        live = sum(s.state == "live" for s in self.slots)
        pinned = collections.defaultdict(list)
        for g in groups:
            if g.target is not None:
                pinned[g.target].append(g)
        free = shard([g for g in groups if g.target is None], max(1, live), lambda g: g.samples)
        return list(pinned.values()) + free

    def _strand(self, slot: EngineSlot, how: str, unanswered: list[Group], todo: list,
                lost: dict) -> list[Group]:
        """`slot` went down: its pinned groups, unanswered or waiting, lose their trajectories
        (they must start again from their first turn); the others are returned to resend."""
        why = f"engine {slot.index} was lost mid-trajectory: {how[:200]}"
        for run in [r for r in todo if r[0].target == slot.index]:
            todo.remove(run)
            unanswered = unanswered + run
        for g in unanswered:
            if g.target == slot.index:
                lost.update((t, why) for t in g.req.trajectories)
        return [g for g in unanswered if g.target != slot.index]

    def _requeue(self, groups: list[Group], todo: list, slot: EngineSlot) -> None:
        for g in groups:
            g.tries += 1
            if g.tries > len(self.slots) * (self.max_engine_restarts + 1) + 1:
                raise FleetError(f"request {g.req.rid}: sent {g.tries} times, never answered; "
                                 f"last engine {slot}: {slot.last_error[:300]}")
        self.stats.retried_groups += len(groups)
        todo.extend(run for run in self._split(groups) if run)

    def _lost(self, slot: EngineSlot, how: str, unanswered: list[Group],
              todo: list, tasks: dict, what: str) -> None:
        """`slot`'s engine is gone: hand its unanswered groups to the live engines and relaunch
        it in its bundle (a task in `tasks`), or fail when it has used up its restarts."""
        name = str(slot)
        self._mark_dead(slot, how)
        if self._launch is not None:
            self._check_budget(slot, name, how, what, [g.req.rid for g in unanswered])
            slot.restarts += 1
            self.stats.relaunches += 1
            slot.state = "starting"
            launch = asyncio.ensure_future(asyncio.to_thread(self._relaunch, slot,
                                                             self.weight_version))
            tasks[launch] = ("launch", slot, [])
        self._requeue(unanswered, todo, slot)

    def _check_budget(self, slot: EngineSlot, name: str, how: str, what: str,
                      rids: list[str]) -> None:
        if slot.restarts >= self.max_engine_restarts:
            self._fail(FleetError(
                f"{name} {how} during {what}; restarted {slot.restarts} time(s) already "
                f"(rollout.max_engine_restarts={self.max_engine_restarts}); unanswered "
                f"requests: {sorted(set(rids))}"))

    def _mark_dead(self, slot: EngineSlot, why: str) -> None:
        slot.state, slot.last_error, slot.version = "dead", why, None
        slot.life += 1
        self.stats.engines_marked_dead += 1
        self._event(f"{slot.index} marked dead: {why[:200]}")
        self.transport.forget(slot)
        if slot.actor is not None:  # a hung engine must not keep its bundle (or its CPU)
            from lockstep.cluster.ray_ops import kill
            kill(slot.actor)

    def _event(self, text: str) -> None:
        self.stats.events.append(text)
        self.log(f"fleet: engine {text}")

    def keep(self, slot: EngineSlot, key: tuple[str, int], result: GenerationResult,
             store: dict) -> None:
        """Store an answer under (rid, sample index) unless that sample is already held."""
        if key in store:
            self.stats.duplicates_dropped += 1
            return
        store[key] = result
        self.placement[key] = slot.index
        self._answered[key] = (slot.index, slot.life)
        slot.samples += 1

    # -- relaunch ---------------------------------------------------------------------------
    def _relaunch(self, slot: EngineSlot, version: str) -> None:
        """A new actor for `slot` in its bundle; live when it holds `version` (built from it,
        or brought to it by the transport), else joining (the next push brings it)."""
        from lockstep.cluster.ray_ops import death_reason, kill
        lost_on, slot.pid, slot.node, slot.url = slot.last_node, -1, "?", ""
        slot.actor = self._launch(slot.index, False)
        try:
            info = self._await_start(slot, lost_on)
        except Exception as e:
            kill(slot.actor)
            slot.state = "dead"
            raise EngineDown(f"engine {slot.index}: did not come up within "
                             f"{self.startup_timeout_s:g}s: {death_reason(e)}") from None
        if self.closed:  # the fleet was closed while this one started
            kill(slot.actor)
            raise FleetError("the rollout fleet was closed during a relaunch")
        self._up(slot, info, info.get("weight_version", UNLOADED))
        if slot.version != version and not self.transport.catch_up(self, slot, version):
            slot.state = "joining"
        self._event(f"{slot.index} relaunched ({slot.restarts}/{self.max_engine_restarts}) as "
                    f"pid {slot.pid}{' at ' + slot.url if slot.url else ''} ({slot.state})")

    def _await_start(self, slot: EngineSlot, lost_on: str) -> dict:
        """The relaunched actor's `info()`. While it is not up, the node the engine was lost
        on is watched: once Ray declares that node dead (its raylet gone: the whole node was
        lost, not only the engine), the actor is started again in a bundle of its own on any
        node with room (`EngineBundles.move`), so the relaunch never waits for the resources
        of a node that is gone."""
        import ray

        from lockstep.cluster.ray_ops import DIED, kill, node_alive, node_name
        deadline = time.monotonic() + self.startup_timeout_s + START_GRACE_S
        ref, moved = slot.actor.info.remote(), False
        while True:
            left = deadline - time.monotonic()
            ready, _ = ray.wait([ref], timeout=max(0.0, min(2.0, left)))
            movable = self.bundles is not None and self.bundles.movable and not moved
            if ready:
                try:
                    return ray.get(ref)
                except DIED:  # started on the lost node, which Ray then declared dead
                    if not (movable and node_alive(lost_on) is False):
                        raise
            elif left <= 0:
                raise TimeoutError(f"no answer to info() within "
                                   f"{self.startup_timeout_s + START_GRACE_S:g}s")
            if movable and node_alive(lost_on) is False:
                where = node_name(lost_on)
                self._event(f"{slot.index}: its node {where} is dead; starting it on another "
                            f"node with room")
                kill(slot.actor)
                try:
                    self.bundles.move(slot.index)
                except RuntimeError as e:
                    raise EngineDown(f"engine {slot.index}: its node {where} is lost and no "
                                     f"other node has room: {e}") from None
                slot.actor, moved = self._launch(slot.index, False), True
                ref = slot.actor.info.remote()

    def _restart(self, slot: EngineSlot, how: str, version: str) -> None:
        """Mark `slot` dead and relaunch it now (a server given by URL: only marked), until it
        is up or has used up its restarts."""
        while True:
            name = str(slot)
            self._mark_dead(slot, f"during a weight push: {how}")
            if self._launch is None:
                return
            self._check_budget(slot, name, how, "update_weights", [])
            slot.restarts += 1
            self.stats.relaunches += 1
            try:
                self._relaunch(slot, version)
                return
            except EngineDown as e:
                how = f"failed to restart ({e})"

    def _up(self, slot: EngineSlot, info: dict, version: str) -> None:
        slot.url, slot.pid, slot.node = info.get("url", ""), int(info["pid"]), str(info["node"])
        slot.last_node = slot.node
        slot.threads, slot.version, slot.state = int(info.get("threads", 0)), version, "live"
        slot.wait_policy = info.get("wait_policy")
        self.transport.attach(self, slot, info)

    def _probe_urls(self) -> None:
        """Servers given by URL that were marked dead and answer `/health` again rejoin."""
        for s in self.slots:
            if s.state == "dead" and self._launch is None:
                try:
                    asyncio.run(s.client.get("/health"))
                except Exception:  # noqa: BLE001 - still down
                    continue
                s.state, s.version = "joining", None

    # -- weights ----------------------------------------------------------------------------
    async def aupdate_weights(self, source: Any, weight_version: str | None = None) -> str:
        return await asyncio.to_thread(self.update_weights, source, weight_version)

    def update_weights(self, source: Any, weight_version: str | None = None) -> str:
        """Push `source` (a model, an HF-named or native state dict, an HF folder, or an
        iterable of buckets, consumed once) to every engine. An engine that does not take it
        is relaunched (at this version where the transport can build it so) and the push is
        repeated for the engines still behind when the source can be read again."""
        with self._lock:
            return self._update_weights(source, weight_version)

    def _update_weights(self, source: Any, weight_version: str | None) -> str:
        self._check_open()
        self._probe_urls()
        if weight_version is None:
            v = self.weight_version
            weight_version = str(int(v) + 1) if v.isdigit() else v + "+1"
        version = str(weight_version)
        t0 = time.perf_counter()
        if "weights" in self._released:  # colocated: the weights' memory back, KV cache not yet
            self.resume_memory(["weights"])
        targets = [s for s in self.slots if s.state in ("live", "joining")]
        for _ in range(len(self.slots) * (self.max_engine_restarts + 1) + 1):
            if not targets:
                raise FleetError("no rollout engine to push weights to: " + "; ".join(
                    f"{s}: {s.last_error[:200]}" for s in self.slots))
            try:
                self.transport.push(self, source, version, targets)
                break
            except EnginesDown as e:
                for s in e.unknown:
                    s.version = None
                for s in e.dead:
                    self._restart(s, f"did not take the weights ({e})", version)
                targets = [s for s in self.slots if s.state in ("live", "joining")
                           and s.version != version]
                if targets and not self.transport.can_repeat(source):
                    raise FleetError(f"weight push {version!r} failed ({e}); the weights were "
                                     f"a one-pass stream, so they cannot be pushed again") from e
        for s in self.slots:
            if s.state == "joining" and s.version == version:
                s.state = "live"
        self.weight_version = version
        self.stats.pushes += 1
        self.stats.push_seconds = time.perf_counter() - t0
        return version

    # -- colocated placement: SGLang's memory release between phases ------------------------
    def release_memory(self, tags: list[str] | None = None) -> None:
        """POST /release_memory_occupation to every live server (colocated rollout: free the
        accelerator for the actor's phase; tags None = weights and KV cache). With
        `colocate` the fleet calls it after each generate, resumes ["weights"] before a push
        and the rest before the next generate."""
        self._broadcast("/release_memory_occupation", tags)
        self._released |= set(tags or ("weights", "kv_cache"))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """POST /resume_memory_occupation (tags None = every released tag)."""
        self._broadcast("/resume_memory_occupation", tags)
        self._released -= set(self._released if tags is None else tags)

    def _broadcast(self, path: str, tags: list[str] | None) -> None:
        """POST to every live server; one that does not answer is marked dead (relaunched,
        with its memory in place), other errors raise. Refused, before anything is sent, when
        an engine cannot take the call (SGLang on a CPU dies of it:
        `memory_occupation.release_refusal`)."""
        from lockstep.rollout.memory_occupation import release_refusal
        live = [s for s in self.slots if s.state == "live"]
        if any(s.client is None for s in live):
            raise RolloutError(f"{path}: the engines are not HTTP servers (rollout.backend=ray)")
        for s in live:
            if s.url not in self._refusals:  # asked once per server URL
                self._refusals[s.url] = release_refusal(asyncio.run(s.client.get("/server_info")))
            if self._refusals[s.url] is not None:
                raise RolloutError(f"{s}: {path} refused: {self._refusals[s.url]}")

        async def all_():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                    total=self.request_timeout_s)) as sess:
                return await asyncio.gather(*(s.client._post(sess, path, {"tags": tags})
                                              for s in live), return_exceptions=True)
        for s, got in zip(live, asyncio.run(all_())):
            if isinstance(got, EngineDown):
                self._mark_dead(s, f"{path}: {got}")
            elif isinstance(got, BaseException):
                raise RolloutError(f"{s}: {path}: {got}") from got

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the weight group, stop the engines we launched, free their bundles
        (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.transport.close()
        if self._launch is not None:
            from lockstep.cluster.ray_ops import release
            if self.bundles is not None:  # engines moved off a lost node
                self.bundles.release()
            release([s.actor for s in self.slots if s.actor is not None],
                    self.pg if self._owns_pg else None, self._owns_ray)  # not the group's
            self.pg = None

    def __enter__(self) -> "Dispatcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RolloutError("the rollout fleet is closed (after close() or an engine that "
                               "could not be recovered); build a new one")

    def _fail(self, err: Exception) -> None:
        self.close()
        raise err


def reiterable(source: Any) -> bool:
    """Whether a weight source can be read again (not a one-pass stream of buckets)."""
    return isinstance(source, (MoEModel, dict, str, Path))
