"""`lockstep diagnose`: where, why and how much the rollout engine and the actor disagree.

    lockstep diagnose runs/toy/checkpoints/step_200 --out diag/          # engine + actor, live
    lockstep diagnose CKPT --out diag/ --set rollout.dtype=fp32          # any config key
    lockstep diagnose CKPT --out diag/ --task sort --samples 64
    lockstep diagnose CKPT --out diag/ --data prompts.jsonl              # {"prompt": "07+45="}
    lockstep diagnose CKPT --out diag/ --url http://127.0.0.1:30000      # a live SGLang server
    lockstep diagnose --dump runs/toy/dumps/step_40.safetensors --out diag/   # offline
    lockstep diagnose CKPT --out diag/ --sweep                            # the knob table

On a checkpoint of step s, the samples are exactly those the run's step s+1 drew (same
problems, seeds and engine settings; the run's config.yaml next to `checkpoints/`, or
--config): the report of checkpoint s equals the report of the dump of step s+1. Writes
DIR/report.json, PNG plots, DIR/report.html (self-contained) and prints a summary
(docs/diagnose.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from lockstep.trainer.state.rundir import report_dir_problem

URL_TIMEOUT_S = 120.0  # --url: seconds one request may take unless rollout.request_timeout_s is set
SWEEP = (  # (label, overrides): each one changes one knob from the run's config
    ("as configured", []),
    ("engine fp32", ["rollout.dtype=fp32"]),
    ("engine bf16", ["rollout.dtype=bf16"]),
    ("engine fp16", ["rollout.dtype=fp16"]),
    ("engine router fp32", ["rollout.router_dtype=fp32"]),
    ("engine LM head fp32", ["rollout.lm_head_dtype=fp32"]),
    ("engine router + LM head fp32", ["rollout.router_dtype=fp32", "rollout.lm_head_dtype=fp32"]),
    ("engine + actor fp32", ["rollout.dtype=fp32", "actor.dtype=fp32"]),
    ("engine fp8", ["rollout.dtype=fp8"]),  # block FP8 (docs/precision.md)
    ("engine + actor fp8", ["rollout.dtype=fp8", "actor.fp8=true"]),
    ("replay off", ["replay.mode=off"]),
    ("replay R2", ["replay.mode=R2"]),
    ("replay R3", ["replay.mode=R3"]),
    # batch-invariant kernels on both sides (docs/precision.md "Exact mode"): flips and k3 0
    ("engine + actor bf16 exact", ["rollout.exact=true", "rollout.dtype=bf16", "actor.dtype=bf16"]),
)
ENGINE_KEYS = ("rollout.",)
SWEEP_COLUMNS = (("flip_rate", "routing/flip_rate"), ("token_any_flip", "routing/token_any_flip"),
                 ("k3_kl", "rollout_corr/k3_kl"), ("routing_k3", "diagnose/routing_k3_kl"),
                 ("routing_share", "diagnose/routing_k3_share"))


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("diagnose", help="report routing divergence and train/infer mismatch",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT_DIR",
                   help="RUN/checkpoints/step_<n> (or its hf/ folder)")
    p.add_argument("--out", required=True, help="report folder")
    p.add_argument("--dump", metavar="FILE", help="diagnose a rollout dump offline")
    p.add_argument("--url", help="generate with a live server (SGLang-compatible, or vLLM: "
                                 "rollout.engine, detected unless set)")
    p.add_argument("--config", help="experiment YAML (default: the run's config.yaml)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--task", help="task name (addition, sort) instead of the run's")
    src.add_argument("--data", metavar="FILE",
                     help='JSONL prompts: {"prompt": TEXT[, "answer": TEXT]} or {"input_ids": [...]}')
    p.add_argument("--samples", type=int, default=None,
                   help="sequences to diagnose (default: one step, prompts x samples_per_prompt)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="experiment-config override, e.g. rollout.dtype=fp32 (repeatable)")
    p.add_argument("--sweep", action="store_true",
                   help="repeat over engine dtype, router / LM-head dtype and replay mode")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(run=run)
    return p


# ---------------------------------------------------------------- inputs
def find_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(checkpoint folder holding state.json or None-able, hf folder) of CHECKPOINT_DIR."""
    path = Path(path)
    if (path / "hf" / "config.json").exists():
        return path, path / "hf"
    if (path / "config.json").exists():
        return path.parent, path
    raise FileNotFoundError(f"{path}: neither a checkpoint (with hf/config.json) nor an HF folder")


def load_run_config(ckpt: Path, config: str | None, overrides: list[str]):
    from lockstep.trainer.config.load import load_config

    if config is None:
        run_cfg = ckpt.parent.parent / "config.yaml"
        if not run_cfg.exists():
            raise FileNotFoundError(f"no run config at {run_cfg}; pass --config")
        config = str(run_cfg)
    return load_config(config, overrides)


def read_data(path: str | Path, task) -> list[tuple[list[int], object]]:
    """(prompt ids, Problem or None) per JSONL line; errors name the line."""
    from lockstep.rollout.tasks import Problem

    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from None
        if "input_ids" in d:
            ids = d["input_ids"]
            if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
                raise ValueError(f"{path}:{n}: input_ids must be a non-empty list of ints")
            out.append((ids, None))
        elif isinstance(d.get("prompt"), str):
            p = Problem(d["prompt"], d.get("answer", ""))
            out.append((task.prompt_ids(p), p if "answer" in d else None))
        else:
            raise ValueError(f"{path}:{n}: needs 'prompt' (text) or 'input_ids'")
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def collect(cfg, model, step: int, weight_version: str, *, url: str | None = None,
            data: str | None = None, samples: int | None = None):
    """Generate step `step`'s samples (the loop's requests) with the engine the run's config
    describes (or the server at `url`) and record the actor's view: a `StepRecord`."""
    import torch

    from lockstep.rollout.tasks import Task
    from lockstep.rollout.types import GenerateRequest
    from lockstep.trainer.actor.batch import collate
    from lockstep.trainer.actor.torch_actor import TorchActor
    from lockstep.trainer.observe.dump import record_step, run_header
    from lockstep.trainer.driver.data import TaskSource
    from lockstep.trainer.driver.requests import step_requests
    from lockstep.trainer.driver.rollouts import make_rollout

    task = Task(cfg.task)
    ro = cfg.rollout
    if ro.backend != "embedded" and url is None:
        cfg = cfg.model_copy(update={"rollout": ro.model_copy(update={"backend": "embedded"})})
    # the loop's own request and engine builders, so the samples are the run's
    source = TaskSource(task, cfg.loop.seed)
    max_new_tokens = ro.max_new_tokens or task.max_new_tokens
    n = ro.samples_per_prompt
    prompts = ro.prompts_per_step if samples is None else max(1, math.ceil(samples / n))
    if data is None:
        drawn = source.prompts((step - 1) * ro.prompts_per_step, prompts)
        problems = [p.ground_truth for p in drawn]
        requests = step_requests(cfg, drawn, step, max_new_tokens)
    else:
        rows = read_data(data, task)[:prompts]
        problems = [p for _, p in rows]
        template = step_requests(cfg, source.prompts(0, 1) * len(rows), step, max_new_tokens)
        requests = [GenerateRequest(ids, r.sampling, rid=r.rid,
                                    return_sampling_mask=r.return_sampling_mask)
                    for (ids, _), r in zip(rows, template)]
    if url is not None:
        from lockstep.trainer.config.load import rollout_api_key
        from lockstep.trainer.driver.rollouts import http_client_class
        client = http_client_class(ro.engine, url, rollout_api_key(ro), print,  # SGLang or vLLM
                                   ro.request_timeout_s)
        backend = client(url, cfg.model, api_key=rollout_api_key(ro),
                         max_concurrency=prompts, timeout_s=ro.request_timeout_s)
    else:
        backend = make_rollout(cfg, model, weight_version,
                               max_len=source.max_prompt_len + max_new_tokens,
                               run_dir=None, log=print)
    try:
        results = backend.generate(requests)
    finally:
        backend.close()
    if samples is not None:
        results = results[:samples]
    mc = cfg.model
    batch = collate(results, task.pad_id, mc.num_experts, mc.num_moe_layers,
                    mc.num_experts_per_tok, sampling_mask=ro.mask_replay,
                    vocab_size=mc.vocab_size)
    rewards = torch.tensor([math.nan if problems[i // n] is None else
                            task.reward(problems[i // n], r.output_ids)
                            for i, r in enumerate(results)])
    actor = TorchActor(model, cfg.actor, 1, temperature=ro.temperature)
    version = results[0].weight_version if url is not None else weight_version
    source = f"url:{url}" if url else "engine"
    return record_step(actor, batch, rewards, run_header(cfg, step, version, source))


def tokenizer_for(header: dict, hf: Path | None = None):
    """The tokenizer to decode tokens with: the checkpoint's, else the task's, else None."""
    try:
        if hf is not None and (hf / "tokenizer.json").exists():
            from tokenizers import Tokenizer
            return Tokenizer.from_file(str(hf / "tokenizer.json"))
        from lockstep.rollout.tasks import Task, TaskConfig
        return Task(TaskConfig(**header["task"])).tokenizer
    except (TypeError, ValueError, OSError):
        return None


def diagnose_checkpoint(checkpoint: str | Path, overrides: list[str], config: str | None = None,
                        url: str | None = None, data: str | None = None,
                        samples: int | None = None) -> dict:
    """The report of a live diagnosis of `checkpoint` (see the module doc)."""
    from lockstep.moe.checkpoint import load_hf
    from lockstep.trainer.observe.diagnosis import analyze

    ckpt, hf = find_checkpoint(checkpoint)
    if url is not None:  # one step's prompts: a server silent for minutes is down (--set wins)
        overrides = [f"rollout.request_timeout_s={URL_TIMEOUT_S:g}", *overrides]
    cfg = load_run_config(ckpt, config, overrides)
    if cfg.rollout.env is not None:  # collect() samples single turns: not this run's samples
        raise ValueError("a live diagnosis samples single turns, but this run's config sets "
                         "rollout.env (multi-turn trajectories): train with --set "
                         "loop.dump_every=N and diagnose its dumps with --dump "
                         "RUN/dumps/step_<n>.safetensors")
    rp = cfg.replay  # the live actor replays ids in full and recomputes the gates
    for key, on, off in (("gates", rp.gates == "engine", "recompute"),
                         ("partial", rp.partial is not None, "null")):
        if on:
            raise ValueError(f"this run's config sets replay.{key}, which a live diagnosis "
                             f"does not apply (it replays the ids in full with the actor's own "
                             f"gates): diagnose the run's dumps (--dump RUN/dumps/step_<n>"
                             f".safetensors), or add --set replay.{key}={off} to diagnose "
                             f"plain replay")
    state = ckpt / "state.json"
    done = json.loads(state.read_text()) if state.exists() else {"step": 0, "weight_version": "0"}
    rec = collect(cfg, load_hf(hf), int(done["step"]) + 1, str(done["weight_version"]),
                  url=url, data=data, samples=samples)
    return analyze(rec, tokenizer_for(rec.header, hf))


def diagnose_dump(path: str | Path) -> dict:
    from lockstep.trainer.observe.diagnosis import analyze
    from lockstep.trainer.observe.dump import read_dump

    rec = read_dump(path)
    return analyze(rec, tokenizer_for(rec.header))


# ---------------------------------------------------------------- sweep
def sweep(checkpoint: str | Path, overrides: list[str], config: str | None = None,
          url: str | None = None, data: str | None = None, samples: int | None = None,
          log=print) -> list[dict]:
    """One diagnosis per knob of `SWEEP` on top of `overrides`; rows of the sweep table. With
    `url` the server's numerics are fixed, so engine knobs are skipped (noted)."""
    from lockstep.trainer.config.types import ExperimentConfigError
    rows = []
    for label, sets in SWEEP:
        if url is not None and any(s.startswith(ENGINE_KEYS) for s in sets):
            rows.append({"setting": label, "overrides": sets,
                         "note": "skipped: a live server's numerics are set where it runs"})
            continue
        log(f"sweep: {label} ...")
        try:
            rep = diagnose_checkpoint(checkpoint, overrides + sets, config, url, data, samples)
        except ExperimentConfigError as e:  # e.g. exact mode with another router dtype
            rows.append({"setting": label, "overrides": sets, "note": f"refused: {e}"})
            continue
        m = rep["metrics"]
        rows.append({"setting": label, "overrides": sets,
                     **{name: m[key] for name, key in SWEEP_COLUMNS}})
    return rows


def sweep_table(rows: list[dict]) -> str:
    head = f"{'setting':30s} {'flip_rate':>10s} {'any_flip':>9s} {'k3_kl':>11s} " \
           f"{'routing_k3':>11s} {'routing_share':>13s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "note" in r:
            lines.append(f"{r['setting']:30s} {r['note']}")
            continue
        lines.append(f"{r['setting']:30s} {r['flip_rate']:10.4f} {r['token_any_flip']:9.4f} "
                     f"{r['k3_kl']:11.3e} {r['routing_k3']:11.3e} {r['routing_share']:13.3f}")
    return "\n".join(lines)


# ---------------------------------------------------------------- command
def _fail(msg: str) -> int:
    print(f"lockstep diagnose: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    import torch

    from lockstep.launch.diagnose_report import summary_text, write_report
    from lockstep.trainer.config.types import ExperimentConfigError
    from lockstep.rollout.types import RolloutError
    from lockstep.trainer.observe.dump import DumpError

    if args.threads:
        torch.set_num_threads(args.threads)
    if (args.dump is None) == (args.checkpoint is None):
        return _fail("give CHECKPOINT_DIR or --dump FILE (one of them)")
    if args.dump and (args.sweep or args.url or args.overrides or args.data or args.task):
        return _fail("--dump is offline: it takes no --sweep, --url, --set, --data or --task")
    if args.samples is not None and args.samples < 1:
        return _fail(f"--samples must be >= 1, got {args.samples}")
    out = Path(args.out)
    problem = report_dir_problem(out)
    if problem is not None:
        return _fail(problem)
    sets = list(args.overrides) + ([f"task.name={args.task}"] if args.task else [])
    try:
        if args.sweep:
            rows = sweep(args.checkpoint, sets, args.config, args.url, args.data, args.samples,
                         log=lambda m: print(m, file=sys.stderr, flush=True))
            out.mkdir(parents=True, exist_ok=True)
            (out / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
            table = sweep_table(rows)
            (out / "sweep.txt").write_text(table + "\n")
            print(table)
            return 0
        if args.dump:
            report = diagnose_dump(args.dump)
        else:
            report = diagnose_checkpoint(args.checkpoint, sets, args.config, args.url, args.data,
                                         args.samples)
    except (DumpError, ExperimentConfigError, FileNotFoundError, ValueError, RolloutError) as e:
        return _fail(str(e))
    write_report(report, out)
    print(summary_text(report))
    print(f"\nwrote {out / 'report.json'}, {out / 'report.html'} and plots")
    return 0
