"""Issue 22's fresh probe of `lockstep serve`, run by hand (not by CI):

    OMP_NUM_THREADS=1 python tests/reliability/probe_round2.py

New inputs, through the CLI and HTTP only, in the classes of issue 22: bad weight pushes, slow,
partial and idle clients, bad dtypes / NaN / overflow, bad requests, release and abort races,
bad `lockstep serve` arguments. Each row is classified:
  clear error   - refused (HTTP 4xx with a message, or exit 2 with one line) as it should be
  correct       - accepted and did the right thing
  silent        - accepted something it should refuse, or answered wrongly without saying so
  crash         - HTTP 5xx, a traceback, or the server process died
  hang          - no answer within the bound
Prints every row and the counts by verdict; exits 1 if any row is silent, crash or hang.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_fixtures import tiny_config  # noqa: E402

from lockstep.cluster.ports import free_port  # noqa: E402
from lockstep.moe.checkpoint import hf_state_dict, save_hf  # noqa: E402
from lockstep.moe.model import MoEModel  # noqa: E402
from lockstep.rollout.weight_group import WeightGroup  # noqa: E402

ROWS: list[tuple[str, str, str, str]] = []  # (class, input, verdict, detail)
BOUND = 20.0
NORM = "model.norm.weight"
EMBED = "model.embed_tokens.weight"


def http(url, path, body=None, raw=None, method=None, timeout=BOUND):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method=method or (
        "POST" if data is not None else "GET"), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode(errors="replace")
            return r.status, text
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (socket.timeout, TimeoutError):
        return "hang", ""
    except urllib.error.URLError as e:
        if isinstance(e.reason, (socket.timeout, TimeoutError)):
            return "hang", ""
        return "down", repr(e.reason)
    except (ConnectionError, OSError) as e:
        return "down", repr(e)


def message(text):
    try:
        j = json.loads(text)
    except ValueError:
        return text.strip()
    if isinstance(j, dict):
        return (j.get("error") or {}).get("message") or j.get("message") or ""
    return ""


class Server:
    def __init__(self, folder, *extra):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="probe-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lockstep.launch.serve", "--model", str(folder), "--port",
             str(self.port), "--threads", "1", "--max-len", "48", *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        for _ in range(600):
            if http(self.url, "/health", timeout=2)[0] == 200:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(Path(self.log.name).read_text()[-2000:])
            time.sleep(0.1)
        raise RuntimeError("lockstep serve did not start")

    def alive(self):
        return self.proc.poll() is None and http(self.url, "/health", timeout=5)[0] == 200

    def greedy(self):
        s, t = http(self.url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
            "temperature": 0, "max_new_tokens": 5, "ignore_eos": True}})
        return json.loads(t)["output_ids"] if s == 200 else None

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def record(cls, what, status, text, expect, srv=None, check=None):
    """expect: "error" (a 4xx with a message is right) or "ok" (a 2xx is right, and `check`
    if given says the result is right)."""
    if status == "hang":
        verdict, detail = "hang", f"no answer within {BOUND:.0f}s"
    elif status == "down" or (srv is not None and not srv.alive()):
        verdict, detail = "crash", f"server gone ({status}, {text[:100]})"
    elif status >= 500:
        verdict, detail = "crash", f"HTTP {status}: {message(text)[:150]}"
    elif status >= 400:
        m = message(text)
        if expect == "error" and m:
            verdict, detail = "clear error", f"{status}: {m[:150]}"
        elif expect == "error":
            verdict, detail = "silent", f"{status} without a message"
        else:
            verdict, detail = "silent", f"refused a valid input: {status} {m[:150]}"
    else:
        ok = check() if check else True
        if expect == "ok" and ok:
            verdict, detail = "correct", f"{status}"
        elif expect == "ok":
            verdict, detail = "silent", f"{status} but the result is wrong"
        else:
            verdict, detail = "silent", f"accepted: {status} {text[:150]}"
    ROWS.append((cls, what, verdict, detail))


class _Rows(list):
    """Rows, each printed as it comes (a long probe shows its progress)."""

    def append(self, row):
        super().append(row)
        print(f"{row[0]:20s} {row[1]:48s} {row[2]:12s} {row[3]}", flush=True)


ROWS = _Rows()


# -- weight pushes ---------------------------------------------------------------------------
def session(srv, fn):
    http(srv.url, "/begin_weight_update", {})
    try:
        return fn()
    finally:
        http(srv.url, "/end_weight_update", {})


def distributed(srv, names, dtypes, shapes, sent, flat=False, join=True):
    port, name = free_port(), f"probe-{free_port()}"
    box = {}
    group = None
    if join:
        t = threading.Thread(target=lambda: box.update(j=http(srv.url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "backend": "gloo", "group_name": name})))
        t.start()
        group = WeightGroup("127.0.0.1", port, 0, 2, name, "gloo", 15)
        t.join(30)
    body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": name,
            "load_format": "flattened_bucket" if flat else None}

    def push():
        t = threading.Thread(target=lambda: box.update(p=http(
            srv.url, "/update_weights_from_distributed", body)))
        t.start()
        if group is not None and sent is not None:
            try:
                for x in sent:
                    group.broadcast(x)
            except RuntimeError:
                pass
        t.join(BOUND + 5)
        return box.get("p", ("hang", ""))
    out = session(srv, push)
    if group is not None:
        group.close()
    http(srv.url, "/destroy_weights_update_group", {"group_name": name})
    return out


def tensor_push(srv, tensors, **fields):
    raw = base64.b64encode(save_safetensors(tensors)).decode()
    return session(srv, lambda: http(srv.url, "/update_weights_from_tensor", {
        "serialized_named_tensors": [raw], "load_format": "safetensors", **fields}))


def probe_pushes(srv, sd):
    cls = "weight push"
    before = srv.greedy()
    same = lambda: srv.greedy() == before  # noqa: E731
    e, n = sd[EMBED], sd[NORM]
    flat_n = n.view(torch.uint8)
    cases = [
        ("declared shape half the sent", [NORM], ["float32"], [[16]], [n], False, "error"),
        ("declared shape double the sent", [NORM], ["float32"], [[64]], [n], False, "error"),
        ("declared 2-D for a 1-D weight", [NORM], ["float32"], [[32, 1]], [n], False, "error"),
        ("declared transposed embedding", [EMBED], ["float32"], [[32, 40]], [e], False, "error"),
        ("declared shape [] (scalar)", [NORM], ["float32"], [[]], [n[:1]], False, "error"),
        ("declared 10^12 elements", [NORM], ["float32"], [[10**6, 10**6]], None, False, "error"),
        ("declared negative dim", [NORM], ["float32"], [[-32]], None, False, "error"),
        ("flattened, shape half", [NORM], ["float32"], [[16]], [flat_n], True, "error"),
        ("flattened, sent 1.5x declared bytes", [NORM], ["float32"], [[32]],
         [torch.cat([flat_n, flat_n[:64]])], True, "error"),
        ("flattened, sent 3 bytes short", [NORM], ["float32"], [[32]], [flat_n[:-3].contiguous()],
         True, "error"),
        ("declared float16, sent float32", [NORM], ["float16"], [[32]], [n], False, "error"),
        ("declared float64, sent float32", [NORM], ["float64"], [[32]], [n], False, "error"),
        ("declared bfloat16, sent float32 (2x)", [NORM], ["bfloat16"], [[32]], [n], False, "error"),
        ("sent one element short", [NORM], ["float32"], [[32]], [n[:-1].contiguous()], False, "error"),
        ("two tensors, second declared wrong", [NORM, EMBED], ["float32", "float32"],
         [[32], [40, 31]], [n, e], False, "error"),
        ("unknown name", ["model.layers.7.mlp.gate.weight"], ["float32"], [[4, 32]], None, False,
         "error"),
        ("duplicate names", [NORM, NORM], ["float32", "float32"], [[32], [32]], None, False, "error"),
        ("dtype int32", [NORM], ["int32"], [[32]], None, False, "error"),
        ("dtype 'torch.float32' spelling", [NORM], ["torch.float32"], [[32]], None, False, "error"),
        ("dtype bool", [NORM], ["bool"], [[32]], None, False, "error"),
        ("names/dtypes/shapes lengths differ", [NORM, EMBED], ["float32"], [[32]], None, False,
         "error"),
        ("shape with a float", [NORM], ["float32"], [[32.0]], None, False, "error"),
        ("fp8 bytes, declared float8_e4m3fn (valid)", [NORM], ["float8_e4m3fn"], [[32]],
         [n.to(torch.float8_e4m3fn).view(torch.uint8)], False, "ok"),
        ("float64 NaN", [NORM], ["float64"], [[32]],
         [torch.full((32,), float("nan"), dtype=torch.float64)], False, "error"),
        ("float64 1e39 into bf16", [NORM], ["float64"], [[32]],
         [torch.full((32,), 1e39, dtype=torch.float64)], False, "error"),
        ("float32 3.4e38 into bf16 (rounds to inf)", [NORM], ["float32"], [[32]],
         [torch.full((32,), 3.4e38)], False, "error"),
    ]
    for what, names, dtypes, shapes, sent, flat, expect in cases:
        status, text = distributed(srv, names, dtypes, shapes, sent, flat)
        landed = expect == "ok"
        record(cls, f"distributed: {what}", status, text, expect, srv,
               check=None if landed else same)
        if status == 200:  # put the weights back
            distributed(srv, [NORM], ["float32"], [[32]], [n])
    status, text = session(srv, lambda: http(srv.url, "/update_weights_from_distributed", {
        "names": [NORM], "dtypes": ["float32"], "shapes": [[32]], "group_name": "nope"}))
    record(cls, "distributed: group never joined", status, text, "error", srv)
    status, text = http(srv.url, "/update_weights_from_distributed", {
        "names": [NORM], "dtypes": ["float32"], "shapes": [[32]]})
    record(cls, "distributed: outside a session", status, text, "error", srv)
    tensor_cases = [
        ("fp8 tensor (valid)", {NORM: n.to(torch.float8_e4m3fn)}, "ok"),
        ("float8_e5m2 tensor (valid)", {NORM: n.to(torch.float8_e5m2)}, "ok"),
        ("float64 tensor (valid)", {NORM: n.double()}, "ok"),
        ("float64 1e39", {NORM: torch.full((32,), 1e39, dtype=torch.float64)}, "error"),
        ("float16 inf", {NORM: torch.full((32,), float("inf"), dtype=torch.float16)}, "error"),
        ("int8 tensor", {NORM: torch.ones(32, dtype=torch.int8)}, "error"),
        ("uint8 tensor", {NORM: torch.ones(32, dtype=torch.uint8)}, "error"),
        ("bool tensor", {NORM: torch.ones(32, dtype=torch.bool)}, "error"),
        ("complex tensor", {NORM: torch.ones(32, dtype=torch.complex64)}, "error"),
        ("shape (31,)", {NORM: n[:31].contiguous()}, "error"),
        ("unknown name", {"model.norm.bias": n}, "error"),
        ("empty safetensors", {}, "ok"),
    ]
    for what, tensors, expect in tensor_cases:
        status, text = tensor_push(srv, tensors)
        record(cls, f"tensor: {what}", status, text, expect, srv,
               check=None if expect == "ok" else same)
        if status == 200:
            tensor_push(srv, {NORM: n})
    for what, raw in (("not base64", "@@@"), ("base64 of garbage", base64.b64encode(b"x" * 40).decode()),
                      ("two entries", None)):
        entries = [raw] if raw is not None else ["", ""]
        status, text = session(srv, lambda: http(srv.url, "/update_weights_from_tensor", {
            "serialized_named_tensors": entries, "load_format": "safetensors"}))
        record(cls, f"tensor: {what}", status, text, "error", srv)
    status, text = tensor_push(srv, {NORM: n}, load_format="direct")
    record(cls, "tensor: load_format direct (pickle)", status, text, "error", srv)


# -- disk folders with bad dtypes / values --------------------------------------------------
def probe_folders(srv, model, sd, tmp):
    cls = "dtype/NaN/overflow"
    before = srv.greedy()
    same = lambda: srv.greedy() == before  # noqa: E731

    def folder(name, edit):
        d = tmp / name
        save_hf(model, d)
        t = {k: v.clone() for k, v in sd.items()}
        edit(t)
        save_file(t, d / "model.safetensors")
        return str(d)
    cases = [
        ("all fp8_e4m3fn (valid)", lambda t: t.update({k: v.to(torch.float8_e4m3fn) for k, v in t.items()}), "ok"),
        ("one fp8_e5m2 tensor (valid)", lambda t: t.update({NORM: t[NORM].to(torch.float8_e5m2)}), "ok"),
        ("all float64 (valid)", lambda t: t.update({k: v.double() for k, v in t.items()}), "ok"),
        ("float64 1e39", lambda t: t.update({NORM: torch.full((32,), 1e39, dtype=torch.float64)}), "error"),
        ("float64 -1e300", lambda t: t.update({NORM: torch.full((32,), -1e300, dtype=torch.float64)}), "error"),
        ("float32 3.4e38 (inf in bf16)", lambda t: t.update({NORM: torch.full((32,), 3.4e38)}), "error"),
        ("float16 inf", lambda t: t.update({NORM: torch.full((32,), float("inf"), dtype=torch.float16)}), "error"),
        ("bf16 NaN", lambda t: t.update({NORM: torch.full((32,), float("nan"), dtype=torch.bfloat16)}), "error"),
        ("int64 tensor", lambda t: t.update({NORM: torch.ones(32, dtype=torch.int64)}), "error"),
        ("bool tensor", lambda t: t.update({NORM: torch.ones(32, dtype=torch.bool)}), "error"),
        ("fp8 NaN (0x7f)", lambda t: t.update({NORM: torch.full((32,), 127, dtype=torch.uint8).view(torch.float8_e4m3fn)}), "error"),
        ("embedding one row short", lambda t: t.update({EMBED: t[EMBED][:-1].contiguous()}), "error"),
    ]
    for what, edit, expect in cases:
        path = folder(what.split(" (")[0].replace(" ", "_"), edit)
        status, text = http(srv.url, "/update_weights_from_disk", {"model_path": path})
        record(cls, f"folder: {what}", status, text, expect, srv,
               check=None if expect == "ok" else same)
        if status == 200:
            http(srv.url, "/update_weights_from_disk", {"model_path": str(tmp / "base")})


# -- slow, partial, idle clients -------------------------------------------------------------
def raw_conn(port, data, wait):
    """(status line or '', seconds until the server answered or closed)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=BOUND)
    t0, got = time.monotonic(), b""
    try:
        if data:
            s.sendall(data)
        s.settimeout(wait)
        while chunk := s.recv(4096):
            got += chunk
    except (socket.timeout, ConnectionResetError):
        if not got and time.monotonic() - t0 >= wait - 0.1:
            return "hang", time.monotonic() - t0
    finally:
        s.close()
    return got.split(b"\r\n", 1)[0].decode(errors="replace"), time.monotonic() - t0


def probe_slow(srv):
    cls = "slow/partial/idle"
    post = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    cases = [
        ("idle connection, nothing sent", b"", ""),
        ("half a request line", b"POST /gen", ""),
        ("headers without the blank line", post + b"Content-Length: 10\r\n", ""),
        ("body 1 of 100 bytes", post + b"Content-Length: 100\r\n\r\n{", "408"),
        ("body 99 of 100 bytes", post + b"Content-Length: 100\r\n\r\n" + b" " * 99, "408"),
        ("chunked body never ended", post + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n", "408"),
        ("GET with a declared body never sent", b"GET /server_info HTTP/1.1\r\nHost: x\r\n"
         b"Content-Length: 50\r\n\r\n", "200"),
        ("Content-Length over the limit", post + b"Content-Length: 999999999999\r\n\r\n{", "413"),
        ("negative Content-Length", post + b"Content-Length: -5\r\n\r\n", "400"),
        ("header line over 8 KB", b"GET /health HTTP/1.1\r\nX: " + b"a" * 10000 + b"\r\n\r\n", "400"),
    ]
    for what, data, want in cases:
        status, took = raw_conn(srv.port, data, 15)
        if status == "hang":
            verdict = "hang"
        elif not srv.alive():
            verdict = "crash"
        elif want == "":
            verdict = "correct" if status == "" and took < 10 else "silent"
        elif want in status:
            verdict = "clear error" if not want.startswith("2") else "correct"
        else:
            verdict = "crash" if status.startswith("HTTP/1.1 5") else "silent"
        ROWS.append((cls, what, verdict, f"{status or 'closed'} after {took:.1f}s"))
    # a slow trickle: one byte a second, a 30-byte body (over the 2 s body timeout)
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=BOUND)
    s.sendall(post + b"Content-Length: 30\r\n\r\n")
    t0, got = time.monotonic(), b""
    s.settimeout(0.9)
    for _ in range(30):
        try:
            s.sendall(b" ")
            got += s.recv(4096)
            if got:
                break
        except socket.timeout:
            continue
        except OSError:
            break
    s.close()
    ROWS.append((cls, "body trickled at 1 byte/s", "clear error" if b" 408 " in got else
                 ("hang" if not got else "silent"), f"{got[:40]!r} after {time.monotonic() - t0:.1f}s"))
    # a flood past the cap (--max-connections 100): /health answers throughout
    held, worst = [], 0.0
    for i in range(300):
        c = socket.create_connection(("127.0.0.1", srv.port), timeout=BOUND)
        c.sendall(post + b"Content-Length: 100\r\n\r\n{" if i % 2 else b"GET /he")
        held.append(c)
        if i % 50 == 49:
            t0 = time.monotonic()
            status, _ = http(srv.url, "/health", timeout=5)
            worst = max(worst, time.monotonic() - t0) if status == 200 else 99
    info = json.loads(http(srv.url, "/server_info")[1])["connections"]
    for c in held:
        c.close()
    ok = worst < 3 and info["open"] <= info["cap"] + 1
    ROWS.append((cls, "300 partial connections, cap 100", "correct" if ok else "silent",
                 f"worst /health {worst:.2f}s, {info}"))


# -- bad requests --------------------------------------------------------------------------
def probe_requests(srv):
    cls = "bad request"
    g = lambda **kw: {"input_ids": [1, 2], **kw}  # noqa: E731
    cases = [
        ("max_new_tokens 10^12", g(sampling_params={"max_new_tokens": 10**12}), "error"),
        ("max_new_tokens -1", g(sampling_params={"max_new_tokens": -1}), "error"),
        ("max_new_tokens '5'", g(sampling_params={"max_new_tokens": "5"}), "error"),
        ("temperature 1e309 (JSON inf)", None, "error"),
        ("temperature -0.5", g(sampling_params={"temperature": -0.5}), "error"),
        ("top_p 0", g(sampling_params={"top_p": 0}), "error"),
        ("top_k -5", g(sampling_params={"top_k": -5}), "error"),
        ("n 0", g(sampling_params={"n": 0}), "error"),
        ("n 10^6", g(sampling_params={"n": 10**6}), "error"),
        ("input id 2^63", {"input_ids": [1, 2**63]}, "error"),
        ("input id -1", {"input_ids": [1, -1]}, "error"),
        ("input id = vocab", {"input_ids": [1, 40]}, "error"),
        ("ragged batch with an empty prompt", {"input_ids": [[1, 2], []]}, "error"),
        ("prompt longer than --max-len", {"input_ids": [1] * 60}, "error"),
        ("rid list shorter than batch", {"input_ids": [[1], [2]], "rid": ["a"]}, "error"),
        ("rid an int", g(rid=5), "error"),
        ("stop_token_ids a string", g(sampling_params={"stop_token_ids": "3"}), "error"),
        ("logprob_start_len 99", g(return_logprob=True, logprob_start_len=99), "error"),
        ("top_logprobs_num -3", g(return_logprob=True, top_logprobs_num=-3), "error"),
        ("sampling_seed 2^70 (mod 2^63, reproducible)",
         g(sampling_params={"sampling_seed": 2**70, "max_new_tokens": 4}), "ok"),
        ("JSON nested 100000 deep", None, "error"),
        ("body is a JSON string", "s", "error"),
        ("valid request with unicode rid", g(rid="ü-\u2603", sampling_params={"max_new_tokens": 2}), "ok"),
    ]
    for what, body, expect in cases:
        if what.startswith("temperature 1e309"):
            raw = b'{"input_ids": [1, 2], "sampling_params": {"temperature": 1e309}}'
        elif what.startswith("JSON nested"):
            raw = b"[" * 100000 + b"]" * 100000
        else:
            raw = json.dumps(body).encode()
        status, text = http(srv.url, "/generate", raw=raw)
        def again():  # same sampling_seed, same tokens (the response id is per request)
            s2, t2 = http(srv.url, "/generate", raw=raw)
            return s2 == status and json.loads(t2)["output_ids"] == json.loads(text)["output_ids"]
        record(cls, f"/generate {what}", status, text, expect, srv,
               check=again if "reproducible" in what else None)


# -- release / abort races -----------------------------------------------------------------
def probe_races(srv):
    cls = "release/abort race"
    long = {"max_new_tokens": 16, "ignore_eos": True}

    def fire(k):
        out = []
        ts = [threading.Thread(target=lambda i=i: out.append(http(srv.url, "/generate", {
            "input_ids": [1, 2 + i % 30], "rid": f"race-{k}-{i}", "sampling_params": long})))
            for i in range(k)]
        for t in ts:
            t.start()
        return ts, out

    for k in (4, 16):
        ts, out = fire(k)
        released, after = False, []
        t_end = time.monotonic() + BOUND
        while time.monotonic() < t_end and not released:
            status, _ = http(srv.url, "/release_memory_occupation", {})
            released = status == 200
        if released:
            for _ in range(10):
                info = json.loads(http(srv.url, "/server_info")[1])
                after.append(info["running"] + info["waiting"])
        for t in ts:
            t.join(BOUND)
        http(srv.url, "/resume_memory_occupation", {})
        hung = any(t.is_alive() for t in ts)
        verdict = "hang" if hung else ("correct" if released and not any(after) else "silent")
        ROWS.append((cls, f"release while {k} generate", verdict,
                     f"released={released}, engine after release {after[:5]}"))
    ts, out = fire(8)
    time.sleep(0.2)
    status, text = http(srv.url, "/abort_request", {"abort_all": True})
    for t in ts:
        t.join(BOUND)
    aborted = sum(1 for s, t in out if s == 200 and '"abort"' in t)
    ROWS.append((cls, "abort_all during 8 generate", "correct" if status == 200 and len(out) == 8
                 else "silent", f"{aborted} aborted, {len(out)} answered"))
    cases = [
        ("release twice", [("/release_memory_occupation", {}), ("/release_memory_occupation", {})],
         "ok"),
        ("generate while released", [("/release_memory_occupation", {}),
                                     ("/generate", {"input_ids": [1, 2]})], "error"),
        ("resume unknown tag", [("/resume_memory_occupation", {"tags": ["gpu"]})], "error"),
        ("release tags not a list", [("/release_memory_occupation", {"tags": "weights"})], "error"),
        ("abort unknown rid", [("/abort_request", {"rid": "never-sent"})], "ok"),
        ("abort rid of wrong type", [("/abort_request", {"rid": 7})], "error"),
        ("end session never begun", [("/end_weight_update", {})], "error"),
        ("begin session twice", [("/begin_weight_update", {}), ("/begin_weight_update", {})], "error"),
    ]
    for what, calls, expect in cases:
        for path, body in calls:
            status, text = http(srv.url, path, body)
        record(cls, what, status, text, expect, srv)
        http(srv.url, "/resume_memory_occupation", {})
        http(srv.url, "/end_weight_update", {})


# -- bad CLI arguments ----------------------------------------------------------------------
def probe_cli(folder, tmp):
    cls = "CLI"
    (tmp / "afile").write_text("x")
    cases = [
        ["--idle-timeout", "0"], ["--idle-timeout", "-1"], ["--idle-timeout", "nan"],
        ["--idle-timeout", "inf"], ["--body-timeout", "abc"], ["--body-timeout", "0"],
        ["--max-connections", "0"], ["--max-connections", "-5"], ["--max-connections", "1.5"],
        ["--weight-sync-timeout", "nan"], ["--weight-sync-timeout", "inf"],
        ["--weight-sync-timeout", "-3"], ["--max-request-mb", "nan"], ["--port", "70000"],
        ["--port", "-1"], ["--threads", "0"], ["--max-len", "1"], ["--dtype", "fp8"],
        ["--model", str(tmp / "missing")], ["--model", str(tmp / "afile")],
        ["--host", "999.1.1.1"], ["--max-running", "0"], ["--device", "tpu"],
    ]
    def one(extra):
        args = ["--model", str(folder), *extra] if extra[0] != "--model" else extra
        if "--port" not in extra:
            args += ["--port", str(free_port())]
        try:
            p = subprocess.run([sys.executable, "-m", "lockstep.launch.serve", *args],
                               capture_output=True, text=True, timeout=180,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
        except subprocess.TimeoutExpired:
            return (cls, " ".join(extra), "hang", "kept running (it started serving?)")
        err = p.stderr.strip().splitlines()
        if p.returncode == 2 and err and "Traceback" not in p.stderr:
            verdict = "clear error"
        elif "Traceback" in p.stderr or p.returncode not in (0, 2):
            verdict = "crash"
        else:
            verdict = "silent"
        return (cls, " ".join(extra), verdict, f"exit {p.returncode}: {(err or [''])[-1][:150]}")
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(4) as pool:  # each run imports torch: slow on a busy host
        for row in pool.map(one, cases):
            ROWS.append(row)


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="probe-round2-"))
    torch.manual_seed(0)
    model = MoEModel(tiny_config(max_position_embeddings=64, mlp_only_layers=[0]))
    base = save_hf(model, tmp / "base")
    sd = {k: v.detach().clone() for k, v in hf_state_dict(model).items()}
    srv = Server(base, "--dtype", "bf16", "--idle-timeout", "2", "--body-timeout", "2",
                 "--max-connections", "100", "--weight-sync-timeout", "15")
    try:
        for section in (lambda: probe_pushes(srv, sd), lambda: probe_folders(srv, model, sd, tmp),
                        lambda: probe_slow(srv), lambda: probe_requests(srv),
                        lambda: probe_races(srv)):
            t0 = time.monotonic()
            section()
            print(f"  ({time.monotonic() - t0:.0f}s)", flush=True)
    finally:
        alive = srv.proc.poll() is None
        srv.stop()
        if not alive:
            ROWS.append(("server", "process at the end", "crash",
                         Path(srv.log.name).read_text()[-300:]))
    probe_cli(base, tmp)
    counts = Counter(r[2] for r in ROWS)
    print(f"\n{len(ROWS)} inputs: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    return 1 if counts["silent"] or counts["crash"] or counts["hang"] else 0


if __name__ == "__main__":
    sys.exit(main())
