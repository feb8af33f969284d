"""One rollout interface over two backends: the in-process engine and any SGLang-compatible
HTTP server (real SGLang launched with --enable-return-routed-experts, or `lockstep serve`).

Both return `GenerationResult`s (prompt-major, `n` samples per request in order), with routes
as compact [P+R-1, L_moe, K] tensors checked against the sample's length, full-vocabulary
log-probs after temperature, the finish reason and the weight version that produced them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import aiohttp
import torch

from ..moe.config import ModelConfig
from ..moe.model import MoEModel
from ..replay.codec import (ENCODING_COMPACT, ENCODING_INT32, ENCODING_REQUEST_FIELD,
                            decode_routes, routes_encoding)
from ..replay.gates import GATES_REQUEST_FIELD, GATES_RESPONSE_FIELD, decode_gates
from ..replay.indexer_codec import (INDEXER_ENCODING_FIELD, INDEXER_META_FIELD,
                                    INDEXER_REQUEST_FIELD, INDEXER_START_FIELD, decode_indexer,
                                    indexer_encoding, int32_rows, wire_layer_sources)
from ..replay.trace import RouteError
from .engine import Engine
from .types import EngineDown, GenerateRequest, GenerationResult, RolloutError
from .weight_push import WeightPush
from .weight_sync import TENSOR_FORMAT, DistributedWeightSync, tensor_payload


class RolloutBackend(ABC):
    """What the trainer needs from a rollout engine."""

    weight_version: str

    @abstractmethod
    async def agenerate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        """Run requests; results prompt-major, sample index minor."""

    @abstractmethod
    async def aupdate_weights(self, source: Any, weight_version: str | None = None) -> str:
        """Load new weights; returns the weight version results will report."""

    def generate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        return asyncio.run(self.agenerate(requests))

    def update_weights(self, source: Any, weight_version: str | None = None) -> str:
        return asyncio.run(self.aupdate_weights(source, weight_version))

    def close(self) -> None:
        """Release what the backend holds (worker processes, placement); no-op by default."""

    def counters(self) -> dict[str, float]:
        """Running totals the loop logs with each step's metrics (none by default)."""
        return {}

    def release_trajectories(self, trajectories: list[str]) -> None:
        """Multi-turn trajectories that ended (a fleet forgets their engine; rollout/pins.py);
        nothing to do for one engine."""


def _aborted(item: Any) -> bool:
    """A /generate answer whose sample was aborted (finish_reason type 'abort')."""
    meta = item.get("meta_info") if isinstance(item, dict) else None
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    return isinstance(finish, dict) and finish.get("type") == "abort"


def as_source(source: Any) -> Any:
    """An iterable of weight buckets as one dict of HF-named tensors; anything else as is."""
    if isinstance(source, (dict, str, Path, MoEModel)):
        return source
    return {name: t for bucket in source for name, t in bucket}


class LocalBackend(RolloutBackend):
    """The embedded engine in this process (the default on one machine)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version

    def generate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        return self.engine.generate(requests)

    async def agenerate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        return self.engine.generate(requests)

    def update_weights(self, source: Any, weight_version: str | None = None) -> str:
        """`source`: a model, a state dict (HF or native names), an HF folder, or an
        iterable of weight buckets (the engine validates the whole set, then swaps; the
        buckets' tensors are views of the actor's, so collecting them copies nothing)."""
        return self.engine.update_weights(as_source(source), weight_version)

    async def aupdate_weights(self, source: Any, weight_version: str | None = None) -> str:
        return self.update_weights(source, weight_version)


class HTTPBackend(RolloutBackend):
    """Async client for an SGLang-compatible `/generate` server.

    Each request goes out as its own HTTP call (at most `max_concurrency` in flight) so the
    server batches them continuously. Only a connection that was never made (refused, host
    unreachable: `aiohttp.ClientConnectorError`) is retried, with exponential backoff
    (`retries` times): the server cannot have seen the request. A connection lost after the
    request went out is not retried, since the server may have acted on it (a second
    `/generate` with the same rid is refused as "already running"; a weight update is not
    idempotent); neither are timeouts (the server may still be working) or HTTP errors (the
    request is wrong). With `compact_routes` the client asks for lockstep's compact route
    encoding; a real SGLang server ignores the field and sends int32, which is decoded as well.

    Sampling-mask requests follow what SGLang 0.5.23 accepts (REFERENCE.md): top_k must be
    finite and at most the server's `--sampling-mask-max-tokens` (`sampling_mask_max_tokens`),
    so top_k=-1 is sent as the vocabulary size when that fits (the same distribution) and
    refused before sending otherwise; and an n > 1 request is sent as n single-sample requests
    with seeds seed + j (SGLang fails n > 1 with the mask), regrouped in order, which gives
    the engine's n-sample results exactly.

    A request with a sample that comes back with `finish_reason: abort` (an /abort_request
    on the server) is sent again under a fresh rid, at most `abort_retries` times (then a
    RolloutError), as the fleet resends it: aborted samples never reach the loss;
    `aborted_resent` counts the resends (`counters()`: the `rollout/aborted_resent` metric).

    Every response must carry the `weight_version` that produced it. After `update_weights`
    the client expects exactly the version it pushed: results of any other version are
    refused naming both, as are weight updates the server reports under another version.

    `weight_sync` says how `update_weights` moves weights (docs/rollout.md, "Weight sync"):
    `disk` saves an HF folder under `weights_dir` and calls /update_weights_from_disk;
    `distributed` broadcasts buckets over a process group the server joins
    (/init_weights_update_group + /update_weights_from_distributed; `rollout.weight_sync`);
    `tensor` POSTs each bucket as base64 safetensors to /update_weights_from_tensor (lockstep
    serve only: refused for servers that do not list the format); `auto` uses `distributed`
    and falls back to `disk` for good (said once) when joining fails or a push is refused
    before any weight changed. Pushes run inside SGLang's /begin_weight_update ...
    /end_weight_update session.
    """

    WEIGHT_SYNC = ("auto", "distributed", "tensor", "disk")
    GENERATE_PATH = "/generate"
    VERSION_PATH = "/model_info"  # what reports the server's weight version
    SYNC_CLS = DistributedWeightSync  # the trainer's end of the server's weight-update group

    def __init__(self, url: str, model_cfg: ModelConfig, api_key: str | None = None,
                 max_concurrency: int = 64, timeout_s: float = 600.0, retries: int = 3,
                 backoff_s: float = 0.5, compact_routes: bool = True,
                 weights_dir: str | Path | None = None, sampling_mask_max_tokens: int = 4096,
                 fan_out_samples: bool = False, weight_sync: str = "disk",
                 bucket_bytes: int = 256 << 20, log=None, abort_retries: int = 3,
                 push_marker: str | Path | None = None, launched: bool = False):
        if weight_sync not in self.WEIGHT_SYNC:
            raise ValueError(f"HTTPBackend: weight_sync={weight_sync!r}; valid: "
                             f"{list(self.WEIGHT_SYNC)}")
        self.bucket_bytes = bucket_bytes
        self.abort_retries = abort_retries
        # a server this process launched (a fleet's engine): only our own pushes pause it
        self.launched = launched
        self.aborted_resent = 0  # requests sent again because a sample came back aborted
        self._log = log or (lambda s: None)
        self.url = url.rstrip("/")
        self.cfg = model_cfg
        self.api_key = api_key
        self.max_concurrency = max_concurrency
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.retries, self.backoff_s = retries, backoff_s
        self.compact_routes = compact_routes
        self.sampling_mask_max_tokens = sampling_mask_max_tokens
        # SGLang with --enable-deterministic-inference gives all n samples of one request the
        # same seed (identical samples): fan every n > 1 request out, not only mask requests.
        self.fan_out_samples = fan_out_samples
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.weight_version = "unknown"  # until a response or update_weights names it
        self._pushed_version: str | None = None  # what results must carry after update_weights
        self.encodings_seen: dict[str, int] = {ENCODING_INT32: 0, ENCODING_COMPACT: 0}
        self.route_bytes_received = 0
        # how update_weights moves weights (rollout/weight_push.py: the one place for one
        # server and for fleets)
        self.pusher = WeightPush(model_cfg, weight_sync, self.SYNC_CLS,
                                 weights_dir=self.weights_dir, api_key=api_key,
                                 timeout_s=timeout_s, bucket_bytes=bucket_bytes, log=self._log,
                                 marker=push_marker)

    # -- transport ----------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _post(self, session: aiohttp.ClientSession, path: str, body: dict) -> Any:
        for attempt in range(self.retries + 1):
            try:
                async with session.post(self.url + path, json=body, headers=self._headers()) as r:
                    text = await r.text()
                    if r.status != 200:  # 502/503/504: the server is going away or overloaded
                        raise (EngineDown if r.status in (502, 503, 504) else RolloutError)(
                            f"POST {self.url}{path} -> HTTP {r.status}: {text[:500]}")
                    return await r.json(content_type=None) if text else None
            except asyncio.TimeoutError:
                raise EngineDown(f"POST {self.url}{path}: no answer within "
                                   f"{self.timeout.total}s (not retried)") from None
            except aiohttp.ClientConnectorError as e:  # never connected: safe to send again
                if attempt == self.retries:
                    raise EngineDown(f"POST {self.url}{path}: connection failed after "
                                       f"{self.retries + 1} attempts: {e!r}") from e
                await asyncio.sleep(self.backoff_s * 2 ** attempt * (0.5 + random.random()))
            except aiohttp.ClientConnectionError as e:  # connected: the server may have acted
                raise EngineDown(f"POST {self.url}{path}: connection lost after the request "
                                   f"was sent: {e!r} (not retried: the server may have acted "
                                   f"on it)") from e

    async def get(self, path: str) -> Any:
        async with aiohttp.ClientSession(timeout=self.timeout) as s:
            async with s.get(self.url + path, headers=self._headers()) as r:
                if r.status != 200:
                    raise RolloutError(f"GET {path} -> HTTP {r.status}: {(await r.text())[:500]}")
                text = await r.text()
                return await r.json(content_type=None) if text else None

    # -- generate -----------------------------------------------------------------------------
    def _wire_sampling(self, req: GenerateRequest) -> dict:
        """sampling_params as SGLang accepts them; a finite top_k for sampling-mask requests."""
        sp = req.sampling.to_sglang()
        if not req.return_sampling_mask or req.sampling.greedy or sp["top_k"] == 1:
            return sp
        V, cap = self.cfg.vocab_size, self.sampling_mask_max_tokens
        if sp["top_k"] == -1 and V <= cap:
            sp["top_k"] = V  # keeps every token: the same distribution as -1
        if not 1 < sp["top_k"] <= cap:
            raise RolloutError(
                f"return_sampling_mask with top_k={req.sampling.top_k} (vocabulary {V}): SGLang "
                f"needs a finite top_k <= sampling_mask_max_tokens={cap} "
                f"(--sampling-mask-max-tokens); set rollout.top_k <= {cap}")
        return sp

    def _fan_out(self, req: GenerateRequest) -> list[GenerateRequest]:
        """The n single-sample requests an n > 1 sampling-mask request is sent as."""
        base = req.rid or uuid.uuid4().hex
        sp = req.sampling
        return [dataclasses.replace(req, rid=f"{base}-{j}", sampling=dataclasses.replace(
            sp, n=1, seed=None if sp.seed is None else sp.seed + j)) for j in range(sp.n)]

    def request_body(self, req: GenerateRequest) -> dict:
        body: dict[str, Any] = {
            "input_ids": req.input_ids, "sampling_params": self._wire_sampling(req),
            "rid": req.rid or uuid.uuid4().hex,
            "return_logprob": True, "logprob_start_len": 0 if req.return_input_logprobs else -1,
            "top_logprobs_num": req.top_logprobs_num,
            "return_routed_experts": req.return_routes, "routed_experts_start_len": req.routes_start if req.return_routes else 0,
        }
        if req.return_sampling_mask:
            body["return_sampling_mask"] = True
            body["sampling_logprobs_mode"] = "support" if req.return_support_logprobs else "selected"
        if self.compact_routes and req.return_routes:
            body[ENCODING_REQUEST_FIELD] = ENCODING_COMPACT
        if req.return_gates:
            body[GATES_REQUEST_FIELD] = True
        if req.return_indexer_topk:
            body[INDEXER_REQUEST_FIELD] = True
            if req.indexer_start:
                body[INDEXER_START_FIELD] = req.indexer_start
            if self.compact_routes:
                body[INDEXER_ENCODING_FIELD] = "compact"
        return body

    async def prepare(self) -> None:
        """What must be known of the server before `request_body` (nothing for SGLang's wire;
        vLLM's client reads its /server_info once)."""

    async def agenerate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        sem = asyncio.Semaphore(self.max_concurrency)
        conn = aiohttp.TCPConnector(limit=self.max_concurrency)
        async with aiohttp.ClientSession(timeout=self.timeout, connector=conn) as session:
            async def one(i: int, req: GenerateRequest, j0: int = 0) -> list[GenerationResult]:
                if req.sampling.n > 1 and (req.return_sampling_mask or self.fan_out_samples):
                    subs = self._fan_out(req)
                    parts = await asyncio.gather(*(one(i, sub, j) for j, sub in enumerate(subs)))
                    return [dataclasses.replace(r[0], index=j, rid=req.rid or r[0].rid)
                            for j, r in enumerate(parts)]
                for attempt in range(self.abort_retries + 1):
                    sent = req if attempt == 0 or req.rid is None else dataclasses.replace(
                        req, rid=f"{req.rid}-resent{attempt}")  # a rid the server has not seen
                    body = self.request_body(sent)  # refuses before sending what SGLang refuses
                    async with sem:
                        resp = await self._post(session, self.GENERATE_PATH, body)
                    items = self.items(resp)
                    if len(items) != req.sampling.n:
                        raise RolloutError(f"request {i}: asked n={req.sampling.n}, server "
                                           f"answered {len(items)} results")
                    if not any(map(self.aborted, items)):  # (an aborted one may lack routes)
                        out = [self.parse(item, sent, i, j0 + j) for j, item in enumerate(items)]
                        return out if sent is req else [dataclasses.replace(r, rid=req.rid)
                                                        for r in out]
                    self.aborted_resent += 1  # an aborted sample never reaches the loss
                raise RolloutError(f"request {i} ({req.rid}): aborted by the server "
                                   f"{self.abort_retries + 1} times (rollout requests are "
                                   f"resent at most {self.abort_retries} times)")
            per_req = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        return [res for group in per_req for res in group]

    def items(self, resp: Any) -> list:
        """The per-sample answers of one /generate response (SGLang: a list for n > 1)."""
        return resp if isinstance(resp, list) else [resp]

    def aborted(self, item: Any) -> bool:
        """Whether a per-sample answer is an aborted sample (not a finished one)."""
        return _aborted(item)

    def parse(self, item: dict, req: GenerateRequest, i: int, j: int) -> GenerationResult:
        """One SGLang response object -> GenerationResult (contract checked, sample named)."""
        who = f"request {i} sample {j}"
        try:
            meta = item["meta_info"]
            out_ids = [int(t) for t in item["output_ids"]]
            P, R = int(meta["prompt_tokens"]), int(meta["completion_tokens"])
            lp_entries = meta["output_token_logprobs"]
        except (KeyError, TypeError, ValueError) as e:
            raise RolloutError(f"{who}: response lacks {e} (is the server running with "
                               f"--skip-tokenizer-init?)") from None
        if P != len(req.input_ids) or R != len(out_ids) or len(lp_entries) != R:
            raise RolloutError(f"{who}: prompt_tokens={P} (sent {len(req.input_ids)}), "
                               f"completion_tokens={R}, {len(out_ids)} output_ids and "
                               f"{len(lp_entries)} log-probs disagree")
        if [int(e[1]) for e in lp_entries] != out_ids:
            raise RolloutError(f"{who}: output_token_logprobs ids differ from output_ids")
        routes = None
        if req.return_routes:
            payload = meta.get("routed_experts")
            if payload is None:
                raise RolloutError(f"{who}: no routed_experts (launch SGLang with "
                                   f"--enable-return-routed-experts)")
            c, start = self.cfg, req.routes_start
            try:
                trace = decode_routes(payload, P + R - 1 - start, c.num_hidden_layers,
                                      c.moe_layer_ids, c.num_experts_per_tok, c.num_experts,
                                      start_len=start)
            except RouteError as e:
                raise RolloutError(f"{who}: {e}") from None
            self.encodings_seen[routes_encoding(payload)] += 1
            self.route_bytes_received += len(payload)
            routes = trace.ids_NLK
        gates = (self._gates(meta, req, P + R - 1 - req.routes_start, who) if req.return_gates
                 else None)
        picks = self._indexer(meta, req, P + R - 1, who) if req.return_indexer_topk else None
        if meta.get("weight_version") is None:
            raise RolloutError(f"{who}: meta_info has no weight_version (the server must report "
                               f"the weights that generated each sample)")
        version = str(meta["weight_version"])
        if self._pushed_version is not None and version != self._pushed_version:
            raise RolloutError(f"{who}: generated with weight version {version!r}, expected "
                               f"{self._pushed_version!r} (pushed by update_weights)")
        self.weight_version = version
        finish = meta.get("finish_reason")
        if not isinstance(finish, dict) or "type" not in finish:
            raise RolloutError(f"{who}: finish_reason is {finish!r}, expected an object with a "
                               f"'type' (a finished sample)")
        sel = meta.get("output_token_sampling_logprobs")
        mask = meta.get("output_token_sampling_mask")
        support_lp = None
        if sel is not None and req.return_support_logprobs:
            support_lp, sel = [torch.tensor(x, dtype=torch.float32) for x in sel], None
        inp = meta.get("input_token_logprobs") if req.return_input_logprobs else None
        return GenerationResult(
            rid=req.rid or str(meta.get("id", "")), index=j, prompt_ids=list(req.input_ids),
            output_ids=out_ids,
            output_logprobs=torch.tensor([float(e[0]) for e in lp_entries], dtype=torch.float32),
            sampling_logprobs=None if sel is None else torch.tensor(sel, dtype=torch.float32),
            finish_reason=finish, weight_version=version,
            routes_NLK=routes, routes_start=req.routes_start if routes is not None else 0,
            gates_NLK=gates, indexer=picks,
            input_logprobs=None if inp is None else torch.tensor(
                [float("nan") if e[0] is None else float(e[0]) for e in inp]),
            top_logprobs=None if "output_top_logprobs" not in meta else [
                [(float(v), int(t)) for v, t, *_ in row] for row in meta["output_top_logprobs"]],
            sampling_mask=None if mask is None else [torch.tensor(m, dtype=torch.int32)
                                                     for m in mask],
            support_logprobs=support_lp)

    def _indexer(self, meta: dict, req: GenerateRequest, rows: int, who: str):
        """The indexer picks of a `return_indexer_topk` request, rows from `indexer_start`. A
        real SGLang ignores our start field and sends every row (int32): then the rows before
        the start are dropped here."""
        payload = meta.get(INDEXER_META_FIELD)
        if payload is None:
            raise RolloutError(f"{who}: no meta_info.{INDEXER_META_FIELD} (launch SGLang with "
                               f"--enable-return-indexer-topk; it captures on CUDA / NPU only)")
        c, start = self.cfg, req.indexer_start
        sources = wire_layer_sources([c.indexer_shared(i) for i in range(c.num_hidden_layers)])
        full = start > 0 and indexer_encoding(payload) == "int32" and \
            int32_rows(payload, len(sources), c.index_topk) == rows
        try:
            if full:  # every row from position 0 (SGLang's answer)
                return decode_indexer(payload, rows, sources, c.index_topk, 0).slice(start, rows)
            return decode_indexer(payload, rows - start, sources, c.index_topk, start)
        except RouteError as e:
            raise RolloutError(f"{who}: {e}") from None

    def _gates(self, meta: dict, req: GenerateRequest, rows: int, who: str) -> torch.Tensor:
        """The gate weights of a `return_gates` request (lockstep's extension, replay/gates.py);
        a server without it (real SGLang) is named as such."""
        payload = meta.get(GATES_RESPONSE_FIELD)
        if payload is None:
            raise RolloutError(f"{who}: no meta_info.{GATES_RESPONSE_FIELD}: replay.gates=engine "
                               f"needs a lockstep server (lockstep serve, or the embedded / ray "
                               f"engines); real SGLang returns expert ids only")
        try:
            return decode_gates(payload, rows, self.cfg.num_moe_layers,
                                self.cfg.num_experts_per_tok)
        except RouteError as e:
            raise RolloutError(f"{who}: {e}") from None

    # -- weights ------------------------------------------------------------------------------
    @property
    def weight_sync(self) -> str:
        """How weights move now (`auto` becomes `disk` once it fell back)."""
        return self.pusher.mode

    @property
    def last_push(self) -> dict:
        """{"mode", "bytes", "seconds", "buckets"} of the last push."""
        return self.pusher.last_push

    async def aupdate_weights(self, source: Any, weight_version: str | None = None) -> str:
        """`source`: an HF folder path the server can read; or a model, its HF-named tensors
        or an iterable of weight buckets (consumed once), sent as `weight_sync` says (class
        docstring; `WeightPush`): with `disk` first saved under `weights_dir/<version>` (a
        filesystem the server shares)."""
        if isinstance(source, (str, Path)):
            return await self._from_disk(source, weight_version)
        weight_version = str(weight_version or uuid.uuid4().hex[:8])
        await asyncio.to_thread(self.pusher.push, [self], source, weight_version)
        return self.weight_version

    async def aload_folder(self, folder: Path, weight_version: str) -> str:
        """The server loads an HF folder at `weight_version` (WeightPush's disk path)."""
        return await self._from_disk(folder, weight_version)

    def confirm_version(self, weight_version: str, what: str) -> str:
        """After a push by a group: the server must report `weight_version`; results must
        carry it from now on."""
        return self._check_version(self._get_sync(self.VERSION_PATH), weight_version, what)

    async def apush_tensor(self, buckets, weight_version: str) -> dict:
        """Each bucket as base64 safetensors (our server's safe format; real SGLang's
        formats are pickled and refused by ours), the last one flushing with the version,
        inside one weight-update session. Refused before sending for a server that does not
        say it takes safetensors (real SGLang unpickles the payload: a safetensors file
        inside a session kills its scheduler)."""
        info = await self.get("/server_info")
        formats = info.get("weight_tensor_formats") if isinstance(info, dict) else None
        if not isinstance(formats, list) or TENSOR_FORMAT not in formats:
            raise RolloutError(
                f"rollout.weight_sync=tensor: {self.url} does not list {TENSOR_FORMAT!r} in "
                f"/server_info weight_tensor_formats (real SGLang unpickles "
                f"/update_weights_from_tensor payloads; lockstep's safetensors payload would "
                f"kill its scheduler); use weight_sync 'distributed' or 'disk'")
        total, count = 0, 0
        async with aiohttp.ClientSession(timeout=self.timeout) as s:
            await self._post(s, "/begin_weight_update", {})
            pushed = False
            try:
                it = iter(buckets)
                cur = next(it, None)
                while cur is not None:
                    nxt = next(it, None)
                    body, n = tensor_payload(cur, nxt is None, weight_version)
                    resp = await self._post(s, "/update_weights_from_tensor", body)
                    if not isinstance(resp, dict) or resp.get("success") is not True:
                        raise RolloutError(f"update_weights_from_tensor (bucket {count}) "
                                           f"failed: {resp!r}"[:800])
                    total, count, cur = total + n, count + 1, nxt
                pushed = True
            finally:
                try:
                    await self._post(s, "/end_weight_update", {})
                except RolloutError:
                    if pushed:  # else the push's own error says more
                        raise
        self._check_version(await self.get("/model_info"), weight_version,
                            "update_weights_from_tensor")
        return {"mode": "tensor", "bytes": total, "buckets": count}

    def _get_sync(self, path: str) -> Any:
        return asyncio.run(self.get(path))

    def _check_version(self, info: Any, weight_version: str, what: str) -> str:
        if not isinstance(info, dict) or info.get("weight_version") is None:
            raise RolloutError(f"/model_info after {what} has no weight_version: {info!r}")
        now = str(info["weight_version"])
        if now != str(weight_version):
            raise RolloutError(f"{what}: pushed weight version {str(weight_version)!r}, the "
                               f"server reports {now!r}")
        self.weight_version = self._pushed_version = now
        return now

    def counters(self) -> dict[str, float]:
        return {"rollout/aborted_resent": float(self.aborted_resent)}

    def expect_version(self, version: str) -> None:
        """Results must carry `version` from now on: the server was brought to it by someone
        else (a fleet's push to a group of servers, or the weights it started with)."""
        self.weight_version = self._pushed_version = str(version)

    def close(self) -> None:
        """Leave the weight-update group (the server destroys its side)."""
        self.pusher.close()

    async def _from_disk(self, source, weight_version: str | None) -> str:
        body: dict[str, Any] = {"model_path": str(source), "flush_cache": True,
                                "abort_all_requests": False}
        if weight_version is not None:
            body["weight_version"] = weight_version
        async with aiohttp.ClientSession(timeout=self.timeout) as s:
            resp = await self._post(s, "/update_weights_from_disk", body)
        if not isinstance(resp, dict) or not resp.get("success"):
            raise RolloutError(f"update_weights_from_disk({source}) failed: {resp!r}")
        info = await self.get("/model_info")
        if weight_version is None:  # a folder pushed without a version: take the server's
            weight_version = info.get("weight_version") if isinstance(info, dict) else None
        return self._check_version(info, weight_version, f"update_weights_from_disk({source})")
