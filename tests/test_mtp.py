"""MTP layers (moe/mtp.py): loaded from and saved to checkpoints, their draft logits and routes
against transformers' MtpModel, and kept out of the policy's forward and of route replay."""

import copy

import pytest
import torch

from lockstep.moe.checkpoint import hf_state_dict, load_hf, save_hf
from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.moe.mtp import mtp_hidden

from arch_fixtures import write_hf_folder

transformers = pytest.importorskip("transformers")


def _with_mtp(family, tmp_path, seed=0):
    """Our random model of `family` with one MTP layer, saved (DeepSeek's layout: decoder layer
    num_hidden_layers); the transformers main model loaded from that folder and its MtpModel
    given our MTP layer's tensors (from_pretrained finds MTP weights only at the released
    models' layer numbers, 61 / 46 / 92)."""
    from transformers.modeling_layers import MtpModel

    cfg = ModelConfig.from_json(write_hf_folder(family, tmp_path / "ref"))
    cfg = ModelConfig.from_hf_dict({**cfg.to_hf_dict(), "num_nextn_predict_layers": 1})
    torch.manual_seed(seed)
    ours = MoEModel(cfg).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            if name.endswith("gate.weight") and p.dim() == 2 and p.shape[0] == cfg.num_experts:
                p.normal_(0.0, 0.5)
        for b in ours.buffers():
            b.uniform_(-0.3, 0.3)
    folder = save_hf(ours, tmp_path / "ours")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    mtp = MtpModel(hf, 1).eval()
    names = {"block.": "mtp_block.", "mlp.e_score_correction_bias": "mlp.gate.e_score_correction_bias"}
    sd = {}
    for k, v in ours.mtp[0].state_dict().items():
        for a, b in names.items():
            k = k.replace(a, b)
        sd["layers.0." + k] = v
    missing, unexpected = mtp.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight", "shared_head.weight"}
    return ours, hf, mtp, folder


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_mtp_layer_matches_transformers(family, tmp_path):
    """Our MTP layer's draft logits and its router's top-k against transformers' MtpModel on
    the same folder (fp32); the folder reloads into ours with the same MTP weights."""
    ours, hf, mtp, folder = _with_mtp(family, tmp_path)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = ours(ids).hidden_BTD[:, :-1]           # h_t, t = 0..T-2
        ours_h = mtp_hidden(ours, hidden, ids[:, 1:])[0]
        ours_logits = ours.logits(ours_h)
        hf_hidden = hf.model(ids).last_hidden_state[:, :-1]
        pos = torch.arange(1, 10).expand(2, 9)
        hf_h = mtp.forward_layer(0, hf_hidden, pos, None, input_ids=ids[:, 1:])
        hf_logits = mtp._project_to_logits(hf_h)
    assert (ours_logits - hf_logits).abs().max() <= 1e-5
    reloaded = load_hf(folder)
    assert reloaded.cfg.num_nextn_predict_layers == 1
    for k, v in hf_state_dict(ours).items():
        assert torch.equal(v, hf_state_dict(reloaded)[k]), k
    L = ours.cfg.num_hidden_layers  # DeepSeek's released layout of the MTP layer
    names = set(hf_state_dict(ours))
    assert {f"model.layers.{L}.{n}.weight" for n in
            ("enorm", "hnorm", "eh_proj", "shared_head.norm", "input_layernorm")} <= names


def test_a_folder_without_mtp_weights_loads_without_mtp_layers(tmp_path):
    """transformers' save_pretrained writes num_nextn_predict_layers = 1 but no MTP weights:
    such a folder loads with no MTP layers (and saves so)."""
    folder = write_hf_folder("deepseek_v3", tmp_path / "d")
    assert ModelConfig.from_json(folder).num_nextn_predict_layers == 1
    model = load_hf(folder)
    assert model.cfg.num_nextn_predict_layers == 0 and len(model.mtp) == 0


def test_an_actor_built_from_a_folder_without_mtp_weights_drops_them_once(tmp_path):
    """A run's `model.path` folder whose config.json names an MTP layer it holds no weights
    for (transformers' save_pretrained, a release stripped of its MTP layer): the experiment's
    model has no MTP layer, an actor builds from the folder as a rank does (a LazyHF reader;
    this failed with "missing tensors model.layers.3.eh_proj..."), and the drop is said once.
    A folder of config.json alone (a plan) keeps what it says."""
    import warnings

    from lockstep.moe.hf_lazy import LazyHF
    from lockstep.trainer.actor.build import make_actor
    from lockstep.trainer.config.load import load_config

    folder = write_hf_folder("deepseek_v3", tmp_path / "d")
    sets = [f"model.path={folder}", "warmstart.enabled=false", "rollout.max_new_tokens=4",
            "task.name=sort", "task.sort_length=3"]
    with pytest.warns(UserWarning, match=r"num_nextn_predict_layers=1 but the folder holds "
                                         r"no MTP weights .*model.layers.3.eh_proj.weight"):
        cfg = load_config(None, sets)
    assert cfg.model.num_nextn_predict_layers == 0
    actor = make_actor(cfg, LazyHF(folder), total_updates=1)
    assert len(actor.master.mtp) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: a second read of the folder is silent
        assert load_config(None, sets).model == cfg.model
    plan = tmp_path / "plan"
    plan.mkdir()
    (plan / "config.json").write_text((folder / "config.json").read_text())
    assert load_config(None, [f"model.path={plan}", *sets[1:]]).model.num_nextn_predict_layers == 1


def test_an_mtp_router_never_receives_the_decoders_routes(tmp_path):
    """Route replay (R3) of every decoder MoE layer, then an MTP draft: every decoder router
    gets its layer's replayed ids and the MTP router gets none (it routes on its own). A
    routes tensor with a row for the MTP layer is refused by shape."""
    from lockstep.kernels.routes import RouteError

    ours, _, _, _ = _with_mtp("deepseek_v3", tmp_path)
    seen = {}

    def spy(block, name):
        real = block.forward

        def forward(x, replay_ids=None, *args, **kw):
            seen.setdefault(name, []).append(None if replay_ids is None else replay_ids.clone())
            return real(x, replay_ids, *args, **kw)
        block.forward = forward

    for i, block in enumerate(ours.moe_blocks):
        spy(block, f"decoder{i}")
    spy(ours.mtp[0].block.mlp, "mtp")
    assert all(b is not ours.mtp[0].block.mlp for b in ours.moe_blocks)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = ours(ids)
        replayed = ours(ids, routed_experts_BTLK=out.routes_BTLK)
        mtp_hidden(ours, replayed.hidden_BTD[:, :-1], ids[:, 1:])
    L = ours.cfg.num_moe_layers
    for i in range(L):
        got = seen[f"decoder{i}"][1]
        assert got is not None and torch.equal(got, out.routes_BTLK[:, :, i].reshape(-1, 2))
    assert seen["mtp"] == [None]
    extra = torch.cat([out.routes_BTLK, out.routes_BTLK[:, :, -1:]], 2)  # one row too many
    with pytest.raises(RouteError):
        ours(ids, routed_experts_BTLK=extra)
    assert copy.deepcopy(ours).cfg.num_moe_layers == L
