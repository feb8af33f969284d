"""Multi-turn trajectories (rollout/agent.py, rollout/env.py): token-exact samples, routes
stitched across turns equal to one prefill of the whole trajectory, hostile environments."""

import math
import textwrap

import pytest
import torch

from lockstep.moe.model import MoEModel
from lockstep.rollout.agent import ObservationCodec, TrajectoryRunner
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.env import EnvConfig, EnvPool
from lockstep.rollout.rewards import RewardFunctionError
from lockstep.rollout.tasks import build_tokenizer
from lockstep.rollout.types import GenerateRequest, SamplingParams
from model_fixtures import tiny_config

TOK = build_tokenizer()  # the toy's characters: ids 3.. are "0123456789+=>"
V = 16


def _env_file(tmp_path, body: str, name: str = "env.py") -> str:
    f = tmp_path / name
    f.write_text(textwrap.dedent(body))
    return str(f)


FIXED = """
    def reset(problem):
        return {"n": 0, "k": problem["k"]}

    def step(state, turn):
        n = state["n"] + 1
        return {"observation": "1" * (n + state["k"] % 2) + "=", "reward": 0.5,
                "done": False, "state": {"n": n, "k": state["k"]}}
"""


def _engine(max_len=64, seed=0):
    torch.manual_seed(seed)
    model = MoEModel(tiny_config(vocab_size=V, max_position_embeddings=max_len))
    return Engine.from_model(model, EngineConfig(dtype="fp32", max_len=max_len)), model


def _requests(n_prompts=3, n=2, max_new=5, gates=False):
    return [GenerateRequest([1, 3 + i, 4, 13], SamplingParams(max_new_tokens=max_new, n=n,
                                                              seed=100 + 7 * i, ignore_eos=True),
                            rid=f"p{i}", return_gates=gates) for i in range(n_prompts)]


def _run(env_cfg, engine, requests, max_len=64):
    with EnvPool(env_cfg, log=lambda s: None) as env:
        runner = TrajectoryRunner(engine.generate, env, ObservationCodec(TOK), max_len,
                                  engine.model.cfg.num_experts, eos_id=2, vocab_size=V)
        return runner.run(requests, [{"k": i} for i in range(len(requests))])


def test_three_turns_stitched_routes_equal_one_prefill(tmp_path):
    engine, _ = _engine()
    cfg = EnvConfig(file=_env_file(tmp_path, FIXED), max_turns=3, num_workers=1)
    results = _run(cfg, engine, _requests(gates=True))
    assert len(results) == 6
    for r in results:
        info = r.trajectory
        assert len(info.turns) == 3 and info.end == "max_turns" and info.error is None
        assert info.env_reward == 1.5 and info.tool_calls == 2  # every turn scored, 2 answered
        # token exact: the sampled ids and observations, in order, with the loss mask on the
        # sampled ones only; rollout log-probs 0 at observations
        full = r.prompt_ids + r.output_ids
        assert r.sampled_mask.sum() == sum(t.sampled for t in info.turns)
        for t in info.turns[:-1]:
            obs = full[t.start + t.sampled:t.start + t.sampled + t.observation]
            assert TOK.decode(obs) .endswith("=") and not r.sampled_mask[
                t.start + t.sampled - len(r.prompt_ids)]
        assert torch.all(r.output_logprobs[~r.sampled_mask] == 0)
        # one prefill of the final trajectory: its routes and its log-probs of the sampled ids
        ref = engine.generate([GenerateRequest(full, SamplingParams(max_new_tokens=0),
                                               return_input_logprobs=True, return_gates=True)])[0]
        assert r.routes_NLK.shape[0] == len(full) - 1  # P+R-1 rows
        assert torch.equal(r.routes_NLK, ref.routes_NLK)
        torch.testing.assert_close(r.gates_NLK, ref.gates_NLK, atol=1e-5, rtol=0)  # stitched too
        P = len(r.prompt_ids)
        sampled = r.sampled_mask.nonzero().flatten()
        torch.testing.assert_close(r.output_logprobs[sampled], ref.input_logprobs[P + sampled],
                                   atol=2e-5, rtol=0)


def test_stitch_off_by_one_is_refused(tmp_path, monkeypatch):
    """Asking turn t>1 for rows from one position later (or earlier) than the previous turn's
    end must fail at the stitch, never give a silently shifted trace."""
    engine, _ = _engine()
    cfg = EnvConfig(file=_env_file(tmp_path, FIXED), max_turns=2, num_workers=1)
    orig = TrajectoryRunner._next_request
    for shift in (1, -1):
        def shifted(self, t, turn, shift=shift):
            req = orig(self, t, turn)
            req.routes_start += shift
            return req
        monkeypatch.setattr(TrajectoryRunner, "_next_request", shifted)
        with pytest.raises(Exception, match="continuation starts at position"):
            _run(cfg, engine, _requests(n_prompts=1))


HOSTILE = {
    "raises": ("def step(state, turn):\n    raise RuntimeError('boom')\n", "raised"),
    "hangs": ("import time\ndef step(state, turn):\n    time.sleep(60)\n", "timeout"),
    "none": ("def step(state, turn):\n    return None\n", "bad_value"),
    "none_obs": ("def step(state, turn):\n    return {'observation': None}\n", "bad_value"),
    "nan": ("def step(state, turn):\n    return {'observation': '1', 'reward': float('nan')}\n",
            "bad_value"),
    "huge": ("def step(state, turn):\n    return {'observation': '1' * 10**7}\n", "bad_value"),
    "past_context": ("def step(state, turn):\n    return {'observation': '1' * 200}\n",
                     "context"),
    "bad_ids": ("def step(state, turn):\n    return {'observation': [3, 99]}\n", "bad_value"),
    "exits": ("import os\ndef step(state, turn):\n    os._exit(3)\n", "crashed"),
    "reset_raises": ("def reset(problem):\n    raise KeyError('x')\n"
                     "def step(state, turn):\n    return {'observation': '1'}\n", "raised"),
}


def test_hostile_environments_end_the_trajectory_with_a_counted_error(tmp_path):
    engine, _ = _engine()
    for name, (body, kind) in HOSTILE.items():
        cfg = EnvConfig(file=_env_file(tmp_path, body, f"{name}.py"), max_turns=3,
                        num_workers=1, timeout_s=1.0)
        results = _run(cfg, engine, _requests(n_prompts=1, n=2))
        for r in results:
            info = r.trajectory
            assert (info.error, info.end) == (kind, "error"), (name, info)
            assert len(info.turns) == 1 and info.message  # the run goes on with the first turn
            assert r.sampled_mask.all() and r.routes_NLK.shape[0] == len(r.prompt_ids) + len(
                r.output_ids) - 1


def test_env_file_errors_are_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="rollout.env.file"):
        EnvPool(EnvConfig(file=str(tmp_path / "missing.py")))
    with pytest.raises(RewardFunctionError, match="defines neither step"):
        EnvPool(EnvConfig(file=_env_file(tmp_path, "x = 1\n"), num_workers=1))
    with pytest.raises(RewardFunctionError, match="importing .* failed: ZeroDivisionError"):
        EnvPool(EnvConfig(file=_env_file(tmp_path, "1 / 0\n", "bad.py"), num_workers=1))
    with pytest.raises(ValueError, match="max_turns"):
        EnvConfig(max_turns=0)
    assert math.isfinite(EnvConfig().error_score)


def test_the_multiply_task_needs_an_env():
    from pathlib import Path

    from lockstep.trainer.config.load import load_config
    configs = Path(__file__).resolve().parent.parent / "configs"
    with pytest.raises(ValueError, match="task.name=multiply calls a calculator .* needs "
                                         "rollout.env"):
        load_config(configs / "toy_agent_r3.yaml", ["rollout.env=null"])
    cfg = load_config(configs / "toy_agent_r3.yaml")
    assert cfg.rollout.env.stop == [">"] and cfg.rollout.env.file == "calculator"


def test_observation_messages_go_through_the_chat_template_once(tmp_path):
    """Messages are rendered as they follow an assistant turn (generation prompt included),
    text with observation_role becomes one message of that role, ids stay ids."""
    from lockstep.launch.example import build_tokenizer as build_hf_tokenizer

    tok = build_hf_tokenizer(tmp_path / "tok", ["tool user assistant 7 hi"] * 4)
    codec = ObservationCodec(tok, role="tool")
    want = "<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(codec.encode("7")) == want
    msgs = [{"role": "user", "content": "hi"}]
    assert codec.encode(msgs) == tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                     add_special_tokens=False)["input_ids"]
    assert codec.encode([5, 6]) == [5, 6]
    assert ObservationCodec(tok).encode("7") == tok("7", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        ObservationCodec(TOK, role="tool")


def test_trajectory_reward_is_the_final_turn_plus_env_rewards_or_the_error_score():
    from lockstep.rollout.agent import TrajectoryInfo, Turn
    from lockstep.rollout.tasks import Task, TaskConfig
    from lockstep.rollout.types import GenerationResult
    from lockstep.trainer.driver.agent import trajectory_rewards
    from lockstep.trainer.driver.data import TaskSource

    task = Task(TaskConfig(name="multiply"))
    source = TaskSource(task, seed=0)
    prompt = source.prompts(0, 1)[0]
    demo, sampled = task.demonstration(prompt.ground_truth)  # call, observation, answer
    P, n_call = len(prompt.ids), sampled.index(False)
    n_obs = sampled[n_call:].index(True)

    def result(error=None, env_reward=0.0, answer=None):
        out = demo if answer is None else demo[:n_call + n_obs] + answer
        turns = [Turn(P, n_call, n_obs), Turn(P + n_call + n_obs, len(out) - n_call - n_obs)]
        return GenerationResult(
            "r", 0, list(prompt.ids), out, torch.zeros(len(out)), None, {"type": "trajectory"},
            "0", sampled_mask=torch.tensor(sampled[:n_call + n_obs] + [True] * (
                len(out) - n_call - n_obs)),
            trajectory=TrajectoryInfo(turns, env_reward, error, end="error" if error else "done"))
    cfg = EnvConfig(error_score=-0.5)
    wrong = task.answer_ids(prompt.ground_truth)[:-2] + [task.eos_id]
    rewards, m = trajectory_rewards(source.rewards, [prompt] * 4,
                                    [result(), result(env_reward=0.25), result(error="timeout"),
                                     result(answer=wrong)], cfg)
    assert rewards.tolist() == [1.0, 1.25, -0.5, 0.0]
    assert m["agent/errors_timeout"] == 1 and m["agent/tool_calls_mean"] == 1
    assert m["agent/observation_tokens_mean"] == n_obs
