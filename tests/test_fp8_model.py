"""Block FP8 in the model, the embedded engine (rollout.dtype=fp8), the torch actor (actor.fp8)
and the plan/megatron options for the same choices."""

import copy

import pytest
import torch

from lockstep.kernels.fp8 import act_qdq, weight_qdq
from lockstep.moe.layers import grouped_linear, grouped_linear_loop, linear
from lockstep.moe.model import MoEModel
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.megatron import precision_problems
from lockstep.trainer.config.sections import ActorConfig

from model_fixtures import tiny_config

CFG = tiny_config(max_position_embeddings=48, mlp_only_layers=[0])


def _model(seed=0):
    torch.manual_seed(seed)
    return MoEModel(CFG)


def test_fp8_linear_is_the_quantised_matmul():
    torch.manual_seed(0)
    x, w = torch.randn(5, 40).bfloat16(), torch.randn(24, 40).bfloat16()
    want = (act_qdq(x) @ weight_qdq(w).T).bfloat16()
    assert torch.equal(linear(x, w, fp8=True), want)
    assert not torch.equal(linear(x, w, fp8=True), linear(x, w))
    # grouped: each expert's weight in its own blocks, the same as one fp8 matmul per expert
    w_EOD = torch.randn(3, 24, 40)
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)
    assert torch.allclose(grouped_linear(x.float(), w_EOD, offs, fp8=True),
                          grouped_linear_loop(x.float(), w_EOD, offs, fp8=True), atol=1e-6)


def test_set_precision_fp8_leaves_router_and_head_unquantised():
    model = _model().set_precision(torch.bfloat16, fp8=True)
    flagged = {n for n, m in model.named_modules() if getattr(m, "fp8", False)}
    assert "layers.1.self_attn" in flagged and "layers.1.mlp.experts" in flagged
    assert "layers.0.mlp" in flagged  # the dense layer's MLP
    seen = {}
    block = model.layers[1].mlp
    block.register_forward_pre_hook(lambda m, args: seen.update(h=args[0]))
    ids = torch.randint(3, 40, (2, 7))
    out = model(ids)
    h = seen["h"].reshape(-1, CFG.hidden_size)
    # the router's logits are the plain bf16 matmul of the layer input
    assert torch.equal(out.router_logits_LNE[0], linear(h, block.gate.weight).float())
    plain = _model().set_precision(torch.bfloat16)(ids)
    assert not torch.equal(out.logits_BTV, plain.logits_BTV)


def _reqs(n, P=5, max_new=10):
    g = torch.Generator().manual_seed(1)
    return [GenerateRequest(torch.randint(3, 40, (P,), generator=g).tolist(),
                            SamplingParams(max_new_tokens=max_new, seed=100 + i,
                                           ignore_eos=True)) for i in range(n)]


def test_fp8_engine_records_what_one_fp8_forward_gives():
    model = _model()
    eng = Engine.from_model(model, EngineConfig(dtype="fp8", max_running=8, max_len=48))
    assert eng.model.embed_tokens.weight.dtype == torch.bfloat16 and eng.model.fp8
    m = eng.model.layers[1]
    assert m.mlp.gate.weight.dtype == m.input_layernorm.weight.dtype == torch.bfloat16
    # the weights it quantises stay fp32: the q and scales of the actor's own fp32 weights
    assert torch.equal(m.mlp.experts.gate_up_proj, model.layers[1].mlp.experts.gate_up_proj)
    assert torch.equal(m.self_attn.q_proj.weight, model.layers[1].self_attn.q_proj.weight)
    assert eng._decode_weights is None  # decodes through the model's own (fp8) forward
    res = eng.generate(_reqs(6))
    ref = copy.deepcopy(model).set_precision(torch.bfloat16, fp8=True)
    bf16 = Engine.from_model(model, EngineConfig(dtype="bf16", max_running=8, max_len=48))
    differs = False
    for r, b in zip(res, bf16.generate(_reqs(6))):
        ids = torch.tensor(r.prompt_ids + r.output_ids)[None]
        with torch.no_grad():
            out = ref(ids)
        P = len(r.prompt_ids)
        lp = torch.log_softmax(out.logits_BTV[0].float(), -1)[P - 1:-1]
        lp = lp.gather(1, torch.tensor(r.output_ids)[:, None])[:, 0]
        assert torch.allclose(r.output_logprobs, lp, atol=2e-2), r.index
        same = (r.routes_NLK.long() == out.routes_BTLK[0, :-1]).all(-1)
        assert same.float().mean() > 0.95
        differs |= not torch.equal(r.output_logprobs, b.output_logprobs)
    assert differs  # fp8 is not the bf16 engine
    with pytest.raises(ValueError, match=r"dtype must be one of \['bf16', 'fp16', 'fp32'\] "
                                         r"or 'fp8'"):
        EngineConfig(dtype="fp8_e4m3")


def test_fp8_actor_forward_is_quantised_and_trains_fp32_masters():
    model = _model()
    before = copy.deepcopy(model)
    eng = Engine.from_model(model, EngineConfig(dtype="fp8", max_running=8, max_len=48))
    batch = collate(eng.generate(_reqs(4, max_new=4)), CFG.pad_token_id, CFG.num_experts,
                    CFG.num_moe_layers, CFG.num_experts_per_tok)
    actor = TorchActor(model, ActorConfig(fp8=True, lr=1e-2, mini_batch_size=4,
                                          micro_batch_size=2), 1)
    assert actor.compute is model and model.fp8
    res = actor.logprobs(batch)
    want = copy.deepcopy(before).set_precision(torch.float32, fp8=True)
    with torch.no_grad():
        logits = want(batch.input_ids_BT).logits_BTV
    ref = torch.log_softmax(logits[:, :-1], -1).gather(2, batch.input_ids_BT[:, 1:, None])[..., 0]
    m = batch.response_mask_BT[:, 1:]
    assert torch.allclose(res.logprobs_BT[:, 1:][m], ref[m], atol=1e-5)
    with torch.no_grad():
        plain = before(batch.input_ids_BT).logits_BTV
    assert not torch.allclose(logits, plain, atol=1e-4)  # the forward did quantise

    def loss_fn(lp_BT, ent_BT, rows, mini):  # token-mean log-likelihood of the responses
        mask = batch.response_mask_BT[rows].float()
        return -(lp_BT * mask).sum() / batch.response_mask_BT[mini].sum(), {}
    actor.update(batch, loss_fn)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    moved = [n for (n, a), b in zip(model.named_parameters(), before.parameters())
             if not torch.equal(a, b)]
    # straight-through: every quantised projection and expert weight receives gradient
    assert "layers.1.mlp.experts.gate_up_proj" in moved and "layers.2.self_attn.q_proj.weight" \
        in moved and "layers.0.mlp.down_proj.weight" in moved


def test_fp8_config_plan_and_megatron_choices():
    cfg = load_config(None, ["rollout.dtype=fp8", "actor.fp8=true"])
    assert cfg.rollout.dtype == "fp8" and cfg.actor.fp8
    assert "fp8" not in load_config(None).to_dict()["actor"]  # default: saved as before
    why = precision_problems(ActorConfig(backend="megatron", fp8=True), on_gpu=False)
    assert any("actor.fp8=true: the megatron backend runs FP8 through Transformer Engine"
               in w for w in why)
    from lockstep.launch.plan import check_devices, PlanError
    from lockstep.trainer.config.megatron import actor_options, megatron_args
    from lockstep.trainer.driver.sglang_servers import sglang_server_config
    argv = sglang_server_config(load_config(None, ["rollout.dtype=fp8"]),
                                model_path="/m").command()
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--quantization") + 1] == "fp8"
    with pytest.raises(PlanError, match="rollout.dtype=fp8 with rollout.backend=sglang"):
        check_devices(load_config(None, ["rollout.dtype=fp8", "rollout.backend=sglang"]))
    a = ActorConfig(backend="megatron", fp8=True)
    args = megatron_args(CFG, actor_options(a, a.megatron), use_te=True, on_gpu=True)
    assert (args["fp8"], args["fp8_recipe"]) == ("e4m3", "blockwise")
