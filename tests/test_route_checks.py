"""The replay validator's route checks (moe/replay_check.py), on one model forward: all-zero
routes, repeated ids within one top-k and orphaned routers each stop the forward with a
message naming the layer and the position (token row). Fast: a tiny model, no run."""

import pytest
import torch
from torch import nn

from lockstep.moe.model import MoEBlock, MoEModel
from lockstep.moe.replay_check import ReplayCheck, ReplayCheckError, RouteCheck, sample_slice
from model_fixtures import tiny_config

B, T = 2, 16  # 32 tokens: the top-1 all-zero rule needs MIN_OVERLAP_TOKENS


def _model(**over) -> MoEModel:
    torch.manual_seed(0)
    return MoEModel(tiny_config(**over)).eval()


def _natural(model, ids_BT):
    with torch.no_grad():
        return model(ids_BT).routes_BTLK.clone()


def _forward(model, ids_BT, routes_BTLK, min_overlap=0.0):
    cfg = model.cfg
    L, K = cfg.num_moe_layers, cfg.num_experts_per_tok
    check = RouteCheck(routes_BTLK.reshape(B * T, L, K), torch.ones(B * T, dtype=torch.bool),
                       sample_slice(ReplayCheck.FULL, 0), cfg.moe_layer_ids,
                       lambda n: (n // T, n % T), num_experts=cfg.num_experts,
                       min_overlap=min_overlap, what="update forward")
    with torch.no_grad():
        model(ids_BT, routed_experts_BTLK=routes_BTLK, replay_check=check)


def _ids():
    return torch.randint(3, 40, (B, T), generator=torch.Generator().manual_seed(1))


def test_the_models_own_routes_pass():
    model, ids = _model(), _ids()
    _forward(model, ids, _natural(model, ids), min_overlap=None)


def test_an_all_zero_row_stops_the_forward():
    """A top-2 route of two expert 0s was never written (a zeroed kernel output)."""
    model, ids = _model(), _ids()
    routes = _natural(model, ids)
    routes[1, 5, 2] = 0  # sample 1, position 5, MoE layer 2
    with pytest.raises(ReplayCheckError) as e:
        _forward(model, ids, routes)
    msg = str(e.value)
    assert msg.startswith("replay check (update forward): MoE layer 2 (decoder layer 2): "
                          "all-zero routes at sample 1, position 5: every one of its 2 "
                          "replayed ids is expert 0"), msg


def test_a_top1_layer_given_only_zeros_stops_the_forward():
    """Top-1: one expert 0 is a real route, a whole layer of them where the router picks
    others is not (the overlap floor is off here, as on update forwards)."""
    model, ids = _model(num_experts_per_tok=1), _ids()
    routes = _natural(model, ids)
    _forward(model, ids, routes)
    routes[:, :, 1] = 0
    with pytest.raises(ReplayCheckError) as e:
        _forward(model, ids, routes)
    assert "MoE layer 1 (decoder layer 1): all-zero routes at sample " in str(e.value)


def test_a_repeated_id_stops_the_forward():
    model, ids = _model(), _ids()
    routes = _natural(model, ids)
    routes[0, 3, 1, 1] = routes[0, 3, 1, 0]  # sample 0, position 3, MoE layer 1: [e, e]
    e_id = int(routes[0, 3, 1, 0])
    with pytest.raises(ReplayCheckError) as e:
        _forward(model, ids, routes)
    assert str(e.value).startswith(
        f"replay check (update forward): MoE layer 1 (decoder layer 1): duplicate expert ids "
        f"in one top-k at sample 0, position 3: the replayed ids are [{e_id}, {e_id}]"), e.value


def test_a_router_with_no_moe_index_is_named():
    model, ids = _model(), _ids()
    routes = _natural(model, ids)
    model.layers[1].mlp.moe_index = None  # a block built outside the model's own list
    with pytest.raises(ReplayCheckError) as e:
        _forward(model, ids, routes)
    assert "router layers.1.mlp reports MoE-layer index None, but the plan replays 3 MoE " \
        "layers (0..2): a router the replay plan does not know" in str(e.value)


class _FamilyMLP(nn.Module):
    """A new family's MLP that wraps a MoE block the decoder loop does not see as one: its
    router picks its own experts and never reports them."""

    def __init__(self, block: MoEBlock):
        super().__init__()
        self.block = block

    def forward(self, h):
        return self.block(h, None, None)[0]


def test_a_router_not_registered_for_replay_is_named():
    """Layer 1 is dense in the config; a family's code put a MoE block there anyway: replay
    of the two MoE layers looks complete, the third router routes unseen."""
    model, ids = _model(mlp_only_layers=[1]), _ids()
    routes = _natural(model, ids)
    _forward(model, ids, routes)
    model.layers[1].mlp = _FamilyMLP(MoEBlock(model.cfg))
    with pytest.raises(ReplayCheckError) as e:
        _forward(model, ids, routes)
    assert str(e.value) == (
        "replay check (update forward): router layers.1.mlp.block is in the model but not "
        "registered for replay (no replayed MoE layer runs it; MoE-layer index None): it "
        "routes on its own")
