"""The rank-side actor interface without Ray: metrics as (sum, count) that add over ranks to the
one-process numbers, and fp32 gradient accumulation under a bf16 compute copy."""

import copy
import math

import torch

from lockstep.replay import routing_divergence
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.sections import ActorConfig
from lockstep.trainer.objective.stats import add_stats, route_stats, stats_values
from test_actor import _batch, _model


def test_route_stats_split_over_ranks_add_up_to_routing_divergence():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 8, (6, 5, 3, 2), generator=g).to(torch.uint8)
    b = a.clone()
    b[torch.rand(6, 5, 3, generator=g) < 0.3, 0] = 7  # some flips
    valid = torch.rand(6, 5, generator=g) < 0.8
    want = routing_divergence(a, b, valid, "routing", [1, 2, 3])
    whole = stats_values(route_stats(a, b, valid, "routing", [1, 2, 3], True))
    assert whole == want  # one rank: the same numbers, bit for bit
    parts = [route_stats(a[r], b[r], valid[r], "routing", [1, 2, 3], i == 0)
             for i, r in enumerate((slice(0, 2), slice(2, 6)))]
    split = stats_values(add_stats(parts))
    assert split.keys() == want.keys()
    assert all(math.isclose(split[k], want[k], rel_tol=1e-12) for k in want)
    none = stats_values(route_stats(a, b, torch.zeros_like(valid), "routing", [1, 2, 3], True))
    assert math.isnan(none["routing/flip_rate"]) and none["routing/num_tokens"] == 0


def test_bf16_actor_accumulates_micro_batch_gradients_in_fp32():
    """Two micro-batches of one mini-batch: the fp32 master gradient is the fp32 sum of the
    two micro-batches' bf16 gradients (a bf16 running sum would round it)."""
    model = _model()
    batch = _batch(model, B=4)
    n_tokens = batch.response_mask_BT.sum()
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])

    def loss_fn(lp, ent, rows, mini):  # fixed normaliser: a micro-batch's loss alone
        mask = batch.response_mask_BT[rows].float()
        return -(adv[rows, None] * lp * mask).sum() / n_tokens, {}

    def grads(rows, micro):
        cfg = ActorConfig(dtype="bf16", grad_clip=0.0, mini_batch_size=len(rows),
                          micro_batch_size=micro)
        actor = TorchActor(copy.deepcopy(model), cfg, 1)
        seen = []
        actor.optimizer.register_step_pre_hook(
            lambda opt, a, k: seen.append([p.grad.clone() for p in actor.master.parameters()]))
        part = batch.rows(torch.tensor(rows))
        actor.update(part, lambda lp, ent, r, m: loss_fn(lp, ent, torch.tensor(rows)[r], m))
        return seen[0]

    both = grads([0, 1, 2, 3], micro=2)
    first, second = grads([0, 1], micro=2), grads([2, 3], micro=2)
    assert all(torch.equal(g, a + b) for g, a, b in zip(both, first, second))
