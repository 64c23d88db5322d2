"""A real worker process (`python -m kvflow.worker`) held to the simulator's step-time function:
each step computes as usual, then waits until `sim_helpers.paced_seconds(batch)` have passed since
it began before sending its output on (the KV it streams leaves during the compute, as usual). The
same-decisions test runs its pipelines with these workers, so real and simulated stage times agree
up to the messaging latency.

With `DIE_AT_STEP_ENV` set to n, the worker kills itself (SIGKILL) when its n-th step arrives,
before computing it: a failure at a point of the schedule the simulator can place exactly."""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_helpers import paced_seconds  # noqa: E402

from kvflow.perf.perf_model import BatchShape  # noqa: E402
from kvflow.worker import worker as _worker  # noqa: E402
from kvflow.worker.__main__ import main  # noqa: E402

_step = _worker.Worker._step
DIE_AT_STEP_ENV = "KVFLOW_TEST_DIE_AT_STEP"
_die_at = int(os.environ.get(DIE_AT_STEP_ENV, "0"))
_steps = 0


class _Paced:
    """The worker's output socket, sending no earlier than `deadline`."""

    def __init__(self, sock) -> None:
        self.sock, self.deadline = sock, 0.0

    def send_multipart(self, frames, *args, **kw):
        wait = self.deadline - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self.sock.send_multipart(frames, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _paced_step(self, msg, hidden, *rest):
    global _steps
    _steps += 1
    if _steps == _die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    if not isinstance(self.out, _Paced):  # (a Route message replaces the socket)
        self.out = _Paced(self.out)
    self.out.deadline = time.perf_counter() + paced_seconds(BatchShape.of((s.num_new, s.context_len) for s in msg.seqs))
    return _step(self, msg, hidden, *rest)


_worker.Worker._step = _paced_step

if __name__ == "__main__":
    raise SystemExit(main())
