"""SGLang's `/release_memory_occupation` and `/resume_memory_occupation` on `lockstep serve`.

A rollout server colocated with the actor frees its accelerator memory (weights, KV cache)
while the actor trains, and takes it back before the next push and rollout (SGLang's RL flow:
release all after generating; resume `["weights"]`, push, resume `["kv_cache"]`). Bodies as
SGLang's: `{"tags": ["weights", "kv_cache"] | null}`; null means every tag on release and every
released tag on resume. Like SGLang, a release needs an idle server.

lockstep's engine runs on the CPU and holds no accelerator memory, so nothing is freed here;
what the server keeps is the state: while a tag is released, `/generate` is refused (HTTP 400
naming the tags and the call that resumes them), as a real SGLang server cannot generate
without its weights or KV cache; `/server_info` reports `memory_released`. Weight pushes are
accepted in any state (the CPU engine keeps its weights).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from .types import RequestError

TAGS = ("weights", "kv_cache")


def release_refusal(server_info: Any) -> str | None:
    """Why a server must not be sent /release_memory_occupation or /resume_memory_occupation
    (None: it may), from its `/server_info`. Real SGLang reports its `device` there (lockstep
    serve does not: its CPU engine keeps the state only, above); SGLang 0.5.23 on a CPU
    answers a release by calling torch.cuda.synchronize, which fails, and the server dies."""
    if isinstance(server_info, dict) and server_info.get("device") == "cpu":
        return ("SGLang on a CPU (device cpu) cannot release or resume memory: its "
                "/release_memory_occupation calls torch.cuda.synchronize and the server dies; "
                "the fleet does not send it (colocate SGLang servers only on GPUs)")
    return None


class MemoryOccupation:
    """Which memory tags the server has released (its routes and the check /generate runs)."""

    def __init__(self) -> None:
        self.released: set[str] = set()

    def check_generate(self) -> None:
        if self.released:
            raise RequestError(f"memory released ({', '.join(sorted(self.released))}) by "
                               f"/release_memory_occupation: POST /resume_memory_occupation "
                               f"before /generate")

    @staticmethod
    def _tags(body: Any, what: str) -> list[str] | None:
        if not isinstance(body, dict):
            raise RequestError(f"{what} needs a JSON object (optionally with tags)")
        unknown = sorted(set(body) - {"tags"})
        if unknown:
            raise RequestError(f"{what}: unknown field {unknown[0]!r} (valid: ['tags'])")
        tags = body.get("tags")
        if tags is None:
            return None
        if not isinstance(tags, list) or not all(t in TAGS for t in tags):
            raise RequestError(f"{what}: tags must be a list of {list(TAGS)} or null, "
                               f"got {tags!r}"[:300])
        return tags

    def routes(self, body_of, busy) -> list[tuple[str, Any]]:
        """(path, handler) pairs; `busy()` -> requests in flight (handed to the engine worker,
        maybe not yet on the engine, queued or running)."""

        async def release(request: web.Request) -> web.Response:
            tags = self._tags(await body_of(request), "release_memory_occupation")
            n = busy()
            if n:
                raise RequestError(f"release_memory_occupation with {n} requests queued or "
                                   f"running: the server must be idle (as SGLang requires)")
            self.released |= set(TAGS if tags is None else tags)
            return web.json_response({"success": True, "message": "released "
                                      + ", ".join(sorted(self.released))})

        async def resume(request: web.Request) -> web.Response:
            tags = self._tags(await body_of(request), "resume_memory_occupation")
            self.released -= set(self.released if tags is None else tags)
            return web.json_response({"success": True, "message": "released now: "
                                      + (", ".join(sorted(self.released)) or "none")})

        return [("/release_memory_occupation", release), ("/resume_memory_occupation", resume)]
