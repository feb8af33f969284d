"""The cluster plan: the `rollout.sglang` / `cluster` config keys it reads, the SGLang command
each engine is launched with, and `lockstep plan CONFIG` (placement, memory, refusals)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lockstep.rollout.sglang_options import sglang_server_config
from lockstep.trainer.config import ExperimentConfigError, load_config, save_config

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
