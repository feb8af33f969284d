"""Embedded rollout engine: continuous batching over the model's KV cache, recording per token
the sampled id, its log-probs and the experts it was routed to.

Shape legend: S cache slots (one running sequence each), M slot length (prompt + generated),
B running rows this step, T prompt time, L MoE layers, K top-k, V vocabulary, J stop ids.

How a request flows: `add_request` validates and queues it. Each `step()` first admits
queued requests while slots are free (one prefill forward for all of them; the prompt is
prefilled once and its KV copied to the other n-1 slots; the first token of every sample is
drawn from the prefill logits), then runs one decode forward for every running sequence
(so an admitted request joins the running batch at once, and a finished one leaves at the
end of the step that finished it). Routes come from the forward that runs anyway: prompt
rows from the prefill, each generated token's row from the decode step that feeds it; the
last generated token is never fed, so a sample has P+R-1 rows (the DESIGN contract).

Per-step work is a fixed set of tensor ops on preallocated per-slot buffers (tokens,
log-probs, routes as uint8/uint16); Python touches a sequence only when it starts or ends.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from ..moe.checkpoint import (check_tensors, hf_state_dict, load_hf, load_hf_state_dict,
                              read_hf_state_dict)
from .decode import cached_forward_step, decode_step, make_decode_weights
from .engine_config import DTYPES, EngineConfig
from ..kernels.device import resolve_device
from ..kernels.dtypes import FP8, base_precision
from .mismatch import logit_noise, router_noise
from ..moe.cache import allocate_cache
from ..moe.model import MoEModel
from ..moe.sizes import check_fits, kv_cache_bytes
from ..replay.indexer import IndexerTrace
from .sampling import RowUniforms, SamplingTensors, sample
from .types import GenerateRequest, GenerationResult, RequestError

@dataclass
class _Seq:
    """Host-side record of one running sample (touched only at start and finish)."""

    req: GenerateRequest
    index: int
    slot: int
    prompt_len: int
    input_logprobs: torch.Tensor | None = None
    input_top_logprobs: list | None = None
    top_logprobs: list | None = None
    sampling_mask: list | None = None
    support_logprobs: list | None = None


class Engine:
    """Batched generation with exact route and log-prob capture. Owns (and casts) `model`."""

    def __init__(self, model: MoEModel, cfg: EngineConfig | None = None,
                 weight_version: str = "0"):
        self.cfg = cfg = cfg or EngineConfig()
        mcfg = model.cfg
        self.device = dev = resolve_device(cfg.device, "EngineConfig.device")
        self.model = model.eval().requires_grad_(False)
        dtype = DTYPES[base_precision(cfg.dtype)]
        self.model.set_precision(dtype, router_dtype=DTYPES.get(cfg.router_dtype),
                                 lm_head_dtype=DTYPES.get(cfg.lm_head_dtype), fp8=cfg.dtype == FP8)
        if cfg.exact:
            self.model.set_exact(True)
        self.model.to(dev)
        self.weight_version = weight_version
        self._decode_weights = make_decode_weights(self.model)
        self.vocab_size = mcfg.vocab_size
        self.max_len = cfg.max_len or mcfg.max_position_embeddings
        if self.max_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_len={self.max_len} exceeds the model's "
                             f"max_position_embeddings={mcfg.max_position_embeddings}")
        S, M, L, K = cfg.max_running, self.max_len, mcfg.num_moe_layers, mcfg.num_experts_per_tok
        # Every per-slot buffer lives on the engine's device; the host keeps only Python
        # bookkeeping (which slot runs which request).
        buffers = kv_cache_bytes(mcfg, S, M, dtype) + S * M * (L * K * 2 + 16)
        check_fits(f"the engine's KV cache and sequence buffers ({S} slots x max_len {M} "
                   f"tokens x {mcfg.num_hidden_layers} layers)", buffers, dev,
                   "lower the engine's max_len (`lockstep serve --max-len`; it defaults to the "
                   "model's max_position_embeddings) or its max_running")
        self.cache = allocate_cache(mcfg, S, M, dtype=dtype, device=dev)
        # Linear-attention states are those after a row's last token: prefill rows of one
        # prompt length at a time (no right padding).
        self._prefill_by_length = bool(mcfg.linear_layer_ids)
        # uint16 has no index_put on CPU: store int16 bits and view as uint16 on the way out.
        self.route_dtype = torch.uint8 if mcfg.num_experts <= 256 else torch.int16
        self.routes_SMLK = torch.zeros(S, M, L, K, dtype=self.route_dtype, device=dev)
        self.gates_SMLK: torch.Tensor | None = None  # made by the first return_gates request
        # made by the first return_indexer_topk request (DSA families)
        self.indexer_SMLK: torch.Tensor | None = None
        self.tokens_SM = torch.zeros(S, M, dtype=torch.long, device=dev)      # generated ids
        self.logprobs_SM = torch.zeros(S, M, dtype=torch.float32, device=dev)
        self.sel_logprobs_SM = torch.zeros(S, M, dtype=torch.float32, device=dev)
        self.gen_S = torch.zeros(S, dtype=torch.long, device=dev)  # tokens generated so far
        self.prompt_len_S = torch.zeros(S, dtype=torch.long, device=dev)
        self.max_new_S = torch.zeros(S, dtype=torch.long, device=dev)
        self.min_new_S = torch.zeros(S, dtype=torch.long, device=dev)
        self.stop_SJ = torch.full((S, 1), -1, dtype=torch.long, device=dev)  # -1 = no stop id
        self.params_S: list[tuple] = [(1.0, -1, 1.0, 0.0)] * S    # temperature, top_k, top_p, min_p
        self.uniforms = RowUniforms(S, device=dev)
        self.noise_key_S = torch.zeros(S, dtype=torch.long, device=dev)  # sample seeds
        self._seed_rng = random.Random(cfg.seed)
        self.free_slots = list(range(S - 1, -1, -1))
        self.running: dict[int, _Seq] = {}                        # slot -> sequence
        self.waiting: list[GenerateRequest] = []
        self._active_B: torch.Tensor | None = None                # rebuilt when running changes
        self._rid_counter = 0
        self._live: dict[str, int] = {}                           # rid -> samples not finished

    @classmethod
    def from_hf(cls, folder: str | Path, cfg: EngineConfig | None = None,
                weight_version: str = "0") -> "Engine":
        return cls(load_hf(folder), cfg, weight_version)

    @classmethod
    def from_model(cls, model: MoEModel, cfg: EngineConfig | None = None,
                   weight_version: str = "0") -> "Engine":
        """An engine over a private copy of `model` (the trainer keeps its own)."""
        return cls(copy.deepcopy(model), cfg, weight_version)

    # -- requests -------------------------------------------------------------------------
    def validate(self, req: GenerateRequest) -> None:
        """Raise RequestError naming the problem; the engine state is untouched."""
        ids, V = req.input_ids, self.vocab_size
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids")
        bad = [(i, t) for i, t in enumerate(ids)
               if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V]
        if bad:
            i, t = bad[0]
            raise RequestError(f"input_ids[{i}] = {t!r} is outside the vocabulary [0, {V})"
                               + (f" ({len(bad)} such ids)" if len(bad) > 1 else ""))
        sp = req.sampling
        sp.validate(vocab_size=V)
        if len(ids) >= self.max_len:
            raise RequestError(f"prompt of {len(ids)} tokens is too long: the engine's max_len="
                               f"{self.max_len} (prompt + generated tokens) leaves no room")
        if sp.n > self.cfg.max_running:
            raise RequestError(f"n={sp.n} exceeds the engine's max_running={self.cfg.max_running}")
        if not (isinstance(req.top_logprobs_num, int) and 0 <= req.top_logprobs_num <= V):
            raise RequestError(f"top_logprobs_num must be in [0, {V}], got {req.top_logprobs_num!r}")
        s, top = req.routes_start, len(ids) - (sp.max_new_tokens == 0)  # rows end at P+R-1
        if not (isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= top):
            raise RequestError(f"routes_start (routed_experts_start_len)={s!r} must be in "
                               f"[0, {top}] for a prompt of {len(ids)} tokens and "
                               f"max_new_tokens={sp.max_new_tokens}")
        if req.return_indexer_topk:
            cfg = self.model.cfg
            if not cfg.is_dsa:
                raise RequestError(f"return_indexer_topk: model_type {cfg.model_type} has no "
                                   f"lightning indexer (DSA families: deepseek_v32, "
                                   f"glm_moe_dsa)")
            s = req.indexer_start
            if not (isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= top):
                raise RequestError(f"indexer_start (lockstep_indexer_topk_start_len)={s!r} must "
                                   f"be in [0, {top}] for a prompt of {len(ids)} tokens")
        if req.return_gates and not (req.return_routes and self.cfg.capture_routes):
            raise RequestError("return_gates needs the routes too (return_routes, and an engine "
                               "with capture_routes)")

    def _allocate_gates(self) -> None:
        """The per-slot gate-weight buffer (compute dtype), made once a request asks for gates;
        from then on every step records them (one more indexed write)."""
        S, M = self.routes_SMLK.shape[:2]
        L, K = self.routes_SMLK.shape[2:]
        dtype = DTYPES[self.cfg.dtype]
        check_fits(f"the engine's gate-weight buffer ({S} slots x max_len {M} x {L} MoE layers "
                   f"x top-{K})", S * M * L * K * dtype.itemsize, self.device,
                   "lower the engine's max_len or max_running")
        self.gates_SMLK = torch.zeros(S, M, L, K, dtype=dtype, device=self.device)

    def _allocate_indexer(self) -> None:
        """The per-slot indexer-pick buffer (int16 when positions fit), made once a request
        asks for picks; from then on every step records them."""
        S, M = self.routes_SMLK.shape[:2]
        cfg = self.model.cfg
        L, K = cfg.num_indexer_layers, cfg.index_topk
        dtype = torch.int16 if M <= 32767 else torch.int32
        check_fits(f"the engine's indexer-pick buffer ({S} slots x max_len {M} x {L} indexer "
                   f"layers x index_topk {K})", S * M * L * K * dtype.itemsize, self.device,
                   "lower the engine's max_len or max_running")
        self.indexer_SMLK = torch.full((S, M, L, K), -1, dtype=dtype, device=self.device)

    def add_request(self, req: GenerateRequest) -> str:
        """Queue a request; returns its rid (assigned when empty)."""
        self.validate(req)
        if not req.rid:
            self._rid_counter += 1
            req.rid = f"req-{self._rid_counter}"
        if req.rid in self._live:
            raise RequestError(f"rid {req.rid!r} is already queued or running")
        if req.return_gates and self.gates_SMLK is None:
            self._allocate_gates()
        if req.return_indexer_topk and self.indexer_SMLK is None:
            self._allocate_indexer()
        self._live[req.rid] = req.sampling.n
        self.waiting.append(req)
        return req.rid

    def abort(self, rid: str | None = None) -> list[GenerationResult]:
        """Finish a request now, queued or running (rid None: everything), as SGLang does:
        every sample gets a result with finish_reason `abort` (a queued one with no output
        tokens), so whoever waits on it is answered, and its rid is free again."""
        reason = {"type": "abort", "message": "aborted by request"}
        queued = [r for r in self.waiting if rid is None or r.rid == rid]
        self.waiting = [r for r in self.waiting if not (rid is None or r.rid == rid)]
        out = [self._aborted_in_queue(r, j, reason) for r in queued for j in range(r.sampling.n)]
        for r in queued:
            self._live.pop(r.rid, None)
        hit = [s for s in self.running.values() if rid is None or s.req.rid == rid]
        return out + [self._finish(s, reason) for s in hit]

    def _aborted_in_queue(self, req: GenerateRequest, index: int, reason: dict) -> GenerationResult:
        empty = torch.zeros(0, dtype=torch.float32, device="cpu")  # a result: host side
        return GenerationResult(
            rid=req.rid, index=index, prompt_ids=list(req.input_ids), output_ids=[],
            output_logprobs=empty, sampling_logprobs=empty.clone(), finish_reason=dict(reason),
            weight_version=self.weight_version,
            sampling_mask=[] if req.return_sampling_mask else None,
            support_logprobs=[] if req.return_support_logprobs else None)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        """Run the given requests to completion; results in request order, then sample index."""
        for r in requests:
            self.validate(r)
        for r in requests:
            self.add_request(r)
        want = {(r.rid, j) for r in requests for j in range(r.sampling.n)}
        done: dict[tuple[str, int], GenerationResult] = {}
        while not want <= done.keys():
            for res in self.step():
                done[(res.rid, res.index)] = res
        return [done[(r.rid, j)] for r in requests for j in range(r.sampling.n)]

    def set_mismatch(self, router_noise: float | None = None,
                     logprob_noise: float | None = None) -> None:
        """Change the injected noise (rollout/mismatch.py) for the requests admitted from now."""
        for name, v in (("router_noise", router_noise), ("logprob_noise", logprob_noise)):
            if v is not None:
                if not v >= 0:
                    raise ValueError(f"{name}={v} must be >= 0")
                setattr(self.cfg, name, float(v))

    # -- weights ----------------------------------------------------------------------------
    def update_weights(self, source: dict | str | Path | MoEModel,
                       weight_version: str | None = None) -> str:
        """Copy new weights in place (cast to the engine's dtypes). `source` is an HF folder,
        an HF-named or native state dict, or a model. Validate, then swap: every tensor is
        read and checked first, and a bad source (CheckpointError naming the tensor) leaves
        the weights and the version as they were. Sequences still running would continue
        with the new weights (the server drains them first, as SGLang does, so that no sample
        mixes versions); returns the new weight version."""
        return self.swap_weights(self.prepare_weights(source), weight_version)

    def prepare_weights(self, source: dict | str | Path | MoEModel) -> dict:
        """Read and validate new weights without touching the engine (any thread may call
        it: the server reads a folder off the engine thread, then swaps on it)."""
        if isinstance(source, MoEModel):
            source = source.state_dict()
        elif isinstance(source, (str, Path)):
            source = read_hf_state_dict(source)
        if any(k.startswith("model.") for k in source):
            targets = hf_state_dict(self.model)
            if self.model.lm_head is None:
                source = {k: v for k, v in source.items() if k != "lm_head.weight"}
        else:
            targets = self.model.state_dict()
        check_tensors(targets, source)
        return source

    @torch.no_grad()
    def swap_weights(self, state_dict: dict, weight_version: str | None = None) -> str:
        """Copy a state dict that `prepare_weights` returned; sets the new version."""
        if any(k.startswith("model.") for k in state_dict):
            load_hf_state_dict(self.model, state_dict)
        else:
            self.model.load_state_dict(state_dict, strict=True)
        self._decode_weights = make_decode_weights(self.model)
        if weight_version is None:
            weight_version = str(int(self.weight_version) + 1) \
                if self.weight_version.isdigit() else self.weight_version + "+1"
        self.weight_version = str(weight_version)
        return self.weight_version

    # -- the loop ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, admit: bool = True) -> list[GenerationResult]:
        """Admit what fits (prefill + first token), then decode one token for every running
        sequence. Returns the samples that finished in this step. `admit=False` only decodes
        (a server draining its running samples before a weight swap)."""
        finished = self._admit() if admit else []
        if self.running:
            finished += self._decode()
        return finished

    def _admit(self) -> list[GenerationResult]:
        batch: list[GenerateRequest] = []
        free, width = len(self.free_slots), 0
        while self.waiting and self.waiting[0].sampling.n <= free:
            req = self.waiting[0]
            new_width = max(width, len(req.input_ids))
            if batch and new_width * (len(batch) + 1) > self.cfg.max_prefill_tokens:
                break
            batch.append(self.waiting.pop(0))
            free -= req.sampling.n
            width = new_width
        if not batch:
            return []
        if not self._prefill_by_length:
            return self._prefill(batch)
        groups: dict[int, list[GenerateRequest]] = {}
        for r in batch:
            groups.setdefault(len(r.input_ids), []).append(r)
        return [res for group in groups.values() for res in self._prefill(group)]

    def _prefill(self, reqs: list[GenerateRequest]) -> list[GenerationResult]:
        Bp, T, dev = len(reqs), max(len(r.input_ids) for r in reqs), self.device
        # one host-to-device copy of the padded prompts
        ids_BT = torch.tensor([r.input_ids + [0] * (T - len(r.input_ids)) for r in reqs],
                              dtype=torch.long, device=dev)
        seqs: list[_Seq] = []
        for r in reqs:
            sp = r.sampling
            for j in range(sp.n):
                slot = self.free_slots.pop()
                seqs.append(_Seq(r, j, slot, len(r.input_ids)))
                seed = (sp.seed + j) if sp.seed is not None else self._seed_rng.getrandbits(63)
                self.uniforms.assign(slot, seed)
                self.noise_key_S[slot] = seed
                self._init_slot(slot, r)
        first_b = [next(s.slot for s in seqs if s.req is r) for r in reqs]
        first = torch.tensor(first_b, device=dev)
        noise = None
        if self.cfg.router_noise > 0:  # the prompt's noise: keyed by its first sample
            mcfg = self.model.cfg
            noise = router_noise(self.noise_key_S[first], torch.arange(T, device=dev).expand(
                Bp, T), mcfg.num_moe_layers, mcfg.num_experts, self.cfg.router_noise)
        out = self.model(ids_BT, kv_cache=self.cache, cache_slots_B=first, compute_logits=False,
                         router_noise_BTLE=noise)
        last_B = torch.tensor([len(r.input_ids) - 1 for r in reqs], device=dev)
        logits_BV = self.model.logits(out.hidden_BTD[torch.arange(Bp, device=dev), last_B])
        row_of = {id(r): b for b, r in enumerate(reqs)}
        prompt_lp: dict[int, tuple] = {}
        for s in seqs:
            b, P = row_of[id(s.req)], s.prompt_len
            if s.slot != first_b[b]:
                self.cache.copy_slot(first_b[b], s.slot, P)
            if self.cfg.capture_routes and s.req.return_routes:
                self.routes_SMLK[s.slot, :P] = out.routes_BTLK[b, :P].to(self.route_dtype)
            if self.gates_SMLK is not None and s.req.return_gates:
                self.gates_SMLK[s.slot, :P] = out.gates_BTLK[b, :P]
            if self.indexer_SMLK is not None and s.req.return_indexer_topk:
                self.indexer_SMLK[s.slot, :P] = out.indexer_BTLK[b, :P].to(self.indexer_SMLK.dtype)
            if s.req.return_input_logprobs:  # same prompt for all n samples: computed once
                if id(s.req) not in prompt_lp:
                    prompt_lp[id(s.req)] = self._input_logprobs(out.hidden_BTD[b, :P], s.req)
                s.input_logprobs, s.input_top_logprobs = prompt_lp[id(s.req)]
            self.running[s.slot] = s
        self._active_B = None
        # max_new_tokens = 0: nothing to sample; P-1 prompt rows of routes.
        finished = [self._finish(s, {"type": "length", "length": 0})
                    for s in seqs if s.req.sampling.max_new_tokens == 0]
        seqs = [s for s in seqs if s.req.sampling.max_new_tokens > 0]
        if not seqs:
            return finished
        rows = torch.tensor([row_of[id(s.req)] for s in seqs], device=dev)
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        return finished + self._sample_and_record(logits_BV[rows], slots, seqs)

    def _decode(self) -> list[GenerationResult]:
        active_B = self._active()
        gen_B = self.gen_S[active_B]
        pos_B = self.prompt_len_S[active_B] + gen_B - 1
        last_B = self.tokens_SM[active_B, gen_B - 1]
        noise = None
        if self.cfg.router_noise > 0:
            mcfg = self.model.cfg
            noise = router_noise(self.noise_key_S[active_B], pos_B[:, None], mcfg.num_moe_layers,
                                 mcfg.num_experts, self.cfg.router_noise)[:, 0]
        picks_BLK = None
        if self._decode_weights is None:  # a family without the fused step (rollout/decode.py)
            logits_BV, routes_BLK, gates_BLK, picks_BLK = cached_forward_step(
                self.model, last_B, pos_B, self.cache, active_B, noise)
        else:
            if not self._decode_weights.current(self.model):  # written outside update_weights
                self._decode_weights = make_decode_weights(self.model)
            logits_BV, routes_BLK, gates_BLK = decode_step(self.model, self._decode_weights,
                                                           last_B, pos_B, self.cache, active_B,
                                                           noise)
        if self.cfg.capture_routes:
            self.capture_step(active_B, pos_B, routes_BLK)
            if self.gates_SMLK is not None:
                self.gates_SMLK[active_B, pos_B] = gates_BLK
        if self.indexer_SMLK is not None:
            self.indexer_SMLK[active_B, pos_B] = picks_BLK.to(self.indexer_SMLK.dtype)
        return self._sample_and_record(logits_BV, active_B, None)

    def capture_step(self, slots_B: torch.Tensor, pos_B: torch.Tensor,
                     routes_BLK: torch.Tensor) -> None:
        """All the per-step work route capture adds: one cast and one indexed write."""
        self.routes_SMLK[slots_B, pos_B] = routes_BLK.to(self.route_dtype)

    def _sample_and_record(self, logits_BV: torch.Tensor, slots_B: torch.Tensor,
                           seqs: list[_Seq] | None) -> list[GenerationResult]:
        """Sample one token per row, write it and its log-probs, finish what stopped."""
        decode = seqs is None
        st = self._st if decode else self._sampling_tensors(slots_B)
        gen_B = self.gen_S[slots_B]
        banned_BV = None if decode and not self._any_min_new else self._banned(slots_B, gen_B)
        if self.cfg.logprob_noise > 0:  # keyed by the sample and the sampled token's position
            logits_BV = logits_BV.float() + logit_noise(
                self.noise_key_S[slots_B], self.prompt_len_S[slots_B] + gen_B,
                logits_BV.shape[-1], self.cfg.logprob_noise)
        o = sample(logits_BV, st, self.uniforms.next(slots_B), banned_BV, exact=self.cfg.exact)
        tok_B = o.token_ids_B
        self.tokens_SM[slots_B, gen_B] = tok_B
        self.logprobs_SM[slots_B, gen_B] = o.logprobs_B
        self.sel_logprobs_SM[slots_B, gen_B] = o.sampling_logprobs_B
        self._record_extras(o, slots_B)
        gen_B = gen_B + 1
        self.gen_S[slots_B] = gen_B
        stop_BJ, max_new_B = (self._stop_BJ, self._max_new_B) if decode else \
            (self.stop_SJ[slots_B], self.max_new_S[slots_B])
        stop_B = (tok_B[:, None] == stop_BJ).any(-1)
        done_B = stop_B | (gen_B >= max_new_B)
        if not bool(done_B.any()):  # the step's one wait for the device
            return []
        b_N = done_B.nonzero()[:, 0]
        out = []  # what the finished rows need, to the host in one copy
        for slot, stopped, tok, gen in torch.stack(
                [slots_B[b_N], stop_B[b_N].long(), tok_B[b_N], gen_B[b_N]], 1).tolist():
            reason = {"type": "stop", "matched": tok} if stopped else \
                {"type": "length", "length": gen}
            out.append(self._finish(self.running[slot], reason))
        return out

    # -- helpers ----------------------------------------------------------------------------
    def _init_slot(self, slot: int, r: GenerateRequest) -> None:
        sp = r.sampling
        stops = list(sp.stop_token_ids)
        eos = self.model.cfg.eos_token_id
        if eos is not None and not sp.ignore_eos and eos not in stops:
            stops.append(eos)
        J = self.stop_SJ.shape[1]
        if len(stops) > J:
            pad = self.stop_SJ.new_full((self.stop_SJ.shape[0], len(stops) - J), -1)
            self.stop_SJ = torch.cat([self.stop_SJ, pad], dim=1)
        J = self.stop_SJ.shape[1]
        self.stop_SJ[slot] = torch.tensor(stops + [-1] * (J - len(stops)), dtype=torch.long,
                                          device=self.device)
        self.gen_S[slot] = 0
        self.prompt_len_S[slot] = len(r.input_ids)
        # As SGLang does, max_new_tokens is clamped to what fits in the context.
        self.max_new_S[slot] = min(sp.max_new_tokens, self.max_len - len(r.input_ids))
        self.min_new_S[slot] = sp.min_new_tokens
        self.params_S[slot] = (sp.temperature, sp.top_k, sp.top_p, sp.min_p)

    def _active(self) -> torch.Tensor:
        if self._active_B is None:
            self._active_B = torch.tensor(sorted(self.running), dtype=torch.long,
                                          device=self.device)
            self._st = self._sampling_tensors(self._active_B)
            self._stop_BJ = self.stop_SJ[self._active_B]
            self._max_new_B = self.max_new_S[self._active_B]
            # min_new_tokens pending somewhere? (re-checked each step only while it is)
            self._any_min_new = bool((self.gen_S[self._active_B]
                                      < self.min_new_S[self._active_B]).any())
            self._wants_extras = any(s.req.top_logprobs_num or s.req.return_sampling_mask
                                     or s.req.return_support_logprobs
                                     for s in self.running.values())
        return self._active_B

    def _sampling_tensors(self, slots_B: torch.Tensor) -> SamplingTensors:
        cols = list(zip(*(self.params_S[s] for s in slots_B.tolist())))
        return SamplingTensors.build(*cols, vocab_size=self.vocab_size, device=self.device)

    def _banned(self, slots_B: torch.Tensor, gen_B: torch.Tensor) -> torch.Tensor | None:
        """Stop ids are excluded from the support until min_new_tokens were generated."""
        pending_B = gen_B < self.min_new_S[slots_B]
        if not bool(pending_B.any()):
            if slots_B is self._active_B:
                self._any_min_new = False  # generation only grows: stays false for this batch
            return None
        stop_BJ = self.stop_SJ[slots_B]
        banned_BV = torch.zeros(len(slots_B), self.vocab_size + 1, dtype=torch.bool,
                                device=self.device)
        banned_BV.scatter_(1, torch.where(stop_BJ < 0, self.vocab_size, stop_BJ), True)
        return banned_BV[:, :-1] & pending_B[:, None]

    def _record_extras(self, o, slots_B: torch.Tensor) -> None:
        """Top log-probs and sampling masks, only for rows that asked (Python per row)."""
        if slots_B is self._active_B and not self._wants_extras:
            return
        for b, slot in enumerate(slots_B.tolist()):
            seq = self.running[slot]
            if seq.req.top_logprobs_num:
                v, i = o.logprobs_BV[b].topk(seq.req.top_logprobs_num)
                seq.top_logprobs = (seq.top_logprobs or []) + [list(zip(v.tolist(), i.tolist()))]
            if seq.req.return_sampling_mask or seq.req.return_support_logprobs:
                kept = None if o.support_BV is None or bool(o.support_BV[b].all()) else \
                    o.support_BV[b].nonzero()[:, 0]
                if seq.req.return_sampling_mask:  # per token and row: these are host results
                    seq.sampling_mask = (seq.sampling_mask or []) + [
                        None if kept is None else kept.to("cpu", torch.int32)]
                if seq.req.return_support_logprobs:
                    lp = o.logprobs_BV[b] if kept is None else o.logprobs_BV[b, kept]
                    seq.support_logprobs = (seq.support_logprobs or []) + [
                        (lp - torch.logsumexp(lp, 0)).cpu()]

    def _input_logprobs(self, hidden_TD: torch.Tensor, req: GenerateRequest):
        """Prompt log-probs (same distribution as the outputs), entry 0 NaN; top-N if asked."""
        sp = req.sampling
        temp = 1.0 if sp.greedy else sp.temperature
        logp_TV = torch.log_softmax(self.model.logits(hidden_TD).float() / temp, dim=-1)
        ids = torch.tensor(req.input_ids, device=self.device)
        lp = torch.full((len(ids),), float("nan"), device=self.device)
        lp[1:] = logp_TV[:-1].gather(1, ids[1:, None])[:, 0]
        top = None
        if req.top_logprobs_num:
            v, i = logp_TV[:-1].topk(req.top_logprobs_num, dim=-1)
            top = [None] + [list(zip(a, b)) for a, b in zip(v.tolist(), i.tolist())]
        return lp.cpu(), top

    def _finish(self, seq: _Seq, reason: dict) -> GenerationResult:
        slot, P = seq.slot, seq.prompt_len
        R = int(self.gen_S[slot])
        routes = None  # results go to the host here, once per finished sample (copies)
        if self.cfg.capture_routes and seq.req.return_routes:
            routes = self.routes_SMLK[slot, seq.req.routes_start:P + R - 1].to("cpu", copy=True)
            if routes.dtype == torch.int16:
                routes = routes.view(torch.uint16)
        gates = None
        if self.gates_SMLK is not None and seq.req.return_gates:
            gates = self.gates_SMLK[slot, seq.req.routes_start:P + R - 1].to("cpu", copy=True)
        picks = None
        if self.indexer_SMLK is not None and seq.req.return_indexer_topk:
            s0 = seq.req.indexer_start
            picks = IndexerTrace(self.indexer_SMLK[slot, s0:P + R - 1].to("cpu", copy=True), s0)
        res = GenerationResult(
            rid=seq.req.rid, index=seq.index, prompt_ids=list(seq.req.input_ids),
            output_ids=self.tokens_SM[slot, :R].tolist(),
            output_logprobs=self.logprobs_SM[slot, :R].to("cpu", copy=True),
            sampling_logprobs=self.sel_logprobs_SM[slot, :R].to("cpu", copy=True),
            finish_reason=reason, weight_version=self.weight_version, routes_NLK=routes,
            routes_start=seq.req.routes_start, gates_NLK=gates, indexer=picks,
            input_logprobs=seq.input_logprobs, top_logprobs=seq.top_logprobs,
            input_top_logprobs=seq.input_top_logprobs, sampling_mask=seq.sampling_mask,
            support_logprobs=seq.support_logprobs)
        del self.running[slot]
        self._live[seq.req.rid] -= 1
        if not self._live[seq.req.rid]:
            del self._live[seq.req.rid]
        self.free_slots.append(slot)
        self._active_B = None
        return res
