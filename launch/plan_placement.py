"""`lockstep plan`'s placement: which node and GPUs each actor rank and SGLang engine gets
(PACK over a placement group, or colocated in the actor ranks' bundles), the exact SGLang
command of each engine, and how many GPUs the layout takes. A mixin of `plan._Plan`.
"""

from __future__ import annotations

import shlex
from typing import Any

from lockstep.rollout.colocate import RANK_SHARE, SERVER_SHARE, engine_bundles
from lockstep.trainer.actor.build import colocates_fleet, colocation_refusal, planned_nodes
from lockstep.trainer.config.experiment import ExperimentConfig


class Placement:
    """Placement of `plan._Plan` (see the module docstring)."""

    def _placement(self, actor: dict, rollout: dict) -> dict[str, Any]:
        c, ro = self.cfg.cluster, self.cfg.rollout
        N = c.actor_ranks
        M, g = rollout["engines"], rollout.get("gpus_per_engine", 0)
        sglang = ro.backend in ("sglang", "vllm")  # real servers: GPU bundles, a command each
        kind = {"sglang": "SGLang", "vllm": "vLLM"}.get(ro.backend)
        if not self.gpu:
            rank_nodes, engine_nodes = planned_nodes(self.cfg)  # cluster.cpus_per_node
            for r in actor["rank_layout"]:
                r["bundle"] = r["rank"] if N > 1 else None
                r["node"] = rank_nodes[r["rank"]] if N > 1 else None
                r["gpu"] = None
            engines = [{"engine": e, "node": engine_nodes[e] if e < len(engine_nodes) else None,
                        "gpus": [], "bundle": e} for e in range(M)]
            self._check_cpu_nodes(rank_nodes, engine_nodes)
            if colocates_fleet(self.cfg) and N >= M > 0:  # in the actor ranks' bundles
                for x, b in zip(engines, engine_bundles(N, M)):
                    x["bundle"], x["shares_bundle_with_actor_rank"] = None, b
            if sglang:
                self.refuse(f"rollout.backend={ro.backend} needs GPUs: set "
                            f"cluster.gpus_per_node")
            how = (f"laid out by cluster.cpus_per_node={c.cpus_per_node}" +
                   (f", pinned by the node label {c.node_label!r}" if c.node_label else "")
                   if c.cpus_per_node else "Ray chooses the nodes: PACK")
            return {"actor_bundles": ([{"CPU": 1.0}] * N) if N > 1 else [],
                    "engines": engines, "gpus_needed": 0,
                    "note": f"CPU bundles ({how}); the actor runs in the driver process"
                            if N == 1 else f"CPU bundles ({how})"}
        G, gpn = c.nodes * c.gpus_per_node, c.gpus_per_node
        colocated = c.placement == "colocated"
        need = gpus_needed(self.cfg)
        N_cpu, N = N, (N if c.device != "cpu" else 0)  # actor ranks on GPUs
        if need > G:
            how = (f"max(actor ranks {N}, engines {M} x {g} GPUs)" if colocated
                   else f"{N} actor ranks + {M} engines x {g} GPUs")
            self.refuse(f"the layout needs {need} GPUs ({how}, cluster.placement="
                        f"{c.placement}) but the cluster has {G} (cluster.nodes={c.nodes} x "
                        f"cluster.gpus_per_node={gpn})")
        # actor ranks: one GPU bundle each, one placement group (PACK fills node by node)
        for r in actor["rank_layout"]:
            k = r["rank"]
            r["bundle"] = k if N_cpu > 1 else None  # one rank: the driver process itself
            r["node"], r["gpu"] = (k // gpn, k % gpn) if k < min(N, G) else (None, None)
        free = [list(range(gpn)) for _ in range(c.nodes)]
        if not colocated:
            for k in range(min(N, G)):
                free[k // gpn].remove(k % gpn)
        engines = []
        for e in range(M if sglang else 0):
            node = next((n for n in range(c.nodes) if len(free[n]) >= g), None)
            b = engine_bundles(N, M)[e] if N else 0
            if colocated and N and M * g <= N and b // gpn == (b + g - 1) // gpn:
                # where `lockstep train` puts it: from the bundle (GPU) of actor rank e * N // M
                node, gpus = b // gpn, [(b + j) % gpn for j in range(g)]
                engines.append({"engine": e, "node": node, "gpus": gpus,
                                "local_index": sum(1 for x in engines if x["node"] == node),
                                "shares_gpus_with_actor_ranks": list(range(b, b + g))})
                continue
            if node is None:
                engines.append({"engine": e, "node": None, "gpus": []})
                continue
            gpus, free[node] = free[node][:g], free[node][g:]
            share = [r["rank"] for r in actor["rank_layout"]
                     if r["node"] == node and r["gpu"] in gpus] if colocated else []
            engines.append({"engine": e, "node": node, "gpus": gpus,
                            "local_index": sum(1 for x in engines if x["node"] == node),
                            "shares_gpus_with_actor_ranks": share})
        lost = [x["engine"] for x in engines if x["node"] is None]
        if lost and need <= G:
            self.refuse(f"engines {lost} find no node with {g} free GPUs (a {kind} server "
                        f"stays on one node): change rollout.{ro.backend}.tp_size or the "
                        f"placement")
        if need < G:
            self.notes.append(f"{G - need} of the cluster's {G} GPUs stay idle")
        for x in engines:
            x["command"] = None if x["node"] is None else (
                self._vllm_command(x) if ro.backend == "vllm" else self._sglang_command(x))
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if N else {})}
        return {"actor_bundles": [bundle] * N_cpu if N_cpu > 1 else [],
                "engines": engines, "gpus_needed": need, "gpus_total": G}

    def _check_cpu_nodes(self, rank_nodes: list, engine_nodes: list) -> None:
        """CPU bundles laid out by cluster.cpus_per_node: every one must find a node; a node
        label needs a node for every bundle."""
        c = self.cfg.cluster
        if c.cpus_per_node and None in rank_nodes + engine_nodes:
            self.refuse(f"{len(rank_nodes)} actor-rank and {len(engine_nodes)} engine CPU "
                        f"bundles do not fit cluster.nodes={c.nodes} x cluster.cpus_per_node="
                        f"{c.cpus_per_node} (ranks on nodes {rank_nodes}, engines on "
                        f"{engine_nodes})")
        elif c.node_label and not c.cpus_per_node and rank_nodes + engine_nodes:
            self.refuse(f"cluster.node_label={c.node_label!r} pins CPU bundles to planned "
                        f"nodes: set cluster.cpus_per_node")

    def _sglang_command(self, engine: dict) -> dict[str, Any]:
        from lockstep.trainer.driver.sglang_servers import sglang_server_config

        cfg = self.cfg
        host = "0.0.0.0" if cfg.cluster.nodes > 1 else "127.0.0.1"
        try:
            sc = sglang_server_config(cfg, engine["local_index"], host=host,
                                      model_path=cfg.model.path or "MODEL_PATH")
        except ValueError as e:
            self.refuse(str(e))
            return {}
        argv = sc.command()
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, engine["gpus"])),
               "SGLANG_RETURN_ORIGINAL_LOGPROB": sc.env()["SGLANG_RETURN_ORIGINAL_LOGPROB"]}
        line = " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(argv)
        return {"argv": argv, "env": env, "shell": line}


    def _vllm_command(self, engine: dict, host: str | None = None,
                      launched: bool = True) -> dict[str, Any]:
        """The vLLM server of `engine` (its local index on its node, its GPUs): the argv and
        the environment lockstep launches it with (rollout/vllm.py); `launched` false: a
        server the user runs (rollout.urls), whose dtype knobs lockstep does not set."""
        import os

        from lockstep.rollout.vllm import CPU_ENV, PLUGIN_DIR
        from lockstep.trainer.driver.vllm_servers import vllm_server_config

        cfg = self.cfg
        host = host or ("0.0.0.0" if cfg.cluster.nodes > 1 else "127.0.0.1")
        try:
            vc = vllm_server_config(cfg, engine["local_index"], host=host,
                                    model_path=cfg.model.path or "MODEL_PATH", strict=launched)
        except ValueError as e:
            self.refuse(str(e))
            return {}
        argv = vc.command()
        env = ({"CUDA_VISIBLE_DEVICES": ",".join(map(str, engine["gpus"]))}
               if vc.device == "cuda" else
               {**CPU_ENV, "VLLM_CPU_KVCACHE_SPACE": str(vc.cpu_kv_cache_gb)})
        env.update({"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_SERVER_DEV_MODE": "1",
                    "PYTHONPATH": os.pathsep.join([*vc.pythonpath, str(PLUGIN_DIR)])})
        line = " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(argv)
        return {"argv": argv, "env": env, "shell": line}


def gpus_needed(cfg: ExperimentConfig) -> int:
    """GPUs the layout takes: actor ranks (on cuda) and SGLang servers, shared if colocated."""
    c, ro = cfg.cluster, cfg.rollout
    actor = c.actor_ranks if c.device != "cpu" else 0
    engines = (ro.num_engines * getattr(ro, ro.backend).tp_size
               if ro.backend in ("sglang", "vllm") else 0)
    return max(actor, engines) if c.placement == "colocated" else actor + engines


def _colocated_note(cfg: ExperimentConfig) -> str:
    """What `lockstep train` does with a colocated layout (or why it refuses it)."""
    why = colocation_refusal(cfg)
    if why is not None:
        return f"colocated: planned only, `lockstep train` refuses it: {why}"
    if not colocates_fleet(cfg):
        return (f"cluster.placement=colocated with rollout.backend={cfg.rollout.backend}: no "
                f"fleet of servers to place (serve and sglang are placed)")
    return (f"colocated: `lockstep train` runs server i in the placement-group bundle of actor "
            f"rank i x {cfg.cluster.actor_ranks} // {cfg.rollout.num_engines} with "
            f"{SERVER_SHARE} of its CPU/GPU (the rank: {RANK_SHARE}); the servers release their "
            f"memory while the actor trains (rollout/colocate.py)")
