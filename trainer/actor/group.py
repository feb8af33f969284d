"""The actor as a group of ranks: N Ray actors in one placement group, one torch.distributed
world, behind the rank-side interface of `lockstep.trainer.actor.rank` (the same calls the loop makes
on an in-process actor), so `Trainer.step` does not change.

    group = ActorGroup(cfg, folder, total_updates)     # cluster.actor_ranks = N > 1
    old = group.old_logprobs(batch, mode, step)         # each rank gets only its rows
    upd = group.policy_update(batch, inputs, mode, step)
    for bucket in group.export_weights(bucket_bytes):   # streamed from rank 0
        ...

Placement: one bundle per rank (`{CPU: 1}`, plus `{GPU: 1}` with cluster.device=cuda) in one
placement group (PACK); each rank runs `cluster.threads_per_rank` torch threads. The world is
gloo on CPU, NCCL on GPU; rank 0 picks a free port on its own node for the rendezvous.
With `cluster.placement: colocated` (a serve/sglang fleet) each rank takes
`colocate.RANK_SHARE` of its bundle and the fleet puts its servers into the rest of the same
bundles (`placement_group`; rollout/colocate.py).

Start-up: `source` is an HF folder every rank reads itself (`LazyHF`): a megatron rank only
its shard (its stage's layers, its EP rank's experts, its TP slices), a torch DDP rank the
whole model one tensor at a time; neither the driver nor the object store holds weights. A
`MoEModel` source instead goes through the object store once (every rank gets it whole).

Data plane: the driver collates once; `plan_shards` (trainer/actor/batch.py) fixes, per RL step, which
rows each DP rank holds and its part of every optimiser step. `old_logprobs` sends each rank its
trimmed shard (compact uint8/uint16 routes; the rank keeps it, with the routes its forward
recorded, for the update); `policy_update` sends only the per-token loss inputs of those rows.
Log-probs come back per row ([b, t] fp32) and are put back in batch order; metrics come back as
(sum, count) pairs and are added. With `loop.max_staleness >= 1`, `gen_logprobs` sends each rank
only its rows' weight-version names: pi_gen comes from the rank's own kept shards of old
versions (`trainer/actor/versions.py`), never from weights on the driver.

Torch backend: data parallel over the whole world (every rank holds the model and the
optimiser; gradients are summed by torch DDP in each optimiser step), so rank 0 alone
exports the weights and every rank keeps its own optimiser state in the checkpoint.

Failures: a rank that dies (or raises) stops the run: the group kills every rank, removes the
placement group and raises `ActorGroupError` naming the rank, its pid and node, and the call.
The other ranks may be blocked in a collective with the dead one, so nothing waits for them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from lockstep.kernels.device import resolve_device
from lockstep.kernels.threads import worker_env
from lockstep.moe.buckets import Bucket
from lockstep.moe.checkpoint import hf_state_dict
from lockstep.moe.hf_lazy import LazyHF
from lockstep.moe.model import MoEModel
from lockstep.replay import ReplayMode
from lockstep.rollout.colocate import RANK_SHARE
from lockstep.trainer.actor.batch import Batch, ShardPlan, minibatch_schedule, plan_shards
from lockstep.trainer.actor.build import bundle_selectors, colocates_fleet
from lockstep.trainer.actor.rank import OldLogprobs, shuffle_seed, UpdateInputs, UpdateResult
from lockstep.trainer.actor.versions import stale_versions
from lockstep.trainer.config.experiment import ExperimentConfig
from lockstep.trainer.objective.stats import add_stats


LOST_NODE_WAIT_S = 40.0  # after a rank's death, for Ray to say whether its node is lost


class ActorGroupError(RuntimeError):
    """An actor rank died or failed; the group is closed."""


class RankWorker:
    """One actor rank in a Ray actor process (wrapped by `ray.remote` in `ActorGroup`)."""

    def __init__(self, rank: int, world: int, threads: int):
        torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        self.actor = None
        self.cfg: ExperimentConfig | None = None
        self._shards: dict[int, Batch] = {}
        self.startup: dict[str, Any] = {}

    def info(self) -> dict[str, Any]:
        from lockstep.cluster.ray_ops import node_id, node_ip
        return {"pid": os.getpid(), "node": node_id(), "ip": node_ip(),
                "threads": torch.get_num_threads()}

    def free_port(self) -> int:
        """A free port on this rank's node (for the rendezvous rank 0 hosts)."""
        from lockstep.cluster.ports import free_port
        return free_port()

    def init_world(self, address: str, port: int, backend: str) -> None:
        import torch.distributed as dist
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray gives each rank one GPU, visible as device 0
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}",
                                rank=self.rank, world_size=self.world)

    def build(self, source: str | dict[str, torch.Tensor], cfg: ExperimentConfig,
              total_updates: int) -> tuple[int, int]:
        """The rank's actor, from an HF folder this node can read (`source` a path: a megatron
        rank reads only its shard, a torch DDP rank the whole model, one tensor at a time) or
        from HF-named weights (a dict through the object store); returns its (dp_rank,
        dp_size)."""
        import torch.distributed as dist

        from lockstep.trainer.actor.build import make_actor
        self.cfg = cfg
        self.startup["rss_before"] = _rss_now()
        hf = LazyHF(source) if isinstance(source, str) else source
        self.actor = make_actor(cfg, hf, total_updates, dp_group=dist.group.WORLD)
        self._read(hf)
        del hf
        return self.actor.dp_rank, self.actor.dp_size

    def _read(self, hf) -> None:
        self.startup["bytes_read"] = getattr(hf, "bytes_read", None)
        self.startup["peak_rss"] = _peak_rss()

    def startup_stats(self) -> dict[str, Any]:
        """What start-up took: bytes read from the HF folder (None: weights came through the
        object store), this process's resident memory before `build` and its peak after
        (bytes)."""
        return dict(self.startup)

    def old_logprobs(self, shard: Batch, mode: ReplayMode, step: int,
                     counts_rollout: bool = False) -> OldLogprobs:
        """pi_old of the shard. Routes by reference (`shard.rollout_route_refs`): its rows'
        routes are fetched here first, from the engines' nodes, and this rank adds their expert
        loads to the stats when `counts_rollout` (one rank per DP index: TP / PP peers hold
        the same rows), as the driver would have counted them."""
        from lockstep.trainer.actor.batch import fetch_rows
        from lockstep.trainer.observe.expert_load import ROLLOUT_COUNT_KEY, load_count_stats
        by_ref = shard.rollout_route_refs is not None
        if by_ref:  # what this rank asked for (keys: version, rid, sample, attempt)
            self.fetched = [r.key for r in shard.rollout_route_refs.refs]
        m = self.cfg.model
        shard = fetch_rows(shard, m.num_experts, m.num_moe_layers, m.num_experts_per_tok)
        self._shards = {step: shard}  # kept for the update: rows travel once
        got = self.actor.old_logprobs(shard, mode, step)
        if by_ref:
            from lockstep.trainer.observe.expert_load import counted_tokens
            tokens_BT = counted_tokens(shard.response_mask_BT, shard.seq_lens_B)
            tokens_BT &= shard.rollout_routes_valid_BT
            if not counts_rollout:
                tokens_BT = torch.zeros_like(tokens_BT)
            got.stats.update(load_count_stats(shard.rollout_routes_BTLK, tokens_BT,
                                              m.moe_layer_ids, m.num_experts, self.rank == 0,
                                              key=ROLLOUT_COUNT_KEY))
        return got

    def fetched_routes(self) -> list:
        """The route keys this rank fetched for its last shard (routes by reference)."""
        return list(getattr(self, "fetched", []))

    def policy_update(self, inputs: UpdateInputs, mode: ReplayMode, step: int,
                      steps: list[torch.Tensor]) -> UpdateResult:
        if step not in self._shards:
            raise RuntimeError(f"policy_update(step={step}) without old_logprobs of that step")
        return self.actor.policy_update(self._shards.pop(step), inputs, mode, step, steps)

    def gen_logprobs(self, versions: list[str], mode: ReplayMode, step: int,
                     max_staleness: int, stale: list[str]) -> torch.Tensor | None:
        """pi_gen of this rank's rows of a stale version, from its own kept shards
        (`RankActor.gen_logprobs`); between old_logprobs and policy_update of `step`."""
        if step not in self._shards:
            raise RuntimeError(f"gen_logprobs(step={step}) without old_logprobs of that step")
        return self.actor.gen_logprobs(self._shards[step], versions, mode, step,
                                       max_staleness, stale)

    def kept_versions(self) -> dict[str, int]:
        return self.actor.kept_versions()

    def dump_fields(self, mode: ReplayMode, step: int) -> dict[str, torch.Tensor]:
        """The dump's actor fields of this rank's rows (`RankActor.dump_fields`)."""
        if step not in self._shards:
            raise RuntimeError(f"dump_fields(step={step}) without old_logprobs of that step")
        return self.actor.dump_fields(self._shards[step], mode, step)

    def set_reference(self, source: str | dict[str, torch.Tensor]) -> None:
        """The frozen KL reference (an HF folder this node reads, or HF-named weights) on this
        rank, next to its actor: its `policy_update` computes pi_ref of the rank's rows with
        the update's replay plan."""
        from lockstep.trainer.actor.build import rank_reference
        self.actor.set_reference(rank_reference(self.cfg, self.actor, source))

    def export_weights(self, bucket_bytes: int, send: bool, dtypes: dict | None = None):
        """Every rank runs the export (sharded backends gather in it); only `send` yields.
        Buckets are copied to the CPU: a view would ship its whole storage. `dtypes`: each
        weight cast here to the dtype its receivers hold it in (name -> dtype)."""
        for bucket in self.actor.export_weights(bucket_bytes):
            if send:
                yield [(name, t.detach().to("cpu", (dtypes or {}).get(name, t.dtype), copy=True))
                       for name, t in bucket]

    def rank_state(self) -> dict:
        return self.actor.rank_state()

    def load_rank_state(self, state: dict) -> None:
        self.actor.load_rank_state(state)

    def write_checkpoint(self, folder: str) -> dict:
        """This rank's parts of the checkpoint (trainer/actor/checkpoint.py); only names, checksums
        and the small state go back to the driver."""
        from pathlib import Path

        from lockstep.trainer.actor.checkpoint import write_parts
        parts, state = self.actor.checkpoint_parts(self.rank, self.world)
        meta = write_parts(Path(folder), parts, self.cfg.model)
        return {**meta, "state": state}

    def load_checkpoint(self, folder: str, state: dict) -> None:
        self.actor.load_checkpoint(folder, state)


@dataclass
class RankInfo:
    """What the driver knows of one rank, for error messages."""

    rank: int
    pid: int = -1
    node: str = "?"
    threads: int = 0  # torch threads the rank runs (cluster.threads_per_rank)
    ip: str = "?"  # its node's address

    def __str__(self) -> str:
        where = ("starting" if self.pid < 0 else
                 f"pid {self.pid}, node {self.node[:12]} at {self.ip}")
        return f"actor rank {self.rank} ({where})"


class ActorGroup:
    """`cluster.actor_ranks` actor ranks on Ray with the rank interface of the in-process actor
    (module docstring). Joins `cluster.ray_address`, or starts a local Ray for the run (shut
    down by `close`)."""

    def __init__(self, cfg: ExperimentConfig, source: str | os.PathLike | MoEModel,
                 total_updates: int, startup_timeout_s: float = 300.0):
        import ray

        from lockstep.cluster.ray_ops import bundle, init_ray, reserve, spawn

        self.cfg, self.world = cfg, cfg.cluster.actor_ranks
        self.device = str(resolve_device(cfg.cluster.device))
        self.infos = [RankInfo(r) for r in range(self.world)]
        self.workers: list[Any] = []
        self.pg = None
        self.closed = False
        self._plans: dict[int, ShardPlan] = {}
        threads = cfg.cluster.threads_per_rank
        # a private cluster for this run unless cluster.ray_address names one
        env = worker_env(threads)  # + OMP_WAIT_POLICY (kernels/threads.py)
        self._owns_ray = init_ray(cfg.cluster.ray_address or "local", env,
                                  num_cpus=max(self.world, os.cpu_count() or 1))
        try:
            gpu = self.device == "cuda"
            try:
                self.pg = reserve([bundle(1, 1 if gpu else 0)] * self.world, "lockstep-actor",
                                  startup_timeout_s, selectors=bundle_selectors(cfg)[0])
            except RuntimeError as e:
                raise ActorGroupError(str(e)) from None
            remote = ray.remote(RankWorker)
            share = RANK_SHARE if colocates_fleet(cfg) else 1.0  # the rest: a rollout server
            for r in range(self.world):
                self.workers.append(spawn(remote, self.pg, r, share, share if gpu else 0,
                                          env)(r, self.world, threads))
            infos = self._gather("start", [w.info.remote() for w in self.workers],
                                 timeout_s=startup_timeout_s)
            for info, got in zip(self.infos, infos):
                info.pid, info.node, info.threads = got["pid"], got["node"], got["threads"]
                info.ip = got["ip"]
            port = self._gather("start", [self.workers[0].free_port.remote()], [0])[0]
            backend = "nccl" if gpu else "gloo"
            self._gather("init_process_group", [
                w.init_world.remote(infos[0]["ip"], port, backend) for w in self.workers],
                timeout_s=startup_timeout_s)
            if isinstance(source, MoEModel):  # through the object store, once
                weights = ray.put({k: v.detach().clone()
                                   for k, v in hf_state_dict(source).items()})
            else:  # every rank reads its own part of the folder
                weights = str(source)
            layout = self._gather("build", [w.build.remote(weights, cfg, total_updates)
                                            for w in self.workers])
            del weights
        except BaseException:
            self.close()
            raise
        self.dp_rank = [d for d, _ in layout]
        self.dp_size = layout[0][1]

    @property
    def placement_group(self):
        """The group's placement group (bundle r holds rank r; None once closed): a colocated
        fleet puts its servers into these bundles (rollout/colocate.py). Read-only: the
        group removes it in `close`."""
        return self.pg

    # -- the rank interface (driver side) -------------------------------------------------
    def old_logprobs(self, batch: Batch, mode: ReplayMode, step: int) -> OldLogprobs:
        a = self.cfg.actor
        schedule = minibatch_schedule(batch.size, a.mini_batch_size, a.epochs,
                                      shuffle_seed(self.cfg.loop.seed, step))
        plan = plan_shards(batch.seq_lens_B, self.dp_size, schedule)
        self._plans = {step: plan}
        first = {d: self.dp_rank.index(d) for d in set(self.dp_rank)}  # one rank per DP index
        got = self._gather("old_logprobs", [
            w.old_logprobs.remote(plan.batch(self.dp_rank[r], batch), mode, step,
                                  first[self.dp_rank[r]] == r)
            for r, w in enumerate(self.workers)])
        lp_BT = self._unshard(plan, self._by_dp(g.logprobs_BT for g in got), batch)
        return OldLogprobs(lp_BT, add_stats([g.stats for g in got]))

    def policy_update(self, batch: Batch, inputs: UpdateInputs, mode: ReplayMode,
                      step: int) -> UpdateResult:
        if step not in self._plans:
            raise RuntimeError(f"policy_update(step={step}) without old_logprobs of that step")
        plan = self._plans.pop(step)
        got = self._gather("policy_update", [
            w.policy_update.remote(self._inputs_of(plan, self.dp_rank[r], inputs, batch), mode,
                                   step, plan.steps[self.dp_rank[r]])
            for r, w in enumerate(self.workers)])
        lp_BT = self._unshard(plan, self._by_dp(g.logprobs_BT for g in got), batch)
        return UpdateResult(lp_BT, add_stats([g.stats for g in got]))

    def dump_fields(self, batch: Batch, mode: ReplayMode, step: int) -> dict[str, torch.Tensor]:
        """The dump's actor fields (`trainer.observe.dump.ACTOR_FIELDS`) of the whole batch: each
        rank computes its own rows (between old_logprobs and policy_update of `step`); the
        driver puts them in batch order, as the dump writes them (0 past a row's shard)."""
        if step not in self._plans:
            raise RuntimeError(f"dump_fields(step={step}) without old_logprobs of that step")
        plan = self._plans[step]
        got = self._by_dp(self._gather("dump_fields", [w.dump_fields.remote(mode, step)
                                                       for w in self.workers]))
        return {k: self._unshard(plan, [g[k] for g in got], batch) for k in got[0]}

    def gen_logprobs(self, batch: Batch, versions: list[str], mode: ReplayMode, step: int,
                     max_staleness: int, stale: list[str] | None = None
                     ) -> torch.Tensor | None:
        """pi_gen [B, T] of the rows of a `stale` version (0 elsewhere; None when none is),
        each computed by the rank that holds the row from its own kept shard of that version
        (`RankActor.gen_logprobs`); every rank then keeps the current version. The driver
        sends each rank its rows' versions only; the rows themselves are already there."""
        if step not in self._plans:
            raise RuntimeError(f"gen_logprobs(step={step}) without old_logprobs of that step")
        plan = self._plans[step]
        stale = stale_versions(versions, step) if stale is None else stale
        got = self._gather("gen_logprobs", [
            w.gen_logprobs.remote([versions[i] for i in plan.rows[self.dp_rank[r]].tolist()],
                                  mode, step, max_staleness, stale)
            for r, w in enumerate(self.workers)])
        if not stale:
            return None
        return self._unshard(plan, self._by_dp(got), batch)

    def kept_versions(self) -> dict[str, int]:
        """The versions rank 0 keeps, with the bytes of its copies (every rank keeps the same
        versions, each of its own shard)."""
        return self._gather("kept_versions", [self.workers[0].kept_versions.remote()], [0])[0]

    def set_reference(self, reference) -> None:
        """The KL reference on every rank, which keeps its own copy next to its actor: an HF
        folder (str | Path) each rank loads itself, or a `ReferencePolicy` whose weights are
        shipped once through the object store; the driver keeps none."""
        import ray
        if isinstance(reference, (str, os.PathLike)):
            self._gather("set_reference", [w.set_reference.remote(str(reference))
                                           for w in self.workers])
            return
        weights = ray.put({k: v.detach().to("cpu", copy=True)
                           for k, v in hf_state_dict(reference.actor.master).items()})
        self._gather("set_reference", [w.set_reference.remote(weights) for w in self.workers])
        del weights

    def export_weights(self, bucket_bytes: int) -> Iterator[Bucket]:
        self._check_open()
        gens = self._export(bucket_bytes, None)
        for ref in gens[0]:
            yield self._gather("export_weights", [ref], [0])[0]
        self._drain(gens)

    def export_refs(self, bucket_bytes: int, dtypes: dict | None = None) -> Iterator[Any]:
        """The export's buckets as Ray object refs (rank 0 put each in its own node's object
        store, cast to `dtypes`): the driver holds no bytes of them; whoever is given a ref
        fetches it from rank 0's node (`RayCalls.push`, rollout/transports.py). A failed
        export shows where a bucket is fetched (and in the other ranks' answers here)."""
        import ray
        self._check_open()
        gens = self._export(bucket_bytes, dtypes)
        for ref in gens[0]:
            ray.wait([ref], fetch_local=False)  # produced; not brought here
            yield ref
        self._drain(gens)

    def _export(self, bucket_bytes: int, dtypes: dict | None) -> list:
        return [w.export_weights.options(num_returns="streaming").remote(
                    bucket_bytes, r == 0, dtypes if r == 0 else None)
                for r, w in enumerate(self.workers)]

    def _drain(self, gens: list) -> None:
        """The other ranks' side of a collective export (they yield nothing)."""
        for r, gen in enumerate(gens[1:], start=1):
            for ref in gen:
                self._gather("export_weights", [ref], [r])

    def rank_state(self) -> dict:
        return {"ranks": self._gather("rank_state", [w.rank_state.remote() for w in self.workers])}

    def write_checkpoint(self, folder, tokenizer=None) -> tuple[dict, dict]:
        """Every rank writes its parts of `hf/` and `optim/` into `folder` (shared storage:
        the ranks see the driver's run directory); the driver gets names and checksums back
        (`checkpoint_bytes`: their pickled size) and writes the index files, config.json and
        the tokenizer. Returns (the actor state, {path: {sha256, bytes}} of the parts)."""
        import pickle

        from lockstep.trainer.actor.checkpoint import finish
        metas = self._gather("write_checkpoint", [w.write_checkpoint.remote(str(folder))
                                                  for w in self.workers])
        self.checkpoint_bytes = len(pickle.dumps(metas))
        known = finish(Path(folder), metas, self.cfg.model, tokenizer)
        state = {**metas[0]["state"], "no_state": sorted(n for m in metas for n in m["no_state"]),
                 "nonfinite": sorted(n for m in metas for n in m["nonfinite"])}
        return state, known

    def load_checkpoint(self, folder, state: dict) -> None:
        """Every rank reads its slices of the checkpoint's optimiser state (any layout)."""
        self._gather("load_checkpoint", [w.load_checkpoint.remote(str(folder), state)
                                         for w in self.workers])

    def load_rank_state(self, state: dict) -> None:
        ranks = state.get("ranks")
        if not isinstance(ranks, list) or len(ranks) != self.world:
            got = "one in-process actor's" if ranks is None else f"{len(ranks)} ranks'"
            raise ValueError(f"--resume: the checkpoint holds {got} optimiser state, but "
                             f"cluster.actor_ranks={self.world}")
        self._gather("load_rank_state", [w.load_rank_state.remote(s)
                                         for w, s in zip(self.workers, ranks)])

    def startup_stats(self) -> list[dict[str, Any]]:
        """Each rank's `RankWorker.startup_stats` (bytes read, peak RSS after build)."""
        return self._gather("startup_stats", [w.startup_stats.remote() for w in self.workers])

    def close(self) -> None:
        """Kill the ranks and remove the placement group (idempotent); shut down the Ray this
        group started."""
        if self.closed:
            return
        self.closed = True
        from lockstep.cluster.ray_ops import release  # the extra 'ray' is imported lazily
        release(self.workers, self.pg, self._owns_ray)
        self.workers, self.pg = [], None

    # -- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _unshard(plan: ShardPlan, parts: list[torch.Tensor], batch: Batch) -> torch.Tensor:
        """Per-rank [b, t, ...] rows back into a zero-padded [B, T, ...] tensor in batch order."""
        if parts[0].dtype == torch.uint16:  # no index_put for uint16 on CPU: int16 bits
            return ActorGroup._unshard(plan, [p.view(torch.int16) for p in parts],
                                       batch).view(torch.uint16)
        B, T = batch.input_ids_BT.shape
        out = torch.zeros(B, T, *parts[0].shape[2:], dtype=parts[0].dtype)
        for rows_b, part in zip(plan.rows, parts):
            out[rows_b, :part.shape[1]] = part
        return out

    def _by_dp(self, per_rank) -> list:
        """One answer per DP rank (the first rank of each DP index; TP/PP peers agree). Stats
        are added over every rank instead: a rank interface zeroes its peers' counts."""
        out: dict[int, Any] = {}
        for dp, x in zip(self.dp_rank, per_rank):
            out.setdefault(dp, x)
        return [out[d] for d in range(self.dp_size)]

    @staticmethod
    def _inputs_of(plan: ShardPlan, dp: int, inputs: UpdateInputs, batch: Batch) -> UpdateInputs:
        parts = {}
        for f in fields(inputs):
            v = getattr(inputs, f.name)
            parts[f.name] = (plan.take(dp, v, batch.seq_lens_B) if isinstance(v, torch.Tensor)
                             else v)
        return UpdateInputs(**parts)

    def _check_open(self) -> None:
        if self.closed:
            raise ActorGroupError("the actor group is closed (after close() or a rank failure)")

    def _fail(self, err: Exception) -> None:
        self.close()
        raise err

    def _gather(self, what: str, refs: list, ranks: list[int] | None = None,
                timeout_s: float | None = None) -> list:
        """Each rank's answer, in order. The first failure closes the group and raises an
        error naming that rank (the others may be stuck in a collective with it)."""
        from lockstep.cluster.ray_ops import CallFailed, gather
        self._check_open()
        ranks = list(range(len(refs))) if ranks is None else ranks
        try:
            return gather(what, refs, [str(self.infos[r]) for r in ranks], timeout_s)
        except CallFailed as e:
            self._fail(ActorGroupError(str(e) + self._lost_nodes(e.unreachable)))

    def _lost_nodes(self, wait: bool) -> str:
        """The nodes of this group's ranks that Ray declares dead, named with their ranks (a
        rank that failed first may be a survivor whose collective lost its peer). `wait`: the
        failed rank was unreachable, not known dead (its node's raylet may be gone too: Ray
        declares a node dead once its health checks fail); then Ray's verdict is awaited, at
        most `LOST_NODE_WAIT_S`."""
        from lockstep.cluster.ray_ops import node_alive, node_name
        deadline = time.monotonic() + (LOST_NODE_WAIT_S if wait else 0.0)
        while True:
            gone: dict[str, list[int]] = {}
            for info in self.infos:
                if info.pid >= 0 and node_alive(info.node) is False:
                    gone.setdefault(info.node, []).append(info.rank)
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        return "".join(f"; node {node_name(n)} ({n[:12]}) is lost, with actor rank(s) "
                       f"{ranks}" for n, ranks in gone.items())


def _rss_now() -> int:
    """This process's resident set size now, in bytes (Linux /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    """This process's peak resident set size in bytes (Linux: ru_maxrss is in KiB)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
