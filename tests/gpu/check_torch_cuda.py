"""GPU check of `cluster.device=cuda`: 2 RL steps of the toy job on one GPU with the torch actor
and the embedded engine on CUDA, against the same 2 steps on the CPU; then 2 steps with the
megatron actor on CUDA (Transformer Engine layers where `transformer_engine` is installed).

Run on a machine with CUDA:
    OMP_NUM_THREADS=1 python tests/gpu/check_torch_cuda.py
It prints one JSON line and exits 1 when a check fails; without CUDA it prints a skip line and
exits 0. `--cpu-smoke` runs the same code with cluster.device=cpu for one step (the placement
checks then expect the CPU), to check the script itself where no GPU is at hand; with
`--groups` too it also runs the 2-rank megatron groups on the CPU (gloo; minutes).
`tests/test_cluster_gpu.py` runs it under pytest (-m gpu).

Checks:
- placement: the actor's weights and optimiser state, the engine's weights, KV cache, per-slot
  buffers and sampling uniforms all live on the GPU; results come back as CPU tensors;
- torch actor + engine on CUDA vs CPU (TF32 off, engine in fp32 so the two sample the same
  tokens): rewards equal, k3_kl / grad_norm within the group tolerance of docs/cluster.md,
  replay/mismatch 0;
- megatron on CUDA: step 1 samples from the same engine and weights as the torch CUDA run
  (rewards equal), k3_kl within 1e-2, replay/mismatch 0, finite losses; reports whether TE
  layers were used;
- megatron actor groups on 2 GPUs (skipped with fewer): PP=2 and DP=2 (`cluster.actor_ranks=2`,
  a 4-layer toy so PP splits it), NCCL worlds, against the in-process megatron run of the same
  model on one GPU: rewards equal, k3_kl within 1e-3, replay/mismatch 0; PP=2's grad_norm and
  pg_loss within 1e-3 too. These run the collectives on device tensors (the pipeline's sums of
  log-probs and routes, the PP metrics' object gather, the DP mini-batch token counts).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# a short warm start (cached and shared by the runs), so rewards and advantages are not all zero
SETS = ["warmstart.target_accuracy=0.1", "warmstart.eval_every=10",
        "rollout.prompts_per_step=16", "rollout.dtype=fp32",
        "actor.mini_batch_size=64", "actor.micro_batch_size=32", "loss.entropy_coef=0.05",
        "loop.plots=false", "loop.tensorboard=false"]


def close(a: float, b: float, rtol: float, atol: float = 0.0) -> bool:
    return abs(a - b) <= rtol * abs(a) + atol


def run(tmp: Path, name: str, device: str, steps: int, *sets: str) -> tuple[list, dict]:
    """`steps` RL steps of toy_r3 on `device`; returns (metrics per step, placement facts)."""
    from lockstep.trainer.config.load import load_config
    from lockstep.trainer.loop import Trainer

    cfg = load_config(CONFIGS / "toy_r3.yaml", SETS + [
        f"cluster.device={device}", f"loop.steps={steps}", f"warmstart.cache_dir={tmp / 'ws'}",
        *sets])
    tr = Trainer(cfg, tmp / name, progress=False, log=lambda s: None)
    want = torch.device(device).type
    eng = tr.rollout.engine
    facts = {"engine_weights": all(p.device.type == want for p in eng.model.parameters()),
             "engine_kv_cache": eng.cache.k.device.type == want == eng.cache.v.device.type,
             "engine_buffers": all(t.device.type == want for t in (
                 eng.routes_SMLK, eng.tokens_SM, eng.logprobs_SM, eng.uniforms.buf_SC))}
    if cfg.cluster.actor_ranks > 1:
        pass  # the weights live on the ranks (Ray actors); the run itself is the check
    elif cfg.actor.backend == "torch":
        facts["actor_weights"] = all(p.device.type == want for p in tr.actor.master.parameters())
    else:
        facts["actor_weights"] = all(p.device.type == want for p in tr.actor.gpt.parameters())
        facts["megatron_te"] = any("TE" in type(m).__name__ for m in tr.actor.gpt.modules())
    rows = []
    try:
        for s in range(1, steps + 1):
            if s == 1:  # results leave the device once per sample, as CPU tensors
                prompts = tr.source.prompts(0, 1)
                res = tr.rollout.generate(tr.requests(prompts, 0))
                facts["results_on_cpu"] = all(r.output_logprobs.device.type == "cpu" and
                                              r.routes_NLK.device.type == "cpu" for r in res)
            rows.append(tr.step(s))
        opt = getattr(tr.actor, "optimizer", None)
        if cfg.actor.backend == "torch" and opt is not None:
            facts["optimizer_state"] = all(
                t.device.type == want for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    finally:
        tr.rollout.close()
        tr.actor.close()
    return rows, facts


def megatron_groups(tmp: Path, out: dict, dev: str, steps: int) -> bool:
    """PP=2 and DP=2 megatron groups (2 ranks, NCCL) against one process, 4-layer toy."""
    four = ("actor.backend=megatron", "model.num_hidden_layers=4")
    one, _ = run(tmp, "megatron_one4", dev, steps, *four)
    ok = True
    for name, layout in {"pp2": "actor.megatron.pipeline_parallel=2",
                         "dp2": "cluster.actor_ranks=2"}.items():
        rows, _ = run(tmp, f"megatron_{name}", dev, steps, *four, "cluster.actor_ranks=2",
                      layout)
        keys = ("reward/mean", "rollout_corr/k3_kl", "actor/grad_norm", "actor/pg_loss",
                "replay/mismatch")
        out[f"megatron_{name}"] = [{k: [a[k], b[k]] for k in keys} for a, b in zip(one, rows)]
        a, b = one[0], rows[0]  # step 1: same weights, same samples
        ok &= a["reward/mean"] == b["reward/mean"]
        ok &= close(a["rollout_corr/k3_kl"], b["rollout_corr/k3_kl"], 1e-3, 1e-7)
        ok &= all(r["replay/mismatch"] == 0.0 for r in rows)
        if name == "pp2":  # DP=2 balances each rank's micro-batches (load-balancing loss)
            ok &= close(a["actor/grad_norm"], b["actor/grad_norm"], 1e-3)
            ok &= close(a["actor/pg_loss"], b["actor/pg_loss"], 1e-3, 1e-6)
    return ok


def main(argv: list[str]) -> int:
    smoke = "--cpu-smoke" in argv
    if not smoke and not torch.cuda.is_available():
        print("SKIP check_torch_cuda: no CUDA device")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev, steps = ("cpu", 1) if smoke else ("cuda", 2)
    out, ok = {"device": dev}, True
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        gpu, facts = run(tmp, "torch_gpu", dev, steps)
        out["torch"] = facts
        ok &= all(facts.values())
        if not smoke:
            cpu, _ = run(tmp, "torch_cpu", "cpu", steps)
            for a, b in zip(cpu, gpu):
                s = a["step"]
                out[f"step{s}"] = {k: [a[k], b[k]] for k in (
                    "reward/mean", "rollout_corr/k3_kl", "actor/grad_norm", "replay/mismatch")}
                ok &= a["reward/mean"] == b["reward/mean"]
                ok &= close(a["rollout_corr/k3_kl"], b["rollout_corr/k3_kl"], 1e-2, 1e-7)
                ok &= close(a["actor/grad_norm"], b["actor/grad_norm"], 1e-3)
                ok &= b["replay/mismatch"] == 0.0
        try:
            import megatron.core  # noqa: F401
        except ImportError:
            out["megatron"] = "skipped: megatron-core not installed"
        else:
            mg, facts = run(tmp, "megatron_gpu", dev, steps, "actor.backend=megatron")
            te = facts.pop("megatron_te")
            out["megatron"] = {**facts, "transformer_engine_layers": te}
            ok &= all(facts.values())
            a, b = gpu[0], mg[0]
            out["megatron_step1"] = {k: [a[k], b[k]] for k in (
                "reward/mean", "rollout_corr/k3_kl", "actor/pg_loss", "replay/mismatch")}
            ok &= a["reward/mean"] == b["reward/mean"]
            ok &= close(a["rollout_corr/k3_kl"], b["rollout_corr/k3_kl"], 1e-2, 1e-6)
            ok &= all(r["replay/mismatch"] == 0.0 and torch.isfinite(
                torch.tensor(r["actor/pg_loss"])) for r in mg)
            if smoke and "--groups" in argv:
                ok &= megatron_groups(tmp, out, dev, steps)
            elif smoke or torch.cuda.device_count() < 2:
                out["megatron_group"] = "skipped: fewer than 2 GPUs"
            else:
                ok &= megatron_groups(tmp, out, dev, steps)
    out["ok"] = bool(ok)
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
