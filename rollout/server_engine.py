"""The engine side of `lockstep serve` (rollout/server.py): one worker thread that runs every
engine call in order, and a background task that keeps stepping the engine while any request
runs, so concurrent HTTP requests are batched together (continuous batching). Weight swaps and
memory release wait on it for an idle engine (`when_idle`)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from .engine import Engine
from .types import GenerateRequest, GenerationResult


class ShuttingDown(Exception):
    """The server stops: requests still waiting are answered with HTTP 503."""


class EngineWorker:
    """Serialises every engine call on one thread and keeps the engine stepping."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="lockstep-engine")
        self._waiters: dict[str, tuple[asyncio.Future, list[GenerationResult], int]] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.steps = 0
        self.hold = False  # True while a weight swap waits: queued requests stay queued

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def abort(self, rid: str | None = None) -> int:
        """Abort a request (None: all), queued or running; its waiters get abort results."""
        results = await self.call(self.engine.abort, rid)
        self.deliver(results)
        return len({r.rid for r in results})

    async def shutdown(self) -> None:
        """Answer every request still waiting (finish_reason abort), so the HTTP server's
        graceful shutdown does not wait on them."""
        await self.abort(None)
        for fut, _, _ in list(self._waiters.values()):
            if not fut.done():
                fut.set_exception(ShuttingDown("the server is shutting down"))
        self._waiters.clear()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._exec.shutdown(wait=True, cancel_futures=True)

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    async def generate(self, reqs: list[GenerateRequest]) -> list[list[GenerationResult]]:
        """Run requests (rids already set) to completion; per request its n results."""
        loop = asyncio.get_running_loop()
        futs = []
        for r in reqs:  # register before the engine can finish them
            fut = loop.create_future()
            self._waiters[r.rid] = (fut, [], r.sampling.n)
            futs.append(fut)
        try:
            await self.call(self._add_all, reqs)
        except BaseException:
            for r in reqs:
                self._waiters.pop(r.rid, None)
            raise
        self._wake.set()
        try:
            return list(await asyncio.gather(*futs))
        except asyncio.CancelledError:  # client went away: free its slots
            for r in reqs:
                self._waiters.pop(r.rid, None)
                asyncio.ensure_future(self.call(self.engine.abort, r.rid))
            raise

    def in_flight(self) -> int:
        """Requests from the moment /generate hands them over (before the engine has them:
        they may wait for the engine thread) until answered; at least what the engine runs
        or queues (a request whose client left may still run until its abort lands)."""
        return max(len(self._waiters), len(self.engine.running) + len(self.engine.waiting))

    def _add_all(self, reqs: list[GenerateRequest]) -> None:
        for r in reqs:  # all or nothing: validate first
            self.engine.validate(r)
        for r in reqs:
            self.engine.add_request(r)

    def deliver(self, results: list[GenerationResult]) -> None:
        for res in results:
            entry = self._waiters.get(res.rid)
            if entry is None:
                continue
            fut, got, n = entry
            got.append(res)
            if len(got) == n:
                del self._waiters[res.rid]
                if not fut.done():
                    fut.set_result(sorted(got, key=lambda x: x.index))

    def _busy(self) -> bool:
        return bool(self.engine.running or (self.engine.waiting and not self.hold))

    async def when_idle(self, fn, *args):
        """Stop admitting queued requests, then run `fn` on the engine thread once no sample
        is running (checked on that thread, so a step in flight cannot admit one in between).
        Admission resumes afterwards."""
        self.hold = True
        try:
            while True:
                done, out = await self.call(self._if_idle, fn, *args)
                if done:
                    return out
                await asyncio.sleep(0.002)
        finally:
            self.wake()

    def _if_idle(self, fn, *args):
        return (False, None) if self.engine.running else (True, fn(*args))

    def wake(self) -> None:
        self.hold = False
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._busy():
                try:
                    results = await self.call(self.engine.step, not self.hold)
                except Exception as e:  # an engine bug: fail what runs, keep serving
                    results = await self.call(self.engine.abort, None)
                    for fut, _, _ in list(self._waiters.values()):
                        if not fut.done():
                            fut.set_exception(RuntimeError(f"engine step failed: {e!r}"))
                    self._waiters.clear()
                self.steps += 1
                self.deliver(results)


