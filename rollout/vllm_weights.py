"""Trainer side of vLLM's native weight sync: `DistributedWeightSync` (rollout/weight_sync.py,
the same rank layout, buckets, bounded waits and failure rules) speaking vLLM 0.32's routes.

    sync = VLLMWeightSync(["http://a:8000"])           # /init_weight_transfer_engine
    sync.push(actor.export_weights(bucket_bytes), "7")  # pause, start, update per bucket,
    sync.close()                                        # finish(version), resume; shutdown

Per server: `POST /init_weight_transfer_engine {"init_info": {master_address, master_port,
rank_offset, world_size, group_name}}` once (the server's workers join the trainer's group as
ranks rank_offset .. rank_offset + world - 1, `world` from `GET /get_world_size`); per push
`POST /pause?mode=wait` (running samples finish, new ones wait) and `/start_weight_update`,
then per bucket `POST /update_weights {"update_info": {names, dtype_names, shapes, packed:
true}}` answered while the trainer broadcasts the bucket as one uint8 buffer, then
`/finish_weight_update {"weight_version"}` and `/resume`. The transport is the server's
`--weight-transfer-config` backend: vLLM's `nccl` on GPUs (the same fields), lockstep's
`lockstep_gloo` (rollout/vllm_plugin) on CPUs. A pause, start or join that a server refuses
raises `PushRefused` (nothing changed; `auto` then goes to disk).

A trainer killed between `/start_weight_update` and `/finish_weight_update` leaves the
server paused with its update active: every later start is refused (`UPDATE_ACTIVE`, HTTP 500)
and `/shutdown_weight_transfer_engine` too. As for SGLang's open session
(`DistributedWeightSync._close_stale`): where the killed push was this run's (`own_stale`, from
its push marker) the sync finishes that update (committing what it loaded, which the full
push then overwrites) and starts its own; elsewhere it refuses with the commands that end it
(`/finish_weight_update`, then `/resume`) and leaves the server paused as it found it.
"""

from __future__ import annotations

from typing import Any

from .types import PushRefused, RolloutError
from .weight_sync import DistributedWeightSync, dtype_name

UPDATE_ACTIVE = "while a weight update is already active"
"""The words of vLLM 0.32's refusal of a second /start_weight_update (a worker's RuntimeError,
answered HTTP 500 by /collective_rpc's wrapper)."""


def server_config(info: Any) -> dict:
    """The fields lockstep reads from vLLM's `GET /server_info?config_format=json`."""
    cfg = info.get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(cfg, dict):
        raise RolloutError(f"/server_info has no vllm_config object (not a vLLM server?): "
                           f"{str(info)[:300]}")
    model = cfg.get("model_config") or {}
    par = cfg.get("parallel_config") or {}
    wt = cfg.get("weight_transfer_config") or {}
    return {"return_sampling_mask": bool(model.get("return_sampling_mask")),
            "logprobs_mode": model.get("logprobs_mode"),
            "max_model_len": model.get("max_model_len"),
            "tp_size": int(par.get("tensor_parallel_size") or 1),
            "device": (cfg.get("device_config") or {}).get("device", "cpu"),
            "weight_transfer_backend": wt.get("backend")}


class VLLMWeightSync(DistributedWeightSync):
    """Rank 0 of a weight-transfer group over vLLM servers (module docstring)."""

    SESSION_ROUTES = ("/start_weight_update", "/finish_weight_update")
    STALE_THEN = ("/resume",)  # the killed push had paused the server

    def _server_info(self, i: int) -> Any:
        info = server_config(self._request(i, "GET", "/server_info?config_format=json", None,
                                           min(self.timeout_s, 60.0)))
        world = self._request(i, "GET", "/get_world_size?include_dp=true", None, 30.0)
        info["tp_size"] = int(world.get("world_size", 1)) if isinstance(world, dict) else 1
        if info["weight_transfer_backend"] is None:
            raise PushRefused(f"{self.engine(i)}: vLLM runs without --weight-transfer-config")
        # the backend of the trainer's end follows the server's transport
        info["device"] = "cuda" if info["weight_transfer_backend"] != "lockstep_gloo" else "cpu"
        return info

    def _join_request(self, i: int, master_addr: str, port: int) -> tuple[str, dict]:
        return "/init_weight_transfer_engine", {"init_info": {
            "master_address": master_addr, "master_port": port,
            "rank_offset": self.rank_offsets[i], "world_size": self.world_size,
            **({"group_name": self.group_name} if self.backend == "gloo" else {"packed": False})}}

    def _bucket_request(self, names: list[str], dtypes: list, shapes: list, last: bool,
                        weight_version: str) -> tuple[str, dict]:
        return "/update_weights", {"update_info": {
            "names": names, "dtype_names": [dtype_name(d) for d in dtypes],
            "shapes": [list(s) for s in shapes],
            **({"packed": True} if self.backend == "gloo" else {})}}

    def _send(self, flat, bucket) -> None:
        """gloo (lockstep's backend): the bucket's bytes in one broadcast; NCCL (vLLM's, not
        packed): one broadcast per tensor, in order, as its receiver allocates them."""
        if self.backend == "gloo":
            return self.group.broadcast(flat)
        for _, t in bucket:
            self.group.broadcast(t.detach().to(self.group.device).contiguous())

    def _leave_request(self) -> tuple[str, dict]:
        return "/shutdown_weight_transfer_engine", {}

    def _answered(self, resp: Any) -> bool:
        return isinstance(resp, dict) and "error" not in resp  # vLLM: {"message"} or {"status"}

    def _post(self, i: int, path: str, body: dict, timeout_s: float | None = None) -> Any:
        try:
            return super()._post(i, path, body, timeout_s)
        except PushRefused:
            raise
        except RolloutError as e:  # vLLM answers its workers' refusal of a join with HTTP 500
            if path == "/init_weight_transfer_engine" and "HTTP 500" in str(e):
                raise PushRefused(str(e)) from None
            raise

    def _open_session(self, i: int) -> None:
        try:
            self._post(i, "/pause?mode=wait", {})
            try:
                self._post(i, "/start_weight_update", {})
                return
            except RolloutError as e:
                if UPDATE_ACTIVE not in str(e):
                    raise
                stale = e
        except RolloutError as e:  # before any tensor was sent: nothing changed
            self._quiet_post(i, "/resume")
            raise PushRefused(str(e)) from None
        # a killed push's update, paused by it: not resumed here (ours: our push follows;
        # another's: left as found)
        self._close_stale(i, stale)
        self._post(i, "/start_weight_update", {})

    def _close_session(self, i: int, timeout_s: float) -> None:
        try:
            self._post(i, "/finish_weight_update", {"weight_version": self.version}, timeout_s)
        finally:
            self._post(i, "/resume", {}, timeout_s)
