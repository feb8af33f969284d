"""The RL loop against a real SGLang 0.5.23 server on CPU (the `sglang` tier; skipped without
the venv of tests/sglang_cpu/install.sh). One fp32 server of the toy Qwen3-MoE (written by our
code) serves the whole module.

- A run that fails at start-up after joining the weight group, then a second run against the
  same server: 3 R3 steps with the default rollout.weight_sync (the distributed path, no
  fallback); after every push the server's prompt log-probs and routes equal our fp32
  engine's over the actor's weights (it serves exactly the pushed weights).
- The same with weight_sync=disk.
- top_p 0.9 (sampling-mask replay) with n=4 samples per prompt: each request goes out as n
  single requests (SGLang answers n > 1 with the mask with HTTP 500).
- weight_sync=tensor is refused before anything is sent (SGLang would unpickle the payload).
- The differential wire suite (tests/sglang_wire.py) against `lockstep serve` over the
  server's folder, which generates the table in docs/rollout.md.
- Greedy 3-turn trajectories (rollout/agent.py) asking each later turn's new route rows only
  equal the in-process fp32 engine's (tokens, stitched routes, log-probs).
- loop.seed 2^31-1: the step's sampling seeds are int64 and the server takes them.
"""

import copy
import json
from pathlib import Path

import pytest
import torch

from lockstep.moe.checkpoint import save_hf
from lockstep.moe.model import MoEModel
from lockstep.rollout.client import HTTPBackend, RolloutError
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.rollout.weight_sync import choose_backend
from lockstep.trainer.config.load import load_config
from lockstep.trainer.loop import Trainer

import sglang_wire
from sglang_fixtures import alive, server_info, sglang_server

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

TOY = Path(__file__).resolve().parent.parent / "configs" / "toy_r3.yaml"
SMALL = ["warmstart.enabled=false", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
         "actor.mini_batch_size=32", "actor.micro_batch_size=32", "loop.steps=3",
         "loop.tensorboard=false", "loop.plots=false", "rollout.backend=http"]
PROBE = [[1, 5, 7, 3, 9], [1, 12, 4], [1, 8, 8, 8, 2, 6, 11]]  # prompts the checks score


@pytest.fixture(scope="module")
def toy_folder(tmp_path_factory) -> Path:
    """An HF folder of a random toy model (not the trainer's initial weights: its first push
    must land)."""
    cfg = load_config(TOY, SMALL[:-1])
    torch.manual_seed(99)
    return save_hf(MoEModel(cfg.model), tmp_path_factory.mktemp("toy") / "hf")


@pytest.fixture(scope="module")
def sgl(toy_folder, tmp_path_factory):
    """The URL of an fp32 SGLang server over `toy_folder`."""
    with sglang_server(toy_folder, "float32", tmp_path_factory.mktemp("sglang")) as url:
        yield url


def test_wire_lockstep_serve_answers_like_sglang(sgl, toy_folder):
    """First (the server still holds its folder's weights): the differential suite against
    `lockstep serve` over the same folder."""
    with sglang_wire.lockstep_serve(toy_folder) as ours:
        theirs = sglang_wire.run(sgl, toy_folder)
        mine = sglang_wire.run(ours, toy_folder)
    sglang_wire.check_docs(theirs, mine)


def test_multi_turn_trajectories_stitch_routes_like_the_engine(sgl, toy_folder, tmp_path):
    """Still on the folder's weights: greedy 3-turn trajectories (rollout/agent.py) over real
    SGLang, each later turn asking only its new route rows (routed_experts_start_len on a
    prefix-cache hit), equal the in-process fp32 engine's: tokens, stitched routes (P+R-1
    rows) and log-probs."""
    from lockstep.moe.checkpoint import load_hf
    from lockstep.rollout.agent import ObservationCodec, TrajectoryRunner
    from lockstep.rollout.env import EnvConfig, EnvPool
    from lockstep.rollout.tasks import build_tokenizer
    from test_agent import FIXED, _env_file
    cfg = _config(sgl).model
    env = EnvConfig(file=_env_file(tmp_path, FIXED), max_turns=3, num_workers=1)
    asked = []

    def run(generate):
        reqs = [GenerateRequest([1, 3 + i, 4, 13], SamplingParams(
            temperature=0.0, max_new_tokens=3, ignore_eos=True), rid=f"p{i}") for i in range(3)]
        with EnvPool(env, log=lambda s: None) as pool:
            return TrajectoryRunner(generate, pool, ObservationCodec(build_tokenizer()), 32,
                                    cfg.num_experts, eos_id=2, vocab_size=cfg.vocab_size).run(
                reqs, [{"k": i} for i in range(3)])
    client = HTTPBackend(sgl, cfg)

    def over_sglang(reqs):
        results = client.generate(reqs)
        asked.extend((r.routes_start, res.routes_NLK.shape[0], res.prompt_tokens
                      + res.completion_tokens - 1) for r, res in zip(reqs, results))
        return results
    theirs = run(over_sglang)
    ours = run(Engine.from_model(load_hf(toy_folder), EngineConfig(dtype="fp32", max_len=32))
               .generate)
    for a, b in zip(theirs, ours):
        assert len(a.trajectory.turns) == 3 and a.trajectory.error is None
        assert a.prompt_ids + a.output_ids == b.prompt_ids + b.output_ids
        assert torch.equal(a.routes_NLK, b.routes_NLK) and a.routes_NLK.shape[0] == len(
            a.prompt_ids) + len(a.output_ids) - 1
        assert torch.allclose(a.output_logprobs, b.output_logprobs, atol=1e-5, rtol=0)
    later = [x for x in asked if x[0] > 0]
    assert len(later) == 6 and all(rows == end - start for start, rows, end in later)


def _config(url: str, *extra: str):
    return load_config(TOY, SMALL + [f"rollout.url={url}", *extra])


def _served_equals(url: str, model: MoEModel, version: str) -> float:
    """Max |log-prob difference| of the server's prompt log-probs vs our fp32 engine over
    `model`; routes must be identical and the server must report `version`."""
    client = HTTPBackend(url, model.cfg, weight_sync="disk")
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=1, temperature=1.0),
                            return_input_logprobs=True, return_routes=True) for p in PROBE]
    theirs = client.generate(reqs)
    ours = Engine.from_model(copy.deepcopy(model), EngineConfig(dtype="fp32", max_len=32)) \
        .generate([GenerateRequest(p, SamplingParams(max_new_tokens=1, temperature=1.0,
                                                     seed=0), return_input_logprobs=True,
                                   return_routes=True) for p in PROBE])
    worst = 0.0
    for t, o, p in zip(theirs, ours, PROBE):
        assert t.weight_version == version
        n = len(p)  # rows of the prompt's own tokens (the sampled one may differ)
        assert torch.equal(t.routes_NLK[:n - 1], o.routes_NLK[:n - 1])
        a, b = t.input_logprobs[1:], o.input_logprobs[1:n]
        worst = max(worst, float((a - b).abs().max()))
    return worst


def _run_checked(url: str, out: Path, *extra: str):
    """A 3-step run; after each push the served weights are checked against the actor's."""
    logs: list[str] = []
    tr = Trainer(_config(url, *extra), out, progress=False, log=logs.append)
    checks = []
    sync = tr.sync_weights

    def sync_and_check(step: int) -> str:
        version = sync(step)
        checks.append((tr.rollout.last_push["mode"],
                       _served_equals(url, tr.actor.master, version)))
        return version
    tr.sync_weights = sync_and_check
    tr.run()
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return checks, logs, metrics


def test_second_run_after_a_failed_start_up_trains_r3_over_the_distributed_path(sgl, tmp_path):
    """Run 1 joins a weight group and dies at start-up; run 2 (default weight_sync) joins
    its own group, pushes over it each step (never falling back to disk) and the server
    serves exactly the pushed weights (fp32: prompt log-probs within 1e-5, equal routes)."""
    class Died(Exception):
        pass

    def die_once_joined(line: str) -> None:
        if "joined" in line:
            raise Died(line)
    with pytest.raises(Died, match="in weight group 'lockstep-"):
        Trainer(_config(sgl), tmp_path / "failed", progress=False, log=die_once_joined)
    checks, logs, metrics = _run_checked(sgl, tmp_path / "run")
    assert [mode for mode, _ in checks] == ["distributed"] * 3
    assert not any("through disk" in line for line in logs), logs
    assert max(d for _, d in checks) < 1e-5, checks
    assert len(metrics) == 3 and metrics[-1]["replay/mode"] == "R3"
    assert not (tmp_path / "run" / "weights").exists()  # nothing written for the pushes


def test_disk_weight_sync_serves_the_pushed_weights(sgl, tmp_path):
    checks, _, metrics = _run_checked(sgl, tmp_path / "run", "rollout.weight_sync=disk")
    assert [mode for mode, _ in checks] == ["disk"] * 3
    assert max(d for _, d in checks) < 1e-5, checks
    assert len(metrics) == 3


def test_top_p_mask_replay_with_n_samples(sgl, tmp_path):
    """top_p 0.9: the loop asks for sampling masks, 4 samples per prompt go out as single
    requests, and the replayed support gives IS weights of mean 1 on the first step (the
    actor's fp32 support equals the fp32 server's)."""
    out = tmp_path / "run"
    tr = Trainer(_config(sgl, "rollout.top_p=0.9", "loop.steps=2"), out, progress=False,
                 log=lambda s: None)
    assert tr.requests(tr.source.prompts(0, 1), 1)[0].return_sampling_mask
    tr.run()
    m = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(m) == 2
    assert abs(m[0]["rollout_corr/rollout_is_mean"] - 1.0) < 1e-3, m[0]
    client = HTTPBackend(sgl, tr.cfg.model)
    res = client.generate([GenerateRequest([1, 5, 7], SamplingParams(
        top_p=0.9, max_new_tokens=4, n=3, seed=5), return_sampling_mask=True)])
    assert [r.index for r in res] == [0, 1, 2]
    assert all(len(r.sampling_mask) == len(r.output_ids) for r in res)


def test_tensor_sync_is_refused_for_real_sglang_and_the_server_lives(sgl):
    cfg = _config(sgl).model
    assert choose_backend([server_info(sgl)]) == "gloo"  # a CPU server
    client = HTTPBackend(sgl, cfg, weight_sync="tensor")
    with pytest.raises(RolloutError, match="unpickles /update_weights_from_tensor payloads"):
        client.update_weights(MoEModel(cfg), "t1")
    assert alive(sgl)


def test_the_largest_loop_seed_is_sent_as_an_int64(sgl):
    """loop.seed 2^31-1 (rollout/seeds.py): the step's request seeds (and seed + n - 1) are
    int64 and the server takes them. (This server runs without
    --enable-deterministic-inference: the same seeds sent twice gave other samples, so only
    acceptance is checked.)"""
    from lockstep.rollout.seeds import MAX_LOOP_SEED
    from lockstep.trainer.driver.requests import step_requests

    cfg = _config(sgl, f"loop.seed={MAX_LOOP_SEED}")
    n = cfg.rollout.samples_per_prompt
    reqs = step_requests(cfg, [type("P", (), {"ids": p})() for p in PROBE], 9, 6)
    assert all(0 <= r.sampling.seed and r.sampling.seed + n - 1 < 1 << 63 for r in reqs)
    res = HTTPBackend(sgl, cfg.model).generate(reqs)
    assert len(res) == n * len(PROBE) and all(len(r.output_ids) >= 1 for r in res)
