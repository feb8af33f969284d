"""Differential wire suite (run by tests/test_sglang_real.py on its server): one sequence of
requests (generation with routes, log-probs, sampling masks, n > 1 and start lengths, a second
turn asking only its new routes; aborts; version calls; weight-update sessions and pushes;
malformed and out-of-order calls) sent to a real SGLang 0.5.23 server and to
`lockstep serve` (a real process) over the same fp32 HF folder, in the same order. Compared per
request: HTTP status, the `success` flag and the response's shape (the wire keys clients read;
fields only one side sends are ignored). Every difference is listed in KNOWN with its reason.

The comparison table in docs/rollout.md ("Differential wire suite") is generated here: the test
fails when the docs differ from what the servers answered. Regenerate it with
`LOCKSTEP_WRITE_WIRE_TABLE=1 python -m pytest -q tests/test_sglang_real.py -k wire`.
"""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from lockstep.cluster.ports import free_port

from server_fixtures import call
from sglang_fixtures import stop_group

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "rollout.md"
START, END = "<!-- wire-table:start -->", "<!-- wire-table:end -->"
FOLDER = "<folder>"  # replaced by the served HF folder

P = [1, 5, 7, 3, 9]
GREEDY = {"max_new_tokens": 3, "temperature": 0.0}
TURN = {**GREEDY, "ignore_eos": True}
MASK = {"max_new_tokens": 3, "temperature": 1.0, "top_p": 0.9, "top_k": 16, "ignore_eos": True}


def gen(**kw):
    return {"input_ids": P, "sampling_params": GREEDY, "return_logprob": True, **kw}


# (label, method, path, body): sent in this order to both servers (state carries over); a
# callable body is built from the previous answer (a later turn of a trajectory).
STEPS = [
    ("generate, greedy", "POST", "/generate", gen()),
    ("generate + routes", "POST", "/generate", gen(return_routed_experts=True)),
    ("generate + routes, routed_experts_start_len=2", "POST", "/generate",
     gen(return_routed_experts=True, routed_experts_start_len=2)),
    ("generate + routes, routed_experts_start_len=5 (the prompt length)", "POST", "/generate",
     gen(return_routed_experts=True, routed_experts_start_len=5)),
    ("generate + routes, routed_experts_start_len=6 (past the prompt)", "POST", "/generate",
     gen(return_routed_experts=True, routed_experts_start_len=6)),
    ("generate + routes, batch with per-prompt routed_experts_start_len [2, 0]", "POST",
     "/generate", gen(input_ids=[P, P[:3]], return_routed_experts=True,
                      routed_experts_start_len=[2, 0])),
    ("multi-turn: turn 1 (greedy, 3 tokens, routes)", "POST", "/generate",
     gen(sampling_params=TURN, return_routed_experts=True)),
    ("multi-turn: turn 2 = turn 1 + its tokens + 2 observation tokens, routes from turn 1's "
     "last sampled token (prefix-cache hit)", "POST", "/generate", lambda prev: gen(
         input_ids=P + prev["output_ids"] + [8, 2], sampling_params=TURN,
         return_routed_experts=True,
         routed_experts_start_len=len(P) + len(prev["output_ids"]) - 1)),
    ("generate + prompt log-probs (logprob_start_len=0)", "POST", "/generate",
     gen(logprob_start_len=0)),
    ("generate, batch of 2 prompts", "POST", "/generate", gen(input_ids=[P, P[:3]])),
    ("generate, n=2", "POST", "/generate",
     gen(sampling_params={"max_new_tokens": 3, "temperature": 1.0, "n": 2, "ignore_eos": True})),
    ("generate + sampling mask (top_p 0.9, top_k 16, selected)", "POST", "/generate",
     gen(sampling_params=MASK, return_sampling_mask=True, sampling_logprobs_mode="selected")),
    ("generate + sampling mask, support log-probs", "POST", "/generate",
     gen(sampling_params=MASK, return_sampling_mask=True, sampling_logprobs_mode="support")),
    ("generate + sampling mask, n=2", "POST", "/generate",
     gen(sampling_params={**MASK, "n": 2}, return_sampling_mask=True)),
    ("generate + sampling mask, top_k=-1 top_p=0.9", "POST", "/generate",
     gen(sampling_params={**MASK, "top_k": -1}, return_sampling_mask=True)),
    ("generate, unknown sampling key", "POST", "/generate",
     gen(sampling_params={"max_new_tokens": 2, "temprature": 1.0})),
    ("generate, min_new_tokens=1", "POST", "/generate",
     gen(sampling_params={**GREEDY, "min_new_tokens": 1})),
    ("generate, body is not JSON", "POST", "/generate", b"{not json"),
    ("abort_request, unknown rid", "POST", "/abort_request", {"rid": "nobody"}),
    ("abort_request, abort_all", "POST", "/abort_request", {"abort_all": True}),
    ("update_weight_version v9", "POST", "/update_weight_version", {"new_version": "v9"}),
    ("model_info after it", "GET", "/model_info", None),
    ("update_weights_from_distributed, no session", "POST", "/update_weights_from_distributed",
     {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[16, 96]],
      "group_name": "nope"}),
    ("update_weights_from_tensor, no session", "POST", "/update_weights_from_tensor",
     {"serialized_named_tensors": [""], "load_format": "flattened_bucket"}),
    ("end_weight_update, no session", "POST", "/end_weight_update", {}),
    ("begin_weight_update", "POST", "/begin_weight_update", {}),
    ("begin_weight_update again", "POST", "/begin_weight_update", {}),
    ("update_weights_from_disk inside the session", "POST", "/update_weights_from_disk",
     {"model_path": FOLDER, "weight_version": "d1"}),
    ("end_weight_update", "POST", "/end_weight_update", {}),
    ("end_weight_update again", "POST", "/end_weight_update", {}),
    ("update_weights_from_disk, no session", "POST", "/update_weights_from_disk",
     {"model_path": FOLDER, "weight_version": "d2"}),
    ("model_info after it", "GET", "/model_info", None),
    ("update_weights_from_disk, missing folder", "POST", "/update_weights_from_disk",
     {"model_path": "/nonexistent/folder"}),
    ("destroy_weights_update_group, unknown group", "POST", "/destroy_weights_update_group",
     {"group_name": "nope"}),
    ("generate after the weight calls", "POST", "/generate", gen()),
    ("flush_cache", "POST", "/flush_cache", None),
    ("health", "GET", "/health", None),
    ("health_generate", "GET", "/health_generate", None),
]

# label -> why lockstep serve answers differently (kept: the test fails if they agree now).
ERROR_BODY = ("error bodies: SGLang answers {\"error\": \"<text>\"} for a contract error "
              "and {\"object\": \"error\", \"message\"} for a body it cannot validate; ours "
              "always {\"error\": {\"message\"}} (clients read the status and the text)")
KNOWN = {
    "generate + sampling mask, n=2": "SGLang fails it with HTTP 500 (its n > 1 prefix warm-up "
    "copy keeps the flag and samples nothing); ours refuses it up front with 400 naming the "
    "rule. HTTPBackend sends n single requests instead",
    "generate + routes, batch with per-prompt routed_experts_start_len [2, 0]": "SGLang "
    "0.5.23 takes one int only (HTTP 400, its request validation); ours takes a list per prompt "
    "like logprob_start_len. HTTPBackend sends one prompt per request",
    "generate, unknown sampling key": ERROR_BODY,
    "generate, body is not JSON": ERROR_BODY,
}

GEN_KEYS = ("output_ids", "meta_info")
META_KEYS = ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
             "output_token_logprobs", "input_token_logprobs", "routed_experts", "weight_version",
             "output_token_sampling_mask", "output_token_sampling_logprobs")
WIRE_KEYS = ("success", "message", "num_paused_requests", "weight_version", "model_path",
             "is_generation", "error")


def shape(v) -> str:
    """The part of an answer clients read: generate objects by their wire keys, other
    objects by WIRE_KEYS, lists by length and their items' shape; text as `text`."""
    if isinstance(v, list):
        items = sorted({shape(x) for x in v})
        return f"[{len(v)} x {' | '.join(items)}]" if v else "[]"
    if isinstance(v, dict):
        if "meta_info" in v:
            meta = v["meta_info"] if isinstance(v["meta_info"], dict) else {}
            keys = [k for k in META_KEYS if meta.get(k) is not None]
            if "routed_experts" in keys:  # how many rows: the byte count of the int32 payload
                n = len(base64.b64decode(meta["routed_experts"]))
                keys[keys.index("routed_experts")] = f"routed_experts[{n} B]"
            ft = meta.get("finish_reason")
            kind = ft.get("type") if isinstance(ft, dict) else ft
            return f"gen({len(v.get('output_ids') or [])} ids, {kind}; {', '.join(keys)})"
        if "error" in v and isinstance(v["error"], dict):
            return "error{message}" if "message" in v["error"] else "error"
        return "{" + ", ".join(k for k in WIRE_KEYS if k in v) + "}"
    return "text" if v not in (None, "") else "empty"


def answer(status: int, body) -> tuple[int, object, str]:
    ok = body.get("success") if isinstance(body, dict) else None
    return status, ok, shape(body)


def run(url: str, folder: Path) -> list[tuple[int, object, str]]:
    out, prev = [], None
    for _, method, path, body in STEPS:
        if callable(body):
            body = body(prev)
        if isinstance(body, dict) and body.get("model_path") == FOLDER:
            body = {**body, "model_path": str(folder)}
        raw = body if isinstance(body, bytes) else None
        status, resp = call(url, path, None if raw else body, raw=raw, method=method,
                            timeout=120)
        out.append(answer(status, resp))
        prev = resp
    return out


def cell(a: tuple[int, object, str]) -> str:
    status, ok, sh = a
    flag = "" if ok is None else f" success={str(ok).lower()}"
    return f"{status}{flag} `{sh}`".replace("|", "\\|")


def table(theirs, ours) -> str:
    rows = ["| request | SGLang 0.5.23 | lockstep serve | difference |", "|---|---|---|---|"]
    for (label, method, path, _), t, o in zip(STEPS, theirs, ours):
        note = "same" if t == o else KNOWN.get(label, "**unexplained**")
        rows.append(f"| {method} {path}: {label} | {cell(t)} | {cell(o)} | {note} |")
    return "\n".join(rows)


def check_docs(theirs, mine) -> None:
    """Every difference explained (KNOWN), none listed that is gone, the docs table current;
    LOCKSTEP_WRITE_WIRE_TABLE=1 rewrites the docs table instead of checking it."""
    generated = table(theirs, mine)
    text = DOCS.read_text()
    head, rest = text.split(START)
    table_now, tail = rest.split(END)
    if os.environ.get("LOCKSTEP_WRITE_WIRE_TABLE") == "1":
        DOCS.write_text(f"{head}{START}\n{generated}\n{END}{tail}")
        table_now = generated
    unexplained = [f"{label}: SGLang {cell(t)}, ours {cell(o)}"
                   for (label, *_), t, o in zip(STEPS, theirs, mine)
                   if t != o and label not in KNOWN]
    assert not unexplained, "\n".join(unexplained)
    stale = [label for (label, *_), t, o in zip(STEPS, theirs, mine)
             if t == o and label in KNOWN]
    assert not stale, f"listed as differing but now the same: {stale}"
    assert table_now.strip() == generated, (
        "docs/rollout.md's wire table is stale: regenerate it (module docstring)")


@contextlib.contextmanager
def lockstep_serve(folder: Path):
    """`lockstep serve` (a real process, fp32) over `folder` on a free loopback port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.launch.serve", "--model",
                             str(folder), "--dtype", "fp32", "--port", str(port),
                             "--threads", "1", "--max-len", "32"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if call(url, "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "lockstep serve died"
            time.sleep(0.2)
        yield url
    finally:
        stop_group(proc)
