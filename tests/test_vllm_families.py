"""The 2026 families on real vLLM 0.32 on CPU (the `vllm` tier; docs/model.md "Real engines and
the 2026 families" has the whole matrix and why the other families cannot run there).

gpt-oss runs: the toy of configs/toy_gpt_oss_r3.yaml at head_dim 32 (vLLM's CPU attention) with
YaRN as the released models have it (vLLM's gpt-oss reads rope_parameters["factor"] and friends
and fails without them; factor = max_position_embeddings / original_max_position_embeddings, the
ratio transformers takes for the attention factor when both are given). One fp32 server; the
routes of every prompt token equal our fp32 engine's and transformers' top-k, row for row.
The prompt log-probs differ by up to ~2e-3 (cause not found: the Qwen3-MoE toy of
test_vllm_real.py agrees within 1e-5 on the same kernels), so they are bounded, not equal.

Qwen3-Next runs in bf16 only (vLLM's CPU Gated DeltaNet kernel asserts bf16 and supports linear
head dims of 128, not 16 or 32): the toy_r3.yaml model as Qwen3-Next with 3 DeltaNet layers to
1 full-attention layer at those dims, one bf16 server vs our bf16 engine; rows may differ only
at fp32 near-ties of the router (as test_vllm_real's bf16 check).
"""

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from lockstep.moe.checkpoint import load_hf, save_hf
from lockstep.moe.model import MoEModel
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.rollout.vllm_client import VLLMBackend
from lockstep.trainer.config.load import load_config

from vllm_fixtures import vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
YARN = {"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16}  # max_position 32
QWEN3_NEXT = ["model.model_type=qwen3_next", "model.shared_expert_intermediate_size=96",
              "model.num_hidden_layers=4", "model.head_dim=32",
              "model.layer_types=[linear_attention,linear_attention,linear_attention,"
              "full_attention]", "model.linear_key_head_dim=128",
              "model.linear_value_head_dim=128", "model.linear_num_key_heads=2",
              "model.linear_num_value_heads=4"]
PROBE = [[1, 5, 7, 3, 9], [1, 12, 4], [1, 8, 8, 8, 2, 6, 11]]  # 7 tokens: past the window of 4


@pytest.fixture(scope="module")
def gpt_oss_folder(tmp_path_factory) -> Path:
    cfg = load_config(CONFIGS / "toy_gpt_oss_r3.yaml", ["model.head_dim=32"]).model
    assert cfg.max_position_embeddings == 32 and cfg.sliding_window == 4
    torch.manual_seed(99)
    return save_hf(MoEModel(dataclasses.replace(cfg, rope_scaling=YARN)),
                   tmp_path_factory.mktemp("gpt_oss") / "hf")


def test_gpt_oss_routes_equal_the_engine_and_transformers_fp32(gpt_oss_folder, tmp_path):
    from transformers import AutoModelForCausalLM
    model = load_hf(gpt_oss_folder)
    assert model.cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=1, seed=0),
                            return_input_logprobs=True) for p in PROBE]
    with vllm_server(gpt_oss_folder, "float32", tmp_path) as url:
        theirs = VLLMBackend(url, model.cfg).generate(reqs)
    ours = Engine.from_model(copy.deepcopy(model), EngineConfig(dtype="fp32", max_len=32)
                             ).generate(reqs)
    hf = AutoModelForCausalLM.from_pretrained(gpt_oss_folder, dtype=torch.float32).eval()
    K = model.cfg.num_experts_per_tok
    rows = agree_ours = agree_hf = 0
    worst = 0.0
    for p, t, o in zip(PROBE, theirs, ours):
        n = len(p)
        with torch.no_grad():
            out = hf(torch.tensor([p]), output_router_logits=True)
        hf_NLK = torch.stack([x.float().topk(K, -1).indices for x in out.router_logits], 1)
        v, e = t.routes_NLK[:n].long().sort(-1).values, o.routes_NLK[:n].long().sort(-1).values
        rows += v.shape[0] * v.shape[1]
        agree_ours += int((v == e).all(-1).sum())
        agree_hf += int((v == hf_NLK.sort(-1).values).all(-1).sum())
        worst = max(worst, float((t.input_logprobs[1:] - o.input_logprobs[1:n]).abs().max()))
    print(f"gpt-oss on vLLM fp32: {agree_ours}/{rows} rows = engine, {agree_hf}/{rows} = "
          f"transformers; max |prompt log-prob diff| {worst:.1e}")
    assert rows == 60 and agree_ours == rows and agree_hf == rows, (agree_ours, agree_hf, rows)
    assert worst < 1e-2, worst


def test_qwen3_next_bf16_routes_equal_the_engine_but_near_ties(tmp_path):
    from transformers import AutoModelForCausalLM
    cfg = load_config(CONFIGS / "toy_r3.yaml", QWEN3_NEXT).model
    torch.manual_seed(99)
    folder = save_hf(MoEModel(cfg), tmp_path / "hf")
    model = load_hf(folder)
    assert [model.cfg.layer_type(i) for i in range(4)] == ["linear_attention"] * 3 + [
        "full_attention"]
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=1, seed=0),
                            return_input_logprobs=True) for p in PROBE]
    with vllm_server(folder, "bfloat16", tmp_path) as url:
        theirs = VLLMBackend(url, model.cfg).generate(reqs)
    ours = Engine.from_model(copy.deepcopy(model), EngineConfig(dtype="bf16", max_len=32)
                             ).generate(reqs)
    hf32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    K = model.cfg.num_experts_per_tok
    rows = agree = 0
    tie_margins, worst = [], 0.0
    for p, t, o in zip(PROBE, theirs, ours):
        n = len(p)
        with torch.no_grad():
            r32 = hf32(torch.tensor([p]), output_router_logits=True).router_logits
        srt = torch.stack([x.float().sort(-1, descending=True).values for x in r32], 1)
        margin = srt[..., K - 1] - srt[..., K]  # [n, L] fp32 gap at the top-k boundary
        v, e = t.routes_NLK[:n].long().sort(-1).values, o.routes_NLK[:n].long().sort(-1).values
        same = (v == e).all(-1)
        rows += same.numel()
        agree += int(same.sum())
        tie_margins += margin[~same].tolist()
        worst = max(worst, float((t.input_logprobs[1:] - o.input_logprobs[1:n]).abs().max()))
    print(f"Qwen3-Next on vLLM bf16: {agree}/{rows} rows = engine (bf16); fp32 margins of the "
          f"differing rows {tie_margins}; max |prompt log-prob diff| {worst:.1e}")
    assert rows == 60 and agree >= 0.9 * rows, (agree, rows)
    assert all(m < 0.05 for m in tie_margins), tie_margins
    assert worst < 2e-2, worst  # bf16 (measured 2.2e-3)
