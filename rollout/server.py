"""HTTP server for the embedded engine that speaks SGLang's native wire format.

Endpoints: `POST /generate`, `POST /update_weights_from_disk`, `POST /update_weight_version`,
the disk-free weight sync `POST /init_weights_update_group`, `/update_weights_from_distributed`,
`/update_weights_from_tensor`, `/destroy_weights_update_group` (rollout/weight_receiver.py),
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
import hmac
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
from .memory_occupation import MemoryOccupation
from .request_fields import check_generate_fields
from .types import GenerateRequest, GenerationResult, RequestError, SamplingParams
from .weight_receiver import RECEIVER, TENSOR_FORMAT, WeightReceiver

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
                fut.set_exception(_ShuttingDown("the server is shutting down"))
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
                   mask_max_tokens: int | None = None,
                   max_len: int | None = None) -> tuple[list[_Parsed], bool]:
    """SGLang /generate body -> requests; also whether the input was a batch.

    Refuses what SGLang 0.5.23 refuses when run with --skip-tokenizer-init, so that tests
    against this server catch a client that a real SGLang server would fail: unknown
    top-level fields (`check_generate_fields`); `return_sampling_mask` unless the support is
    bounded (greedy, top_k == 1 or 1 < top_k <= `mask_max_tokens`, SGLang's
    --sampling-mask-max-tokens) and with n > 1 (SGLang answers HTTP 500); `min_new_tokens` > 0;
    prompt + max_new_tokens beyond the context `max_len`."""
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    check_generate_fields(body)
    if body.get("stream"):
        raise RequestError("stream=true is not supported by the lockstep server")
    if "input_ids" not in body:
        if "text" in body:
            raise RequestError("text input needs a tokenizer; this server runs with "
                               "--skip-tokenizer-init semantics: send input_ids")
        raise RequestError("input_ids is required")
    if body.get("text") is not None:
        raise RequestError("send input_ids or text, not both (this server takes input_ids)")
    ids = body["input_ids"]
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"input_ids must be a non-empty list, got {ids!r}"[:200])
    batched = isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    encoding = body.get(ENCODING_REQUEST_FIELD) or ENCODING_INT32
    if not isinstance(encoding, str) or encoding not in ENCODINGS:
        raise RequestError(f"{ENCODING_REQUEST_FIELD}={encoding!r}; valid: {list(ENCODINGS)}"[:300])
    rid_all = body.get("rid")
    if batched and isinstance(rid_all, str):  # SGLang: a string rid is a prefix for a batch
        body = {**body, "rid": [f"{rid_all}_{i}" for i in range(len(prompts))]}
    out = []
    for i, p in enumerate(prompts):
        where = f"input_ids[{i}]" if batched else "input_ids"
        if not isinstance(p, list) or not p:
            raise RequestError(f"{where} must be a non-empty list of token ids")
        for j, t in enumerate(p):
            if not isinstance(t, int) or isinstance(t, bool):
                raise RequestError(f"{where}[{j}] must be an integer token id, got {t!r}"[:200])
        g = lambda k, d: _per_request(body, k, i, len(prompts), d)  # noqa: E731
        raw_sp = g("sampling_params", None)
        try:
            sp = SamplingParams.from_sglang(raw_sp)
        except TypeError as e:
            raise RequestError(f"sampling_params: {e}") from None
        rl = _check_type("return_logprob", g("return_logprob", False), bool)
        start = _check_type("logprob_start_len", g("logprob_start_len", -1), int)
        top_n = _check_type("top_logprobs_num", g("top_logprobs_num", 0), int)
        routes = _check_type("return_routed_experts", g("return_routed_experts", False), bool)
        rstart = _check_type("routed_experts_start_len", g("routed_experts_start_len", 0), int)
        mask = _check_type("return_sampling_mask", g("return_sampling_mask", False), bool)
        mode = g("sampling_logprobs_mode", None)
        rid = g("rid", None)
        if rid is not None and not isinstance(rid, str):
            raise RequestError(f"rid must be a string (or a list of strings for a batch), "
                               f"got {rid!r}"[:200])
        if mask:
            _check_mask_request(sp, mask_max_tokens)
        if sp.min_new_tokens:
            raise RequestError(f"sampling_params.min_new_tokens={sp.min_new_tokens} is refused: "
                               f"SGLang refuses min_new_tokens > 0 with --skip-tokenizer-init "
                               f"(stop on max_new_tokens or mask stop ids in your client)")
        # As SGLang: an explicit max_new_tokens must fit; the default is clamped to the room.
        if max_len is not None and (raw_sp or {}).get("max_new_tokens") is not None \
                and len(p) + sp.max_new_tokens > max_len:
            raise RequestError(f"{where}: {len(p)} prompt tokens + max_new_tokens="
                               f"{sp.max_new_tokens} exceed the context of {max_len} tokens "
                               f"(the server's --max-len); ask for at most "
                               f"{max(max_len - len(p), 0)} new tokens")
        if mode is not None and not mask:
            raise RequestError("sampling_logprobs_mode needs return_sampling_mask=true")
        if mode is not None and mode not in _SAMPLING_LOGPROBS_MODES:
            raise RequestError(f"sampling_logprobs_mode={mode!r}; valid: {list(_SAMPLING_LOGPROBS_MODES)}"[:300])
        if not -1 <= start < len(p):
            raise RequestError(f"logprob_start_len={start} must be in [-1, {len(p)}) for a "
                               f"prompt of {len(p)} tokens")
        if not 0 <= rstart < len(p):
            raise RequestError(f"routed_experts_start_len={rstart} must be in [0, {len(p)}) "
                               f"for a prompt of {len(p)} tokens")
        req = GenerateRequest(list(p), sp, rid=rid or uuid.uuid4().hex, return_routes=routes,
                              return_input_logprobs=rl and start >= 0,
                              top_logprobs_num=top_n if rl else 0,
                              return_sampling_mask=mask,
                              return_support_logprobs=mask and mode == "support")
        out.append(_Parsed(req, rl, start, routes, rstart, encoding, mode if mask else None))
    rids = [x.req.rid for x in out]
    if len(set(rids)) != len(rids):
        raise RequestError(f"rid values must be distinct within a batch, got {rids}"[:300])
    return out, batched


def _check_mask_request(sp: SamplingParams, mask_max_tokens: int | None) -> None:
    """SGLang 0.5.23's rule for return_sampling_mask (REFERENCE.md)."""
    if sp.n > 1:
        raise RequestError(f"return_sampling_mask with n={sp.n} is refused: SGLang fails such a "
                           f"request (HTTP 500, its prefix-cache warm-up copy samples nothing); "
                           f"send {sp.n} requests with n=1 and sampling_seed + j instead")
    if mask_max_tokens is None or sp.greedy or sp.top_k == 1:
        return
    if not 1 < sp.top_k <= mask_max_tokens:
        raise RequestError(f"return_sampling_mask needs a finite top_k in (1, "
                           f"{mask_max_tokens}] (sampling_mask_max_tokens, SGLang's "
                           f"--sampling-mask-max-tokens), got top_k={sp.top_k}: set top_k <= "
                           f"{mask_max_tokens} (the vocabulary size keeps every token)")


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
        if p.logprob_start_len >= 0 and res.input_logprobs is not None:  # None: aborted in queue
            s = p.logprob_start_len
            meta["input_token_logprobs"] = _lp_entries(res.input_logprobs[s:].tolist(),
                                                       res.prompt_ids[s:])
        if p.req.top_logprobs_num:
            meta["output_top_logprobs"] = _top_entries(res.top_logprobs or [])
            if p.logprob_start_len >= 0 and res.input_top_logprobs is not None:
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


_SHUTDOWN_S = 5.0  # the most a stopping server waits for handlers (all are answered first)
_BIG_BODY = 256 * 1024  # bodies above this are parsed on a thread, off the event loop


def create_app(engine: Engine, api_key: str | None = None, model_path: str | None = None,
               sampling_mask_max_tokens: int | None = 4096,
               max_body_bytes: int = 64 * 1024 * 1024,
               weight_sync_timeout_s: float = 600.0) -> web.Application:
    """The aiohttp application (engine worker started and stopped with the app).

    `max_body_bytes` bounds a request body (HTTP 413 above it, before it is read);
    `weight_sync_timeout_s` bounds joining a weight-update group and each broadcast."""
    worker = EngineWorker(engine)
    weights_lock = asyncio.Lock()
    receiver = WeightReceiver(engine, worker, weights_lock, weight_sync_timeout_s)
    memory = MemoryOccupation()  # /release_memory_occupation state (colocated fleets)

    @web.middleware
    async def guard(request: web.Request, handler):
        if api_key and request.path != "/health" and not hmac.compare_digest(
                request.headers.get("Authorization", "").encode(), f"Bearer {api_key}".encode()):
            return _err(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")
        try:
            return await handler(request)
        except RequestError as e:
            return _err(400, str(e))
        except _TooLarge as e:
            return _err(413, str(e))
        except _ShuttingDown as e:
            return _err(503, str(e))

    async def body_of(request: web.Request, parse=None) -> Any:
        """The JSON body (bounded; big ones decoded on a thread), optionally passed through
        `parse` on that thread too."""
        limit = (f"the server's limit is {max_body_bytes} bytes (lockstep serve "
                 f"--max-request-mb): split the batch into smaller requests")
        if request.content_length is not None and request.content_length > max_body_bytes:
            raise _TooLarge(f"request body of {request.content_length} bytes is too large; {limit}")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _TooLarge(f"request body is too large; {limit}") from None

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
            "weight_tensor_formats": [TENSOR_FORMAT]})

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
    for path, handler in memory.routes(body_of, lambda: len(engine.running) + len(engine.waiting)):
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


class _ShuttingDown(Exception):
    """The server stops: requests still waiting are answered with HTTP 503."""


def _known(body: dict, endpoint: str, fields: tuple[str, ...]) -> None:
    unknown = [k for k in body if k not in fields]
    if unknown:
        raise RequestError(f"{endpoint}: unknown field {str(unknown[0])[:100]!r}; valid: {list(fields)}")


def _flag(body: dict, key: str) -> bool:
    return _check_type(key, body.get(key, False) if body.get(key) is not None else False, bool)


def _opt_str(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise RequestError(f"{key} must be a string or null, got {v!r}"[:200])
    return v


class ServerThread:
    """Run the server on a background thread (tests, benchmarks, a trainer that serves its
    own engine): `with ServerThread(engine) as srv: ... srv.url`."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, model_path: str | None = None,
                 sampling_mask_max_tokens: int | None = 4096,
                 max_body_bytes: int = 64 * 1024 * 1024, weight_sync_timeout_s: float = 600.0):
        self.app = create_app(engine, api_key=api_key, model_path=model_path,
                              sampling_mask_max_tokens=sampling_mask_max_tokens,
                              max_body_bytes=max_body_bytes,
                              weight_sync_timeout_s=weight_sync_timeout_s)
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
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=_SHUTDOWN_S)
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
               weight_sync_timeout_s: float = 600.0) -> None:
    """Serve until interrupted (what `lockstep serve` runs)."""
    app = create_app(engine, api_key=api_key, model_path=model_path,
                     sampling_mask_max_tokens=sampling_mask_max_tokens,
                     max_body_bytes=max_body_bytes, weight_sync_timeout_s=weight_sync_timeout_s)
    web.run_app(app, host=host, port=port, access_log=None, shutdown_timeout=_SHUTDOWN_S,
                print=lambda s: print(s, flush=True))
