"""Virtual pipeline (megatron-core's interleaved 1F1B schedule): PP=2 x VPP=2 on 2 gloo
processes gives the one-process torch actor's log-probs, R3 / R2 routes (each model chunk's
replay adapter runs exactly its own MoE layers' slice of [B, T, L, K]), gradients, metrics,
the step, the HF export and the rank state round trip.

Layers of the 4-layer toy (layer 1 dense): stage 0 holds chunks [layer 0], [layer 2], stage 1
[layer 1 (dense: no MoE layer)], [layer 3] -> stage 0's chunks replay L = 0 and 1, stage 1's
second chunk L = 2.
"""

import copy

import pytest
import torch

pytest.importorskip("megatron.core")

import torch.multiprocessing as mp  # noqa: E402

from lockstep.moe.checkpoint import hf_state_dict, load_hf_state_dict  # noqa: E402
from lockstep.moe.model import MoEModel  # noqa: E402

from test_megatron_parallel import (TOL, _actor_cfg, _actor_step, _batch, _cfg,  # noqa: E402
                                    _free_port, _random_model)

pytestmark = [pytest.mark.megatron]

VPP = dict(pipeline_parallel=2, virtual_pipeline_parallel=2)


def _worker(rank: int, port: int, path: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from lockstep.trainer.actor.megatron import convert
    from lockstep.trainer.actor.megatron.actor import MegatronActor
    from lockstep.trainer.config.megatron import MegatronOptions

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    data = torch.load(path)
    from lockstep.moe.config import ModelConfig
    cfg, sd = ModelConfig.from_hf_dict(data["cfg"]), data["sd"]
    model = MoEModel(cfg)
    load_hf_state_dict(model, sd)
    actor = MegatronActor(model, _actor_cfg(), total_updates=2,
                          options=MegatronOptions(**VPP))
    chunks = [sorted(convert.stage_layers(m).values()) for m in actor.chunks]
    slices = [(s.start, s.stop) for s in actor.moe_slices]
    exported = {k: v.clone() for b in actor.export_weights(1 << 12) for k, v in b}
    out = dict(chunks=chunks, slices=slices,
               export_exact=set(exported) == set(sd)
               and all(torch.equal(exported[k], sd[k]) for k in sd))
    state = actor.rank_state() if hasattr(actor, "rank_state") else actor.state_dict()
    out.update(_actor_step(actor, _batch(data), data["adv"]))
    out["state_keys"] = len(state)
    out["ckpt"] = _checkpoint_round_trip(actor, cfg, rank, f"{path}.ckpt")
    torch.save(out, f"{path}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


def test_interleaved_group_size_is_one_megatron_core_accepts():
    """microbatch_group_size_per_vp_stage: in [PP, M], and M % g is 0 or >= PP (schedules.py
    raises otherwise); the smallest such g."""
    from lockstep.trainer.actor.megatron.schedule import vp_group_size
    for pp in (2, 3, 4):
        for m in range(pp, 20):
            g = vp_group_size(m, pp)
            assert pp <= g <= m and (m % g == 0 or m % g >= pp), (pp, m, g)
            assert all(not (m % h == 0 or m % h >= pp) for h in range(pp, g)), (pp, m, g)
    assert vp_group_size(4, 2) == 2 and vp_group_size(5, 2) == 3 and vp_group_size(7, 4) == 7
    with pytest.raises(ValueError, match="1 micro-batches < pipeline_parallel=2"):
        vp_group_size(1, 2)


def _checkpoint_round_trip(actor, cfg, rank: int, folder: str) -> dict:
    """The group's checkpoint path (trainer/actor/checkpoint.py: HF-named Adam moments written by
    the ranks) over model chunks: write, wipe this rank's moments, load them back."""
    from pathlib import Path

    import torch.distributed as dist

    from lockstep.trainer.actor.checkpoint import actor_load, actor_parts, write_parts
    from lockstep.trainer.actor.megatron.checkpoint import adam_states

    parts, state = actor_parts(actor, rank, 2)
    write_parts(Path(folder), parts, cfg)
    dist.barrier()
    adam = {k: o.state[main] for k, (o, main) in adam_states(actor).items()
            if o.state.get(main)}
    before = {k: (s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for k, s in adam.items()}
    for s in adam.values():
        s["exp_avg"].zero_()
        s["exp_avg_sq"].zero_()
    actor_load(actor, Path(folder), state)
    adam = {k: o.state[main] for k, (o, main) in adam_states(actor).items()
            if o.state.get(main)}
    n_params = sum(1 for m in actor.chunks for _ in m.parameters())
    return dict(params=n_params, with_state=len(before),
                exact=set(adam) == set(before) and all(
                    torch.equal(adam[k]["exp_avg"], a) and torch.equal(adam[k]["exp_avg_sq"], b)
                    and a.abs().sum() > 0 for k, (a, b) in before.items()))


@pytest.mark.slow
def test_pp2_vpp2_matches_torch_actor(tmp_path):
    cfg = _cfg()
    ref_model = _random_model(cfg)
    sd = {k: v.detach().clone() for k, v in hf_state_dict(ref_model).items()}
    B, T, L, K = 4, 7, cfg.num_moe_layers, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=g)
    lens = torch.tensor([7, 5, 6, 3])
    t_T = torch.arange(T)
    ids[t_T[None] >= lens[:, None]] = 0
    valid = t_T[None] < (lens[:, None] - 1)
    routes = torch.rand(B, T, L, cfg.num_experts, generator=g).argsort(-1)[..., :K]
    routes[~valid] = 0
    routes = routes.to(torch.uint8)
    path = str(tmp_path / "inputs.pt")
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    torch.save(dict(cfg=cfg.to_hf_dict(), sd=sd, ids=ids, routes=routes, valid=valid,
                    lens=lens, adv=adv), path)
    mp.spawn(_worker, args=(_free_port(), path), nprocs=2, join=True)

    from lockstep.trainer.actor.torch_actor import TorchActor
    batch = _batch(torch.load(path))
    ref = _actor_step(TorchActor(copy.deepcopy(ref_model), _actor_cfg(), total_updates=2),
                      batch, adv)
    got = [torch.load(f"{path}.rank{r}") for r in range(2)]
    scored = torch.cat([torch.zeros(B, 1, dtype=torch.bool), valid[:, :-1]], 1)
    real = batch.token_mask_BT
    for rank, res in enumerate(got):
        assert res["export_exact"], rank
        # the checkpoint's Adam moments (HF-named, written by the ranks) load back into
        # every chunk's parameters
        ck = res["ckpt"]
        assert ck["exact"] and ck["with_state"] == ck["params"] > 0, (rank, ck)
        # R3: every layer of every chunk ran the given routes (both ranks hold all layers'
        # results after the pipeline sum), and the log-probs are the torch actor's
        assert torch.equal(res["routes_before"][valid], routes[valid]), rank
        assert torch.equal(res["used"][valid], routes[valid]), rank
        for k in ("lp_before", "lp_natural", "r2_lp"):
            err = (res[k] - ref[k])[scored].abs().max()
            assert err <= TOL, f"rank {rank}: {k} differs by {err}"
        # R2: recorded = the torch actor's natural routes, replaying them runs them
        assert torch.equal(res["recorded"].sort(-1).values[real],
                           ref["recorded"].sort(-1).values[real]), rank
        assert torch.equal(res["r2_routes"][real], res["recorded"][real]), rank
        scale = max(x.abs().max() for x in ref["grads"].values())
        diff, key = max(((res["grads"][k] - ref["grads"][k]).abs().max(), k)
                        for k in ref["grads"])
        assert diff <= 1e-5 * scale, f"rank {rank}: grads: {diff} ({key})"
        for k in ("loss/pg", "actor/grad_norm", "actor/aux_loss"):
            a, b = ref["metrics"][k], res["metrics"][k]
            assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (rank, k, a, b)
        err = (res["lp_after"] - ref["lp_after"])[scored].abs().max()
        assert err <= 1e-3, f"rank {rank}: log-probs after the step: {err}"
        diff = max((res["weights"][k] - ref["weights"][k]).abs().max() for k in ref["weights"])
        assert diff <= 0.1 * _actor_cfg().lr, f"rank {rank}: weights after the step: {diff}"
    # the chunks hold megatron-core's interleaved layers, each replaying its own L slice
    assert [g["chunks"] for g in got] == [[[0], [2]], [[1], [3]]]
    assert [g["slices"] for g in got] == [[(0, 1), (1, 2)], [(0, 0), (2, 3)]]


@pytest.mark.slow
def test_pp2_vpp2_group_matches_one_process(cluster, tmp_path):
    """`--set actor.megatron.pipeline_parallel=2 --set actor.megatron.virtual_pipeline_parallel=2`
    on 2 Ray ranks (4 layers: 1 per chunk): 3 RL steps of the toy R3 config give the
    one-process run's metrics and pushed weights within the group tolerance
    (docs/cluster.md), routes replayed without a mismatch on every step."""
    from test_megatron_group import _export, _trainer
    from test_megatron_group4 import TOLERANCE

    one = _trainer(tmp_path, "one")
    want = [one.step(s) for s in (1, 2, 3)]
    want_w = _export(one.actor)
    group = _trainer(tmp_path, "vpp", "cluster.actor_ranks=2",
                     "actor.megatron.pipeline_parallel=2",
                     "actor.megatron.virtual_pipeline_parallel=2")
    try:
        got = [group.step(s) for s in (1, 2, 3)]
        got_w = _export(group.actor)
    finally:
        group.actor.close()
    for a, b in zip(want, got):
        assert b["replay/mismatch"] == 0.0 and a["actor/grad_norm"] > 0
        assert b["routing/num_tokens"] == a["routing/num_tokens"]
        for k, (rtol, atol) in {**TOLERANCE, "actor/aux_loss": (1e-3, 0.0)}.items():
            assert abs(a[k] - b[k]) <= rtol * abs(a[k]) + atol, (k, a[k], b[k])
    lr = one.cfg.actor.lr
    assert set(got_w) == set(want_w)
    diff = max(float((got_w[k] - want_w[k]).abs().max()) for k in want_w)
    print(f"PP=2 x VPP=2 group: pushed weights after 3 RL steps differ by {diff:.2e}")
    assert diff <= lr / 10
