"""Actor step time with R3 route replay vs no replay, and log-prob peak memory chunked vs full.

(a) One actor step = old-log-prob forward + update (forward + backward + AdamW) on the same
    batch of engine rollouts (bf16 engine, fp32 actor), with R3 replay of the engine's routes
    vs natural routing. Modes alternate within each repeat; medians are compared.
    Target: replay overhead <= 3%.
(c) (with --mismatch-model DIR, e.g. a warm-started toy checkpoint) Where the train/infer
    mismatch comes from: on fixed batches sampled by the bf16 engine, k3 KL of the fp32 actor's
    log-probs vs the engine's with replay off and with R3, split into tokens whose prediction
    depends on a routing flip (an engine/actor expert-set difference at any earlier position)
    and the rest; repeated with the engine's LM head, then also its router, in fp32.
(b) Peak memory added by the log-prob of the chosen tokens (forward + backward) on a large
    vocabulary, full fp32 log-softmax vs `kernels.logprob.chunked_logprobs`, measured in
    separate processes by bench/logprob_memory.py. Target: chunked/full <= 1/4.

    OMP_NUM_THREADS=1 python bench/train_step.py
    OMP_NUM_THREADS=1 python bench/train_step.py --repeats 15 --vocab 65536 --tokens 2048
    OMP_NUM_THREADS=1 python bench/train_step.py --skip-memory --repeats 3 \
        --mismatch-model runs/toy/checkpoints/step_300/hf
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lockstep.moe.checkpoint import load_hf
from lockstep.moe.model import MoEModel
from lockstep.replay import compare_routes, old_logprob_plan, update_plan
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.tasks import Task
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.load import load_config

ROOT = Path(__file__).resolve().parent.parent


def _batch(cfg, model, task):
    engine = Engine.from_model(model, EngineConfig(dtype="bf16", max_running=cfg.rollout.batch_size,
                                                   max_len=task.prompt_len + task.max_new_tokens))
    problems = task.problems(0, 0, cfg.rollout.prompts_per_step)
    reqs = [GenerateRequest(task.prompt_ids(p), SamplingParams(
        max_new_tokens=task.max_new_tokens, n=cfg.rollout.samples_per_prompt, seed=1000 * i))
        for i, p in enumerate(problems)]
    c = model.cfg
    return collate(engine.generate(reqs), task.pad_id, c.num_experts, c.num_moe_layers,
                   c.num_experts_per_tok)


def actor_step_seconds(actor: TorchActor, batch, mode: str) -> tuple[float, float]:
    """(wall, process CPU) seconds of one actor step (old log-probs + update) under `mode`."""
    routes, valid = batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT
    adv = torch.randn(batch.size)
    mask = batch.response_mask_BT.float()

    def loss_fn(lp, ent, rows, mini):
        return -(adv[rows, None] * lp * mask[rows]).sum() / mask[mini].sum(), {}

    t0, c0 = time.perf_counter(), time.process_time()
    plan = old_logprob_plan(mode, routes, valid)
    old = actor.logprobs(batch, plan.routes_BTLK, plan.replay_mask_BT, record=True)
    up = update_plan(mode, routes, valid, old.routes_BTLK, batch.token_mask_BT)
    actor.update(batch, loss_fn, up.routes_BTLK, up.replay_mask_BT)
    return time.perf_counter() - t0, time.process_time() - c0


def bench_replay(args) -> None:
    cfg = load_config(ROOT / "configs/toy_r3.yaml", [
        f"rollout.prompts_per_step={args.prompts}", f"actor.mini_batch_size={args.prompts * 8}",
        f"actor.micro_batch_size={args.prompts * 8}", "actor.lr=1e-6"])
    torch.manual_seed(0)
    task, model = Task(cfg.task), MoEModel(cfg.model)
    batch = _batch(cfg, model, task)
    actor = TorchActor(model, cfg.actor, total_updates=10**6)
    wall: dict[str, list[float]] = {"off": [], "R3": []}
    cpu: dict[str, list[float]] = {"off": [], "R3": []}
    for mode in ("off", "R3"):  # warm-up
        actor_step_seconds(actor, batch, mode)
    for i in range(args.repeats):
        for mode in (("off", "R3") if i % 2 == 0 else ("R3", "off")):
            w, c = actor_step_seconds(actor, batch, mode)
            wall[mode].append(w)
            cpu[mode].append(c)
    tokens = int(batch.token_mask_BT.sum())
    print(f"(a) actor step, toy model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          f"params), batch {batch.size} x {batch.input_ids_BT.shape[1]} ({tokens} tokens), "
          f"{args.repeats} repeats, threads={torch.get_num_threads()}")
    # On a shared host wall time swings with other processes; process CPU time is steadier.
    for name, times in (("wall", wall), ("cpu", cpu)):
        med = {m: statistics.median(t) for m, t in times.items()}
        for m in ("off", "R3"):
            print(f"  {name:4s} {m:4s} median {med[m] * 1e3:8.1f} ms  (min "
                  f"{min(times[m]) * 1e3:.1f}, max {max(times[m]) * 1e3:.1f})")
        print(f"  {name:4s} R3 / off = {med['R3'] / med['off']:.3f}  (overhead "
              f"{(med['R3'] / med['off'] - 1) * 100:+.1f}%, target <= +3%)")


def bench_mismatch(args) -> None:
    cfg = load_config(ROOT / "configs/toy_r3.yaml")
    task, model = Task(cfg.task), load_hf(args.mismatch_model)
    c = model.cfg
    actor = TorchActor(model, cfg.actor, total_updates=1)
    print(f"(c) train/infer k3 KL on {args.mismatch_batches} batches of "
          f"{cfg.rollout.batch_size} samples from {args.mismatch_model}")
    for extra in ({}, {"lm_head_dtype": "fp32"}, {"lm_head_dtype": "fp32", "router_dtype": "fp32"}):
        engine = Engine.from_model(model, EngineConfig(
            dtype="bf16", max_running=cfg.rollout.batch_size,
            max_len=task.prompt_len + task.max_new_tokens, **extra))
        sums = {(m, part): [0.0, 0] for m in ("off", "R3") for part in ("flip", "rest")}
        flip_rates = []
        for b in range(args.mismatch_batches):
            problems = task.problems(777, b * cfg.rollout.prompts_per_step,
                                     cfg.rollout.prompts_per_step)
            reqs = [GenerateRequest(task.prompt_ids(p), SamplingParams(
                max_new_tokens=task.max_new_tokens, n=cfg.rollout.samples_per_prompt,
                seed=10**6 * b + 8 * i)) for i, p in enumerate(problems)]
            batch = collate(engine.generate(reqs), task.pad_id, c.num_experts,
                            c.num_moe_layers, c.num_experts_per_tok)
            routes, valid = batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT
            resp_BT = batch.response_mask_BT
            for mode in ("off", "R3"):
                res = actor.logprobs(batch, *((routes, valid) if mode == "R3" else ()))
                log_r = res.logprobs_BT - batch.rollout_logprobs_BT
                k3_BT = log_r.exp() - 1 - log_r
                if mode == "off":  # token t is predicted from positions < t
                    cmp = compare_routes(routes, res.natural_BTLK, valid)
                    flip_rates.append(float(cmp.flip_BTL[valid].float().mean()))
                    seen_BT = cmp.any_flip_BT.cumsum(1) > 0
                    hit_BT = torch.zeros_like(resp_BT)
                    hit_BT[:, 1:] = seen_BT[:, :-1]
                for part, sel in (("flip", hit_BT & resp_BT), ("rest", ~hit_BT & resp_BT)):
                    sums[(mode, part)][0] += float(k3_BT[sel].sum())
                    sums[(mode, part)][1] += int(sel.sum())
        n_flip, n_rest = sums[("off", "flip")][1], sums[("off", "rest")][1]
        k3 = {(m, part): sums[(m, part)][0] / max(sums[(m, part)][1], 1) for m, part in sums}
        for m in ("off", "R3"):
            k3[(m, "all")] = (sums[(m, "flip")][0] + sums[(m, "rest")][0]) / (n_flip + n_rest)
        name = "engine bf16" + "".join(f", {k[:-6]} fp32" for k in extra)
        print(f"  {name}: flip rate {statistics.mean(flip_rates):.4f}, response tokens after "
              f"a flip {n_flip / (n_flip + n_rest):.3f}")
        for m in ("off", "R3"):
            print(f"    {m:3s} k3 all {k3[(m, 'all')]:.3e} | after a flip "
                  f"{k3[(m, 'flip')]:.3e} | rest {k3[(m, 'rest')]:.3e}")
        print("    R3 / off: " + ", ".join(f"{part} {k3[('R3', part)] / k3[('off', part)]:.3f}"
                                           for part in ("all", "flip", "rest")))


def bench_memory(args) -> None:
    print("(b) log-prob peak memory, via bench/logprob_memory.py")
    cmd = [sys.executable, str(ROOT / "bench/logprob_memory.py"), "--tokens", str(args.tokens),
           "--vocab", str(args.vocab), "--dim", str(args.dim), "--repeats", str(args.mem_repeats)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    print("\n".join("  " + line for line in out.strip().splitlines()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9, help="actor steps per mode")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per batch (x 8 samples)")
    ap.add_argument("--tokens", type=int, default=2048, help="(b) tokens")
    ap.add_argument("--vocab", type=int, default=65536, help="(b) vocabulary")
    ap.add_argument("--dim", type=int, default=256, help="(b) hidden size")
    ap.add_argument("--mem-repeats", type=int, default=1, help="(b) repeats")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--mismatch-model", default=None, help="(c) HF folder of a trained toy policy")
    ap.add_argument("--mismatch-batches", type=int, default=8, help="(c) batches")
    args = ap.parse_args()
    bench_replay(args)
    if args.mismatch_model:
        bench_mismatch(args)
    if not args.skip_memory:
        bench_memory(args)


if __name__ == "__main__":
    main()
