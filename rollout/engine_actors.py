"""The Ray actors a fleet runs in its bundles, one per engine (rollout/fleet.py):

- `EngineActor`: the embedded engine, called by Ray (`rollout.backend: ray`); weights come
  through the object store;
- `ServerActor`: the embedded engine behind our SGLang-wire HTTP server (what `lockstep serve`
  runs; `rollout.backend: serve`);
- `SGLangActor`: a real SGLang server (`rollout.backend: sglang`);
- `VLLMActor`: a real vLLM server (`rollout.backend: vllm`).

Each answers `info()` with where it runs (pid, node, and the URL of an HTTP server). Ray is
imported inside the methods: this module loads where Ray is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import torch

from lockstep.kernels.threads import policy_text
from lockstep.moe.buckets import Bucket
from lockstep.moe.checkpoint import hf_state_dict
from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.types import FleetError, RolloutError
from lockstep.rollout.types import GenerateRequest, GenerationResult

UNLOADED = "unloaded"  # version of a relaunched server before its first push (never served)


class EngineActor:
    """One embedded engine in a Ray actor process. `source` is an HF folder readable on the
    actor's node, or a list of object refs of weight buckets (each a list of `(name, tensor)`,
    native or HF names, together the whole model; passed nested, so this actor fetches them
    itself) with `model_cfg`."""

    def __init__(self, source: str | list, model_cfg: ModelConfig | None,
                 engine_cfg: EngineConfig, weight_version: str, threads: int = 1):
        import ray
        torch.set_num_threads(threads)
        self._incoming: dict[str, torch.Tensor] = {}
        self._buckets_in = 0
        if isinstance(source, str):
            self.engine = Engine.from_hf(source, engine_cfg, weight_version)
            return
        if model_cfg is None:
            raise ValueError("EngineActor: a bucket source needs model_cfg")
        weights = {name: t for bucket in ray.get(list(source)) for name, t in bucket}
        self.engine = Engine(MoEModel(model_cfg), engine_cfg, weight_version)
        self.engine.update_weights(weights, weight_version)

    def info(self) -> dict[str, Any]:
        """Where this actor runs and the dtype each weight is held in, under its native and
        its HF name (for casting pushes on the driver)."""
        from lockstep.cluster.ray_ops import node_id
        model = self.engine.model
        named = {**model.state_dict(), **hf_state_dict(model)}
        return {"pid": os.getpid(), "node": node_id(), "threads": torch.get_num_threads(),
                "wait_policy": policy_text(),
                "weight_version": self.engine.weight_version, "model_cfg": model.cfg,
                "dtypes": {k: v.dtype for k, v in named.items()}}

    def generate(self, requests: list[GenerateRequest], attempts: dict[str, int] | None = None,
                 store: Any = None) -> list[GenerationResult]:
        """The engine's results; with a route `store` on this node (rollout.routes_by_reference)
        each sample's routes stay there and the result carries their ref
        (`rollout.route_refs.keep_routes`; `attempts`: rid -> times sent before)."""
        results = self.engine.generate(requests)
        if store is None:
            return results
        from lockstep.rollout.route_refs import keep_routes
        return keep_routes(results, attempts or {}, store)

    def load_bucket(self, k: int, bucket: Bucket) -> None:
        """Receive bucket k of a push (k == 0 starts a new one); applied by `commit_weights`."""
        if k == 0:
            self._incoming, self._buckets_in = {}, 0
        if k != self._buckets_in:
            raise RolloutError(f"weight push: bucket {k} arrived after {self._buckets_in}")
        self._incoming.update(bucket)
        self._buckets_in += 1

    def commit_weights(self, weight_version: str, num_buckets: int) -> str:
        """Load the `num_buckets` buckets received (validate, then swap: a bad push leaves the
        engine as it was); returns the new version."""
        weights, got = self._incoming, self._buckets_in
        self._incoming, self._buckets_in = {}, 0
        if got != num_buckets:
            raise RolloutError(f"weight push {weight_version!r}: received {got} of "
                               f"{num_buckets} buckets")
        return self.engine.update_weights(weights, weight_version)

    def update_weights(self, state_dict: dict[str, torch.Tensor], weight_version: str) -> str:
        return self.engine.update_weights(state_dict, weight_version)


class ServerActor:
    """Our embedded engine behind our SGLang-wire HTTP server, in a Ray actor process (what
    `lockstep serve` runs). `source`: an HF folder on the actor's node, a native state dict
    (an object ref Ray resolves) with `model_cfg`, or None: random weights with version
    `UNLOADED`, for a relaunched server that gets the current weights pushed before serving."""

    def __init__(self, source: str | dict[str, torch.Tensor] | None, model_cfg: ModelConfig,
                 engine_cfg: EngineConfig, weight_version: str, api_key: str | None,
                 threads: int = 1):
        from lockstep.cluster.ray_ops import node_id, node_ip
        from lockstep.rollout.server import ServerThread
        torch.set_num_threads(threads)
        if isinstance(source, str):
            engine = Engine.from_hf(source, engine_cfg, weight_version)
        else:
            model = MoEModel(model_cfg)
            if source is not None:
                model.load_state_dict(source, strict=True)
            engine = Engine(model, engine_cfg, weight_version if source is not None else UNLOADED)
        self.node = node_id()
        self.server = ServerThread(engine, host=node_ip(), port=0, api_key=api_key).start()

    def info(self) -> dict[str, Any]:
        return {"url": self.server.url, "pid": os.getpid(), "node": self.node,
                "threads": torch.get_num_threads(),
                "wait_policy": policy_text()}

    def stop(self) -> None:
        self.server.stop()


class SGLangActor:
    """A real SGLang server launched from a Ray actor (its GPUs, or CPUs, are the actor's
    bundle). Needs the `sglang` package in the configured interpreter (`options["python"]`);
    refused with a clear message otherwise. `host`: "loopback" (127.0.0.1) or "node" (the Ray
    node's IP)."""

    def __init__(self, options: dict[str, Any], model_path: str, weight_version: str,
                 api_key: str | None, log_dir: str | None = None, host: str = "node",
                 startup_timeout_s: float = 900.0):
        from lockstep.cluster.ports import free_port
        from lockstep.cluster.ray_ops import node_id, node_ip
        from lockstep.rollout.sglang import SGLangServer
        require_sglang(options.get("python"), options.get("extra_env"))
        cfg = sglang_config(options, model_path, "127.0.0.1" if host == "loopback" else
                            node_ip(), free_port(), weight_version, api_key)
        self.node = node_id()
        log = None if log_dir is None else os.path.join(log_dir, f"sglang-{cfg.port}.log")
        self.server = SGLangServer(cfg, log_path=log, die_with_parent=True).start(
            float(startup_timeout_s))

    def info(self) -> dict[str, Any]:
        return {"url": self.server.cfg.url, "pid": self.server.proc.pid, "node": self.node}

    def stop(self) -> None:
        self.server.stop()


class VLLMActor:
    """A real vLLM server launched from a Ray actor (its GPUs, or CPUs, are the actor's
    bundle). Needs the `vllm` package in the configured interpreter (`options["python"]`).
    `host` as for `SGLangActor`. vLLM takes no initial weight version: a server reports its
    own until the first push (which the fleet makes before it serves)."""

    def __init__(self, options: dict[str, Any], model_path: str, api_key: str | None,
                 log_dir: str | None = None, host: str = "node",
                 startup_timeout_s: float = 900.0):
        from lockstep.cluster.ports import free_port
        from lockstep.cluster.ray_ops import node_id, node_ip
        from lockstep.rollout.vllm import VLLMServer
        require_vllm(options.get("python"), options.get("extra_env"))
        cfg = vllm_config(options, model_path, "127.0.0.1" if host == "loopback" else
                          node_ip(), free_port(), api_key)
        self.node = node_id()
        log = None if log_dir is None else os.path.join(log_dir, f"vllm-{cfg.port}.log")
        self.server = VLLMServer(cfg, log_path=log, die_with_parent=True).start(
            float(startup_timeout_s))

    def info(self) -> dict[str, Any]:
        return {"url": self.server.cfg.url, "pid": self.server.proc.pid, "node": self.node}

    def stop(self) -> None:
        self.server.stop()


def _require(kind: str, package: str, name: str, python: str | None,
             extra_env: dict[str, str] | None, how: str) -> None:
    exe = python or sys.executable
    which = (f"rollout.{kind}.python={exe}" if python else
             f"lockstep's own interpreter ({exe}; rollout.{kind}.python is unset)")
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({package!r}) is None)"
    try:
        rc = subprocess.run([exe, "-c", probe], env={**os.environ, **(extra_env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            timeout=120).returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FleetError(f"rollout.backend={kind}: cannot run {which}: {e}") from None
    if rc != 0:
        raise FleetError(f"rollout.backend={kind} needs {name} installed in the interpreter "
                         f"that runs the servers: no `{package}` package in {which}; {how}")


def require_sglang(python: str | None = None, extra_env: dict[str, str] | None = None) -> None:
    """Refuse (one line, naming the interpreter) unless `python` (rollout.sglang.python; None =
    this interpreter) runs and can import-find `sglang` with `extra_env` set."""
    _require("sglang", "sglang", "SGLang", python, extra_env,
             "set rollout.sglang.python to SGLang's venv (GPU: pip install 'lockstep[gpu]'; "
             "CPU tests: tests/sglang_cpu/install.sh), or use rollout.backend=serve "
             "(lockstep's own SGLang-wire servers)")


def require_vllm(python: str | None = None, extra_env: dict[str, str] | None = None) -> None:
    """`require_sglang` for `vllm` (rollout.vllm.python)."""
    _require("vllm", "vllm", "vLLM", python, extra_env,
             "set rollout.vllm.python to vLLM's venv (GPU: pip install vllm==0.32.0; CPU: "
             "tests/vllm_cpu/install.sh)")


def vllm_config(options: dict[str, Any] | None, model_path: str, host: str, port: int,
                api_key: str | None = None):
    """The `VLLMConfig` one fleet server is launched with: `rollout.vllm` options plus what the
    fleet decides per server (model, host, port, key)."""
    from lockstep.rollout.vllm import VLLMConfig
    from lockstep.rollout.vllm_options import FLEET_KEYS
    opts = {k: v for k, v in (options or {}).items() if k not in FLEET_KEYS}
    clash = sorted(k for k in ("model_path", "host", "port", "api_key") if k in opts)
    if clash:
        raise ValueError(f"rollout.vllm.{clash[0]}: set by the fleet for each server; leave "
                         f"it out")
    return VLLMConfig.from_dict({**opts, "model_path": model_path, "host": host, "port": port,
                                 "api_key": api_key})


def sglang_config(options: dict[str, Any] | None, model_path: str, host: str, port: int,
                  weight_version: str | None = None, api_key: str | None = None):
    """The `SGLangConfig` one fleet server is launched with: `rollout.sglang` options (the
    SGLangConfig fields: tp_size, ep_size, dtype, enable_fp32_lm_head, ...) plus what the fleet
    decides per server (model, host, port, weight version, key)."""
    from lockstep.rollout.sglang import SGLangConfig
    from lockstep.rollout.sglang_options import FLEET_KEYS
    opts = {k: v for k, v in (options or {}).items() if k not in FLEET_KEYS}
    fixed = {"model_path": model_path, "host": host, "port": port, "api_key": api_key,
             "weight_version": weight_version}
    clash = sorted(k for k in ("model_path", "host", "port", "api_key") if k in opts)
    if clash:
        raise ValueError(f"rollout.sglang.{clash[0]}: set by the fleet for each server "
                         f"(model from the run, a free port on the actor's node); leave it out")
    return SGLangConfig.from_dict({**opts, **fixed})
