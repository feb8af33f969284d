"""SGLang's `/generate` wire for `lockstep serve` (rollout/server.py): the request body parsed
and checked as SGLang 0.5.23 checks it with --skip-tokenizer-init (token ids in), and the
response built from a `GenerationResult` (docs/rollout.md lists every field)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..replay.codec import ENCODING_INT32, ENCODING_REQUEST_FIELD, ENCODINGS, encode_routes
from ..replay.gates import GATES_REQUEST_FIELD, GATES_RESPONSE_FIELD, encode_gates
from ..replay.indexer_codec import (ENCODINGS as INDEXER_ENCODINGS, INDEXER_ENCODING_FIELD,
                                    INDEXER_META_FIELD, INDEXER_REQUEST_FIELD,
                                    INDEXER_START_FIELD, encode_indexer, wire_layer_sources)
from ..replay.trace import RoutingTrace
from .engine import Engine
from .request_fields import check_generate_fields
from .types import GenerateRequest, GenerationResult, RequestError, SamplingParams

_SAMPLING_LOGPROBS_MODES = ("selected", "support")


def err(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _per_request(body: dict, key: str, i: int, n: int, default: Any) -> Any:
    """A per-request field: one value for the whole batch, or a list with one per input."""
    v = body.get(key, default)
    if isinstance(v, list):
        if len(v) != n:
            raise RequestError(f"{key} is a list of {len(v)} entries but the batch has {n} inputs")
        v = v[i]
    return default if v is None else v


def check_type(name: str, v: Any, kind: type) -> Any:
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
    encoding: str
    mask_mode: str | None
    indexer_encoding: str = "int32"


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
        rl = check_type("return_logprob", g("return_logprob", False), bool)
        start = check_type("logprob_start_len", g("logprob_start_len", -1), int)
        top_n = check_type("top_logprobs_num", g("top_logprobs_num", 0), int)
        routes = check_type("return_routed_experts", g("return_routed_experts", False), bool)
        gates = check_type(GATES_REQUEST_FIELD, g(GATES_REQUEST_FIELD, False), bool)
        if gates and not routes:
            raise RequestError(f"{GATES_REQUEST_FIELD}=true needs return_routed_experts=true "
                               f"(gate weights come with the experts they weight)")
        rstart = check_type("routed_experts_start_len", g("routed_experts_start_len", 0), int)
        picks = check_type(INDEXER_REQUEST_FIELD, g(INDEXER_REQUEST_FIELD, False), bool)
        pstart = check_type(INDEXER_START_FIELD, g(INDEXER_START_FIELD, 0), int)
        penc = g(INDEXER_ENCODING_FIELD, "int32")
        if penc not in INDEXER_ENCODINGS:
            raise RequestError(f"{INDEXER_ENCODING_FIELD}={penc!r}; valid: "
                               f"{list(INDEXER_ENCODINGS)}"[:300])
        mask = check_type("return_sampling_mask", g("return_sampling_mask", False), bool)
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
        if not 0 <= rstart <= len(p):  # SGLang 0.5.23 takes the prompt length too
            raise RequestError(f"routed_experts_start_len={rstart} must be in [0, {len(p)}] "
                               f"for a prompt of {len(p)} tokens")
        req = GenerateRequest(list(p), sp, rid=rid or uuid.uuid4().hex, return_routes=routes,
                              routes_start=rstart if routes else 0,
                              return_gates=gates,
                              return_indexer_topk=picks, indexer_start=pstart if picks else 0,
                              return_input_logprobs=rl and start >= 0,
                              top_logprobs_num=top_n if rl else 0,
                              return_sampling_mask=mask,
                              return_support_logprobs=mask and mode == "support")
        out.append(_Parsed(req, rl, start, routes, encoding, mode if mask else None, penc))
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
        elif p.logprob_start_len < 0:  # not asked: SGLang 0.5.23 sends an empty list
            meta["input_token_logprobs"] = []
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
        trace = RoutingTrace(res.routes_NLK, cfg.num_experts, start=res.routes_start)
        meta["routed_experts"] = encode_routes(trace, p.encoding, cfg.num_hidden_layers,
                                               cfg.moe_layer_ids)
        if p.req.return_gates:  # lockstep's extension (replay/gates.py)
            meta[GATES_RESPONSE_FIELD] = (None if res.gates_NLK is None else
                                          encode_gates(res.gates_NLK))
    if p.req.return_indexer_topk:  # SGLang's field (replay/indexer_codec.py)
        sources = wire_layer_sources([cfg.indexer_shared(i) for i in range(cfg.num_hidden_layers)])
        meta[INDEXER_META_FIELD] = None if res.indexer is None else \
            encode_indexer(res.indexer, p.indexer_encoding, sources)
    return {"output_ids": res.output_ids, "meta_info": meta}


