"""Rollout engine and server benchmark; every figure is a ratio against a baseline run here.

(a) engine new tokens/s vs transformers `generate()` (same weights, batch, lengths, dtype,
    plain temperature-1 sampling, no early stop); target >= 3x.
(b) engine with route capture on vs off; target <= 2% loss.
(c) route bytes per token held in memory and sent on the wire (lockstep compact) vs SGLang's
    int32 encoding; target <= 1/4.
(d) `lockstep serve` (own process) under C concurrent clients: requests/s, failed requests.

    OMP_NUM_THREADS=1 python bench/rollout.py [--preset small] [--dtype all|bf16|fp32] [--repeats 7]
        [--clock wall|cpu] [--parts abcd]
`--clock cpu` times this thread's CPU time (a and b only): on a shared host it drops the time
spent waiting for a core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from lockstep.kernels.dtypes import PRECISIONS, torch_dtype
from lockstep.moe.checkpoint import save_hf
from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.rollout.client import HTTPBackend
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.types import GenerateRequest, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from model_forward import CLOCKS, PRESETS  # noqa: E402  (the models transformers was measured on)

TORCH_DTYPES = {n: torch_dtype(n) for n in PRECISIONS}


def requests(prompts: list[list[int]], new: int) -> list[GenerateRequest]:
    return [GenerateRequest(p, SamplingParams(max_new_tokens=new, ignore_eos=True))
            for p in prompts]


def engine_tok_s(engine: Engine, prompts, new: int, clock=time.perf_counter) -> float:
    t0 = clock()
    res = engine.generate(requests(prompts, new))
    dt = clock() - t0
    return sum(len(r.output_ids) for r in res) / dt


@torch.no_grad()
def hf_tok_s(hf, prompts_BP: torch.Tensor, new: int, clock=time.perf_counter) -> float:
    t0 = clock()
    out = hf.generate(prompts_BP, attention_mask=torch.ones_like(prompts_BP), do_sample=True,
                      temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                      min_new_tokens=new, pad_token_id=0)
    dt = clock() - t0
    return (out.shape[1] - prompts_BP.shape[1]) * out.shape[0] / dt


def interleaved(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Median and best of `repeats` runs of each callable (higher is better); the order rotates
    every round so drift on a shared host hits every contender alike."""
    got = {k: [] for k in fns}
    keys = list(fns)
    for r in range(repeats):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            got[k].append(fns[k]())
    return ({k: statistics.median(v) for k, v in got.items()},
            {k: max(v) for k, v in got.items()})


def capture_cost_per_step(engine: Engine, batch: int, repeats: int = 200) -> float:
    """Seconds of `Engine.capture_step` (the only per-step work capture adds) at this batch."""
    cfg = engine.model.cfg
    slots = torch.arange(batch)
    pos = torch.randint(0, engine.max_len, (batch,))
    routes = torch.randint(0, cfg.num_experts, (batch, cfg.num_moe_layers, cfg.num_experts_per_tok))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.capture_step(slots, pos, routes)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def load_test(http: HTTPBackend, prompts, new: int, clients: int, per_client: int):
    import aiohttp
    ok = failed = 0
    errors: list[str] = []
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(timeout=http.timeout, connector=conn) as session:
        async def client(c: int):
            nonlocal ok, failed
            for i in range(per_client):
                req = GenerateRequest(prompts[(c + i) % len(prompts)], SamplingParams(
                    max_new_tokens=new, ignore_eos=True))
                try:
                    item = await http._post(session, "/generate", http.request_body(req))
                    http.parse(item, req, c, 0)
                    ok += 1
                except Exception as e:  # counted, reported
                    failed += 1
                    errors.append(repr(e)[:200])
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        dt = time.perf_counter() - t0
    return ok, failed, dt, errors[:3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--dtype", choices=sorted(TORCH_DTYPES) + ["all"], default="all",
                    help="engine and transformers dtype for (a), (b); all = bf16 and fp32")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--per-client", type=int, default=4)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="cpu: this thread's CPU time for (a) and (b) (drops waits for a core)")
    ap.add_argument("--parts", default="abcd", help="which of (a)-(d) to run, e.g. a or ab")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig(**PRESETS[args.preset], eos_token_id=None,
                      max_position_embeddings=args.prompt + args.new)
    model = MoEModel(cfg)
    g = torch.Generator().manual_seed(0)
    prompts_BP = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), generator=g)
    prompts = prompts_BP.tolist()
    print(f"model {args.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"{cfg.num_hidden_layers} layers, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}"
          f"), batch {args.batch}, prompt {args.prompt}, new {args.new}, torch threads "
          f"{torch.get_num_threads()}, medians of {args.repeats} (order rotated), "
          f"{args.clock} clock")
    clock = CLOCKS[args.clock]
    for dtype in (["bf16", "fp32"] if args.dtype == "all" else [args.dtype]):
        if not set(args.parts) & set("ab"):
            break
        ecfg = dict(dtype=dtype, max_running=args.batch, max_len=args.prompt + args.new)
        # One engine, capture toggled between runs: same weights and buffers in memory, so
        # the only difference is the capture work itself.
        eng_on = Engine.from_model(model, EngineConfig(**ecfg))

        def run(capture: bool) -> float:
            eng_on.cfg.capture_routes = capture
            return engine_tok_s(eng_on, prompts, args.new, clock)
        fns = {"on": lambda: run(True)}
        if "b" in args.parts:
            fns["off"] = lambda: run(False)
        if "a" in args.parts and not args.skip_hf:
            from transformers import AutoModelForCausalLM
            with tempfile.TemporaryDirectory() as d:
                save_hf(model, d + "/ck")
                hf = AutoModelForCausalLM.from_pretrained(d + "/ck", dtype=TORCH_DTYPES[dtype]).eval()
            fns["hf"] = lambda: hf_tok_s(hf, prompts_BP, args.new, clock)
        for f in fns.values():  # warm-up
            f()
        m, best = interleaved(fns, args.repeats)
        if "hf" in m:
            print(f"(a) {dtype}: engine {m['on']:7.0f} new tok/s | transformers generate "
                  f"{m['hf']:7.0f} | ratio {m['on'] / m['hf']:.2f}x (best-of-{args.repeats} "
                  f"{best['on'] / best['hf']:.2f}x) (target >= 3x)")
        if "off" not in m:
            continue
        step_s = args.batch / m["on"]
        cap_s = capture_cost_per_step(eng_on, args.batch)
        print(f"(b) {dtype}: capture on {m['on']:7.0f} | off {m['off']:7.0f} new tok/s | "
              f"loss {100 * (1 - m['on'] / m['off']):+.1f}% (best-of {100 * (1 - best['on'] / best['off']):+.1f}%); "
              f"capture work {cap_s * 1e6:.0f} us of a {step_s * 1e3:.1f} ms step = "
              f"{100 * cap_s / step_s:.2f}% (target <= 2%)")

    if not set(args.parts) & set("cd"):
        return
    eng_on = Engine.from_model(model, EngineConfig(dtype="bf16", max_running=args.batch,
                                                   max_len=args.prompt + args.new))
    res = eng_on.generate(requests(prompts[:8], args.new))
    rows = sum(r.routes_NLK.shape[0] for r in res)
    mem = sum(r.routes_NLK.numel() * r.routes_NLK.element_size() for r in res) / rows
    sglang_mem = 4 * cfg.num_hidden_layers * cfg.num_experts_per_tok
    serve_dtype = "bf16" if args.dtype == "all" else args.dtype
    with tempfile.TemporaryDirectory() as d:
        save_hf(model, d + "/ck")
        port = free_port()
        log = open(os.path.join(d, "server.log"), "w")
        proc = subprocess.Popen([sys.executable, "-m", "lockstep.launch.serve", "--model",
                                 d + "/ck", "--dtype", serve_dtype, "--port", str(port),
                                 "--max-running", str(args.batch), "--threads", "1"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wire = {}
            for compact in (True, False):
                http = HTTPBackend(url, cfg, compact_routes=compact, retries=40, backoff_s=0.25)
                out = http.generate(requests(prompts[:8], args.new))
                wire[compact] = http.route_bytes_received / sum(r.routes_NLK.shape[0] for r in out)
            print(f"(c) route bytes/token: memory {mem:.1f} vs SGLang int32 {sglang_mem} "
                  f"({mem / sglang_mem:.3f}); wire (base64 JSON) compact {wire[True]:.2f} vs "
                  f"int32 {wire[False]:.2f} ({wire[True] / wire[False]:.3f}) (target <= 0.25)")
            http = HTTPBackend(url, cfg, max_concurrency=args.clients)
            asyncio.run(load_test(http, prompts, args.new, args.clients, 1))  # warm-up
            ok, failed, dt, errs = asyncio.run(load_test(http, prompts, args.new, args.clients,
                                                         args.per_client))
            print(f"(d) server ({serve_dtype}), {args.clients} concurrent clients x {args.per_client} requests "
                  f"(prompt {args.prompt}, {args.new} new): {ok / dt:.1f} requests/s, "
                  f"{ok * args.new / dt:.0f} new tok/s, {failed} failed {errs if errs else ''}")
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
