"""`lockstep plan` configs for the largest MoE models (configs/cluster_{deepseek_v3, kimi_k2,
qwen3_235b_a22b, glm45_355b}.yaml, on 16-64 nodes of 8 GPUs), each layout checked by the
libraries that would run it, without GPUs:

- megatron-core 0.16.1: the actor's own TransformerConfig (MLATransformerConfig for the MLA
  models) is built from the plan's arguments, its __post_init__ checks included (pipeline
  layout against the layer count, MoE and parallel sizes), and its parallel-state arithmetic
  (`RankGenerator`, order tp-cp-ep-dp-pp) gives every rank the coordinates the plan prints;
- SGLang 0.5.23 (its venv, tests/sglang_cpu/install.sh): every server's command line is parsed
  by SGLang's own argument parser into its `ServerArgs` (the `__post_init__` checks included);
- published figures: the plan's SGLang memory per GPU agrees with what the model owners and
  SGLang publish (docs/cluster.md names the sources).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from lockstep.launch.plan import make_plan
from lockstep.trainer.actor.build import planned_nodes
from lockstep.trainer.config.load import load_config

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"deepseek_v3": 671.0, "kimi_k2": 1026.4, "qwen3_235b_a22b": 235.1, "glm45_355b": 352.8}
SGLANG_PY = Path.home() / ".cache/lockstep/sglang-0.5.23/bin/python"


def _cfg(name: str, *sets: str):
    return load_config(ROOT / f"configs/cluster_{name}.yaml", list(sets))


@pytest.fixture(autouse=True)
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # model.path is relative to the repository


@pytest.mark.parametrize("name", list(MODELS))
def test_the_plan_fits_and_is_what_train_pins(name):
    cfg = _cfg(name)
    p = make_plan(cfg)
    assert not p["refusals"], p["refusals"]
    assert abs(p["model"]["params"] / 1e9 - MODELS[name]) < 0.1  # the published sizes
    assert 16 <= cfg.cluster.nodes <= 64 and cfg.cluster.gpus_per_node == 8
    assert p["placement"]["gpus_needed"] == p["placement"]["gpus_total"]  # no GPU idle
    # the node of every rank and server in the plan is the node `lockstep train` pins it to
    ranks, engines = planned_nodes(cfg)
    assert [r["node"] for r in p["actor"]["rank_layout"]] == ranks
    assert [e["node"] for e in p["placement"]["engines"]] == engines
    if name == "kimi_k2":  # 384 experts: uint16 routes
        assert p["buffers"]["routes_dtype"] == "uint16"
    if name in ("deepseek_v3", "kimi_k2", "glm45_355b"):  # 61 / 61 / 92 layers: uneven stages
        assert len(set(p["actor"]["layout"]["pipeline_layers"])) == 2


@pytest.mark.megatron
@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_core_accepts_the_layout(name):
    pytest.importorskip("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    from lockstep.trainer.config.megatron import actor_options
    from lockstep.trainer.actor.megatron.model import transformer_config
    cfg = _cfg(name)
    p = make_plan(cfg)
    # the GPU build uses Transformer Engine's layers; the config checks are the same without
    opts = dataclasses.replace(actor_options(cfg.actor, cfg.actor.megatron),
                               use_transformer_engine=False, grouped_gemm=False)
    tc = transformer_config(cfg.model, opts)
    assert type(tc).__name__ == ("MLATransformerConfig" if cfg.model.is_mla
                                 else "TransformerConfig")
    args = p["actor"]["megatron_args"]
    for k in ("tensor_model_parallel_size", "expert_model_parallel_size",
              "pipeline_model_parallel_size", "num_layers", "num_moe_experts", "moe_router_topk"):
        assert getattr(tc, k) == args[k], k
    assert str(tc.pipeline_model_parallel_layout) == args["pipeline_model_parallel_layout"] or \
        tc.pipeline_model_parallel_layout is not None
    lay, ranks = p["actor"]["layout"], p["actor"]["rank_layout"]
    dense = RankGenerator(tp=lay["tensor_parallel"], ep=1, dp=lay["data_parallel"],
                          pp=lay["pipeline_parallel"], cp=lay["context_parallel"],
                          order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=lay["expert_tensor_parallel"], ep=lay["expert_parallel"],
                           dp=lay["expert_data_parallel"], pp=lay["pipeline_parallel"], cp=1,
                           order="tp-cp-ep-dp-pp")
    assert dense.world_size == expert.world_size == cfg.cluster.actor_ranks
    for axis, gen, key in (("tp", dense, "tp"), ("dp", dense, "dp"), ("pp", dense, "pp"),
                           ("ep", expert, "ep")):
        groups = gen.get_ranks(axis)
        assert sorted(r for g in groups for r in g) == list(range(cfg.cluster.actor_ranks))
        for group in groups:
            assert [ranks[r][key] for r in group] == list(range(len(group))), (axis, group)


@pytest.mark.megatron
def test_megatron_core_refuses_a_broken_layout():
    """The checks above can fail: a pipeline layout one layer short, and an EP that does
    not divide the experts, are refused by megatron-core itself."""
    pytest.importorskip("megatron.core")
    from lockstep.trainer.config.megatron import actor_options, megatron_args
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    cfg = _cfg("deepseek_v3")
    opts = dataclasses.replace(actor_options(cfg.actor, cfg.actor.megatron),
                               use_transformer_engine=False, grouped_gemm=False)
    args = megatron_args(cfg.model, opts, use_te=False, on_gpu=False)
    import torch.nn.functional as F
    args["activation_func"] = getattr(F, args["activation_func"])
    import torch
    for k in ("params_dtype", "pipeline_dtype"):
        if args[k] is not None:
            args[k] = getattr(torch, args[k])
    short = dict(args, pipeline_model_parallel_layout=args["pipeline_model_parallel_layout"]
                 .replace("tttL", "ttL"))
    with pytest.raises(Exception, match="layer"):
        MLATransformerConfig(**short)
    with pytest.raises(Exception):
        MLATransformerConfig(**dict(args, num_moe_experts=250))


def _sglang_parse(argvs: list[list[str]]) -> list[dict]:
    """Each SGLang command line through SGLang's own parser and ServerArgs, in its venv."""
    script = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
out = []
for argv in json.loads(sys.stdin.read()):
    p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)
    try:
        a = ServerArgs.from_cli_args(p.parse_args(argv))
        out.append({k: getattr(a, k) for k in ("tp_size", "ep_size", "dtype", "quantization",
                    "mem_fraction_static", "context_length", "enable_return_routed_experts",
                    "skip_tokenizer_init", "random_seed")})
    except BaseException as e:
        out.append({"error": f"{type(e).__name__}: {e}"[:300]})
print("RESULT" + json.dumps(out))
"""
    got = subprocess.run([str(SGLANG_PY), "-c", script], input=json.dumps(argvs), text=True,
                         capture_output=True, timeout=600,
                         env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
    line = [x for x in got.stdout.splitlines() if x.startswith("RESULT")]
    assert line, got.stderr[-3000:]
    return json.loads(line[0][len("RESULT"):])


@pytest.mark.sglang
def test_sglang_parses_every_server_command():
    if not SGLANG_PY.exists():
        pytest.skip(f"no SGLang venv at {SGLANG_PY} (tests/sglang_cpu/install.sh)")
    argvs, want = [], []
    for name in MODELS:
        cfg = _cfg(name)
        engines = make_plan(cfg)["placement"]["engines"]
        assert len(engines) == cfg.rollout.num_engines
        for e in engines[:1]:  # every server's command differs only in its node
            argv = e["command"]["argv"]
            argvs.append(argv[argv.index("sglang.launch_server") + 1:])
            want.append(cfg)
    bad = list(argvs[0])  # a dtype spelled lockstep's way, not SGLang's: refused
    bad[bad.index("--dtype") + 1] = "bf16"
    got = _sglang_parse(argvs + [bad])
    for cfg, g in zip(want, got):
        assert "error" not in g, g
        sg = cfg.rollout.sglang
        assert (g["tp_size"], g["ep_size"]) == (sg.tp_size, sg.ep_size)
        assert g["context_length"] == sg.context_length and g["mem_fraction_static"] == 0.85
        assert g["enable_return_routed_experts"] and g["skip_tokenizer_init"]
        assert g["quantization"] == ("fp8" if cfg.rollout.dtype == "fp8" else None)
    assert "error" in got[-1], got[-1]


def _sglang_fits(name: str, *sets: str) -> bool:
    p = make_plan(_cfg(name, *sets))
    return not any("SGLang" in r for r in p["refusals"])


def test_sglang_memory_agrees_with_published_figures():
    """SGLang's DeepSeek-V3 guide: FP8 on 8 x H200, BF16 (upcast) needs 2 x 8 H200; GLM-4.5's
    README: BF16 on 8 x H200 or 16 x H100 (docs/cluster.md). The plan's weights per GPU say
    the same of one TP-8 server."""
    assert _sglang_fits("deepseek_v3")                                   # FP8, 8 x H200
    assert not _sglang_fits("deepseek_v3", "rollout.dtype=bf16")          # BF16: not on 8
    assert _sglang_fits("glm45_355b")                                    # BF16, 8 x H200
    assert not _sglang_fits("glm45_355b", "cluster.gpu_memory_gib=79.6")  # not on 8 x H100
