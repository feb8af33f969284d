"""Issue 22: group joins to masters that never answer do not starve generation or disk
updates (their own bounded pool), and /release_memory_occupation never succeeds while a
request handed to the engine worker can still generate. Real ServerThreads on loopback."""

import os
import socket
import threading
import time

from lockstep.moe.checkpoint import save_hf
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.server import ServerThread
from lockstep.rollout.weight_receiver import JOIN_THREADS

from server_fixtures import ENGINE, call, model  # noqa: F401 (pytest fixture)


def _fire(url, path, bodies, timeout=60):
    out = [None] * len(bodies)

    def one(i):
        try:
            out[i] = call(url, path, bodies[i], timeout=timeout)
        except OSError as e:
            out[i] = ("error", repr(e))
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    return threads, out


def test_joins_to_silent_masters_leave_generation_alone(model, tmp_path):  # noqa: F811
    """Before: each join held a thread of the default executor (min(32, cpus + 4) of them)
    for the whole join timeout; a disk update and a big /generate then waited for them."""
    folder = save_hf(model, tmp_path / "w")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # accepts (kernel backlog), never answers
    port = silent.getsockname()[1]
    n = min(32, (os.cpu_count() or 1) + 4) + 2
    # ~270 KB, parsed on a default-executor thread; its last prompt is bad (a quick 400)
    big = {"input_ids": [[31, 32, 33, 34] * 10] * 1700 + [[1, "x"]]}

    def disk_and_big(url):
        t0 = time.monotonic()
        status, out = call(url, "/update_weights_from_disk", {"model_path": str(folder)},
                           timeout=30)
        assert status == 200 and out["success"], out
        status, out = call(url, "/generate", big, timeout=30)
        assert status == 400 and "input_ids[1700][1]" in out["error"]["message"], out
        return time.monotonic() - t0
    try:
        with ServerThread(Engine.from_model(model, ENGINE), weight_sync_timeout_s=6) as srv:
            alone = disk_and_big(srv.url)
            joins, answers = _fire(srv.url, "/init_weights_update_group", [
                {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                 "world_size": 2, "backend": "gloo", "group_name": f"g{i}"} for i in range(n)])
            time.sleep(0.5)
            took = disk_and_big(srv.url)
            assert took < 4 * alone + 2.5, f"disk update + big generate took {took:.1f}s behind " \
                f"{n} joins, {alone:.1f}s alone"
            for t in joins:
                t.join(30)
            busy = [o for o in answers if o[0] == 503]
            assert len(busy) == n - JOIN_THREADS and "group joins are in flight" in \
                busy[0][1]["message"], answers
            failed = [o for o in answers if o[0] == 400]
            assert len(failed) == JOIN_THREADS and "could not join" in failed[0][1]["message"]
    finally:  # the join threads end when their master closes
        silent.close()


def test_release_refused_while_requests_are_handed_over(model):  # noqa: F811
    """Before: release answered success while requests that /generate had parsed were still
    on their way to the engine; they then generated with the memory 'released'."""
    long = {"max_new_tokens": 12, "ignore_eos": True}
    cfg = EngineConfig(dtype="fp32", max_running=4, max_len=48)
    with ServerThread(Engine.from_model(model, cfg)) as srv:
        for attempt in range(2):
            threads, out = _fire(srv.url, "/generate", [
                {"input_ids": [1, 2 + i], "sampling_params": long} for i in range(12)])
            seen_after = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                status, rel = call(srv.url, "/release_memory_occupation", {}, timeout=10)
                if status == 200:
                    for _ in range(20):  # nothing may enter or stay on the engine now
                        info = call(srv.url, "/server_info", timeout=10)[1]
                        seen_after.append(info["running"] + info["waiting"])
                        time.sleep(0.005)
                    break
                assert "must be idle" in rel["error"]["message"], rel
            for t in threads:
                t.join(30)
            assert status == 200, "release never succeeded"
            assert not any(seen_after), f"attempt {attempt}: generating after release: {seen_after}"
            for s, o in out:  # each answered: generated before, or refused after the release
                assert s == 200 or (s == 400 and "memory released" in o["error"]["message"]), o
            assert call(srv.url, "/resume_memory_occupation", {})[0] == 200

