"""The reward pool: verl's compute_score results, and every way a reward function can fail
(raise, hang, garbage, dying worker) counted and scored `error_score`, never an exception."""

from __future__ import annotations

import os
import time

import pytest

from lockstep.rollout.rewards import (RewardCall, RewardConfig, RewardFunctionError, RewardPool,
                                      check_score, exact_match)

MISBEHAVING = '''
import os
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    kind = extra_info["kind"]
    if kind == "raise":
        raise KeyError("no answer")
    if kind == "hang":
        time.sleep(600)
    if kind == "garbage":
        return "seven"
    if kind == "nan":
        return float("nan")
    if kind == "nodict":
        return {"acc": 1.0}
    if kind == "die":
        os._exit(7)
    if kind == "dict":
        return {"score": 0.25, "acc": True}
    if kind == "bool":
        return True
    return float(solution_str == ground_truth)
'''


def _calls(*kinds):
    return [RewardCall("src", "7", "7", {"kind": k}) for k in kinds]


def test_every_failure_is_counted_and_scored_error_score(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(MISBEHAVING)
    logged = []
    cfg = RewardConfig(function=f"{f}:compute_score", timeout_s=1.0, error_score=-2.0,
                       num_workers=2)
    with RewardPool(cfg, log=logged.append, max_logged_errors=3) as pool:
        kinds = ["ok", "raise", "dict", "hang", "garbage", "bool", "nan", "nodict", "die", "ok"]
        out = pool.score(_calls(*kinds))
        assert out.scores == [1.0, -2.0, 0.25, -2.0, -2.0, 1.0, -2.0, -2.0, -2.0, 1.0]
        assert dict(out.errors) == {"raised": 1, "timeout": 1, "bad_value": 3, "crashed": 1}
        m = out.metrics()
        assert m["reward/errors"] == 6 and m["reward/errors_bad_value"] == 3
        assert any("KeyError: 'no answer'" in s for s in out.messages)
        assert any("returned str 'seven'" in s for s in out.messages)
        # the first max_logged_errors of each kind are logged, one line each: all 6 here, and
        # the third bad_value says the rest of its kind is only counted
        assert len(logged) == 6 and sum("only counted" in m for m in logged) == 1
        assert [m for m in logged if "only counted" in m][0].count("bad_value") == 2
        assert {k: len(v) for k, v in pool.first_errors.items()} == dict(out.errors)
        # the pool recovered: killed and dead workers were replaced
        assert pool.score(_calls("ok", "ok", "ok")).scores == [1.0, 1.0, 1.0]


def test_bad_reward_specs_fail_at_construction(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file"):
        RewardPool(RewardConfig(function=f"{tmp_path}/missing.py:f"))
    f = tmp_path / "r.py"
    f.write_text("x = 1\n")
    with pytest.raises(RewardFunctionError, match="has no callable 'compute_score'"):
        RewardPool(RewardConfig(function=f"{f}:compute_score"))
    f.write_text("raise KeyboardInterrupt\n")  # probe round 2: the worker died, a traceback
    with pytest.raises(RewardFunctionError, match="failed: KeyboardInterrupt"):
        RewardPool(RewardConfig(function=f"{f}:compute_score"))
    with pytest.raises(ValueError, match="must be 'path/to/file.py:name' or one of"):
        RewardConfig(function="mystery")
    with pytest.raises(ValueError, match=r"reward.timeout_s=0 is outside \(0, 3600\]"):
        RewardConfig(timeout_s=0)


def test_builtins():
    assert exact_match("s", " 42\n", 42) == 1.0 and exact_match("s", "4 2", "42") == 0.0
    assert check_score({"score": 1}) == 1.0 and check_score(False) == 0.0
    with pytest.raises(ValueError, match="not a number"):
        check_score([1.0])
    # probe round 2: an int too large for a float killed the worker (OverflowError)
    with pytest.raises(ValueError, match="integer of 1329 bits, outside the score range"):
        check_score({"score": 10**400})
    assert check_score(10**6) == 1e6
    pytest.importorskip("math_verify")
    with RewardPool(RewardConfig(function="math_verify", num_workers=1)) as pool:
        out = pool.score([RewardCall("m", r"so it is $\boxed{\frac{1}{2}}$", "0.5"),
                          RewardCall("m", r"$\boxed{3}$", "4")])
    assert out.scores == [1.0, 0.0] and not out.errors


@pytest.mark.parametrize("body, says", [
    ("import sys\nsys.exit(0)\n", "called sys.exit(0)"),
    ("raise RuntimeError('no GPU here')\n", "failed: RuntimeError: no GPU here"),
    ("import os\nos._exit(0)\n", "exited (code 0) while importing"),
    ("import time\ntime.sleep(600)\n", "did not start (import the file) within "
                                       "reward.import_timeout_s=2"),
])
def test_a_file_that_exits_raises_or_hangs_at_import_is_one_error(tmp_path, body, says):
    import time

    f = tmp_path / "r.py"
    f.write_text(body + "def compute_score(**kw):\n    return 1.0\n")
    # the hang waits out a short timeout; the others must be told before a long one (a
    # worker's start takes seconds on a loaded machine)
    timeout = 2 if "sleep" in body else 60
    t0 = time.monotonic()
    with pytest.raises(RewardFunctionError, match="reward.function=") as e:
        RewardPool(RewardConfig(function=f"{f}:compute_score", import_timeout_s=timeout,
                                num_workers=1))
    assert says in str(e.value) and time.monotonic() - t0 < 60


def test_scores_outside_the_range_are_bad_values_named(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return float(solution_str)\n")
    with RewardPool(RewardConfig(function=f"{f}:compute_score", num_workers=1)) as pool:
        out = pool.score([RewardCall("s", x, "1") for x in ("1e300", "-2e6", "1e6", "0.5")])
    assert out.scores == [0.0, 0.0, 1e6, 0.5] and dict(out.errors) == {"bad_value": 2}
    assert "returned 1e+300, outside the score range [-1e+06, 1e+06]" in out.messages[0]
    with pytest.raises(ValueError, match="reward.error_score=1e\\+300 is outside"):
        RewardConfig(error_score=1e300)


HOSTILE = '''
import os
import subprocess
import sys
import time

print("printed at import")   # must not reach lockstep's stdout


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    kind = extra_info["kind"]
    print("printed by a call")
    if kind == "fork":        # both processes return: only the worker may answer
        os.fork()
        return 1.0
    if kind == "grandchild":  # outlives the call, must not outlive the pool
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(extra_info["pidfile"], "w").write(str(p.pid))
        return 1.0
    if kind == "recursion":
        def f(n):
            return f(n + 1)
        return f(0)
    if kind == "deep":        # a result too deeply nested to check or send
        d = {}
        for _ in range(100000):
            d = {"score": d}
        return d
    if kind == "closefd":     # every descriptor the process may hold (a long-running suite's
        import resource       # worker socket can be numbered above 1024)
        os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        return 1.0
    return 1.0
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_hostile_functions_cost_one_call_each(tmp_path, capfd):
    """fork, a grandchild, RecursionError, a result too deep to send, closed fds, prints: each
    costs its own call (a named error, no traceback), never another call's score, and nothing
    the function prints or starts outlives the pool or reaches stdout."""
    f = tmp_path / "r.py"
    f.write_text(HOSTILE)
    pidfile = tmp_path / "grandchild"
    cfg = RewardConfig(function=f"{f}:compute_score", timeout_s=20.0, error_score=-2.0,
                       num_workers=1)
    logged = []
    with RewardPool(cfg, log=logged.append) as pool:
        kinds = ["fork", "ok", "ok", "recursion", "deep", "ok", "closefd", "ok", "grandchild"]
        calls = _calls(*kinds)
        calls[-1].extra_info["pidfile"] = str(pidfile)
        out = pool.score(calls)
        assert out.scores == [1.0, 1.0, 1.0, -2.0, -2.0, 1.0, -2.0, 1.0, 1.0], out.messages
        assert dict(out.errors) == {"raised": 1, "bad_value": 1, "crashed": 1}, out.messages
        assert any("RecursionError" in m for m in out.messages)
        assert any("close its file descriptors" in m for m in out.messages), out.messages
        assert pool.score(_calls("ok", "ok")).scores == [1.0, 1.0]
        grandchild = int(pidfile.read_text())
        assert _alive(grandchild)
    deadline = time.monotonic() + 10  # SIGKILL is delivered when the process next runs
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild), "the function's grandchild outlived the pool"
    captured = capfd.readouterr()
    assert "printed" not in captured.out and "printed at import" in captured.err
    # no traceback of the workers (one would pass through the function's file); the suite's
    # other threads may print their own to the same stderr
    assert str(f) not in captured.err and "lockstep worker" not in captured.err, captured.err
