"""The vLLM differential wire suite (tests/test_vllm_real.py runs it on the tier's server).

`lockstep serve` speaks SGLang's wire and claims no vLLM compatibility, so the differential
is between real vLLM 0.32 and what lockstep's vLLM client relies on (`EXPECT`: the answers
the facts we started from and rollout/vllm_client.py assume). Every step's real answer is
recorded as `status shape`; where it differs from the expectation the step must be listed in
`KNOWN` with the reason (what the client does about it), else the test fails; the table in
docs/rollout.md is generated from the answers (LOCKSTEP_WRITE_VLLM_TABLES=1 rewrites it,
otherwise the test fails when it is stale). No step may kill the server: token ids outside
the vocabulary are never sent (they kill vLLM's engine; the client refuses them).
"""

from __future__ import annotations

import base64
import io
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

DOCS = Path(__file__).resolve().parent.parent / "docs" / "rollout.md"
START, END = "<!-- vllm-wire-table:start -->", "<!-- vllm-wire-table:end -->"
G = "/inference/v1/generate"
# ignore_eos: every answer's length (and so its shape) is the same whatever the weights
SP = {"max_tokens": 3, "temperature": 1.0, "top_k": 17, "seed": 3, "logprobs": 0,
      "ignore_eos": True}
P = [1, 5, 7, 3, 9]

# (label, method, path, body, expected "status shape" or status alone)
STEPS = [
    ("generate with log-probs", "POST", G, {"token_ids": P, "sampling_params": SP}, "200 gen"),
    ("n=2, seeded", "POST", G, {"token_ids": P, "sampling_params": {**SP, "n": 2}}, "200 gen"),
    ("prompt log-probs", "POST", G,
     {"token_ids": P, "sampling_params": {**SP, "prompt_logprobs": 0}}, "200 gen"),
    ("routed_experts_prompt_start=2", "POST", G,
     {"token_ids": P, "sampling_params": {**SP, "routed_experts_prompt_start": 2}}, "200 gen"),
    ("routed_experts_prompt_start=P (5)", "POST", G,
     {"token_ids": P, "sampling_params": {**SP, "routed_experts_prompt_start": 5}}, "200 gen"),
    ("routed_experts_prompt_start=P+1", "POST", G,
     {"token_ids": P, "sampling_params": {**SP, "routed_experts_prompt_start": 6}}, "400"),
    ("top_p 0.5, top_k 8 (mask server)", "POST", G,
     {"token_ids": P, "sampling_params": {**SP, "top_p": 0.5, "top_k": 8}}, "200 gen"),
    ("top_k=-1 (mask server)", "POST", G,
     {"token_ids": P, "sampling_params": {**SP, "top_k": -1}}, "500"),
    ("temperature 0 (mask server)", "POST", G,
     {"token_ids": P, "sampling_params": {**SP, "temperature": 0.0, "top_k": 1}}, "200 gen"),
    ("min_tokens=2", "POST", G,
     {"token_ids": P, "sampling_params": {**SP, "min_tokens": 2}}, "200 gen"),
    ("stop_token_ids", "POST", G,
     {"token_ids": P, "sampling_params": {**SP, "stop_token_ids": list(range(17))}}, "200 gen"),
    ("unknown sampling key", "POST", G,
     {"token_ids": P, "sampling_params": {**SP, "max_new_tokens": 3}}, "400"),
    ("unknown top-level key", "POST", G,
     {"token_ids": P, "sampling_params": SP, "input_ids": P}, "400"),
    ("prompt longer than max_model_len", "POST", G,
     {"token_ids": [1] * 40, "sampling_params": SP}, "400"),
    ("max_tokens past max_model_len", "POST", G,
     {"token_ids": [1] * 20, "sampling_params": {**SP, "max_tokens": 20}}, "400"),
    ("empty token_ids", "POST", G, {"token_ids": [], "sampling_params": SP}, "400"),
    ("body is not JSON", "POST", G, b"{nope", "400"),
    ("abort an unknown request", "POST", "/inference/v1/abort_requests",
     {"request_ids": ["generate-tokens-nobody"]}, "200"),
    ("is_paused", "GET", "/is_paused", None, "200 {is_paused}"),
    ("update_weights before init", "POST", "/update_weights",
     {"update_info": {"names": [], "dtype_names": [], "shapes": []}}, "400"),
    ("finish_weight_update without start", "POST", "/finish_weight_update",
     {"weight_version": "x"}, "400"),
    ("init with an unknown init_info field", "POST", "/init_weight_transfer_engine",
     {"init_info": {"bogus": 1}}, "400"),
    ("resume while not paused", "POST", "/resume", {}, "200 {status}"),
    ("pause?mode=wait", "POST", "/pause?mode=wait", {}, "200 {status}"),
    ("is_paused while paused", "GET", "/is_paused", None, "200 {is_paused}"),
    ("resume", "POST", "/resume", {}, "200 {status}"),
    ("pause?mode=bogus", "POST", "/pause?mode=bogus", {}, "400"),
    ("update_weight_version w9", "POST", "/update_weight_version", {"new_version": "w9"},
     "200 {new_version, success}"),
    ("weight_info after it", "GET", "/weight_info", None, "200 {weight_version}"),
    ("get_world_size", "GET", "/get_world_size", None, "200 {world_size}"),
    ("generate after the weight calls", "POST", G, {"token_ids": P, "sampling_params": SP},
     "200 gen"),
]

KNOWN = {
    "temperature 0 (mask server)": "vLLM refuses greedy on a --return-sampling-mask server "
    "('sampling distribution replay requires temperature > 0'), HTTP 500 with an empty "
    "message: VLLMBackend sends greedy as top_k=1 at temperature 1",
    "unknown sampling key": "vLLM ignores unknown sampling_params keys (a misspelled flag "
    "silently means off): VLLMBackend builds the body from typed fields only",
    "unknown top-level key": "vLLM ignores unknown top-level keys: as above",
    "max_tokens past max_model_len": "vLLM clamps max_tokens to what fits in max_model_len "
    "(12 of the 20 asked here) instead of refusing; VLLMBackend checks the answer's length "
    "like any other",
    "update_weights before init": "vLLM answers a refusal by its workers with HTTP 500 "
    "('Call to collective_rpc method failed: Worker failed with error ...'), not 400: "
    "VLLMWeightSync reads a refused pause/start/join as nothing changed (auto -> disk)",
    "finish_weight_update without start": "HTTP 500 from the worker, as above",
    "init with an unknown init_info field": "HTTP 500 from the worker, as above",
}


def call(url: str, method: str, path: str, body) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else (None if body is None else
                                                 json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw.strip() else None
    except ValueError:
        return status, raw.decode(errors="replace")


def shape(v) -> str:
    """The keys clients read: gen(ids, finish, log-probs, routes shape, masks per choice);
    the masks' sizes depend on the weights, so only their count is shown."""
    if isinstance(v, dict) and isinstance(v.get("choices"), list):
        parts = []
        for c in v["choices"]:
            r = c.get("routed_experts")
            routes = "none" if r is None else "x".join(
                map(str, np.load(io.BytesIO(base64.b64decode(r)), allow_pickle=False).shape))
            mask = c.get("sampling_mask")
            lp = "lp" if (c.get("logprobs") or {}).get("content") else "no lp"
            parts.append(f"{len(c.get('token_ids') or [])} ids {c.get('finish_reason')}, {lp}, "
                         f"routes {routes}, {len(mask) if mask else 'no'} masks")
        prompt = " + prompt_logprobs" if v.get("prompt_logprobs") else ""
        return "gen(" + "; ".join(parts) + ")" + prompt
    if isinstance(v, dict):
        if isinstance(v.get("error"), dict):
            msg = v["error"].get("message")
            return "error{message}" if msg else "error{message: ''}"
        if "error" in v:
            return "{error}"
        return "{" + ", ".join(sorted(v)) + "}"
    return "empty" if v in (None, "") else "text"


def run(url: str) -> list[tuple[int, str]]:
    return [(status, shape(resp)) for status, resp in
            (call(url, method, path, body) for _, method, path, body, _ in STEPS)]


def matches(answer: tuple[int, str], expected: str) -> bool:
    status, sh = answer
    want = expected.split(" ", 1)
    return str(status) == want[0] and (len(want) == 1 or sh.startswith(want[1]))


def table(answers) -> str:
    rows = ["| request | vLLM 0.32 answers | lockstep expected | difference |",
            "|---|---|---|---|"]
    for (label, method, path, *_, want), a in zip(STEPS, answers):
        note = "same" if matches(a, want) else KNOWN.get(label, "**unexplained**")
        cell = f"{a[0]} `{a[1]}`".replace("|", "\\|")
        rows.append(f"| {method} {path}: {label} | {cell} | {want} | {note} |")
    return "\n".join(rows)


def check_docs(answers) -> None:
    generated = table(answers)
    unexplained = [f"{label}: {a}" for (label, *_, want), a in zip(STEPS, answers)
                   if not matches(a, want) and label not in KNOWN]
    stale = [label for (label, *_, want), a in zip(STEPS, answers)
             if matches(a, want) and label in KNOWN]
    text = DOCS.read_text()
    head, rest = text.split(START)
    now, tail = rest.split(END)
    if os.environ.get("LOCKSTEP_WRITE_VLLM_TABLES") == "1":
        DOCS.write_text(f"{head}{START}\n{generated}\n{END}{tail}")
        now = generated
    assert not unexplained, "\n".join(unexplained)
    assert not stale, f"listed as differing but now as expected: {stale}"
    assert now.strip() == generated, "docs/rollout.md's vLLM wire table is stale (docstring)"
