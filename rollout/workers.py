"""The worker process of a `RewardPool` (rollout/rewards.py): `python -m lockstep.rollout.workers
FD SPEC [ROLE]`. It loads a reward function (ROLE `reward`, the default) or an environment file
(ROLE `env`, rollout/env.py) once, says "ready" (or ("error", message)) over the socket FD, then
answers each (call id, kwargs) with (call id, kind, score-or-message): `ok` with the checked
result, `raised` with the exception's one line, `bad_value` when the result fails its check.
Its stdout is the pool's stderr (what the user's code prints never reaches lockstep's stdout,
which carries the run's summary), and it leads a process group of its own, so that what the
user's code starts ends with the worker.

Its own module, above both rewards.py and env.py, so neither imports the other's worker side;
like them it imports only the standard library, so a worker starts in well under a second.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

from lockstep.rollout.env import check_reply, load_env
from lockstep.rollout.rewards import RewardFunctionError, check_score, load_function


def serve(spec: str, conn: Connection, role: str = "reward") -> None:
    """Load `spec` for `role`, then answer calls until the pool closes the socket or sends
    None. A reply carries the id of the call it answers. A process the user's code forked
    returns here too: it exits at once, silent (only the worker itself answers). A result that
    cannot be sent (too deep to pickle, say) is a `bad_value` reply naming why."""
    me = os.getpid()
    try:
        fn, check = (load_env(spec), check_reply) if role == "env" else \
            (load_function(spec), check_score)
    except RewardFunctionError as e:
        _send(conn, me, ("error", str(e)))
        return
    _send(conn, me, "ready")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the pool is gone, or the function closed our socket
            return
        if msg is None:
            return
        call, kwargs = msg
        try:
            out = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - the user's code may raise anything
            reply = (call, "raised", _one_line(e))
        else:
            try:
                reply = (call, "ok", check(out))
            except ValueError as e:
                reply = (call, "bad_value", str(e))
            except RecursionError as e:
                reply = (call, "bad_value", f"the result is too deeply nested to check ({e})")
        _send(conn, me, reply)


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 500 else text[:497] + "..."


def _send(conn: Connection, me: int, msg) -> None:
    if os.getpid() != me:  # a fork of the worker (the user's code forked and returned)
        os._exit(0)
    try:
        conn.send(msg)
    except OSError:  # the socket is closed: the pool counts this call as crashed
        os._exit(3)
    except Exception as e:  # noqa: BLE001 - unpicklable or too deep a result
        conn.send((msg[0], "bad_value", f"the result could not be sent back: {_one_line(e)}"))


def main(argv: list[str]) -> None:
    """A worker's life, without a traceback on the way out: an error the calls could not
    catch ends the process with code 4 and one line on stderr."""
    try:
        serve(argv[2], Connection(int(argv[1])), *argv[3:4])
    except BaseException as e:  # noqa: BLE001
        print(f"lockstep worker {os.getpid()}: {_one_line(e)}", file=sys.stderr, flush=True)
        os._exit(4)


if __name__ == "__main__":
    main(sys.argv)
