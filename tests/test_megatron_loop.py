"""The RL loop with actor.backend=megatron vs actor.backend=torch (CPU, gloo world of one):
the first R3 / R2 step gives the same metrics as with the torch actor, weights reach the
engine, and a checkpoint is written."""

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from lockstep.trainer.actor.megatron.actor import MegatronActor  # noqa: E402
from lockstep.trainer.config.load import load_config  # noqa: E402
from lockstep.trainer.loop import Trainer  # noqa: E402

pytestmark = pytest.mark.megatron

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "toy_r3.yaml"


def trainer(tmp_path, name: str, mode: str, *extra: str) -> Trainer:
    cfg = load_config(CONFIG, [*extra,
        f"actor.backend={name}", f"replay.mode={mode}", "loop.steps=2", "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4", "actor.mini_batch_size=8", "actor.micro_batch_size=4",
        "warmstart.enabled=false", "loop.tensorboard=false", "loop.plots=false",
        "loop.checkpoint_every=0",
        "loss.entropy_coef=0.01"])  # a gradient even when every reward of a random policy is 0
    return Trainer(cfg, tmp_path / name, progress=False, log=lambda s: None)


@pytest.mark.parametrize("mode", ["R3", "R2"])
def test_first_step_matches_torch_actor_and_loop_runs(tmp_path, mode):
    ref = trainer(tmp_path, "torch", mode)
    mg = trainer(tmp_path, "megatron", mode)
    assert isinstance(mg.actor, MegatronActor)
    before = {k: v.clone() for k, v in mg.actor.master.state_dict().items()}
    a, b = ref.step(1), mg.step(1)
    compared = 0
    for k, v in a.items():
        if k.startswith("time/") or not isinstance(v, float):
            continue
        assert k in b, k
        assert math.isclose(v, b[k], rel_tol=1e-3, abs_tol=1e-4), (k, v, b[k])
        compared += 1
    assert compared > 20
    # the megatron update reached the master weights, hence the engine
    assert any(not torch.equal(before[k], v) for k, v in mg.actor.master.state_dict().items())
    c = mg.step(2)
    assert all(math.isfinite(v) for v in c.values() if isinstance(v, float))
    assert (mg.save() / "model.safetensors").exists() or any(mg.save().iterdir())


def test_resume_continues_exactly(tmp_path):
    """Steps 1-3 in one go == steps 1-2, checkpoint, resume (optimiser state restored), 3."""
    one = trainer(tmp_path, "megatron", "R3")
    for step in (1, 2):
        one.step(step)
    one.save()
    third = one.step(3)
    resumed = Trainer(load_config(tmp_path / "megatron" / "config.yaml", ["loop.steps=3"]),
                      tmp_path / "megatron", resume=True, progress=False, log=lambda s: None)
    assert isinstance(resumed.actor, MegatronActor) and resumed.state.step == 2
    again = resumed.step(3)
    for k, v in third.items():
        if not k.startswith("time/") and isinstance(v, float):
            assert math.isclose(v, again[k], rel_tol=1e-6, abs_tol=1e-7), (k, v, again[k])


def test_megatron_section_reaches_the_actor(tmp_path):
    tr = trainer(tmp_path, "megatron", "R3", "actor.megatron.seed=7",
                 "actor.megatron.recompute_activations=true")
    assert tr.actor.opts.seed == 7 and tr.actor.opts.recompute_activations
    assert tr.actor.gpt.config.recompute_granularity == "full"
    assert all(math.isfinite(v) for v in tr.step(1).values() if isinstance(v, float))


@pytest.mark.parametrize("override", ["actor.megatron.tensor_parallel=2",
                                      "actor.megatron.expert_parallel=2",
                                      "actor.megatron.pipeline_parallel=2"])
def test_loop_refuses_a_multi_rank_layout(tmp_path, override):
    with pytest.raises(ValueError, match=override.replace(".", r"\.") + r".*world of one "
                                         r"process.*torchrun\) is not supported yet"):
        trainer(tmp_path, "megatron", "R3", override)
    assert not (tmp_path / "megatron").exists()  # refused before anything was written


@pytest.mark.parametrize("sets,msg", [
    (["cluster.actor_ranks=4", "actor.megatron.tensor_parallel=2",
      "actor.megatron.expert_parallel=2"],
     r"expert_parallel=2 with actor\.megatron\.expert_tensor_parallel=2 and .*alltoall on CPU: "
     r".*gloo cannot"),
    (["cluster.actor_ranks=4", "actor.megatron.tensor_parallel=2",
      "actor.megatron.expert_parallel=2", "actor.megatron.token_dispatcher=allgather"],
     r"allgather with actor\.megatron\.expert_parallel=2 x .*expert_tensor_parallel=2 > .*"
     r"tensor_parallel=2: .* span data-parallel ranks"),
    (["cluster.actor_ranks=2", "actor.megatron.expert_parallel=2",
      "actor.megatron.token_dispatcher=allgather"],
     r"allgather with actor\.megatron\.expert_parallel=2 x .*expert_tensor_parallel=1 > "),
    (["cluster.actor_ranks=3", "actor.megatron.tensor_parallel=2"],
     r"tensor_parallel=2 x actor\.megatron\.pipeline_parallel=1 does not divide the 3 actor"),
    # 3 layers on 2 stages run ([2, 1]: stage_layer_counts); more stages than layers do not
    (["cluster.actor_ranks=4", "actor.megatron.pipeline_parallel=4"],
     r"actor\.megatron\.pipeline_parallel=4 is more stages than model\.num_hidden_layers=3"),
    (["cluster.actor_ranks=2", "actor.megatron.pipeline_parallel=2",
      "actor.megatron.pipeline_layers=[2,2]"],
     r"actor\.megatron\.pipeline_layers=\[2, 2\] sums to 4 layers, but "
     r"model\.num_hidden_layers=3"),
])
def test_group_layouts_megatron_cannot_run_are_refused_before_any_rank_starts(sets, msg):
    from lockstep.moe.checks import ConfigError
    from lockstep.trainer.config.megatron import check_world
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "toy_r3.yaml",
                      ["actor.backend=megatron", *sets])
    with pytest.raises(ConfigError, match=msg):
        check_world(cfg)
    ok = load_config(Path(__file__).resolve().parent.parent / "configs" / "toy_r3.yaml",
                     ["actor.backend=megatron", "cluster.actor_ranks=4",
                      "actor.megatron.tensor_parallel=2", "actor.megatron.expert_parallel=2",
                      "actor.megatron.expert_tensor_parallel=1"])
    check_world(ok)  # the same layout with expert TP 1 is allowed (and tested)


@pytest.mark.parametrize("sets, msg", [
    (["actor.megatron.virtual_pipeline_parallel=2"],
     r"virtual_pipeline_parallel=2 needs pipeline_parallel >= 2 \(got 1\)"),
    (["actor.megatron.pipeline_parallel=2", "actor.megatron.virtual_pipeline_parallel=0"],
     r"virtual_pipeline_parallel must be a positive integer or null, got 0"),
    (["actor.megatron.pipeline_parallel=2", "actor.megatron.pipeline_layers=[3]"],
     r"pipeline_layers=\[3\] has 1 stages but pipeline_parallel=2: give one layer count per"),
    (["actor.megatron.pipeline_parallel=2", "actor.megatron.pipeline_layers=[3,0]"],
     r"pipeline_layers must be a list of positive layer counts .*got \[3, 0\]"),
])
def test_bad_virtual_pipeline_is_refused_when_read(sets, msg):
    with pytest.raises(Exception, match=msg):
        load_config(Path(__file__).resolve().parent.parent / "configs" / "toy_r3.yaml",
                    ["actor.backend=megatron", "cluster.actor_ranks=2", *sets])


def test_virtual_pipeline_layers_must_split_over_every_chunk():
    from lockstep.moe.checks import ConfigError
    from lockstep.trainer.config.megatron import check_world
    toy = Path(__file__).resolve().parent.parent / "configs" / "toy_r3.yaml"
    sets = ["actor.backend=megatron", "cluster.actor_ranks=2",
            "actor.megatron.pipeline_parallel=2", "actor.megatron.virtual_pipeline_parallel=2"]
    with pytest.raises(ConfigError, match=r"model\.num_hidden_layers=6 is not divisible by "
                       r"actor\.megatron\.pipeline_parallel=2 x actor\.megatron\."
                       r"virtual_pipeline_parallel=2 \(every model chunk"):
        check_world(load_config(toy, [*sets, "model.num_hidden_layers=6"]))
    check_world(load_config(toy, [*sets, "model.num_hidden_layers=4"]))  # runs


def test_uneven_pipeline_stages_are_accepted_and_laid_out():
    """3 layers on 2 stages: [2, 1] by default, [1, 2] by pipeline_layers, and megatron-core
    is given the matching pipeline_model_parallel_layout; with a virtual pipeline the chunks
    stay equal (pipeline_layers refused, naming both options)."""
    from lockstep.moe.checks import ConfigError
    from lockstep.trainer.config.megatron import chunk_layers, megatron_args
    from lockstep.trainer.config.megatron import check_world
    toy = Path(__file__).resolve().parent.parent / "configs" / "toy_r3.yaml"
    sets = ["actor.backend=megatron", "cluster.actor_ranks=2",
            "actor.megatron.pipeline_parallel=2"]
    for extra, stages, layout in (([], [[0, 1], [2]], "Ett|tL"),
                                  (["actor.megatron.pipeline_layers=[1,2]"], [[0], [1, 2]],
                                   "Et|ttL")):
        cfg = load_config(toy, [*sets, *extra])
        check_world(cfg)
        m = cfg.actor.megatron
        assert [chunk_layers(cfg.model, m, p) for p in range(2)] == [[s] for s in stages]
        args = megatron_args(cfg.model, m, use_te=False, on_gpu=False)
        assert args["pipeline_model_parallel_layout"] == layout
    even = load_config(toy, [*sets, "model.num_hidden_layers=4"])
    assert megatron_args(even.model, even.actor.megatron, use_te=False,
                         on_gpu=False)["pipeline_model_parallel_layout"] is None
    with pytest.raises(ConfigError, match=r"pipeline_layers with actor\.megatron\."
                       r"virtual_pipeline_parallel=2 is not supported"):
        check_world(load_config(toy, [*sets, "model.num_hidden_layers=4",
                                               "actor.megatron.virtual_pipeline_parallel=2",
                                               "actor.megatron.pipeline_layers=[2,2]"]))
