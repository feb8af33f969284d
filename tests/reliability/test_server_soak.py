"""Soak (issue 12): `lockstep serve` in its own process under 200 concurrent loopback clients for
60 s while weights are pushed (two weight sets, alternating, with versions) and requests are
aborted in a loop. Every request is answered; every sample's tokens are the greedy output of
the weight set its `weight_version` names (a prefix of it when aborted), so no sample mixes
versions; the server's RSS stays flat (start/end printed)."""

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter

import aiohttp
import pytest
import torch

from lockstep.moe.checkpoint import save_hf
from lockstep.moe.model import MoEModel
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.types import GenerateRequest, SamplingParams

from model_fixtures import tiny_config

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

CLIENTS, SECONDS, NEW = 200, 60.0, 8
PROMPTS = [[3 + k, 5, 7 + (k % 5), 2 + k] for k in range(12)]
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}


def _rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _known_outputs(folder):
    eng = Engine.from_hf(folder, EngineConfig(dtype="fp32", max_running=16, max_len=32))
    res = eng.generate([GenerateRequest(p, SamplingParams(**GREEDY)) for p in PROMPTS])
    return [r.output_ids for r in res]


async def _soak(url, paths, known, pid):
    stats = Counter()
    bad: list[str] = []
    recent: list[str] = []
    stop = time.monotonic() + SECONDS
    timeout = aiohttp.ClientTimeout(total=60)

    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=CLIENTS + 4)) as s:
        async def client(c):
            i = 0
            while time.monotonic() < stop:
                k, rid = (c + i) % len(PROMPTS), f"c{c}-{i}"
                i += 1
                recent.append(rid)
                del recent[:-400]
                body = {"input_ids": PROMPTS[k], "rid": rid, "sampling_params": GREEDY}
                try:
                    async with s.post(url + "/generate", json=body) as r:
                        out = await r.json(content_type=None)
                        status = r.status
                except asyncio.TimeoutError:
                    stats["hang"] += 1
                    bad.append(f"{rid}: no answer in 60 s")
                    continue
                stats["sent"] += 1
                if status != 200:
                    stats[f"http {status}"] += 1
                    bad.append(f"{rid}: HTTP {status} {out}")
                    continue
                meta = out["meta_info"]
                which = meta["weight_version"].split("-")[0]
                want = known[which][k]
                got = out["output_ids"]
                kind = meta["finish_reason"]["type"]
                stats[kind] += 1
                if (kind == "abort" and got != want[:len(got)]) or (kind != "abort" and got != want):
                    stats["mixed"] += 1
                    bad.append(f"{rid}: version {meta['weight_version']} output {got} is not "
                               f"set {which}'s greedy {want}")

        async def pusher():
            n = 0
            while time.monotonic() < stop:
                n += 1
                which = "B" if n % 2 else "A"
                body = {"model_path": paths[which], "weight_version": f"{which}-{n}",
                        "abort_all_requests": n % 3 == 0}
                async with s.post(url + "/update_weights_from_disk", json=body) as r:
                    ok = await r.json(content_type=None)
                    if r.status != 200 or not ok.get("success"):
                        bad.append(f"push {n}: HTTP {r.status} {ok}")
                stats["pushes"] += 1
                await asyncio.sleep(0.3)

        async def aborter():
            rng = random.Random(0)
            while time.monotonic() < stop:
                body = {"abort_all": True} if rng.random() < 0.1 else \
                    {"rid": rng.choice(recent) if recent else "none"}
                async with s.post(url + "/abort_request", json=body) as r:
                    if r.status != 200:
                        bad.append(f"abort {body}: HTTP {r.status}")
                stats["aborts"] += 1
                await asyncio.sleep(0.05)

        rss = []

        async def monitor():  # server RSS every 5 s, from after the first 10 s (warm-up)
            await asyncio.sleep(10)
            while time.monotonic() < stop:
                rss.append(_rss_kb(pid))
                await asyncio.sleep(5)

        await asyncio.gather(pusher(), aborter(), monitor(),
                             *(client(c) for c in range(CLIENTS)))
    rss.append(_rss_kb(pid))
    return stats, bad, rss


def test_serve_under_load_with_pushes_and_aborts(tmp_path):
    torch.manual_seed(0)
    cfg = tiny_config(max_position_embeddings=32)
    paths = {}
    for which, seed in (("A", 0), ("B", 1)):
        torch.manual_seed(seed)
        paths[which] = str(save_hf(MoEModel(cfg), tmp_path / which))
    known = {w: _known_outputs(p) for w, p in paths.items()}
    assert known["A"] != known["B"]
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep.launch.serve", "--model", paths["A"], "--dtype", "fp32",
         "--port", str(port), "--threads", "1", "--max-running", "64", "--max-len", "32",
         "--weight-version", "A-0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()
                time.sleep(0.25)
        start_rss = _rss_kb(proc.pid)
        t0 = time.monotonic()
        stats, bad, rss = asyncio.run(_soak(url, paths, known, proc.pid))
        took = time.monotonic() - t0
        rss0, rss1 = rss[0], rss[-1]
        print(f"\nsoak: {dict(stats)} in {took:.0f}s; server RSS idle {start_rss / 1024:.0f} MB, "
              f"at 10 s {rss0 / 1024:.0f} MB, end {rss1 / 1024:.0f} MB (every 5 s: "
              f"{[round(x / 1024) for x in rss]})")
        assert not bad, bad[:5]
        assert stats["hang"] == 0 and stats["mixed"] == 0
        assert stats["sent"] > CLIENTS and stats["pushes"] > 10 and stats["abort"] > 0
        assert rss1 - rss0 < 64 * 1024, f"RSS grew {rss0} -> {rss1} kB"
        assert proc.poll() is None
    finally:
        proc.terminate()
        t_stop = time.monotonic()
        proc.wait(30)
        assert time.monotonic() - t_stop < 15, "shutdown was not prompt"


SLOW_CLIENTS, SLOW_SECONDS = 5000, 8.0
PARTIAL = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: 4096\r\n\r\n{")


def test_serve_answers_under_slowloris(tmp_path):
    """Issue 22: 5,000 connections that sent their headers and one body byte stay open and
    idle while /health and /generate keep answering within a bound; the server's RSS stays
    flat and its log quiet (before: no timeout, no cap; at the fd limit /health stopped and
    the log grew by accept errors)."""
    import resource
    import urllib.request

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * SLOW_CLIENTS + 1024  # ours and the server's ends, loopback
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    torch.manual_seed(0)
    folder = str(save_hf(MoEModel(tiny_config(max_position_embeddings=32)), tmp_path / "A"))
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep.launch.serve", "--model", folder, "--dtype", "fp32",
         "--port", str(port), "--threads", "1", "--max-len", "32",
         "--max-connections", str(SLOW_CLIENTS + 1000)], stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    held = []

    def timed(path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data,
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
            r.read()
        return time.monotonic() - t0

    try:
        for _ in range(240):
            try:
                timed("/health")
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()
                time.sleep(0.25)
        quiet = max(timed("/generate", {"input_ids": [3, 5], "sampling_params": GREEDY})
                    for _ in range(3))
        for _ in range(SLOW_CLIENTS):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(PARTIAL)
            held.append(s)
        time.sleep(1.0)
        with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
            conns = json.loads(r.read())["connections"]
        assert conns["open"] >= SLOW_CLIENTS and conns["evicted"] == 0, conns
        rss0 = _rss_kb(proc.pid)
        worst = {"health": 0.0, "generate": 0.0}
        stop = time.monotonic() + SLOW_SECONDS
        n = 0
        while time.monotonic() < stop:
            worst["health"] = max(worst["health"], timed("/health"))
            worst["generate"] = max(worst["generate"], timed(
                "/generate", {"input_ids": [3 + n % 7, 5], "sampling_params": GREEDY}))
            n += 1
            time.sleep(0.1)
        rss1 = _rss_kb(proc.pid)
        log_bytes = (tmp_path / "serve.log").stat().st_size
        print(f"\nslowloris: {SLOW_CLIENTS} partial connections open ({conns}); {n} rounds; "
              f"worst /health {worst['health']:.3f}s, worst /generate {worst['generate']:.3f}s "
              f"(quiet {quiet:.3f}s); RSS {rss0 / 1024:.0f} -> {rss1 / 1024:.0f} MB; log "
              f"{log_bytes} bytes")
        assert n > 10
        assert worst["health"] < 2.0 and worst["generate"] < max(3.0, 10 * quiet), worst
        assert rss1 - rss0 < 32 * 1024, f"RSS grew {rss0} -> {rss1} kB"
        assert log_bytes < 64 * 1024
        assert proc.poll() is None
    finally:
        for s in held:
            s.close()
        proc.terminate()
        proc.wait(30)
        log.close()
