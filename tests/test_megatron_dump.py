"""Rollout dumps with the megatron actor (CPU, gloo world of one): `MegatronActor.dump_fields`
equals the torch actor's dump fields on the same weights and batch for every replay mode and
two router families (log-probs within 1e-5, natural top-k equal, router margins from
megatron-core's own routers within 1e-5), and `loop.dump_every` with `actor.backend=megatron`
writes the torch run's dump of the same step, which `lockstep diagnose --dump` reads.
(The group: test_megatron_group.py.)

Shapes: B batch, T tokens, L MoE layers, K top-k.
"""

import copy
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from lockstep.replay import ReplayMode  # noqa: E402
from lockstep.trainer.actor.torch_actor import TorchActor  # noqa: E402
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.sections import ActorConfig
from lockstep.trainer.observe.dump import ACTOR_FIELDS, read_dump  # noqa: E402
from lockstep.trainer.loop import Trainer  # noqa: E402
from lockstep.trainer.actor.megatron.actor import MegatronActor  # noqa: E402

from test_megatron_actor import setup  # noqa: E402
from test_megatron_families import glm_cfg, random_torch_model  # noqa: E402

pytestmark = pytest.mark.megatron

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TOL = 1e-5


def compare(want: dict, got: dict, lens: torch.Tensor) -> None:
    """The actor's dump fields equal where defined: log-probs at real tokens, routes and
    margins at routed rows (0 .. P+R-2); `lens` [B] = P + R."""
    assert set(got) == set(want) and set(ACTOR_FIELDS) <= set(got)
    T = want["old_logprobs"].shape[1]
    tok = torch.arange(T)[None] < lens[:, None]
    routed = torch.arange(T)[None] < lens[:, None] - 1
    for k in ACTOR_FIELDS:
        where = routed if k in ("actor_routes", "router_margin") else tok
        x, y = want[k][where], got[k][where]
        assert x.dtype == y.dtype and x.shape == y.shape, (k, x.dtype, y.dtype)
        if k == "actor_routes":
            assert torch.equal(x, y), k
        else:
            assert torch.allclose(x, y, atol=TOL, rtol=0), (k, float((x - y).abs().max()))


def _batch_and_model(family: str):
    cfg, model, batch, _ = setup()
    if family == "glm":  # sigmoid router, expert bias, group limit, dense layer 0
        model = random_torch_model(glm_cfg(), 0)
        E, K = model.cfg.num_experts, model.cfg.num_experts_per_tok
        g = torch.Generator().manual_seed(3)
        routes = torch.rand(*batch.input_ids_BT.shape, model.cfg.num_moe_layers, E,
                            generator=g).argsort(-1)[..., :K]
        routes[~batch.rollout_routes_valid_BT] = 0
        batch.rollout_routes_BTLK = routes.to(torch.uint8)
    return model, batch


@pytest.mark.parametrize("family", ["qwen3", "glm"])
def test_dump_fields_equal_the_torch_actors(world1, family):
    model, batch = _batch_and_model(family)
    acfg = ActorConfig(mini_batch_size=4, micro_batch_size=2)
    torch_actor = TorchActor(copy.deepcopy(model), acfg, 1)
    mg = MegatronActor(copy.deepcopy(model), acfg, 1)
    got = {}
    for mode in ReplayMode:
        want = torch_actor.dump_fields(batch, mode, 1)
        got[mode] = mg.dump_fields(batch, mode, 1)
        compare(want, got[mode], batch.seq_lens_B)
    # each mode's fields come from its own pi_old forward: R3's natural top-k and margins are
    # those of the forward replaying the engine's routes, which routes later layers otherwise
    off, r3 = got[ReplayMode.OFF], got[ReplayMode.R3]
    assert torch.equal(off["natural_logprobs"], r3["natural_logprobs"])
    assert not torch.equal(off["router_margin"], r3["router_margin"])
    assert not torch.equal(off["old_logprobs"], r3["old_logprobs"])
    assert (r3["router_margin"][:, :, 0] == off["router_margin"][:, :, 0]).all()  # layer 0:
    # the same input either way; layers after it see the replayed history


def _trainer(tmp_path, backend: str) -> Trainer:
    cfg = load_config(CONFIGS / "toy_r3.yaml", [
        f"actor.backend={backend}", "warmstart.enabled=false", "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4", "actor.mini_batch_size=16", "actor.micro_batch_size=8",
        "loop.dump_every=1", "loop.checkpoint_every=0", "loop.tensorboard=false",
        "loop.plots=false"])
    return Trainer(cfg, tmp_path / backend, progress=False, log=lambda s: None)


def test_loop_dump_every_with_megatron_equals_torch_and_diagnose_reads_it(tmp_path, capsys):
    """`loop.dump_every=1` on the in-process megatron actor: the dump of step 1 holds the
    torch run's samples and, within fp32 rounding, its actor fields; `lockstep diagnose
    --dump` reads it and reports what it reports for the torch run's dump."""
    from lockstep.launch import cli
    from lockstep.launch.diagnose import diagnose_dump

    for backend in ("torch", "megatron"):
        _trainer(tmp_path, backend).step(1)
    paths = {b: tmp_path / b / "dumps/step_1.safetensors" for b in ("torch", "megatron")}
    a, b = read_dump(paths["torch"]), read_dump(paths["megatron"])
    assert b.header["actor"]["backend"] == "megatron" and b.header["replay_mode"] == "R3"
    for k in set(a.tensors) - set(ACTOR_FIELDS):  # the engine's samples: the same
        assert torch.equal(a.tensors[k], b.tensors[k]), k
    compare(a.tensors, b.tensors, a.seq_lens)
    out = tmp_path / "diag"
    assert cli.main(["diagnose", "--dump", str(paths["megatron"]), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    want = diagnose_dump(paths["torch"])
    for k in ("routing/flip_rate", "routing/token_any_flip", "diagnose/flipped_token_fraction"):
        assert report["metrics"][k] == want["metrics"][k], k
    for k in ("rollout_corr/k3_kl", "diagnose/k3_kl_natural"):
        assert abs(report["metrics"][k] - want["metrics"][k]) <= 1e-6, k
    capsys.readouterr()
