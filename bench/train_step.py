"""Actor step time with R3 route replay vs no replay, and log-prob peak memory chunked vs full.

(a) One actor step = old-log-prob forward + update (forward + backward + AdamW) on the same
    batch of engine rollouts (bf16 engine, fp32 actor), with R3 replay of the engine's routes
    vs natural routing. Modes alternate within each repeat; medians are compared.
    Target: replay overhead <= 3%.
(b) Peak memory added by the log-prob of the chosen tokens (forward + backward) on a large
    vocabulary, full fp32 log-softmax vs `kernels.logprob.chunked_logprobs`, measured in
    separate processes by bench/logprob_memory.py. Target: chunked/full <= 1/4.

    OMP_NUM_THREADS=1 python bench/train_step.py
    OMP_NUM_THREADS=1 python bench/train_step.py --repeats 15 --vocab 65536 --tokens 2048
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lockstep.moe.model import MoEModel
from lockstep.replay import old_logprob_plan, update_plan
from lockstep.rollout.engine import Engine, EngineConfig
from lockstep.rollout.tasks import Task
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.actor import TorchActor, collate
from lockstep.trainer.config import load_config

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


def bench_memory(args) -> None:
    print(f"(b) log-prob peak memory, via bench/logprob_memory.py")
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
    args = ap.parse_args()
    bench_replay(args)
    if not args.skip_memory:
        bench_memory(args)


if __name__ == "__main__":
    main()
