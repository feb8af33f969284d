"""The cluster plan: the `rollout.sglang` / `cluster` config keys it reads, the SGLang command
each engine is launched with, and `lockstep plan CONFIG` (placement, memory, refusals)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lockstep.trainer.config.load import load_config, save_config
from lockstep.trainer.config.types import ExperimentConfigError
from lockstep.trainer.driver.sglang_servers import sglang_server_config

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "configs" / "toy_r3.yaml"


def _flag(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


def test_sglang_section_maps_onto_the_launch_command():
    cfg = load_config(TOY, ["rollout.sglang.tp_size=4", "rollout.sglang.ep_size=2",
                            "rollout.sglang.mem_fraction_static=0.7",
                            "rollout.sglang.deterministic_inference=true",
                            "rollout.sglang.sampling_mask_max_tokens=64",
                            "rollout.sglang.extra_args=[--cuda-graph-max-bs, '8']",
                            "rollout.lm_head_dtype=fp32", "loop.seed=7"])
    argv = sglang_server_config(cfg, 1, model_path="/m", host="0.0.0.0").command()
    assert _flag(argv, "--tp-size") == "4" and _flag(argv, "--ep-size") == "2"
    assert _flag(argv, "--dtype") == "bfloat16"           # rollout.dtype: bf16
    assert _flag(argv, "--mem-fraction-static") == "0.7"
    assert _flag(argv, "--sampling-mask-max-tokens") == "64"
    assert _flag(argv, "--random-seed") == "7"
    assert _flag(argv, "--port") == "30001"               # the node's second server
    assert _flag(argv, "--model-path") == "/m"
    for flag in ("--enable-return-routed-experts", "--skip-tokenizer-init",
                 "--enable-fp32-lm-head", "--enable-deterministic-inference"):
        assert flag in argv
    assert argv[-2:] == ["--cuda-graph-max-bs", "8"]
    plain = sglang_server_config(load_config(TOY), model_path="/m").command()
    assert "--enable-fp32-lm-head" not in plain and "--enable-deterministic-inference" not in plain
    assert _flag(plain, "--tp-size") == "1"


@pytest.mark.parametrize("override, match", [
    (["rollout.sglang.tp_sise=2"], r"did you mean 'rollout\.sglang\.tp_size'"),
    (["rollout.sglang={ep_szie: 2}"], r"unknown key.*rollout\.sglang\.ep_szie.*did you mean "
                                      r"'rollout\.sglang\.ep_size'"),
    (["cluster.placment=colocated"], r"did you mean 'cluster\.placement'"),
    (["rollout.sglang.tp_size=4", "rollout.sglang.ep_size=3"],
     r"rollout\.sglang\.ep_size=3 must divide rollout\.sglang\.tp_size=4"),
    (["rollout.sglang.mem_fraction_static=1.5"], r"mem_fraction_static=1\.5 must be in \(0, 1\)"),
    (["rollout.sglang.extra_args=[--tp-size, '2']"],
     r"extra_args \['--tp-size'\].*rollout\.sglang\.tp_size"),
    (["cluster.placement=spread"], r"cluster\.placement='spread' is not one of"),
    (["cluster.gpus_per_node=-1"], r"cluster\.gpus_per_node=-1 is outside"),
])
def test_bad_sglang_and_cluster_keys_are_refused_by_name(override, match):
    with pytest.raises(ExperimentConfigError, match=match):
        load_config(TOY, override)


def test_defaults_leave_saved_configs_and_hashes_as_before():
    # hashes of toy_r3 before the section existed (runs written then still resume)
    assert load_config(TOY).hash() == "ca2ee681cb752ec3"
    assert load_config(TOY, ["cluster.actor_ranks=2"]).hash() == "e89adb74b71d7d92"
    d = load_config(TOY, ["cluster.actor_ranks=2"]).to_dict()
    assert "sglang" not in d["rollout"] and "placement" not in d["cluster"]
    assert load_config(TOY, ["rollout.sglang.tp_size=2"]).hash() != "ca2ee681cb752ec3"
    assert load_config(TOY, ["cluster.nodes=2"]).hash() != "ca2ee681cb752ec3"


def test_sglang_and_cluster_keys_survive_save_and_load(tmp_path):
    cfg = load_config(TOY, ["rollout.sglang.tp_size=4", "rollout.sglang.extra_args=[--x]",
                            "cluster.nodes=2", "cluster.gpus_per_node=8",
                            "cluster.placement=colocated", "cluster.gpu_memory_gib=79.6"])
    save_config(cfg, tmp_path / "c.yaml")
    back = load_config(tmp_path / "c.yaml")
    assert back == cfg and back.hash() == cfg.hash()


# -- lockstep plan -----------------------------------------------------------------------------
CLUSTER = ROOT / "configs" / "cluster_qwen3_30b_a3b.yaml"
COLOCATED = ROOT / "configs" / "cluster_qwen3_30b_a3b_colocated.yaml"


@pytest.fixture
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the cluster configs' model.path is relative to the repository


def _plan(path, *overrides):
    from lockstep.launch.plan import make_plan

    return make_plan(load_config(path, list(overrides)), str(path))


def _cli(capsys, *argv) -> tuple[int, str, str]:
    from lockstep.launch.cli import main

    code = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("path", [CLUSTER, COLOCATED], ids=["disaggregated", "colocated"])
def test_cluster_config_plan_has_the_launch_flags(path, in_root, capsys):
    import json

    code, out, err = _cli(capsys, "plan", path.relative_to(ROOT), "--json")
    assert code == 0, err
    p = json.loads(out)
    assert p["refusals"] == []
    engines = p["placement"]["engines"]
    assert len(engines) == 2
    for e in engines:
        argv = e["command"]["argv"]
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        assert "--enable-return-routed-experts" in argv and "--skip-tokenizer-init" in argv
        assert _flag(argv, "--tp-size") == "4" and _flag(argv, "--ep-size") == "4"
        assert _flag(argv, "--dtype") == "bfloat16" and "--enable-fp32-lm-head" in argv
        assert _flag(argv, "--model-path") == "configs/models/qwen3-30b-a3b"
        assert len(e["gpus"]) == 4
        assert e["command"]["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, e["gpus"]))
    mg = p["actor"]["megatron_args"]
    assert (mg["tensor_model_parallel_size"], mg["expert_model_parallel_size"],
            mg["expert_tensor_parallel_size"], mg["pipeline_model_parallel_size"],
            mg["data_parallel_size"]) == (2, 8, 1, 1, 4)
    assert mg["moe_router_dtype"] == "fp32" and mg["params_dtype"] == "bfloat16"
    assert mg["moe_enable_routing_replay"] is True and mg["moe_grouped_gemm"] is True
    assert p["actor"]["replay"]["mode"] == "R3"
    assert "engine's routes" in p["actor"]["replay"]["update"]
    ranks = p["actor"]["rank_layout"]
    assert [(r["node"], r["gpu"]) for r in ranks] == [(0, g) for g in range(8)]
    assert [r["experts"] for r in ranks] == [[16 * k, 16 * k + 16] for k in range(8)]
    if path == CLUSTER:  # the servers on node 1, the actor alone on node 0
        assert [(e["node"], e["gpus"]) for e in engines] == [(1, [0, 1, 2, 3]), (1, [4, 5, 6, 7])]
        assert [_flag(e["command"]["argv"], "--port") for e in engines] == ["30000", "30001"]
    else:  # the servers share the actor's GPUs; one step off policy, the actor trains while
        # they generate: its peak and SGLang's fraction at once
        assert [e["shares_gpus_with_actor_ranks"] for e in engines] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        mem, actor = p["rollout"]["memory_per_gpu"], p["actor"]["memory_per_rank"]
        assert mem["colocated_rollout_phase_bytes"] == pytest.approx(
            actor["peak_bytes"] + 0.3 * 140 * 2**30, rel=1e-9)
        sync = _plan(path, "loop.max_staleness=0")  # synchronous: SGLang released in training
        mem = sync["rollout"]["memory_per_gpu"]
        assert mem["colocated_rollout_phase_bytes"] == pytest.approx(
            actor["static_bytes"] + 0.3 * 140 * 2**30, rel=1e-9)
        assert mem["colocated_train_phase_bytes"] == actor["peak_bytes"]
    # the text a user reads says the same
    code, text, _ = _cli(capsys, "plan", path.relative_to(ROOT))
    assert code == 0
    for s in ("--enable-return-routed-experts", "--tp-size 4", "--ep-size 4", "replay R3",
              'moe_router_dtype = "fp32"', "tensor_model_parallel_size = 2",
              "expert_model_parallel_size = 8", "moe_enable_routing_replay = true"):
        assert s in text, s


def test_memory_estimates_scale_with_the_layout(in_root):
    base = _plan(CLUSTER)
    mem = base["actor"]["memory_per_rank"]
    pc_experts = base["model"]["expert_params"]
    assert mem["expert_params"] == pc_experts // 8  # EP 8, ETP 1: an eighth of the experts each
    ep4 = _plan(CLUSTER, "actor.megatron.expert_parallel=4")["actor"]["memory_per_rank"]
    assert ep4["expert_params"] == 2 * mem["expert_params"]  # halving EP doubles them
    # ... and what is not an expert is split by TP alone (embedding, attention, LM head)
    non_expert = mem["params"] - mem["expert_params"]
    assert ep4["params"] - ep4["expert_params"] == non_expert
    tp1 = _plan(CLUSTER, "actor.megatron.tensor_parallel=1")["actor"]["memory_per_rank"]
    tp1_non_expert = tp1["params"] - tp1["expert_params"]
    assert 1.95 < tp1_non_expert / non_expert < 2.0  # norms and routers are not split
    # precision: bf16 params + fp32 grads + fp32 master + Adam = 18 B/param; fp32: 16 B/param
    n = mem["params"]
    assert (mem["weights_bytes"], mem["grads_bytes"], mem["master_bytes"],
            mem["adam_bytes"]) == (2 * n, 4 * n, 4 * n, 8 * n)
    fp32 = _plan(CLUSTER, "actor.dtype=fp32", "actor.router_dtype=null")
    m32 = fp32["actor"]["memory_per_rank"]
    assert (m32["weights_bytes"], m32["master_bytes"]) == (4 * n, 0)
    assert fp32["actor"]["megatron_args"]["moe_router_dtype"] is None
    # engines: TP 8 instead of 4 halves each GPU's share of the weights (up to norms/routers)
    e4 = base["rollout"]["memory_per_gpu"]
    e8 = _plan(CLUSTER, "rollout.sglang.tp_size=8", "rollout.sglang.ep_size=8",
               "rollout.num_engines=1")["rollout"]["memory_per_gpu"]
    assert 0.5 < e8["weights_bytes"] / e4["weights_bytes"] < 0.51
    # per-step buffers: [B, T, L, K] uint8 routes split over DP
    b = base["buffers"]
    assert b["routes_bytes"] == 256 * 5120 * 48 * 8 and b["routes_dtype"] == "uint8"
    assert b["routes_per_dp_rank_bytes"] == b["routes_bytes"] // 4
    # host RAM while starting: every rank reads its shard of the folder; the driver and the
    # object store hold none (before: the fp32 policy in the driver, the store and every rank)
    h = base["host"]
    assert h["mode"] == "from-folder" and h["driver_bytes"] == h["object_store_bytes"] == 0
    largest = 4 * 151936 * 2048 // 2  # the embedding's TP half, read as fp32
    assert h["largest_read_bytes"] == largest
    shard = base["actor"]["memory_per_rank"]["weights_bytes"]
    assert h["rank_startup_bytes"] == shard + largest
    assert h["node_peak_bytes"] == 8 * (shard + largest) < (2 + 8) * 4 * base["model"]["params"] / 15
    one = _plan(ROOT / "configs" / "toy_r3.yaml")  # the in-process actor: the fp32 policy
    assert one["host"]["mode"] == "in-process"
    assert one["host"]["driver_bytes"] == 4 * one["model"]["params"]


@pytest.mark.parametrize("overrides, reason", [
    (["actor.megatron.tensor_parallel=3"],
     r"tensor_parallel=3 does not divide the model's num_attention_heads=32"),
    (["actor.megatron.expert_parallel=3"],
     r"expert_parallel=3 does not divide the model's num_experts=128"),
    (["rollout.sglang.tp_size=6", "rollout.sglang.ep_size=3"],
     r"rollout\.sglang\.tp_size=6 does not divide the model's num_attention_heads=32"),
    (["rollout.sglang.ep_size=3", "rollout.sglang.tp_size=3"],
     r"rollout\.sglang\.ep_size=3 does not divide the model's num_experts=128"),
    (["cluster.actor_ranks=16"], r"needs 24 GPUs \(16 actor ranks \+ 2 engines x 4 GPUs.*"
                                 r"the cluster has 16"),
    (["cluster.gpu_memory_gib=79.6"], r"actor rank: estimated peak .* exceeds "
                                      r"cluster\.gpu_memory_gib=79\.6"),
    (["rollout.sglang.mem_fraction_static=0.1", "cluster.gpu_memory_gib=40",
      "actor.megatron.expert_parallel=8"], r"SGLang engine: weights .* no room for a KV cache"),
    (["rollout.sglang.tp_size=16", "rollout.sglang.ep_size=16", "rollout.num_engines=1"],
     r"one SGLang server spans at most one node"),
])
def test_bad_layouts_are_refused_naming_the_reason(overrides, reason, in_root):
    import re

    refusals = _plan(CLUSTER, *overrides)["refusals"]
    assert any(re.search(reason, r) for r in refusals), refusals


def test_colocated_memory_over_the_gpu_is_refused(in_root, capsys):
    code, out, err = _cli(capsys, "plan", COLOCATED.relative_to(ROOT), "--set",
                          "rollout.sglang.mem_fraction_static=0.6", "--set", "loop.max_staleness=0")
    assert code == 2
    assert "engine 0" in out  # the plan is still printed
    assert err.startswith("lockstep plan: the layout does not fit: (1) colocated: the actor's "
                          "resident 73.77 GiB + SGLang's mem_fraction_static=0.6")
    assert "set rollout.sglang.mem_fraction_static below 0.47" in err
    code, out, err = _cli(capsys, "plan", COLOCATED.relative_to(ROOT), "--set",
                          "rollout.sglang.mem_fraction_static=0.45", "--json")
    assert code == 2 and '"refusals": [' in out
    assert "the actor's peak (it trains while SGLang generates: loop.max_staleness=1) 81.51 GiB" \
        in err and "below 0.42" in err


def test_megatron_arguments_are_what_the_actor_builds(monkeypatch):
    """The plan's megatron-core arguments equal the TransformerConfig trainer/actor/megatron builds
    for the same layout (bf16 params with an fp32 router: the cluster configs' precision)."""
    pytest.importorskip("megatron.core")
    import torch

    from lockstep.launch.plan import make_plan
    from lockstep.trainer.actor.megatron.actor import options_for
    from lockstep.trainer.actor.megatron.model import transformer_config

    cfg = load_config(TOY, ["cluster.actor_ranks=4", "actor.backend=megatron",
                            "actor.megatron.tensor_parallel=2", "actor.megatron.expert_parallel=2",
                            "actor.megatron.token_dispatcher=allgather",
                            # expert ranks = TP ranks (allgather refuses experts across DP)
                            "actor.megatron.expert_tensor_parallel=1",
                            "actor.megatron.recompute_activations=true",
                            "actor.dtype=bf16", "actor.router_dtype=fp32",
                            "actor.megatron.use_transformer_engine=false",
                            "cluster.gpus_per_node=4", "cluster.device=cuda"])
    plan = make_plan(cfg)
    assert plan["refusals"] == []
    with monkeypatch.context() as m:  # options_for refuses bf16 where CUDA is missing
        m.setattr(torch.cuda, "is_available", lambda: True)
        opts = options_for(cfg.actor, cfg.actor.megatron)
    tc = transformer_config(cfg.model, opts)
    args = plan["actor"]["megatron_args"]
    skip = {"data_parallel_size", "use_transformer_engine", "ddp", "optimizer", "params_dtype"}
    for k, v in args.items():
        if k not in skip:
            assert getattr(tc, k) == v, (k, getattr(tc, k), v)
    assert tc.params_dtype == getattr(torch, args["params_dtype"])
    assert tc.moe_router_dtype == "fp32" and tc.bf16


def test_rank_coordinates_follow_megatron_core_groups(in_root):
    """Each rank's (tp, dp, ep) in the plan is its position in megatron-core's own groups."""
    pytest.importorskip("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    for over in ([], ["actor.megatron.expert_parallel=4"], ["actor.megatron.tensor_parallel=1"]):
        p = _plan(CLUSTER, *over)
        lay, ranks = p["actor"]["layout"], p["actor"]["rank_layout"]
        dense = RankGenerator(tp=lay["tensor_parallel"], ep=1, dp=lay["data_parallel"],
                              pp=lay["pipeline_parallel"], cp=1, order="tp-cp-ep-dp-pp")
        expert = RankGenerator(tp=lay["expert_tensor_parallel"], ep=lay["expert_parallel"],
                               dp=lay["expert_data_parallel"], pp=lay["pipeline_parallel"], cp=1,
                               order="tp-cp-ep-dp-pp")
        for axis, gen, key in (("tp", dense, "tp"), ("dp", dense, "dp"), ("ep", expert, "ep")):
            for group in gen.get_ranks(axis):
                assert [ranks[r][key] for r in group] == list(range(len(group))), (over, axis)


def test_train_refuses_a_gpu_config_on_a_cpu_machine(in_root, capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = _cli(capsys, "train", COLOCATED.relative_to(ROOT), "--out", tmp_path / "r",
                        "--set", "cluster.placement=disaggregated", "--set", "cluster.nodes=2")
    assert code == 2 and "cluster.ray_address=auto" in err
    code, _, err = _cli(capsys, "train", CLUSTER.relative_to(ROOT), "--out", tmp_path / "r",
                        "--set", "cluster.nodes=1", "--set", "cluster.gpus_per_node=16")
    assert code == 2
    assert "plans 16 GPUs" in err and "this machine has 0 CUDA device(s)" in err
    # colocated TP-4 SGLang servers are planned, not launched (a Ray actor holds one bundle's
    # GPUs): refused even on a Ray cluster, naming the reason
    code, _, err = _cli(capsys, "train", COLOCATED.relative_to(ROOT), "--out", tmp_path / "r",
                        "--set", "cluster.ray_address=auto")
    assert code == 2 and "rollout.sglang.tp_size=4 cannot take the GPUs of 4 ranks'" in err
    # colocated servers need actor ranks' bundles: one per engine, none with the driver's actor
    for ranks, want in (("1", "cluster.actor_ranks=1 runs the actor in the driver process"),
                        ("2", "needs cluster.actor_ranks (2) >= rollout.num_engines (3)")):
        code, _, err = _cli(capsys, "train", TOY, "--out", tmp_path / "r", "--set",
                            "cluster.placement=colocated", "--set", "rollout.backend=serve",
                            "--set", "rollout.num_engines=3", "--set", f"cluster.actor_ranks={ranks}")
        assert code == 2 and want in err, err
    code, _, err = _cli(capsys, "train", CLUSTER.relative_to(ROOT), "--out", tmp_path / "r")
    assert code == 2 and "cluster.ray_address=auto" in err
    assert not (tmp_path / "r").exists()  # refused before the run directory


def test_plan_works_on_the_toy_config(capsys):
    code, out, err = _cli(capsys, "plan", TOY)
    assert code == 0, err
    assert "actor    torch, 1 rank(s)" in out and "driver" in out
    assert "rollout  embedded" in out


@pytest.mark.slow  # ~20 s: transformers' import and a 48-layer model on the meta device
def test_parameter_count_equals_transformers(in_root):
    """The plan's meta-device count of Qwen3-30B-A3B (from its config.json alone) equals that
    of transformers' own Qwen3MoeForCausalLM, in total and in the routed experts."""
    transformers = pytest.importorskip("transformers")
    import json

    import torch

    from lockstep.launch.plan_estimate import count_params
    from lockstep.moe.config import ModelConfig

    path = ROOT / "configs" / "models" / "qwen3-30b-a3b"
    d = json.loads((path / "config.json").read_text())
    hf_cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in d.items() if k != "architectures"})
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(hf_cfg)
    total = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    pc = count_params(ModelConfig.from_json(path))
    assert (pc.total, pc.experts) == (total, experts) == (30_532_122_624, 28_991_029_248)


def test_colocated_plan_places_servers_where_train_does():
    """Colocated, server i sits on the GPUs of actor rank i x R // M (where `lockstep train`
    puts it, rollout/colocate.py), and the plan says whether train runs the layout."""
    one = _plan(COLOCATED, "rollout.sglang.tp_size=1", "rollout.sglang.ep_size=1")
    got = [(e["node"], e["gpus"], e["shares_gpus_with_actor_ranks"])
           for e in one["placement"]["engines"]]
    assert got == [(0, [0], [0]), (0, [4], [4])]  # 8 ranks, 2 engines: ranks 0 and 4
    assert any(n.startswith("colocated: `lockstep train` runs server i in the placement-group "
                            "bundle of actor rank i x 8 // 2") for n in one["notes"])
    tp4 = _plan(COLOCATED)  # TP 4: the same GPUs as before; planned, not trained
    assert [e["gpus"] for e in tp4["placement"]["engines"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert any(n.startswith("colocated: planned only") and "tp_size=4" in n
               for n in tp4["notes"])


def test_virtual_pipeline_chunks_are_megatron_cores(in_root, capsys):
    """PP=2 x VPP=3 of the 48-layer model: each rank's chunks (JSON and text) are the layers
    megatron-core builds for (stage, chunk) (`get_transformer_layer_offset`), and the model's
    `chunk_layers` (what the actor checks its chunks against) agrees."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from lockstep.trainer.actor.megatron.model import transformer_config
    from lockstep.trainer.config.megatron import chunk_layers

    sets = ["actor.megatron.expert_parallel=4", "actor.megatron.pipeline_parallel=2",
            "actor.megatron.virtual_pipeline_parallel=3"]
    p = _plan(CLUSTER, *sets)
    assert p["refusals"] == []
    cfg = load_config(CLUSTER, sets + ["actor.megatron.use_transformer_engine=false",
                                       "actor.megatron.grouped_gemm=false"])
    tc = transformer_config(cfg.model, cfg.actor.megatron)
    assert p["actor"]["megatron_args"]["virtual_pipeline_model_parallel_size"] == 3
    assert p["actor"]["layout"]["virtual_pipeline_parallel"] == 3
    for r in p["actor"]["rank_layout"]:
        want = [[get_transformer_layer_offset(tc, vp_stage=c, pp_rank=r["pp"]),
                 get_transformer_layer_offset(tc, vp_stage=c, pp_rank=r["pp"]) + 8]
                for c in range(3)]
        assert r["chunks"] == want and r["layers"] is None, r
        assert [[x[0], x[-1] + 1] for x in chunk_layers(cfg.model, cfg.actor.megatron,
                                                        r["pp"])] == want
    assert p["actor"]["rank_layout"][4]["chunks"] == [[8, 16], [24, 32], [40, 48]]
    code, out, err = _cli(capsys, "plan", CLUSTER.relative_to(ROOT), *[
        a for s in sets for a in ("--set", s)])
    assert code == 0, err
    assert "PP 2 (VPP 3)" in out and "layers 8-15 | 24-31 | 40-47 (chunks)" in out
    # 48 layers do not split over PP=2 x VPP=5
    bad = _plan(CLUSTER, *sets[:2], "actor.megatron.virtual_pipeline_parallel=5")["refusals"]
    assert any("num_hidden_layers=48 is not divisible by actor.megatron.pipeline_parallel=2 x "
               "actor.megatron.virtual_pipeline_parallel=5" in x for x in bad), bad


def test_uneven_pipeline_stages_are_megatron_cores(in_root, capsys):
    """PP=2 with pipeline_layers=[20, 28] of the 48-layer model: each rank's layers (JSON and
    text) are those megatron-core's pipeline layout builds for its stage, the layout string is
    among the printed arguments, and the memory estimate picks the 28-layer stage."""
    pytest.importorskip("megatron.core")
    from lockstep.trainer.actor.megatron.model import transformer_config

    sets = ["actor.megatron.expert_parallel=4", "actor.megatron.pipeline_parallel=2",
            "actor.megatron.pipeline_layers=[20,28]"]
    p = _plan(CLUSTER, *sets)
    assert p["refusals"] == []
    cfg = load_config(CLUSTER, sets + ["actor.megatron.use_transformer_engine=false",
                                       "actor.megatron.grouped_gemm=false"])
    layout = transformer_config(cfg.model, cfg.actor.megatron).pipeline_model_parallel_layout
    assert p["actor"]["megatron_args"]["pipeline_model_parallel_layout"] == repr(layout)
    assert p["actor"]["layout"]["pipeline_layers"] == [20, 28]
    for r in p["actor"]["rank_layout"]:
        ids = layout.get_layer_id_list(pp_rank=r["pp"])
        assert r["layers"] == [ids[0], ids[-1] + 1] and r["chunks"] == [r["layers"]], r
    assert p["actor"]["memory_per_rank"]["fullest_stage"] == 1
    code, out, err = _cli(capsys, "plan", CLUSTER.relative_to(ROOT), *[
        a for s in sets for a in ("--set", s)])
    assert code == 0, err
    assert "PP 2 (layers per stage 20, 28)" in out and "layers 20-47" in out, out


def test_context_parallel_plan_follows_megatron_core_groups(in_root, capsys):
    """CP=2 on the 8 ranks: DP halves, each rank's (tp, cp, dp, ep) is its position in
    megatron-core's own groups (RankGenerator, order tp-cp-ep-dp-pp; the expert grid has no CP
    axis), context_parallel_size is among the printed arguments, and the plan names why the
    actor does not run it yet."""
    pytest.importorskip("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    p = _plan(CLUSTER, "actor.megatron.context_parallel=2")
    lay, ranks = p["actor"]["layout"], p["actor"]["rank_layout"]
    assert (lay["context_parallel"], lay["data_parallel"]) == (2, 2)
    assert p["actor"]["megatron_args"]["context_parallel_size"] == 2
    dense = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=1, ep=8, dp=1, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    for axis, gen in (("tp", dense), ("cp", dense), ("dp", dense), ("ep", expert)):
        for group in gen.get_ranks(axis):
            assert [ranks[r][axis] for r in group] == list(range(len(group))), axis
    assert any("context_parallel=2: the megatron actor does not split its passes" in x
               for x in p["refusals"]), p["refusals"]
    code, out, err = _cli(capsys, "plan", CLUSTER.relative_to(ROOT), "--set",
                          "actor.megatron.context_parallel=2")
    assert "x PP 1 x CP 2 x DP 2" in out and "pp 0 tp 1 cp 1 dp 1 ep 7" in out, out


def test_multi_turn_rows_are_sized_to_the_context():
    """rollout.env rows are whole trajectories (the engines' context), not prompt + one turn."""
    b = _plan(ROOT / "configs" / "toy_agent_r3.yaml")["buffers"]
    assert b["multi_turn"] and b["row_tokens"] == 32  # the toy's max_position_embeddings
    assert b["prompt_tokens"] + b["response_tokens"] == 32
    single = _plan(TOY)["buffers"]
    assert not single["multi_turn"] and single["row_tokens"] == 12


VLLM = ["rollout.backend=vllm", "rollout.vllm.tp_size=4", "rollout.vllm.expert_parallel=true",
        "rollout.vllm.gpu_memory_utilization=0.85", "rollout.lm_head_dtype=null"]


def test_vllm_backend_plan_prints_vllms_launch_arguments(in_root, capsys):
    """rollout.backend=vllm: one vLLM command per engine, on its node's GPUs, with what lockstep
    needs of it (routes, token ids, the sampled distribution's log-probs, the weight-transfer
    backend) and the TP/EP of rollout.vllm; the same servers' command for rollout.urls with
    rollout.engine=vllm; what vLLM has no flag for is refused."""
    import json

    p = _plan(CLUSTER, *VLLM)
    assert p["refusals"] == [] and p["rollout"]["vllm"]["tp_size"] == 4
    engines = p["placement"]["engines"]
    assert [(e["node"], e["gpus"]) for e in engines] == [(1, [0, 1, 2, 3]), (1, [4, 5, 6, 7])]
    for i, e in enumerate(engines):
        argv, env = e["command"]["argv"], e["command"]["env"]
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        for flag in ("--enable-return-routed-experts", "--skip-tokenizer-init", "--tokens-only",
                     "--enable-expert-parallel"):
            assert flag in argv, flag
        assert _flag(argv, "--tensor-parallel-size") == "4"
        assert _flag(argv, "--logprobs-mode") == "processed_logprobs"
        assert json.loads(_flag(argv, "--weight-transfer-config")) == {"backend": "nccl"}
        assert _flag(argv, "--dtype") == "bfloat16" and _flag(argv, "--port") == str(8000 + i)
        assert _flag(argv, "--model") == "configs/models/qwen3-30b-a3b"
        assert _flag(argv, "--gpu-memory-utilization") == "0.85"
        assert "--return-sampling-mask" not in argv  # untruncated sampling: no masks
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, e["gpus"]))
        assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1"
        assert env["PYTHONPATH"].endswith("vllm_plugin")
    assert p["placement"]["gpus_needed"] == 16
    code, out, err = _cli(capsys, "plan", CLUSTER.relative_to(ROOT), *[
        x for kv in VLLM for x in ("--set", kv)])
    assert code == 0, err
    assert "vLLM TP 4, experts sharded over the 4 GPUs" in out
    assert "--enable-return-routed-experts" in out and "as vLLM sends them" in out
    # top_p < 1: the servers return sampling masks
    argv = _plan(CLUSTER, *VLLM, "rollout.top_p=0.9")["placement"]["engines"][0]["command"]["argv"]
    assert "--return-sampling-mask" in argv
    # servers you run (rollout.urls, rollout.engine=vllm): the command to launch them with
    p = _plan(CLUSTER, "rollout.backend=http", "rollout.engine=vllm", "rollout.vllm.tp_size=4",
              "rollout.urls=[http://10.0.0.5:8000, http://10.0.0.6:8000]")
    argv = p["rollout"]["vllm_command"]["argv"]
    assert "--enable-return-routed-experts" in argv and _flag(argv, "--host") == "0.0.0.0"
    assert _flag(argv, "--tensor-parallel-size") == "4" and p["refusals"] == []
    # the fp32 LM head of the SGLang config has no vLLM flag: refused, once
    p = _plan(CLUSTER, "rollout.backend=vllm", "rollout.vllm.tp_size=4")
    assert len(p["refusals"]) == 1 and "lm_head_dtype='fp32'" in p["refusals"][0]


@pytest.mark.parametrize("override, match", [
    (["rollout.vllm.tp_sise=2"], r"did you mean 'rollout\.vllm\.tp_size'"),
    (["rollout.vllm.extra_args=[--tensor-parallel-size, '2']"],
     r"extra_args \['--tensor-parallel-size'\].*rollout\.vllm\.tp_size"),
    (["rollout.vllm.gpu_memory_utilization=1.5"], r"must be in \(0, 1\)"),
    (["rollout.backend=vllm", "cluster.gpus_per_engine=2"],
     r"a vLLM server takes rollout\.vllm\.tp_size=1 GPUs"),
])
def test_bad_vllm_keys_are_refused_by_name(override, match):
    with pytest.raises(ExperimentConfigError, match=match):
        load_config(TOY, override)
