"""HTTP server for the embedded engine that speaks SGLang's native wire format.

Endpoints: `POST /generate`, `POST /update_weights_from_disk`, `POST /update_weight_version`,
`POST /abort_request`, `POST /flush_cache`, `GET /health`, `GET /health_generate`,
`GET /model_info`, `GET /server_info`. The `/generate` request and response follow SGLang
(REFERENCE.md) with `--skip-tokenizer-init` semantics (token ids in, `output_ids` out); see
docs/rollout.md for every field. All engine calls run on one worker thread, in order; a
background task keeps stepping the engine while any request is running, so concurrent HTTP
requests are batched together (continuous batching).

Errors: a bad request gets HTTP 400 (401 without the API key) and a JSON body
`{"error": {"message": ...}}` naming the problem; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..replay.codec import ENCODING_INT32, ENCODING_REQUEST_FIELD, ENCODINGS, encode_routes
from ..replay.trace import RoutingTrace
from .engine import Engine
from .types import GenerateRequest, GenerationResult, RequestError, SamplingParams

_SAMPLING_LOGPROBS_MODES = ("selected", "support")


class EngineWorker:
    """Serialises every engine call on one thread and keeps the engine stepping."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="lockstep-engine")
        self._waiters: dict[str, tuple[asyncio.Future, list[GenerationResult], int]] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.steps = 0

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run())

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

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.engine.has_work:
                try:
                    results = await self.call(self.engine.step)
                except Exception as e:  # an engine bug: fail what runs, keep serving
                    results = await self.call(self.engine.abort, None)
                    for fut, _, _ in list(self._waiters.values()):
                        if not fut.done():
                            fut.set_exception(RuntimeError(f"engine step failed: {e!r}"))
                    self._waiters.clear()
                self.steps += 1
                self.deliver(results)


def _err(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _per_request(body: dict, key: str, i: int, n: int, default: Any) -> Any:
    """A per-request field: one value for the whole batch, or a list with one per input."""
    v = body.get(key, default)
    if isinstance(v, list):
        if len(v) != n:
            raise RequestError(f"{key} is a list of {len(v)} entries but the batch has {n} inputs")
        v = v[i]
    return default if v is None else v


def _check_type(name: str, v: Any, kind: type) -> Any:
    ok = isinstance(v, kind) and not (kind is int and isinstance(v, bool))
    if not ok:
        raise RequestError(f"{name} must be {kind.__name__}, got {type(v).__name__} {v!r}")
    return v


@dataclass
class _Parsed:
    req: GenerateRequest
    return_logprob: bool
    logprob_start_len: int
    routes: bool
    routes_start: int
    encoding: str
    mask_mode: str | None


def parse_generate(body: Any, vocab_size: int | None = None,
                   mask_max_tokens: int | None = None) -> tuple[list[_Parsed], bool]:
    """SGLang /generate body -> requests; also whether the input was a batch.

    `mask_max_tokens` plays SGLang's --sampling-mask-max-tokens: a request for the sampling
    mask whose support could exceed it (top_k unset or larger, vocabulary larger) is refused
    up front, so clients keep top_k below it as they must with SGLang."""
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by the lockstep server")
    if "input_ids" not in body:
        if "text" in body or "prompt" in body:
            raise RequestError("text input needs a tokenizer; this server runs with "
                               "--skip-tokenizer-init semantics: send input_ids")
        raise RequestError("input_ids is required")
    ids = body["input_ids"]
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"input_ids must be a non-empty list, got {ids!r}"[:200])
    batched = isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    encoding = body.get(ENCODING_REQUEST_FIELD) or ENCODING_INT32
    if encoding not in ENCODINGS:
        raise RequestError(f"{ENCODING_REQUEST_FIELD}={encoding!r}; valid: {list(ENCODINGS)}")
    out = []
    for i, p in enumerate(prompts):
        where = f"input_ids[{i}]" if batched else "input_ids"
        if not isinstance(p, list) or not p:
            raise RequestError(f"{where} must be a non-empty list of token ids")
        for j, t in enumerate(p):
            if not isinstance(t, int) or isinstance(t, bool):
                raise RequestError(f"{where}[{j}] must be an integer token id, got {t!r}")
        g = lambda k, d: _per_request(body, k, i, len(prompts), d)  # noqa: E731
        try:
            sp = SamplingParams.from_sglang(g("sampling_params", None))
        except TypeError as e:
            raise RequestError(f"sampling_params: {e}") from None
        rl = _check_type("return_logprob", g("return_logprob", False), bool)
        start = _check_type("logprob_start_len", g("logprob_start_len", -1), int)
        top_n = _check_type("top_logprobs_num", g("top_logprobs_num", 0), int)
        routes = _check_type("return_routed_experts", g("return_routed_experts", False), bool)
        rstart = _check_type("routed_experts_start_len", g("routed_experts_start_len", 0), int)
        mask = _check_type("return_sampling_mask", g("return_sampling_mask", False), bool)
        mode = g("sampling_logprobs_mode", None)
        if mask and mask_max_tokens is not None and vocab_size is not None \
                and vocab_size > mask_max_tokens \
                and not (sp.greedy or 1 <= sp.top_k <= mask_max_tokens):
            raise RequestError(f"return_sampling_mask with top_k={sp.top_k} could return "
                               f"supports of up to {vocab_size} ids, more than "
                               f"sampling_mask_max_tokens={mask_max_tokens}: set top_k <= "
                               f"{mask_max_tokens}")
        if mode is not None and not mask:
            raise RequestError("sampling_logprobs_mode needs return_sampling_mask=true")
        if mode is not None and mode not in _SAMPLING_LOGPROBS_MODES:
            raise RequestError(f"sampling_logprobs_mode={mode!r}; valid: {list(_SAMPLING_LOGPROBS_MODES)}")
        if not -1 <= start < len(p):
            raise RequestError(f"logprob_start_len={start} must be in [-1, {len(p)}) for a "
                               f"prompt of {len(p)} tokens")
        if not 0 <= rstart < len(p):
            raise RequestError(f"routed_experts_start_len={rstart} must be in [0, {len(p)}) "
                               f"for a prompt of {len(p)} tokens")
        rid = g("rid", None) or uuid.uuid4().hex
        req = GenerateRequest(list(p), sp, rid=str(rid), return_routes=routes,
                              return_input_logprobs=rl and start >= 0,
                              top_logprobs_num=top_n if rl else 0,
                              return_sampling_mask=mask,
                              return_support_logprobs=mask and mode == "support")
        out.append(_Parsed(req, rl, start, routes, rstart, encoding, mode if mask else None))
    rids = [x.req.rid for x in out]
    if len(set(rids)) != len(rids):
        raise RequestError(f"rid values must be distinct within a batch, got {rids}")
    return out, batched


def _lp_entries(lps, ids):
    """SGLang's [[logprob, token_id, text]] with text null (no tokenizer)."""
    return [[None if lp != lp else float(lp), int(t), None] for lp, t in zip(lps, ids)]


def _top_entries(tops):
    return [None if row is None else [[float(v), int(i), None] for v, i in row] for row in tops]


def build_response(res: GenerationResult, p: _Parsed, engine: Engine, n: int) -> dict:
    cfg = engine.model.cfg
    P, R = res.prompt_tokens, res.completion_tokens
    meta: dict[str, Any] = {
        "id": res.rid if n == 1 else f"{res.rid}-{res.index}",
        "finish_reason": res.finish_reason,
        "prompt_tokens": P, "completion_tokens": R,
        "cached_tokens": P if res.index > 0 else 0,  # samples after the first reuse the prefill
        "weight_version": res.weight_version,
    }
    if p.return_logprob:
        meta["output_token_logprobs"] = _lp_entries(res.output_logprobs.tolist(), res.output_ids)
        if p.logprob_start_len >= 0:
            s = p.logprob_start_len
            meta["input_token_logprobs"] = _lp_entries(res.input_logprobs[s:].tolist(),
                                                       res.prompt_ids[s:])
        if p.req.top_logprobs_num:
            meta["output_top_logprobs"] = _top_entries(res.top_logprobs or [])
            if p.logprob_start_len >= 0:
                meta["input_top_logprobs"] = _top_entries(res.input_top_logprobs[p.logprob_start_len:])
    if p.req.return_sampling_mask:
        V = cfg.vocab_size
        masks = [list(range(V)) if m is None else m.tolist() for m in res.sampling_mask or []]
        meta["output_token_sampling_mask"] = masks
        meta["output_token_sampling_mask_length"] = [len(m) for m in masks]
        if p.mask_mode == "support":
            meta["output_token_sampling_logprobs"] = [x.tolist() for x in res.support_logprobs or []]
        else:
            meta["output_token_sampling_logprobs"] = res.sampling_logprobs.tolist()
    if p.routes and res.routes_NLK is None:
        meta["routed_experts"] = None  # the engine runs with capture_routes=False
    elif p.routes:
        trace = RoutingTrace(res.routes_NLK, cfg.num_experts).slice(p.routes_start, P + R - 1)
        meta["routed_experts"] = encode_routes(trace, p.encoding, cfg.num_hidden_layers,
                                               cfg.moe_layer_ids)
    return {"output_ids": res.output_ids, "meta_info": meta}


def create_app(engine: Engine, api_key: str | None = None, model_path: str | None = None,
               sampling_mask_max_tokens: int | None = 4096,
               max_body_bytes: int = 256 * 1024 * 1024) -> web.Application:
    """The aiohttp application (engine worker started and stopped with the app)."""
    worker = EngineWorker(engine)

    @web.middleware
    async def guard(request: web.Request, handler):
        if api_key and request.path != "/health" and \
                request.headers.get("Authorization") != f"Bearer {api_key}":
            return _err(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")
        try:
            return await handler(request)
        except RequestError as e:
            return _err(400, str(e))

    async def body_of(request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw) if raw else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"request body is not valid JSON: {e}") from None

    async def generate(request: web.Request) -> web.Response:
        parsed, batched = parse_generate(await body_of(request), engine.vocab_size,
                                         sampling_mask_max_tokens)
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
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise RequestError("update_weights_from_disk needs a JSON body with model_path")
        version = body.get("weight_version")
        if body.get("abort_all_requests"):
            worker.deliver(await worker.call(engine.abort, None))
        paused = len(engine.running)
        try:
            new = await worker.call(engine.update_weights, body["model_path"], version)
        except (ValueError, OSError) as e:
            return web.json_response({"success": False, "message": str(e),
                                      "num_paused_requests": 0}, status=400)
        return web.json_response({"success": True, "message": f"weights loaded from "
                                  f"{body['model_path']}; weight_version={new}",
                                  "num_paused_requests": paused})

    async def update_weight_version(request: web.Request) -> web.Response:
        body = await body_of(request)
        v = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(v, str) or not v:
            raise RequestError("update_weight_version needs a non-empty string new_version")
        if body.get("abort_all_requests"):
            worker.deliver(await worker.call(engine.abort, None))
        engine.weight_version = v
        return web.json_response({"success": True, "message": f"weight_version={v}"})

    async def abort(request: web.Request) -> web.Response:
        body = await body_of(request)
        if not isinstance(body, dict):
            raise RequestError("abort_request needs a JSON object")
        rid = body.get("rid")
        if body.get("abort_all"):
            rid = None
        elif not isinstance(rid, str):
            raise RequestError("abort_request needs rid (string) or abort_all=true")
        worker.deliver(await worker.call(engine.abort, rid))
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
            "weight_version": engine.weight_version})

    async def on_startup(app):
        await worker.start()

    async def on_cleanup(app):
        await worker.stop()

    app = web.Application(middlewares=[guard], client_max_size=max_body_bytes)
    app.router.add_post("/generate", generate)
    app.router.add_post("/update_weights_from_disk", update_weights)
    app.router.add_post("/update_weight_version", update_weight_version)
    app.router.add_post("/abort_request", abort)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/server_info", server_info)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


class ServerThread:
    """Run the server on a background thread (tests, benchmarks, a trainer that serves its
    own engine): `with ServerThread(engine) as srv: ... srv.url`."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, model_path: str | None = None,
                 sampling_mask_max_tokens: int | None = 4096):
        self.app = create_app(engine, api_key=api_key, model_path=model_path,
                              sampling_mask_max_tokens=sampling_mask_max_tokens)
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
        self._runner = web.AppRunner(self.app, access_log=None)
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
               sampling_mask_max_tokens: int | None = 4096) -> None:
    """Serve until interrupted (what `lockstep serve` runs)."""
    app = create_app(engine, api_key=api_key, model_path=model_path,
                     sampling_mask_max_tokens=sampling_mask_max_tokens)
    web.run_app(app, host=host, port=port, access_log=None,
                print=lambda s: print(s, flush=True))
