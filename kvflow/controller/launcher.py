"""Starting worker processes: the one interface the controller uses, whatever runs the processes.

A worker needs only the controller's address, its name, the interface it binds and the cluster
secret; everything else (its layers, role, model, dtype, KV settings) arrives in the handshake.
`SubprocessLauncher` starts local processes (the default): forked from a fork server that has
imported the worker (torch included) once, so a worker does not pay torch's import again on every
start and every replacement of a lost worker (docs/results.md, 2026-11-23 launchers); on a machine
with several GPUs (`--device cuda`) each worker sees one of them, in turn (`local_gpus`);
`ExternalLauncher` starts nothing and prints the command to run on each host;
`kvflow.controller.ray_launcher.RayLauncher` starts each stage as a Ray actor placed on a Ray
cluster (imported only when asked for). The controller calls
`start` for every stage at start-up and again for the replacement of a lost worker; whoever built
the launcher calls `close()` once the controller has shut down.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from typing import Protocol

from kvflow.wire import SECRET_ENV


class WorkerHandle(Protocol):
    """A started worker: `poll()` is None while it runs, else its exit code; `kill()` ends it."""

    pid: int | None

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


class Launcher(Protocol):
    def start(self, name: str, controller_addr: str, host: str, secret: bytes) -> WorkerHandle | None:
        """Start worker `name`; None when the process is not ours to supervise (started by hand)."""
        ...

    def close(self) -> None:
        """Release what the launcher holds beyond its workers (e.g. a Ray placement group)."""
        ...


def worker_command(name: str, controller_addr: str, host: str) -> list[str]:
    return [sys.executable, "-m", "kvflow.worker", "--controller", controller_addr, "--name", name, "--host", host]


def _run_forked_worker(controller_addr: str, name: str, host: str, secret: bytes, env: dict[str, str],
                       controller_pid: int) -> None:
    """A forked worker's entry: the environment its launcher had when it was started, then the worker,
    which stops when the controller process exits (its parent is the fork server, which lives as
    long as any of its workers)."""
    os.environ.clear()
    os.environ.update(env)
    from kvflow.worker.worker import run_worker

    run_worker(controller_addr, name, host, secret, controller_pid)


class ForkedWorker:
    """A `WorkerHandle` over a process forked by the fork server (a `multiprocessing.Process`)."""

    def __init__(self, proc) -> None:
        self.proc = proc
        self.pid = proc.pid

    def poll(self) -> int | None:
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code; `subprocess.TimeoutExpired` if it still runs after `timeout` (as `Popen.wait`)."""
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        return self.proc.exitcode


def local_gpus(device: str) -> list[str]:
    """The GPUs local workers spread over: for device "cuda" (no index) with more than one visible,
    each one's CUDA_VISIBLE_DEVICES entry; else none (every worker uses `device` as given)."""
    if device != "cuda":
        return []
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [g.strip() for g in visible.split(",") if g.strip()] if visible is not None else [str(i) for i in range(torch.cuda.device_count())]
    return ids if len(ids) > 1 else []


class SubprocessLauncher:
    """Each worker is a local process. Where the platform has a fork server, workers are forked from
    it: it is started once per controller process (the first `start`) and imports
    `kvflow.worker.worker` (torch included) before forking anything; a worker gets the launcher's
    environment of the moment it is started (libraries that read the environment only on import,
    such as OpenMP, see the fork server's) and the secret as an argument. As with any
    multiprocessing start other than a bare fork, a forked worker first imports the script that
    runs the controller (as `__mp_main__`): such a script keeps its work under
    `if __name__ == "__main__":` (`kvflow serve` and the benchmarks do). Elsewhere each worker is a
    fresh interpreter (`python -m kvflow.worker`, the secret in its environment)."""

    def __init__(self, gpus: Sequence[str] = ()) -> None:
        self._ctx = None
        if "forkserver" in mp.get_all_start_methods():
            self._ctx = mp.get_context("forkserver")
            self._ctx.set_forkserver_preload(["kvflow.worker.worker"])
        self._gpus = list(gpus)  # (`local_gpus`): each worker sees one of these as its "cuda"
        self._gpu_of: dict[str, str] = {}

    def worker_env(self, name: str) -> dict[str, str]:
        """The environment worker `name` starts with: this process's, and with several GPUs, only the
        next one in turn visible (a restarted worker keeps the GPU its name had), as Ray gives each
        worker actor its own."""
        env = dict(os.environ)
        if self._gpus:
            gpu = self._gpu_of.setdefault(name, self._gpus[len(self._gpu_of) % len(self._gpus)])
            env["CUDA_VISIBLE_DEVICES"] = gpu
        return env

    def start(self, name: str, controller_addr: str, host: str, secret: bytes) -> WorkerHandle:
        env = self.worker_env(name)
        if self._ctx is None:
            return subprocess.Popen(worker_command(name, controller_addr, host), env={**env, SECRET_ENV: secret.hex()})
        proc = self._ctx.Process(target=_run_forked_worker,
                                 args=(controller_addr, name, host, secret, env, os.getpid()),
                                 name=f"kvflow-worker-{name}", daemon=True)
        proc.start()
        return ForkedWorker(proc)

    def close(self) -> None:
        pass


class ExternalLauncher:
    """Starts nothing: prints, for each worker, the exact command that joins this controller."""

    def __init__(self, out=sys.stderr) -> None:
        self.out = out

    def start(self, name: str, controller_addr: str, host: str, secret: bytes) -> None:
        cmd = ["kvflow", "worker", "--controller", controller_addr, "--name", name, "--host", "<this-host>"]
        print(f"  {SECRET_ENV}={secret.hex()} {shlex.join(cmd)}", file=self.out)
        return None

    def close(self) -> None:
        pass
