"""HTTP server for the embedded engine that speaks SGLang's native wire format.

Endpoints: `POST /generate`, `POST /update_weights_from_disk`, `POST /update_weight_version`,
the disk-free weight sync `POST /init_weights_update_group`, `/update_weights_from_distributed`,
`/update_weights_from_tensor`, `/destroy_weights_update_group` (rollout/weight_receiver.py),
`POST /abort_request`, `POST /flush_cache`, `GET /health`, `GET /health_generate`,
`GET /model_info`, `GET /server_info`. The `/generate` request and response follow SGLang
(REFERENCE.md) with `--skip-tokenizer-init` semantics (token ids in, `output_ids` out); see
docs/rollout.md for every field. The files of the server, by role: this one (the app, its
routes and handlers, the runners), rollout/generate_wire.py (the /generate body and answer),
rollout/server_engine.py (the one engine thread and continuous batching),
rollout/weight_receiver.py (weight sync endpoints), rollout/memory_occupation.py.

Errors: a bad request gets HTTP 400 (401 without the API key) and a JSON body
`{"error": {"message": ...}}` naming the problem; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
import threading
import uuid
from typing import Any

from aiohttp import web

from ..replay.codec import ENCODING_REQUEST_FIELD, ENCODINGS
from .engine import Engine
from .generate_wire import build_response, check_type, err, parse_generate
from .memory_occupation import MemoryOccupation
from .server_engine import EngineWorker, ShuttingDown
from .server_limits import Connections, Runner, ServerLimits, throttle_accept_errors
from .types import GenerateRequest, RequestError, SamplingParams
from .weight_receiver import RECEIVER, TENSOR_FORMAT, WeightReceiver

_SHUTDOWN_S = 5.0  # the most a stopping server waits for handlers (all are answered first)
_BIG_BODY = 256 * 1024  # bodies above this are parsed on a thread, off the event loop


def create_app(engine: Engine, api_key: str | None = None, model_path: str | None = None,
               sampling_mask_max_tokens: int | None = 4096,
               max_body_bytes: int = 64 * 1024 * 1024,
               weight_sync_timeout_s: float = 600.0,
               limits: ServerLimits | None = None) -> web.Application:
    """The aiohttp application (engine worker started and stopped with the app).

    `max_body_bytes` bounds a request body (HTTP 413 above it, before it is read);
    `weight_sync_timeout_s` bounds joining a weight-update group and each broadcast;
    `limits`: idle/body timeouts and the connection cap (rollout/server_limits.py), applied
    by the runners below (`ServerThread`, `run_server`)."""
    connections = Connections(limits or ServerLimits())
    worker = EngineWorker(engine)
    weights_lock = asyncio.Lock()
    receiver = WeightReceiver(engine, worker, weights_lock, weight_sync_timeout_s)
    memory = MemoryOccupation()  # /release_memory_occupation state (colocated fleets)

    @web.middleware
    async def guard(request: web.Request, handler):
        if api_key and request.path != "/health" and not hmac.compare_digest(
                request.headers.get("Authorization", "").encode(), f"Bearer {api_key}".encode()):
            return err(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")
        try:
            return await handler(request)
        except RequestError as e:
            return err(400, str(e))
        except _TooLarge as e:
            return err(413, str(e))
        except _SlowBody as e:
            slow = err(408, str(e))
            slow.force_close()  # the rest of the body is not waited for
            return slow
        except ShuttingDown as e:
            return err(503, str(e))

    async def body_of(request: web.Request, parse=None) -> Any:
        """The JSON body (bounded; big ones decoded on a thread), optionally passed through
        `parse` on that thread too."""
        limit = (f"the server's limit is {max_body_bytes} bytes (lockstep serve "
                 f"--max-request-mb): split the batch into smaller requests")
        if request.content_length is not None and request.content_length > max_body_bytes:
            raise _TooLarge(f"request body of {request.content_length} bytes is too large; {limit}")
        connections.reading.add(request.protocol)
        wait = connections.limits.body_timeout_s
        try:
            async with asyncio.timeout(wait):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _TooLarge(f"request body is too large; {limit}") from None
        except ConnectionResetError:  # the client went (or was evicted) mid-body
            raise RequestError("the client closed the connection before its body arrived") \
                from None
        except TimeoutError:
            raise _SlowBody(f"the request body did not arrive within {wait:g}s of its headers "
                            f"(lockstep serve --body-timeout)") from None
        finally:
            connections.reading.discard(request.protocol)

        def decode():
            try:
                body = json.loads(raw) if raw else {}
            except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
                raise RequestError(f"request body is not valid JSON: {e}"[:300]) from None
            return body if parse is None else parse(body)
        if len(raw) > _BIG_BODY:
            return await asyncio.to_thread(decode)
        return decode()

    def _parse(body):
        return parse_generate(body, engine.vocab_size, sampling_mask_max_tokens, engine.max_len)

    async def generate(request: web.Request) -> web.Response:
        parsed, batched = await body_of(request, _parse)
        memory.check_generate()
        busy = [p.req.rid for p in parsed if p.req.rid in worker._waiters]
        if busy:
            raise RequestError(f"rid {busy[0]!r} is already running")
        per_req = await worker.generate([p.req for p in parsed])
        out = [build_response(res, p, engine, p.req.sampling.n)
               for p, results in zip(parsed, per_req) for res in results]
        single = not batched and parsed[0].req.sampling.n == 1
        return web.json_response(out[0] if single else out)

    async def update_weights(request: web.Request) -> web.Response:
        body = await body_of(request)
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str) \
                or not body["model_path"]:
            raise RequestError("update_weights_from_disk needs a JSON body with model_path "
                               "(an HF checkpoint folder the server can read)")
        _known(body, "update_weights_from_disk", ("model_path", "load_format", "flush_cache",
               "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
               "keep_pause", "recapture_cuda_graph", "token_step", "manifest", "rid", "http_worker_ipc"))
        version = _opt_str(body, "weight_version")
        load_format = body.get("load_format")
        if load_format not in (None, "auto", "safetensors"):
            raise RequestError(f"load_format={load_format!r}: the lockstep server reads HF "
                               f"safetensors folders (null, 'auto' or 'safetensors')"[:300])
        path = body["model_path"]
        async with weights_lock:  # one update at a time; generation goes on while it reads
            try:  # read and check every tensor off the engine thread and the event loop
                new_sd = await asyncio.to_thread(engine.prepare_weights, path)
            except (ValueError, OSError) as e:  # CheckpointError is a ValueError
                return web.json_response({"success": False, "message": str(e),
                                          "num_paused_requests": 0}, status=400)
            aborted = await worker.abort(None) if _flag(body, "abort_all_requests") else 0
            # As SGLang: the swap waits for running samples to finish and holds queued ones,
            # so no sample mixes two weight versions.
            paused = len(engine.waiting)
            receiver.discard()  # a half-sent distributed push must not land on top of these
            new = await worker.when_idle(engine.swap_weights, new_sd, version)
        return web.json_response({"success": True, "message": f"weights loaded from "
                                  f"{path}; weight_version={new}"
                                  + (f"; aborted {aborted} requests" if aborted else ""),
                                  "num_paused_requests": paused})

    async def update_weight_version(request: web.Request) -> web.Response:
        body = await body_of(request)
        if not isinstance(body, dict):
            raise RequestError("update_weight_version needs a JSON object with new_version")
        _known(body, "update_weight_version", ("new_version", "abort_all_requests"))
        v = body.get("new_version")
        if not isinstance(v, str) or not v:
            raise RequestError("update_weight_version needs a non-empty string new_version")
        if _flag(body, "abort_all_requests"):
            await worker.abort(None)
        engine.weight_version = v
        return web.json_response({"success": True, "message": f"weight_version={v}"})

    async def abort(request: web.Request) -> web.Response:
        body = await body_of(request)
        if not isinstance(body, dict):
            raise RequestError("abort_request needs a JSON object with rid or abort_all")
        _known(body, "abort_request", ("rid", "abort_all", "finished_reason", "abort_message",
                                          "http_worker_ipc"))
        if _flag(body, "abort_all"):
            await worker.abort(None)
        elif isinstance(body.get("rid"), str):
            await worker.abort(body["rid"])
        else:
            raise RequestError("abort_request needs rid (string) or abort_all=true")
        return web.Response(status=200)

    async def flush_cache(request: web.Request) -> web.Response:
        # No prefix cache to flush: a prompt's KV lives only while its samples run.
        return web.Response(text="Cache flushed.", status=200)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(request: web.Request) -> web.Response:
        req = GenerateRequest([0], SamplingParams(max_new_tokens=1), rid="health-" + uuid.uuid4().hex,
                              return_routes=False)
        await worker.generate([req])
        return web.Response(status=200)

    async def model_info(request: web.Request) -> web.Response:
        cfg = engine.model.cfg
        return web.json_response({
            "model_path": model_path, "tokenizer_path": None, "is_generation": True,
            "weight_version": engine.weight_version, "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "lockstep": {"config": cfg.to_hf_dict(), "moe_layer_ids": cfg.moe_layer_ids,
                         "dtype": engine.cfg.dtype, "routes_encodings": list(ENCODINGS),
                         "encoding_request_field": ENCODING_REQUEST_FIELD},
        })

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({
            "engine": {k: getattr(engine.cfg, k) for k in engine.cfg.__dataclass_fields__},
            "max_len": engine.max_len, "running": len(engine.running),
            "waiting": len(engine.waiting), "steps": worker.steps,
            "weight_version": engine.weight_version, "tp_size": 1,
            "sampling_mask_max_tokens": sampling_mask_max_tokens,
            "max_request_bytes": max_body_bytes, "memory_released": sorted(memory.released),
            "weight_tensor_formats": [TENSOR_FORMAT],
            "connections": {"open": connections.open, "cap": connections.cap,
                            "evicted": connections.evicted, "refused": connections.refused}})

    async def on_startup(app):
        await worker.start()

    async def on_shutdown(app):
        await worker.shutdown()

    async def on_cleanup(app):
        receiver.close()
        await worker.stop()

    app = web.Application(middlewares=[guard], client_max_size=max_body_bytes)
    app.router.add_post("/generate", generate)
    app.router.add_post("/update_weights_from_disk", update_weights)
    app.router.add_post("/update_weight_version", update_weight_version)
    for path, handler in receiver.routes(body_of):
        app.router.add_post(path, handler)
    app[RECEIVER] = receiver
    app[CONNECTIONS] = connections
    for path, handler in memory.routes(body_of, worker.in_flight):
        app.router.add_post(path, handler)
    app.router.add_post("/abort_request", abort)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/server_info", server_info)
    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


class _TooLarge(Exception):
    """A request body over the server's limit (HTTP 413)."""


class _SlowBody(Exception):
    """A request body that did not arrive within the body timeout (HTTP 408)."""


def _known(body: dict, endpoint: str, fields: tuple[str, ...]) -> None:
    unknown = [k for k in body if k not in fields]
    if unknown:
        raise RequestError(f"{endpoint}: unknown field {str(unknown[0])[:100]!r}; valid: {list(fields)}")


def _flag(body: dict, key: str) -> bool:
    return check_type(key, body.get(key, False) if body.get(key) is not None else False, bool)


def _opt_str(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise RequestError(f"{key} must be a string or null, got {v!r}"[:200])
    return v


CONNECTIONS = web.AppKey("connections", Connections)  # the app's connection state (runners, tests)


class ServerThread:
    """Run the server on a background thread (tests, benchmarks, a trainer that serves its
    own engine): `with ServerThread(engine) as srv: ... srv.url`."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, model_path: str | None = None,
                 sampling_mask_max_tokens: int | None = 4096,
                 max_body_bytes: int = 64 * 1024 * 1024, weight_sync_timeout_s: float = 600.0,
                 limits: ServerLimits | None = None):
        self.app = create_app(engine, api_key=api_key, model_path=model_path,
                              sampling_mask_max_tokens=sampling_mask_max_tokens,
                              max_body_bytes=max_body_bytes,
                              weight_sync_timeout_s=weight_sync_timeout_s, limits=limits)
        self.host, self.port = host, port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="lockstep-server")
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerThread":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(60)
        return self

    async def _start(self) -> None:
        throttle_accept_errors(asyncio.get_running_loop())
        self._runner = Runner(self.app, self.app[CONNECTIONS], access_log=None,
                              shutdown_timeout=_SHUTDOWN_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the OS-chosen port for port=0

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(60)
            self._runner = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_server(engine: Engine, host: str = "127.0.0.1", port: int = 30000,
               api_key: str | None = None, model_path: str | None = None,
               sampling_mask_max_tokens: int | None = 4096,
               max_body_bytes: int = 64 * 1024 * 1024,
               weight_sync_timeout_s: float = 600.0,
               limits: ServerLimits | None = None) -> None:
    """Serve until SIGINT or SIGTERM (what `lockstep serve` runs)."""
    app = create_app(engine, api_key=api_key, model_path=model_path,
                     sampling_mask_max_tokens=sampling_mask_max_tokens,
                     max_body_bytes=max_body_bytes, weight_sync_timeout_s=weight_sync_timeout_s,
                     limits=limits)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        throttle_accept_errors(loop)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        runner = Runner(app, app[CONNECTIONS], access_log=None, shutdown_timeout=_SHUTDOWN_S)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            c = app[CONNECTIONS]
            print(f"lockstep serve: listening on http://{host}:{port} (at most {c.cap} "
                  f"connections; idle {c.limits.idle_timeout_s:g}s, body "
                  f"{c.limits.body_timeout_s:g}s); Ctrl+C stops", flush=True)
            await stop.wait()
        finally:
            await runner.cleanup()
    asyncio.run(serve())
