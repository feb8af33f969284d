"""Multi-turn trajectories through the trainer (rollout.env): with engine and actor in fp32 the
actor's routes and log-probs of 3-turn trajectories equal the engine's stitched ones; the
trained sample holds the sampled ids even where decode-then-encode changes them; dumps and
diagnose read multi-turn samples; the user-style example resumes exactly."""

import json
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from tokenizers import AddedToken

from lockstep.moe.model import MoEModel
from lockstep.rollout.agent import ObservationCodec, TrajectoryRunner
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.env import EnvConfig, EnvPool
from lockstep.rollout.tasks import build_tokenizer
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.config.load import load_config
from lockstep.trainer.loop import Trainer
from lockstep.trainer.observe.diagnosis import analyze
from lockstep.trainer.observe.dump import read_dump
from model_fixtures import tiny_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
THREE_TURNS = """
    def step(state, turn):
        return {"observation": "12=", "reward": 0.0}
"""


def _config(tmp_path, env: dict, *overrides):
    d = yaml.safe_load((CONFIGS / "toy_r3.yaml").read_text())
    d["rollout"]["env"] = env
    d["model"]["max_position_embeddings"] = 48
    f = tmp_path / "cfg.yaml"
    f.write_text(yaml.safe_dump(d))
    small = ["warmstart.enabled=false", "rollout.prompts_per_step=4",
             "rollout.samples_per_prompt=2", "actor.mini_batch_size=8",
             "actor.micro_batch_size=8", "loop.tensorboard=false", "loop.plots=false",
             "loop.checkpoint_every=0"]
    return load_config(f, small + list(overrides))


@pytest.mark.parametrize("mode", ["R3", pytest.param("R2", marks=pytest.mark.slow)])
def test_fp32_three_turn_trajectories_match_the_actor(tmp_path, mode):
    """The actor's natural routes over each final trajectory (one prefill) equal the engine's
    routes stitched across its 3 turns, and its log-probs of the sampled tokens equal the
    rollout's; observation tokens are routed (R3 replays them, R2 records them) but not
    trained."""
    env_file = tmp_path / "env.py"
    env_file.write_text(textwrap.dedent(THREE_TURNS))
    cfg = _config(tmp_path, {"file": str(env_file), "max_turns": 3, "num_workers": 1},
                  "rollout.dtype=fp32", "actor.dtype=fp32", "loop.steps=1",
                  "loop.dump_every=1", "rollout.max_new_tokens=4", f"replay.mode={mode}")
    tr = Trainer(cfg, tmp_path / "run", progress=False, log=lambda s: None)
    m = tr.run()
    rec = read_dump(tmp_path / "run" / "dumps" / "step_1.safetensors")
    turns, sampled = rec.turns, rec.sampled_mask
    assert int(turns.max()) == 2  # three turns
    obs = (turns >= 0) & ~sampled
    assert bool(obs.any()) and bool(sampled.any())
    valid = rec.rollout_routes_valid
    assert torch.equal(rec.actor_routes[valid], rec.rollout_routes[valid])
    assert (rec.natural_logprobs - rec.rollout_logprobs)[sampled].abs().max() < 1e-4
    assert bool((rec.rollout_logprobs[obs] == 0).all())
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["agent/turns_mean"] == 3 and metrics["agent/tool_calls_mean"] == 2
    assert metrics["routing/flip_rate"] == 0 and metrics["routing/observation/flip_rate"] == 0
    assert metrics["agent/k3_kl/turn_2"] < 1e-6
    # the update forwards replayed every routed row (R3: the engine's, all but each sample's
    # last token) or every token (R2: the recorded ones), observation tokens included
    seq = rec.seq_lens.double()
    assert metrics["replay/mismatch"] == 0
    want = float((seq - 1).sum() / seq.sum()) if mode == "R3" else 1.0
    assert abs(metrics["replay/replayed_fraction"] - want) < 1e-9
    assert m["steps"] == 1 and m["agent/turns_mean_first"] == 3  # summary.json has them too
    report = analyze(rec)  # lockstep diagnose reads multi-turn dumps
    assert report["metrics"]["diagnose/num_response_tokens"] == int(sampled.sum())
    assert report["metrics"]["diagnose/num_observation_tokens"] == int(obs.sum())


def _lossy_tokenizer():
    """The toy's characters plus one added token for every pair of digits: two sampled digit
    ids decode to text that encodes back to one other id."""
    tok = build_tokenizer()
    tok.add_tokens([AddedToken(f"{a}{b}", normalized=False) for a in range(10) for b in range(10)])
    return tok


def test_trained_sample_holds_the_sampled_ids_not_a_retokenised_transcript(tmp_path):
    tok = _lossy_tokenizer()
    torch.manual_seed(0)
    engine = Engine.from_model(MoEModel(tiny_config(vocab_size=16, max_position_embeddings=48)),
                               EngineConfig(dtype="fp32", max_len=48))
    turns = []

    def generate(reqs):
        out = engine.generate(reqs)
        turns.extend(out)
        return out
    env_file = tmp_path / "env.py"
    env_file.write_text(textwrap.dedent(THREE_TURNS))
    with EnvPool(EnvConfig(file=str(env_file), max_turns=3, num_workers=1)) as env:
        runner = TrajectoryRunner(generate, env, ObservationCodec(tok), 48, 6, eos_id=2,
                                  vocab_size=16)
        reqs = [GenerateRequest([1, 3 + i, 13], SamplingParams(max_new_tokens=5, n=2, seed=i,
                                                                ignore_eos=True), rid=f"p{i}")
                for i in range(3)]
        results = runner.run(reqs, [{}] * 3)
    batch = collate(results, 0, 6, 3, 2)
    by_traj = {}  # (rid, sample) -> the engine's results of its turns, in order
    for t in turns:
        rid, _, rest = t.rid.partition("-")
        by_traj.setdefault((rid, int(rest.split("-")[0]) if rest else t.index), []).append(t)
    obs = tok.encode("12=", add_special_tokens=False).ids
    changed = 0
    for b, r in enumerate(results):
        ids = batch.input_ids_BT[b, :int(batch.seq_lens_B[b])].tolist()
        want = list(r.prompt_ids)
        for t in by_traj[(r.rid, r.index)]:
            assert t.prompt_ids == want  # each turn was asked with the whole trajectory so far
            want += list(t.output_ids) + obs
            sampled = list(t.output_ids)
            changed += tok.encode(tok.decode(sampled), add_special_tokens=False).ids != sampled
        assert ids == want[:len(ids)] and len(want) - len(ids) == len(obs)  # last: no obs
        resp = batch.response_mask_BT[b, :len(ids)]
        assert int(resp.sum()) == sum(t.sampled for t in r.trajectory.turns)
    assert changed > 0  # re-tokenising the transcript would have changed some turns


@pytest.mark.slow
def test_user_style_env_example_trains_and_resumes_exactly(tmp_path):
    """`lockstep example-data`'s model, data, reward and env.py under
    configs/dataset_agent_example.yaml; 2 steps straight equal 1 step + --resume."""
    from lockstep.launch.example import write_example

    root = write_example(tmp_path / "runs" / "example", n_train=16, n_val=4)
    text = (CONFIGS / "dataset_agent_example.yaml").read_text().replace(
        "runs/example", str(root))
    f = tmp_path / "agent.yaml"
    f.write_text(text)
    sets = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
            "actor.mini_batch_size=8", "actor.micro_batch_size=8", "loop.checkpoint_every=1",
            "loop.plots=false", "loop.tensorboard=false", f"data.val_files=[{root}/val.jsonl]",
            "loop.val_every=2"]

    def run(out, steps, resume=False):
        cfg = load_config(f, sets + [f"loop.steps={steps}"])
        Trainer(cfg, out, resume=resume, progress=False, log=lambda s: None).run()
        return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]

    straight = run(tmp_path / "a", 2)
    run(tmp_path / "b", 1)
    resumed = run(tmp_path / "b", 2, resume=True)
    assert straight[0]["agent/turns_mean"] > 1  # the env's second try happened
    assert straight[1]["val/agent/turns_mean"] > 1  # validation runs the env's trajectories
    assert "val/reward_mean" in straight[1] and "val/errors" in straight[1]
    for a, b in zip(straight, resumed):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == \
            {k: v for k, v in b.items() if not k.startswith("time/")}
