"""A real worker process (`kvflow.worker`) held to the simulator's step-time function: each step
computes as usual, then waits until `sim_helpers.paced_seconds(batch)` have passed since it began
before sending its output on (the KV it streams leaves during the compute, as usual). A step that
comes while the one before is still paced (a one-stage worker launching it behind that one on the
device, `worker.compute`) begins when that one ends, as on a device, and each output keeps its own
step's time. The same-decisions test runs its pipelines with these workers, so real and simulated
stage times agree up to the messaging latency.

`run` is the entry of a worker forked by the multiprocessing fork server (`PacedLauncher`, as
`kvflow.controller.launcher.SubprocessLauncher` forks its workers: torch is imported once, not on
every start); the pacing is installed in the forked worker only, so the fork server's other
workers (other tests') are not paced. `pace` scales the step times; with `die_at` = n, the worker
kills itself (SIGKILL) when its n-th step arrives, before computing it: a failure at a point of
the schedule the simulator can place exactly."""

import os
import signal
import time
from collections import deque

from sim_helpers import paced_seconds

from kvflow.controller.launcher import _run_forked_worker
from kvflow.perf.perf_model import BatchShape
from kvflow.worker import worker as _worker


class _Paced:
    """The worker's output socket: each step sends one output, in step order, no earlier than that
    step's deadline (`deadlines`, oldest first)."""

    def __init__(self, sock) -> None:
        self.sock, self.deadlines = sock, deque()

    def pace(self, seconds: float) -> None:
        """A step begins: now, or when the step before it ends if that is later."""
        start = max(time.perf_counter(), self.deadlines[-1] if self.deadlines else 0.0)
        self.deadlines.append(start + seconds)

    def send_multipart(self, frames, *args, **kw):
        wait = (self.deadlines.popleft() if self.deadlines else 0.0) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self.sock.send_multipart(frames, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _pace(pace: float, die_at: int) -> None:
    """Make every `Worker` of this process paced (`paced_seconds` scaled by `pace`; it dies when its
    `die_at`-th step arrives)."""
    step, steps = _worker.Worker._step, 0

    def paced_step(self, msg, hidden, *rest):
        nonlocal steps
        steps += 1
        if steps == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if not isinstance(self.out, _Paced):  # (a Route message replaces the socket)
            self.out = _Paced(self.out)
        self.out.pace(paced_seconds(BatchShape.of((s.num_new, s.context_len) for s in msg.seqs), pace))
        return step(self, msg, hidden, *rest)

    _worker.Worker._step = paced_step


def run(controller_addr: str, name: str, host: str, secret: bytes, env: dict[str, str], controller_pid: int,
        pace: float, die_at: int = 0) -> None:
    """A forked paced worker's entry (`SubprocessLauncher`'s, with the pacing installed first)."""
    _pace(pace, die_at)
    _run_forked_worker(controller_addr, name, host, secret, env, controller_pid)
