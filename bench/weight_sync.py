"""Weight-sync benchmark: one step's weight push to 2 engines, three ways, on the same model in the
same run, as ratios against the disk path (docs/rollout.md, "Weight sync"):

  disk          HF folder written bucket by bucket + /update_weights_from_disk on both servers
  collective    DistributedWeightSync: /update_weights_from_distributed + one gloo broadcast
                per bucket to both servers (nothing written)
  object_store  Fleet.ray's update_weights: each bucket cast and ray.put once, both Ray engine workers
                load from the object store (nothing written)

Servers are `lockstep serve` processes (bf16 engines) over the same folder; the trainer pushes
fp32 weights (what the actor exports) in `--bucket-mb` buckets. Per path: median push time
over `--repeats` pushes, tensor bytes moved, and bytes this process wrote to storage
(/proc/self/io write_bytes). Start-up (servers, Ray, the group join) is not in the ratios.

    OMP_NUM_THREADS=1 python bench/weight_sync.py [--models toy,moe60m] [--repeats 3]

`--overlap` also runs the rollout/train overlap measurement of bench/async_overlap.py
(`measure_overlap()`: loop.max_staleness 1 vs 0 step time) when that file is present.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from lockstep.moe.buckets import bucketize
from lockstep.moe.checkpoint import hf_state_dict, save_hf
from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.rollout.weight_sync import DistributedWeightSync, write_hf_buckets

sys.path.insert(0, os.path.dirname(__file__))
from model_forward import PRESETS  # noqa: E402

MODELS = {
    "toy": PRESETS["small"],  # 3.4M parameters
    # a synthetic MoE of ~60M parameters: 8 layers, 8 experts of 512 x 512
    "moe60m": dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, intermediate_size=1024,
                   moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2),
}


def write_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return -1


def post(url: str, path: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def serve(folder: Path, n: int) -> tuple[list[subprocess.Popen], list[str]]:
    procs, urls = [], []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "lockstep.launch.serve", "--model", str(folder), "--dtype",
             "bf16", "--port", str(port), "--threads", "1", "--max-len", "64"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"}))
        urls.append(f"http://127.0.0.1:{port}")
    for url, p in zip(urls, procs):
        for _ in range(1200):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if p.poll() is not None:
                    raise RuntimeError("lockstep serve exited")
                time.sleep(0.25)
    return procs, urls


def measure(push, repeats: int) -> tuple[float, int, int]:
    """Median seconds, tensor bytes of one push, bytes written per push (median)."""
    times, written, moved = [], [], 0
    for _ in range(repeats):
        w0, t0 = write_bytes(), time.perf_counter()
        moved = push()
        times.append(time.perf_counter() - t0)
        written.append(write_bytes() - w0)
    return statistics.median(times), moved, int(statistics.median(written))


def run(name: str, args) -> None:
    cfg = ModelConfig(**MODELS[name], eos_token_id=2, pad_token_id=0, bos_token_id=1)
    torch.manual_seed(0)
    model = MoEModel(cfg)
    params = sum(p.numel() for p in model.parameters())
    bucket_bytes = int(args.bucket_mb * 2**20)
    buckets = lambda: bucketize(hf_state_dict(model).items(), bucket_bytes)  # noqa: E731
    root = Path(tempfile.mkdtemp(prefix="lockstep-wsync-bench-"))
    rows = {}
    try:
        folder = save_hf(model, root / "init")
        procs, urls = serve(folder, args.engines)
        try:
            version = iter(range(1, 1 << 30))

            def disk() -> int:
                v = str(next(version))
                out, nbytes, _ = write_hf_buckets(buckets(), cfg, root / "push")
                with cf.ThreadPoolExecutor(len(urls)) as ex:
                    for r in ex.map(lambda u: post(u, "/update_weights_from_disk", {
                            "model_path": str(out), "weight_version": v}), urls):
                        assert r["success"], r
                return nbytes
            rows["disk"] = measure(disk, args.repeats)

            t0 = time.perf_counter()
            sync = DistributedWeightSync(urls, timeout_s=600)
            join_s = time.perf_counter() - t0
            try:
                rows["collective"] = measure(
                    lambda: sync.push(buckets(), str(next(version)))["bytes"], args.repeats)
            finally:
                sync.close()
        finally:
            for p in procs:
                p.terminate()
                p.wait(30)
        print(f"{name}: disk {rows['disk']}, collective {rows['collective']} "
              f"(seconds, tensor bytes, written bytes)", flush=True)
        try:
            rows["object_store"], ray_start_s = object_store(model, args, buckets)
        except Exception as e:  # e.g. Ray's OOM killer on a crowded host: report, go on
            print(f"{name}: object_store failed: {type(e).__name__}: {str(e)[:300]}")
            rows["object_store"], ray_start_s = (float("nan"), 0, 0), float("nan")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base_t, base_b, _ = rows["disk"]
    print(f"\n{name}: {params / 1e6:.1f}M parameters, {args.engines} engines (bf16), "
          f"fp32 push in {args.bucket_mb:g} MiB buckets; median of {args.repeats} pushes")
    print(f"  start-up (not in ratios): group join {join_s:.2f}s, Ray + workers {ray_start_s:.1f}s")
    print(f"  {'path':<13} {'push s':>8} {'x disk':>7} {'tensor MB':>10} {'written MB':>11}")
    for path, (sec, moved, written) in rows.items():
        print(f"  {path:<13} {sec:8.3f} {sec / base_t:7.2f} {moved / 1e6:10.1f} "
              f"{written / 1e6:11.1f}")
    print(f"  ratios: collective/disk time {rows['collective'][0] / base_t:.2f}, "
          f"object_store/disk time {rows['object_store'][0] / base_t:.2f}; bytes written per "
          f"push: disk {base_b / 1e6:.1f} MB of tensors ({rows['disk'][2] / 1e6:.1f} MB "
          f"measured), collective {rows['collective'][2]}, object_store {rows['object_store'][2]}")


def object_store(model: MoEModel, args, buckets) -> tuple[tuple[float, int, int], float]:
    import ray

    from lockstep.kernels.threads import worker_env
    from lockstep.rollout.engine_config import EngineConfig
    from lockstep.rollout.fleet import Fleet

    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=args.engines, include_dashboard=False,
             runtime_env={"env_vars": worker_env(1)})
    try:
        backend = Fleet.ray(model, EngineConfig(dtype="bf16", max_len=64), args.engines)
        start = time.perf_counter() - t0
        version = iter(range(1, 1 << 30))
        nbytes = sum(t.numel() * t.element_size() for t in hf_state_dict(model).values())

        def push() -> int:
            backend.update_weights(buckets(), str(next(version)))
            return nbytes
        row = measure(push, args.repeats)
        backend.close()
    finally:
        ray.shutdown()
    return row, start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="toy,moe60m", help=f"comma list of {sorted(MODELS)}")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--overlap", action="store_true",
                    help="also run bench/async_overlap.py (max_staleness 1 vs 0) if present")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in args.models.split(","):
        run(name, args)
    if args.overlap:
        try:
            import async_overlap  # bench/async_overlap.py (loop.max_staleness owner)
        except ImportError:
            print("\nbench/async_overlap.py is not present: rollout/train overlap not measured")
        else:
            r = async_overlap.measure_overlap("ray", args.engines)
            print(f"\nrollout/train overlap (bench/async_overlap.py, toy, ray x{args.engines}): "
                  f"step time max_staleness 0 / 1 = {r['ratio']:.2f}x (ideal {r['ideal']:.2f}x, "
                  f"mean version lag {r['lag']:.2f})")


if __name__ == "__main__":
    main()
