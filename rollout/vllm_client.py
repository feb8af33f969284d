"""Client for a real vLLM server (0.32; rollout/vllm.py launches one): `/inference/v1/generate`
for rollouts, vLLM's native weight sync for pushes. Same `GenerationResult`s, checks and
retry/abort rules as `HTTPBackend` (rollout/client.py), whose transport it reuses.

What differs from SGLang's wire, and what the client does about it (docs/rollout.md, "vLLM"):
- Request `{"request_id", "token_ids", "sampling_params": {temperature, top_p, top_k, min_p,
  max_tokens, min_tokens, stop_token_ids, ignore_eos, n, seed, logprobs, prompt_logprobs,
  routed_experts_prompt_start}}`; answer `choices[j]` with `token_ids`, `logprobs.content[t]`
  (`token_id`, `logprob`, `top_logprobs`), `routed_experts` (base64 `.npy`, uint8/uint16
  [P+R-1-start, num_hidden_layers, K]), `sampling_mask`, `weight_versions` (spans); prompt
  log-probs once per request (`prompt_logprobs`, position 0 null).
- Log-probs are `processed_logprobs` (the server's mode): those of the distribution sampled
  from. For untruncated sampling that is lockstep's `output_logprobs` (full vocabulary after
  temperature); for top-k/top-p/min-p it is the truncated, renormalised `sampling_logprobs`
  and the full-vocabulary one is not known (`output_logprobs` is NaN), so such requests must
  ask for the sampling mask (the RL loop does, `rollout.sampling_mask_replay`).
- A server with `--return-sampling-mask` refuses requests without top_k > 0 and temperature
  > 0 (HTTP 500, empty message): top_k=-1 goes out as the vocabulary size (the same
  distribution) and greedy as top_k=1 at temperature 1 (the same tokens; their log-prob is the
  support's, 0).
- A token id outside the vocabulary kills vLLM's engine (IndexError in the worker): refused
  here before sending. vLLM clamps a max_tokens that does not fit max_model_len (here too).
- Abort: vLLM names request `rid` `generate-tokens-<rid>`; `abort(rids)` sends those names
  (the plain rid silently aborts nothing). An aborted sample (`finish_reason: abort`) is sent
  again under a fresh rid and never reaches the loss.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import aiohttp
import torch

from ..moe.config import ModelConfig
from ..replay.codec import decode_vllm
from ..replay.trace import RouteError
from .client import HTTPBackend
from .types import GenerateRequest, GenerationResult, RolloutError
from .vllm_weights import VLLMWeightSync, server_config
from .weight_sync import curl_post

REQUEST_PREFIX = "generate-tokens-"
"""vLLM's name for request `rid` on /inference/v1/generate (what abort needs)."""


def detect_engine(url: str, api_key: str | None = None, timeout_s: float = 60.0) -> str:
    """`vllm` when the server at `url` answers /server_info with vLLM's `vllm_config`, else
    `sglang` (real SGLang and lockstep serve)."""
    import json
    import urllib.error
    import urllib.request
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    req = urllib.request.Request(url.rstrip("/") + "/server_info", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            info = json.loads(r.read() or b"null")
    except (OSError, ValueError) as e:  # refused, no answer within timeout_s, not JSON
        raise RolloutError(f"rollout.engine=auto: GET {url}/server_info failed or got no answer "
                           f"within {timeout_s:g}s ({e}); set rollout.engine to sglang or "
                           f"vllm") from None
    return "vllm" if isinstance(info, dict) and "vllm_config" in info else "sglang"


def paused_help(url: str, api_key: str | None) -> str:
    """Why a paused server is refused, and what a user runs."""
    return (f"{url} is paused (GET /is_paused), so it would hold every generate request: a "
            f"trainer killed between /pause and /resume leaves it so. If no other trainer is "
            f"pushing to it, resume it with `{curl_post(url, '/resume', api_key)}` (a weight "
            f"update the killed trainer left open is ended first: "
            f"`{curl_post(url, '/finish_weight_update', api_key)}`)")


class VLLMBackend(HTTPBackend):
    """`HTTPBackend` over vLLM's wire (module docstring). `weight_sync`: `auto` (default in the
    loop) and `distributed` push through vLLM's native weight transfer (/pause?mode=wait,
    /init_weight_transfer_engine once, then per push /start_weight_update, one
    /update_weights per bucket concurrent with its broadcast, /finish_weight_update with the
    version, /resume); `disk` writes an HF folder and reloads it (`reload_weights` over
    /collective_rpc, then /update_weight_version); `auto` falls back to disk for good when the
    server refuses to join or to start an update (nothing changed). A server found paused at
    first contact (a trainer killed between /pause and /resume) is refused, naming /resume,
    unless it is `launched` (a fleet's own engine)."""

    WEIGHT_SYNC = ("auto", "distributed", "disk")
    GENERATE_PATH = "/inference/v1/generate"
    VERSION_PATH = "/weight_info"
    SYNC_CLS = VLLMWeightSync

    def __init__(self, url: str, model_cfg: ModelConfig, **kw: Any):
        kw.setdefault("compact_routes", False)
        super().__init__(url, model_cfg, **kw)
        self.server: dict | None = None  # server_config(), read on first use

    # -- server ---------------------------------------------------------------------------------
    async def _server(self) -> dict:
        """The server's config, read (and checked) at first contact."""
        if self.server is None:
            server = server_config(await self.get("/server_info?config_format=json"))
            mode = server["logprobs_mode"]
            if mode != "processed_logprobs":
                raise RolloutError(
                    f"{self.url}: vLLM runs --logprobs-mode {mode}; lockstep needs "
                    f"processed_logprobs (the log-probs of the distribution sampled from)")
            # a server we launched is paused by our own pushes only (a fleet's, mid-run)
            if not self.launched and (await self.get("/is_paused") or {}).get("is_paused"):
                raise RolloutError(paused_help(self.url, self.api_key))
            self.server = server
        return self.server

    async def prepare(self) -> None:
        await self._server()

    async def agenerate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        await self._server()
        return await super().agenerate(requests)

    # -- generate ---------------------------------------------------------------------------------
    def _sampling(self, req: GenerateRequest) -> dict:
        sp, V = req.sampling, self.cfg.vocab_size
        mask_server = bool(self.server and self.server["return_sampling_mask"])
        if req.return_sampling_mask and not mask_server:
            raise RolloutError(f"{self.url}: a sampling-mask request, but the vLLM server runs "
                               f"without --return-sampling-mask")
        if sp.truncates and not sp.greedy and not req.return_sampling_mask:
            raise RolloutError(
                "vLLM reports log-probs of the truncated distribution it sampled from "
                f"(top_k={sp.top_k}, top_p={sp.top_p}, min_p={sp.min_p}); the full-vocabulary "
                "log-prob is not known: ask for the sampling mask (rollout.sampling_mask_replay)")
        if req.return_support_logprobs:
            raise RolloutError("vLLM does not return support log-probs (sampling_logprobs_mode "
                               "'support'); ask for the selected ones")
        temperature, top_k = sp.temperature, sp.top_k
        if sp.greedy:
            temperature, top_k = (1.0, 1) if mask_server else (0.0, -1)
        if top_k == -1 and mask_server:
            top_k = V  # every token: the same distribution as -1, which the server refuses
        out: dict[str, Any] = {
            "temperature": temperature, "top_p": sp.top_p, "top_k": top_k, "min_p": sp.min_p,
            "max_tokens": sp.max_new_tokens, "min_tokens": sp.min_new_tokens,
            "stop_token_ids": list(sp.stop_token_ids), "ignore_eos": sp.ignore_eos,
            "n": sp.n, "logprobs": req.top_logprobs_num}
        if sp.seed is not None:
            out["seed"] = sp.seed
        if req.return_input_logprobs:
            out["prompt_logprobs"] = 0
        if req.return_routes and req.routes_start:
            out["routed_experts_prompt_start"] = req.routes_start
        return out

    def request_body(self, req: GenerateRequest) -> dict:
        V = self.cfg.vocab_size
        bad = next((t for t in req.input_ids if not (isinstance(t, int) and 0 <= t < V)), None)
        if bad is not None:  # vLLM's engine dies on it (IndexError in the worker)
            raise RolloutError(f"request {req.rid!r}: token id {bad!r} is outside the "
                               f"vocabulary [0, {V})")
        if not 0 <= req.routes_start <= len(req.input_ids):
            raise RolloutError(f"request {req.rid!r}: routes_start={req.routes_start} is "
                               f"outside [0, {len(req.input_ids)}]")
        if req.return_gates:
            raise RolloutError("replay.gates=engine needs a lockstep server (lockstep serve, or "
                               "the embedded / ray engines); vLLM returns expert ids only")
        body: dict[str, Any] = {"token_ids": list(req.input_ids),
                                "sampling_params": self._sampling(req)}
        if req.rid:
            body["request_id"] = req.rid
        return body

    def items(self, resp: Any) -> list:
        if not isinstance(resp, dict) or not isinstance(resp.get("choices"), list):
            raise RolloutError(f"{self.url}: /inference/v1/generate answered without choices: "
                               f"{str(resp)[:300]}")
        prompt = resp.get("prompt_logprobs")
        usage = resp.get("usage") or {}
        return [{**c, "prompt_logprobs": prompt, "prompt_tokens": usage.get("prompt_tokens")}
                for c in sorted(resp["choices"], key=lambda c: c.get("index", 0))]

    def aborted(self, item: Any) -> bool:
        return isinstance(item, dict) and item.get("finish_reason") == "abort"

    def parse(self, item: dict, req: GenerateRequest, i: int, j: int) -> GenerationResult:
        who = f"request {i} sample {j}"
        try:
            out_ids = [int(t) for t in item["token_ids"]]
            P = int(item["prompt_tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise RolloutError(f"{who}: answer lacks {e}") from None
        R = len(out_ids)
        if P != len(req.input_ids):
            raise RolloutError(f"{who}: prompt_tokens={P}, sent {len(req.input_ids)}")
        content = (item.get("logprobs") or {}).get("content")
        if not isinstance(content, list) or len(content) != R:
            raise RolloutError(f"{who}: {R} token ids and "
                               f"{len(content) if isinstance(content, list) else 'no'} log-probs")
        if [int(e["token_id"]) for e in content] != out_ids:
            raise RolloutError(f"{who}: logprobs token ids differ from token_ids")
        lp = torch.tensor([float(e["logprob"]) for e in content], dtype=torch.float32)
        sp = req.sampling
        truncated = sp.truncates or sp.greedy
        mask = item.get("sampling_mask")
        if req.return_sampling_mask and (not isinstance(mask, list) or len(mask) != R):
            raise RolloutError(f"{who}: asked for the sampling mask, got {str(mask)[:80]}")
        output_lp = torch.full_like(lp, math.nan) if truncated and req.return_sampling_mask \
            else lp
        if sp.greedy and not req.return_sampling_mask and not self.server["return_sampling_mask"]:
            output_lp = lp  # greedy on a plain server: the full-vocabulary log-prob at T=1
        routes = None
        if req.return_routes:
            payload = item.get("routed_experts")
            if payload is None:
                raise RolloutError(f"{who}: no routed_experts (launch vLLM with "
                                   f"--enable-return-routed-experts)")
            c, start = self.cfg, req.routes_start
            try:
                routes = decode_vllm(payload, P + R - 1 - start, c.num_hidden_layers,
                                     c.moe_layer_ids, c.num_experts_per_tok, c.num_experts,
                                     sample=j, start_len=start).ids_NLK
            except RouteError as e:
                raise RolloutError(f"{who}: {e}") from None
            self.route_bytes_received += len(payload)
        spans = item.get("weight_versions")
        versions = {str(s.get("version")) for s in spans} if isinstance(spans, list) else set()
        if len(versions) != 1:
            raise RolloutError(f"{who}: weight_versions {spans!r}: a sample must come from one "
                               f"weight version")
        version = versions.pop()
        if self._pushed_version is not None and version != self._pushed_version:
            raise RolloutError(f"{who}: generated with weight version {version!r}, expected "
                               f"{self._pushed_version!r} (pushed by update_weights)")
        self.weight_version = version
        reason = item.get("finish_reason")
        if reason == "length":
            finish: dict[str, Any] = {"type": "length", "length": R}
        elif reason == "stop":
            finish = {"type": "stop", "matched": item.get("stop_reason")}
        else:
            raise RolloutError(f"{who}: finish_reason {reason!r} (a finished sample says length "
                               f"or stop)")
        inp = item.get("prompt_logprobs") if req.return_input_logprobs else None
        return GenerationResult(
            rid=req.rid, index=j, prompt_ids=list(req.input_ids), output_ids=out_ids,
            output_logprobs=output_lp,
            sampling_logprobs=lp if req.return_sampling_mask else None,
            finish_reason=finish, weight_version=version, routes_NLK=routes,
            routes_start=req.routes_start if routes is not None else 0,
            input_logprobs=None if inp is None else torch.tensor(
                [math.nan if e is None else float(next(iter(e.values()))["logprob"])
                 for e in inp]),
            top_logprobs=None if not req.top_logprobs_num else [
                [(float(t["logprob"]), int(t["token_id"])) for t in e["top_logprobs"]]
                for e in content],
            sampling_mask=None if not req.return_sampling_mask else [
                torch.tensor(m, dtype=torch.int32) for m in mask])

    async def abort(self, rids: list[str]) -> Any:
        """Abort requests by lockstep rid (vLLM's names, `generate-tokens-<rid>`); their samples
        come back with finish_reason abort and are resent by `agenerate`."""
        async with aiohttp.ClientSession(timeout=self.timeout) as s:
            return await self._post(s, "/inference/v1/abort_requests",
                                    {"request_ids": [REQUEST_PREFIX + r for r in rids]})

    # -- weights --------------------------------------------------------------------------------
    async def apush_tensor(self, buckets, weight_version: str) -> dict:
        raise RolloutError("rollout.weight_sync=tensor is lockstep serve's; vLLM takes "
                           "'distributed' (its native weight transfer) or 'disk'")

    async def _from_disk(self, source, weight_version: str | None) -> str:
        """Reload an HF folder (`reload_weights`, inside /pause ... /resume), then set the
        version (vLLM's reload does not take one)."""
        version = weight_version or Path(source).name
        async with aiohttp.ClientSession(timeout=self.timeout) as s:
            await self._post(s, "/pause?mode=wait", {})
            try:
                await self._post(s, "/collective_rpc", {
                    "method": "reload_weights", "kwargs": {"weights_path": str(source)}})
                await self._post(s, "/update_weight_version", {"new_version": str(version)})
            finally:
                await self._post(s, "/resume", {})
        return self._check_version(await self.get(self.VERSION_PATH), version,
                                   f"reload_weights({source})")
