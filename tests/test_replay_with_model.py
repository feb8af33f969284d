"""Replay plans and codecs driving the real MoE model (random init, CPU, fp32)."""

import torch

from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.replay import (
    RoutingTrace,
    batch_traces,
    decode_routes,
    encode_routes,
    old_logprob_plan,
    routing_divergence,
    update_plan,
)


def tiny():
    cfg = ModelConfig(num_hidden_layers=3, mlp_only_layers=[0], num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    return cfg, MoEModel(cfg)


def test_r3_plan_runs_exactly_the_decoded_rollout_routes():
    cfg, model = tiny()
    L, K, E = cfg.num_moe_layers, cfg.num_experts_per_tok, cfg.num_experts
    g = torch.Generator().manual_seed(1)
    seq_lens = [6, 4]
    traces = []
    for b, n in enumerate(seq_lens):  # arbitrary "engine" routes, sent over the wire and back
        ids = torch.rand(n - 1, L, E, generator=g).topk(K, -1).indices
        wire = encode_routes(RoutingTrace(ids, E), "int32", cfg.num_hidden_layers, cfg.moe_layer_ids)
        traces.append(decode_routes(wire, n - 1, cfg.num_hidden_layers, cfg.moe_layer_ids, K, E, sample=b))
    ids_BTLK, valid_BT = batch_traces(traces, T=6, seq_lens=seq_lens)
    tokens_BT = torch.randint(0, cfg.vocab_size, (2, 6), generator=g)
    for plan in (old_logprob_plan("R3", ids_BTLK, valid_BT), update_plan("R3", ids_BTLK, valid_BT)):
        out = model(tokens_BT, routed_experts_BTLK=plan.routes_BTLK, replay_mask_BT=plan.replay_mask_BT)
        m = routing_divergence(out.routes_BTLK, ids_BTLK, valid_BT)
        assert m["routing/flip_rate"] == 0.0 and m["routing/num_tokens"] == 8.0
        # where no route exists the model routed naturally
        assert torch.equal(out.routes_BTLK[~valid_BT], out.natural_BTLK[~valid_BT])


def test_r2_update_replays_the_recorded_routes_after_a_weight_change():
    cfg, model = tiny()
    tokens_BT = torch.randint(0, cfg.vocab_size, (3, 5))
    old = old_logprob_plan("R2")
    assert old.record and not old.replays
    recorded_BTLK = model(tokens_BT).routes_BTLK
    with torch.no_grad():  # a policy update moves the routers
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    plan = update_plan("R2", recorded_routes_BTLK=recorded_BTLK)
    out = model(tokens_BT, routed_experts_BTLK=plan.routes_BTLK, replay_mask_BT=plan.replay_mask_BT)
    assert torch.equal(out.routes_BTLK, recorded_BTLK)
    staleness = routing_divergence(recorded_BTLK, out.natural_BTLK, prefix="routing_r2")
    assert staleness["routing_r2/flip_rate"] > 0.0  # the moved router would have picked others
