"""Every MoE family against transformers: folders written by transformers load into ours with
the same logits and router top-k, and ours load into transformers likewise."""

import pytest
import torch

from lockstep.moe.checkpoint import hf_state_dict, load_hf, save_hf
from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel

from arch_fixtures import HF_FAMILIES, hf_forward_with_routes, write_hf_folder

transformers = pytest.importorskip("transformers")


def _compare(ours: MoEModel, hf, ids_BT):
    logits, hf_routes = hf_forward_with_routes(hf, ids_BT)
    with torch.no_grad():
        out = ours(ids_BT)
    assert (out.logits_BTV - logits).abs().max().item() <= 1e-5
    assert hf_routes.shape == out.natural_BTLK.shape
    assert torch.equal(out.natural_BTLK.sort(-1).values, hf_routes)
    return out


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_transformers_folder_loads_with_parity(family, tmp_path):
    folder = write_hf_folder(family, tmp_path / family)
    ours = load_hf(folder).eval()
    assert ours.cfg.model_type == family
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (3, 13), generator=torch.Generator().manual_seed(1))
    out = _compare(ours, hf, ids)
    # Routing is not degenerate: several experts in use, and (sigmoid routers) the bias and
    # the group limit matter for the natural choice.
    assert out.natural_BTLK.unique().numel() >= 4
    # Our folder of the same weights loads back in transformers with the same numbers.
    save_hf(ours, tmp_path / "ours")
    assert ModelConfig.from_json(tmp_path / "ours") == ours.cfg
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours",
                                                            dtype=torch.float32).eval()
    _compare(ours, hf2, ids)
    reloaded = load_hf(tmp_path / "ours")
    for k, v in hf_state_dict(ours).items():
        assert torch.equal(v, hf_state_dict(reloaded)[k]), k


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_our_random_model_matches_transformers(family, tmp_path):
    """The other direction from our own random init (every tensor random, norms included)."""
    cfg = ModelConfig.from_json(write_hf_folder(family, tmp_path / "ref"))
    torch.manual_seed(3)
    model = MoEModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        for b in model.buffers():
            b.uniform_(-0.3, 0.3)
    save_hf(model, tmp_path / "ours")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours",
                                                           dtype=torch.float32).eval()
    _compare(model, hf, torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2)))


def _check_served(http, hf, prompts=((5, 9, 1, 7), (5, 9), (3, 4, 8))):
    from lockstep.rollout.types import GenerateRequest, SamplingParams

    reqs = [GenerateRequest(list(p), SamplingParams(max_new_tokens=8, seed=i))
            for i, p in enumerate(prompts)]
    for r in http.generate(reqs):
        ids = torch.tensor(r.prompt_ids + r.output_ids)[None]
        logits, hf_routes = hf_forward_with_routes(hf, ids)
        P, R = r.prompt_tokens, r.completion_tokens
        lp = torch.log_softmax(logits[0].float(), -1)[P - 1:P + R - 1]
        want = lp.gather(1, torch.tensor(r.output_ids)[:, None])[:, 0]
        assert (r.output_logprobs - want).abs().max().item() <= 1e-4
        assert torch.equal(r.routes_NLK.long().sort(-1).values, hf_routes[0, :P + R - 1])


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_served_folder_matches_transformers(family, tmp_path):
    """The embedded engine behind the SGLang-wire server (what `lockstep serve` runs): the
    routes decoded from the wire and the sampled tokens' log-probs equal transformers' forward
    over prompt + completion (prefill and cached decoding, MLA's cache included)."""
    from lockstep.rollout.client import HTTPBackend
    from lockstep.rollout.engine import Engine
    from lockstep.rollout.engine_config import EngineConfig
    from lockstep.rollout.server import ServerThread

    folder = write_hf_folder(family, tmp_path / family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = Engine.from_hf(folder, EngineConfig(dtype="fp32", max_len=64, max_running=4))
    with ServerThread(engine, model_path=str(folder)) as srv:
        _check_served(HTTPBackend(srv.url, ModelConfig.from_json(folder)), hf)


@pytest.mark.slow
def test_serve_cli_process_deepseek_v3(tmp_path):
    """`lockstep serve` as a process on a DeepSeek-V3 folder (MLA, sigmoid router, dense
    first layer: the wire's layer axis has a zero row for it)."""
    import socket
    import subprocess
    import sys

    from lockstep.rollout.client import HTTPBackend

    folder = write_hf_folder("deepseek_v3", tmp_path / "ds")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.launch.serve", "--model",
                             str(folder), "--dtype", "fp32", "--port", str(port),
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        http = HTTPBackend(f"http://127.0.0.1:{port}", ModelConfig.from_json(folder),
                           retries=60, backoff_s=0.25)
        _check_served(http, hf)
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)


def test_family_defaults_and_config_errors(tmp_path):
    from lockstep.moe.checks import ConfigError

    glm = ModelConfig(model_type="glm4_moe", num_experts=8, n_group=2, topk_group=1)
    assert (glm.router, glm.expert_bias, glm.partial_rotary_factor, glm.n_shared_experts,
            glm.first_k_dense_replace, glm.moe_layer_ids) == ("sigmoid", True, 0.5, 1, 1, [1, 2])
    assert (glm.score_function, glm.softmax_before_topk) == ("sigmoid", False)
    with pytest.raises(ConfigError, match="router='sigmoid' is not expressible in a qwen3_moe"):
        ModelConfig(router="sigmoid")
    with pytest.raises(ConfigError, match="deepseek_v3 needs kv_lora_rank"):
        ModelConfig(model_type="deepseek_v3")
    with pytest.raises(ConfigError, match="topk_group=3 exceeds n_group=2"):
        ModelConfig(model_type="glm4_moe", num_experts=8, n_group=2, topk_group=3)
    d = ModelConfig.from_json(write_hf_folder("deepseek_v3", tmp_path / "ds")).to_hf_dict()
    with pytest.raises(ConfigError, match="rope_scaling"):
        ModelConfig.from_hf_dict({**d, "rope_scaling": {"type": "linear", "factor": 4}})
    with pytest.raises(ConfigError, match="topk_method='group_limited_greedy'"):
        ModelConfig.from_hf_dict({**d, "topk_method": "group_limited_greedy"})
    with pytest.raises(ConfigError, match=r"unknown config keys \['kv_rank'\].*deepseek_v3"):
        ModelConfig.from_hf_dict({**d, "kv_rank": 3})


def test_deepseek_yarn_rope_matches_transformers(tmp_path):
    """DeepSeek-V3 / Kimi-K2 ship YaRN (rope_scaling): frequencies, cos/sin attention factor
    and MLA's mscale^2 softmax scale, against transformers."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
            "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 0.7}
    folder = write_hf_folder("deepseek_v3", tmp_path / "ds", rope_parameters=yarn)
    ours = load_hf(folder).eval()
    assert ours.cfg.rope_scaling["factor"] == 8.0
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    _compare(ours, hf, ids)
    save_hf(ours, tmp_path / "ours")
    assert ModelConfig.from_json(tmp_path / "ours") == ours.cfg
    _compare(ours, transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", dtype=torch.float32).eval(), ids)


def test_yarn_frequencies_at_deepseek_v3_scale():
    """The released DeepSeek-V3 YaRN setting (rope dims 64, factor 40, 4096 original
    positions), where the interpolation ramp covers real dims: inv_freq and attention factor as
    transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lockstep.moe.layers import yarn_inv_freq

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096}
    hf_cfg = transformers.DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840,
                                           rope_parameters=dict(yarn))
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    base = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    got, factor = yarn_inv_freq(base, 64, 10000.0, yarn, 163840)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor)
    assert 0 < int((got < base / 39).sum()) < 32  # the ramp is inside the rotary dims
