"""Starting worker processes: the one interface the controller uses, whatever runs the processes.

A worker needs only the controller's address, its name, the interface it binds and the cluster
secret; everything else (its layers, role, model, dtype, KV settings) arrives in the handshake.
`SubprocessLauncher` spawns local processes (the default); `ExternalLauncher` starts nothing and
prints the command to run on each host; `kvflow.controller.ray_launcher.RayLauncher` starts each
stage as a Ray actor placed on a Ray cluster (imported only when asked for). The controller calls
`start` for every stage at start-up and again for the replacement of a lost worker; whoever built
the launcher calls `close()` once the controller has shut down.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
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


class SubprocessLauncher:
    """Each worker is a child process of this one; the secret travels in its environment."""

    def start(self, name: str, controller_addr: str, host: str, secret: bytes) -> subprocess.Popen:
        env = {**os.environ, SECRET_ENV: secret.hex()}
        return subprocess.Popen(worker_command(name, controller_addr, host), env=env)

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
