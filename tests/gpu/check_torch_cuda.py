"""GPU check of `cluster.device=cuda` for the torch actor: 2 RL steps of the toy job with the
actor on one GPU, against the same 2 steps with the actor on the CPU.

Run on a machine with CUDA:
    OMP_NUM_THREADS=1 python tests/gpu/check_torch_cuda.py
It prints one JSON line and exits 1 when a check fails; without CUDA it prints a skip line and
exits 0. `tests/test_cluster_gpu.py` runs it under pytest (-m gpu).

Checks: the actor's weights and optimiser state live on the GPU; the run's rewards are equal
(step 1 samples from the same weights; step 2 from weights that differ only by GPU vs CPU
fp32 rounding) and its k3_kl / grad_norm agree within the group tolerance of docs/cluster.md
(TF32 off, so fp32 matmuls are fp32). NOTE: the embedded engine still runs on the CPU.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SETS = ["warmstart.enabled=false", "rollout.prompts_per_step=16", "actor.mini_batch_size=64",
        "actor.micro_batch_size=32", "loss.entropy_coef=0.05", "loop.steps=2",
        "loop.plots=false", "loop.tensorboard=false"]


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP check_torch_cuda: no CUDA device")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from lockstep.trainer.config import load_config
    from lockstep.trainer.loop import Trainer

    out, ok = {}, True
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for device in ("cpu", "cuda"):
            cfg = load_config(CONFIGS / "toy_r3.yaml", SETS + [f"cluster.device={device}"])
            tr = Trainer(cfg, Path(tmp) / device, progress=False, log=lambda s: None)
            if device == "cuda":
                out["actor_on_cuda"] = all(p.is_cuda for p in tr.actor.master.parameters())
                ok &= out["actor_on_cuda"]
            runs[device] = [tr.step(s) for s in (1, 2)]
            if device == "cuda":
                out["optimizer_state_on_cuda"] = all(
                    t.is_cuda for st in tr.actor.optimizer.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
                ok &= out["optimizer_state_on_cuda"]
            tr.rollout.close()
    for a, b in zip(runs["cpu"], runs["cuda"]):
        s = a["step"]
        out[f"step{s}_reward"] = [a["reward/mean"], b["reward/mean"]]
        out[f"step{s}_k3_kl"] = [a["rollout_corr/k3_kl"], b["rollout_corr/k3_kl"]]
        out[f"step{s}_grad_norm"] = [a["actor/grad_norm"], b["actor/grad_norm"]]
        ok &= a["reward/mean"] == b["reward/mean"]
        ok &= abs(a["rollout_corr/k3_kl"] - b["rollout_corr/k3_kl"]) <= 1e-2 * abs(
            a["rollout_corr/k3_kl"]) + 1e-7
        ok &= abs(a["actor/grad_norm"] - b["actor/grad_norm"]) <= 1e-3 * a["actor/grad_norm"]
    out["ok"] = bool(ok)
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
