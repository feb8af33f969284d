"""The worker process of a `RewardPool` (rollout/rewards.py): `python -m lockstep.rollout.workers
FD SPEC [ROLE]`. It loads a reward function (ROLE `reward`, the default) or an environment file
(ROLE `env`, rollout/env.py) once, says "ready" (or ("error", message)) over the socket FD, then
answers each (i, kwargs) with (i, kind, score-or-message): `ok` with the checked result,
`raised` with the exception's one line, `bad_value` when the result fails its check.

Its own module, above both rewards.py and env.py, so neither imports the other's worker side;
like them it imports only the standard library, so a worker starts in well under a second.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from lockstep.rollout.env import check_reply, load_env
from lockstep.rollout.rewards import RewardFunctionError, check_score, load_function


def serve(spec: str, conn: Connection, role: str = "reward") -> None:
    """Load `spec` for `role`, then answer calls until the pool closes the socket or sends
    None."""
    try:
        fn, check = (load_env(spec), check_reply) if role == "env" else \
            (load_function(spec), check_score)
    except RewardFunctionError as e:
        conn.send(("error", str(e)))
        return
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        i, kwargs = msg
        try:
            out = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - the user's code may raise anything
            reply = (i, "raised", f"{type(e).__name__}: {e}")
        else:
            try:
                reply = (i, "ok", check(out))
            except ValueError as e:
                reply = (i, "bad_value", str(e))
        conn.send(reply)


if __name__ == "__main__":
    serve(sys.argv[2], Connection(int(sys.argv[1])), *sys.argv[3:4])
