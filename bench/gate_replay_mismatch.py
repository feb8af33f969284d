"""What gate-weight replay removes from the train/inference mismatch, paired on the same samples:
R3 with `replay.gates: recompute` vs `engine`, the same engine results and the same actor
weights, in the bf16-engine / fp32-actor study config (configs/study_routing.yaml).

    OMP_NUM_THREADS=1 python bench/gate_replay_mismatch.py --seeds 0 1 --batches 4

Per seed (its own warm start, as `lockstep train` would make it, cached) and per batch of
rollouts (the loop's own requests of steps 1..batches, weights not updated): pi_old under
both settings, then over response tokens the mean |log pi_old - log mu_old| and verl's k3 KL
(`rollout_corr/k3_kl`). Prints each and the ratio engine / recompute per seed (means over its
batches) and over all seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile

from lockstep.replay import ReplayMode
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.config.load import load_config
from lockstep.trainer.objective.correction import correct
from lockstep.trainer.loop import Trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/study_routing.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--batches", type=int, default=4)
    args = ap.parse_args()
    ratios = {"abs": [], "k3": []}
    for seed in args.seeds:
        cfg = load_config(args.config, overrides=[
            f"loop.seed={seed}", "replay.mode=R3", "replay.gates=engine",
            f"loop.steps={args.batches}", "loop.checkpoint_every=0", "loop.dump_every=0"])
        per = {"recompute": {"abs": [], "k3": []}, "engine": {"abs": [], "k3": []}}
        with tempfile.TemporaryDirectory() as out:
            tr = Trainer(cfg, out, progress=False, log=lambda s: None)
            base = tr.actor.replay_options
            for step in range(1, args.batches + 1):
                _, requests = tr.step_requests(step)
                results = tr.rollout.generate(requests)
                batch = collate(results, tr.source.pad_id, *tr._route_shape(),
                                sampling_mask=cfg.rollout.mask_replay,
                                vocab_size=cfg.model.vocab_size)
                mask = batch.response_mask_BT
                for gates in per:
                    tr.actor.replay_options = dataclasses.replace(base, gates=gates)
                    old = tr.actor.old_logprobs(batch, ReplayMode.R3, step).logprobs_BT
                    diff = (old - batch.rollout_logprobs_BT)[mask]
                    per[gates]["abs"].append(float(diff.abs().mean()))
                    per[gates]["k3"].append(correct(cfg.correction, old, batch.rollout_logprobs_BT,
                                                    mask.float()).metrics["rollout_corr/k3_kl"])
            tr.pipeline.close()
            tr.rollout.close()
            tr.actor.close()
        for key, name in (("abs", "mean |log pi_old - log mu_old|"), ("k3", "k3 KL")):
            rec, eng = statistics.mean(per["recompute"][key]), statistics.mean(per["engine"][key])
            ratios[key].append(eng / rec)
            print(f"seed {seed}: {name}: recompute {rec:.3e}, engine {eng:.3e}, "
                  f"ratio engine/recompute {eng / rec:.3f} (batches: "
                  f"{', '.join(f'{a:.2e}/{b:.2e}' for a, b in zip(per['recompute'][key], per['engine'][key]))})")
    for key, name in (("abs", "mean |log pi_old - log mu_old|"), ("k3", "k3 KL")):
        print(f"{name}: ratio engine/recompute over seeds {args.seeds}: "
              f"{statistics.mean(ratios[key]):.3f} ({', '.join(f'{r:.3f}' for r in ratios[key])})")


if __name__ == "__main__":
    main()
