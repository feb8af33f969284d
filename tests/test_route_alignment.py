"""Routes stay aligned with their tokens from the engine to the router: a route moved by one
position at any stage fails these tests.

The chain, all real: the embedded engine samples in fp32 and captures routes -> a loopback
server encodes them (SGLang int32 with dense-layer zero rows, or lockstep's bit-packed
compact) -> `HTTPBackend` decodes -> `collate` -> DP shards (`plan_shards`, each trimmed to its
longest row) -> the actor's R3 replay in token-budget micro-batches (`TorchActor`; and
`MegatronActor`'s replay adapter where megatron-core is installed). On every rank, at every
position that has a route:
- the actor ran exactly the rollout's routes (the replay reached the router), and
- they are the routes the actor's own router picks there (its natural top-k on the same fp32
  weights): true only if routes and tokens line up at every stage, since the router's choice
  at position t depends on the token at t;
- and the actor's log-probs equal the engine's at every response token.
"""

import copy

import pytest
import torch

from lockstep.rollout.client import HTTPBackend
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.actor.batch import collate, minibatch_schedule, plan_shards
from lockstep.trainer.config.sections import ActorConfig

from server_fixtures import model, server  # noqa: F401 (pytest fixtures)

DP = 2


def _requests():
    g = torch.Generator().manual_seed(3)
    return [GenerateRequest(torch.randint(3, 40, (p,), generator=g).tolist(),
                            SamplingParams(max_new_tokens=m, seed=7 + i, temperature=1.0,
                                           ignore_eos=True))
            for i, (p, m) in enumerate([(3, 9), (8, 4), (5, 12), (2, 6), (9, 7), (4, 10)])]


def _sharded_batch(server, model, compact):
    c = model.cfg
    http = HTTPBackend(server.url, c, max_concurrency=4, compact_routes=compact)
    results = http.generate(_requests())
    assert http.encodings_seen["compact" if compact else "int32"] == len(results)
    batch = collate(results, c.pad_token_id, c.num_experts, c.num_moe_layers,
                    c.num_experts_per_tok)
    assert len(set(batch.seq_lens_B.tolist())) > 3  # ragged: trimming and padding matter
    plan = plan_shards(batch.seq_lens_B, DP, minibatch_schedule(batch.size, 3, 1, shuffle_seed=1))
    return batch, plan


def _check_rank(actor, shard, who):
    valid_BT = shard.rollout_routes_valid_BT
    out = actor.logprobs(shard, shard.rollout_routes_BTLK, valid_BT, record=True)
    given = shard.rollout_routes_BTLK[valid_BT].long()
    ran = out.routes_BTLK[valid_BT].long()
    assert torch.equal(ran, given), f"{who}: the router did not run the given routes"
    natural = out.natural_BTLK[valid_BT].long()
    picked_other = (natural.sort(-1).values != given.sort(-1).values).any(-1).any(-1)
    assert not picked_other.any(), (
        f"{who}: at {int(picked_other.sum())} of {len(given)} positions the actor's router picks "
        f"other experts than the rollout's routes (routes and tokens are misaligned)")
    resp_BT = shard.response_mask_BT
    torch.testing.assert_close(out.logprobs_BT[resp_BT], shard.rollout_logprobs_BT[resp_BT],
                               atol=1e-4, rtol=0, msg=lambda m: f"{who}: {m}")


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "int32"])
def test_engine_to_torch_actor_replay_keeps_routes_on_their_tokens(server, model, compact):
    batch, plan = _sharded_batch(server, model, compact)
    cfg = ActorConfig(mini_batch_size=3, micro_batch_size=1, max_tokens_per_micro_batch=24)
    actor = TorchActor(copy.deepcopy(model), cfg, total_updates=1)
    for r in range(DP):
        _check_rank(actor, plan.batch(r, batch), f"rank {r}")


@pytest.mark.slow
@pytest.mark.megatron
def test_engine_to_megatron_replay_adapter_keeps_routes_on_their_tokens(server, model):
    pytest.importorskip("megatron.core")
    from lockstep.trainer.actor.megatron.actor import MegatronActor

    batch, plan = _sharded_batch(server, model, compact=True)
    cfg = ActorConfig(mini_batch_size=3, micro_batch_size=3)
    actor = MegatronActor(copy.deepcopy(model), cfg, total_updates=1)
    for r in range(DP):
        _check_rank(actor, plan.batch(r, batch), f"megatron, rank {r}")
