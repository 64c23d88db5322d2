"""Instances the router starts itself (`kvflow router --launch N`): local `kvflow serve` processes, each on a free
port of this machine, kept running.

The router treats them like any other instance: their URLs join the pool, the health check takes one out when it
stops answering, and its open requests move (`RouterBackend`). What the fleet adds is the process: `supervise()`
(called by the router every health interval) starts again, on the same port, an instance whose process exited, so
the health check brings it back with an empty cache record, as it would any restarted instance. An instance that
keeps exiting (more than `max_restarts` times within `restart_window_s`: a bad argument, a missing checkpoint) is
given up, with its log's last lines in the router's log, rather than restarted in a loop.

On a machine with several GPUs (`gpus`, from `kvflow.controller.launcher.local_gpus`) each instance sees one of them, in
turn. Each instance's output goes to `instance-<i>.log` in `log_dir` (a fresh temporary directory by default, named at
start). On Linux an instance is also asked to stop when the router process dies (parent-death signal), so that
killing the router does not leave its instances serving.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetConfig:
    """`count` instances of `kvflow serve <serve_args> --host <host> --port <a free port>`."""

    count: int
    serve_args: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    max_restarts: int = 3  # restarts of one instance within `restart_window_s` before it is given up
    restart_window_s: float = 300.0
    log_dir: str | None = None  # None: a new temporary directory
    gpus: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES entries: instance i sees gpus[i mod len] alone (`local_gpus`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "serve_args", tuple(self.serve_args))
        object.__setattr__(self, "gpus", tuple(str(g) for g in self.gpus))
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")
        if self.max_restarts < 0 or not self.restart_window_s > 0:
            raise ValueError("max_restarts must be >= 0 and restart_window_s > 0")
        for flag in ("--host", "--port"):
            if any(a == flag or a.startswith(flag + "=") for a in self.serve_args):
                raise ValueError(f"{flag} is the fleet's to choose; leave it out of the instances' arguments")


@dataclass(eq=False)
class LocalInstance:
    index: int
    port: int
    url: str
    log_path: Path
    proc: subprocess.Popen | None = None
    starts: int = 0
    restarts: deque[float] = field(default_factory=deque)  # monotonic times of recent restarts
    given_up: bool = False
    retired: bool = False  # stopped on purpose (scaled down): not started again


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # (in the child, before exec)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LocalFleet:
    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="kvflow-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.instances: list[LocalInstance] = []

    def start(self) -> list[str]:
        """Start every instance (not waiting for them to load); their URLs."""
        return [i.url for i in self.grow(self.config.count)]

    def grow(self, k: int) -> list[LocalInstance]:
        """Start `k` more instances, each on a new free port."""
        host = self.config.host
        shown = f"[{host}]" if ":" in host else host
        new = []
        for _ in range(k):
            port, i = free_port(host), len(self.instances)
            inst = LocalInstance(i, port, f"http://{shown}:{port}", self.log_dir / f"instance-{i}.log")
            self.instances.append(inst)
            self._spawn(inst)
            new.append(inst)
        return new

    @property
    def active(self) -> list[LocalInstance]:
        """The instances kept running (neither retired nor given up), oldest first."""
        return [i for i in self.instances if not i.retired and not i.given_up]

    def retire(self, inst: LocalInstance) -> None:
        """Stop an instance for good: SIGTERM, on which `kvflow serve` drains its open requests and exits."""
        inst.retired = True
        if inst.proc is not None and inst.proc.poll() is None:
            inst.proc.terminate()
        log.info("instance %d (%s) retired", inst.index, inst.url)

    def command(self, inst: LocalInstance) -> list[str]:
        return [sys.executable, "-m", "kvflow.cli.main", "serve", *self.config.serve_args,
                "--host", self.config.host, "--port", str(inst.port)]

    def env(self, inst: LocalInstance) -> dict[str, str]:
        """This process's environment; with several GPUs, only the instance's own one visible (a restarted instance
        keeps it)."""
        env = dict(os.environ)
        if self.config.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.config.gpus[inst.index % len(self.config.gpus)]
        return env

    def _spawn(self, inst: LocalInstance) -> None:
        with open(inst.log_path, "ab") as out:
            out.write(f"--- start {inst.starts + 1}: {' '.join(self.command(inst))}\n".encode())
            out.flush()
            inst.proc = subprocess.Popen(self.command(inst), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env(inst), preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        inst.starts += 1
        log.info("instance %d started on %s (pid %d, log %s)", inst.index, inst.url, inst.proc.pid, inst.log_path)

    def supervise(self) -> list[str]:
        """Start again every instance whose process exited (within its restart budget); the URLs started again."""
        restarted = []
        now = time.monotonic()
        for inst in self.instances:
            if inst.given_up or inst.retired or inst.proc is None or (code := inst.proc.poll()) is None:
                continue
            while inst.restarts and now - inst.restarts[0] > self.config.restart_window_s:
                inst.restarts.popleft()
            if len(inst.restarts) >= self.config.max_restarts:
                inst.given_up = True
                log.error("instance %d (%s) exited with code %s %d times within %.0f s: given up; the end of %s:\n%s",
                          inst.index, inst.url, code, len(inst.restarts) + 1, self.config.restart_window_s,
                          inst.log_path, self.tail(inst))
                continue
            log.warning("instance %d (%s) exited with code %s: starting it again", inst.index, inst.url, code)
            inst.restarts.append(now)
            self._spawn(inst)
            restarted.append(inst.url)
        return restarted

    @staticmethod
    def tail(inst: LocalInstance, lines: int = 15) -> str:
        try:
            return "\n".join(inst.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self, timeout: float = 15.0) -> None:
        """Stop every instance: SIGTERM (they drain), then SIGKILL after `timeout` seconds."""
        running = [i.proc for i in self.instances if i.proc is not None and i.proc.poll() is None]
        for p in running:
            p.terminate()
        deadline = time.monotonic() + timeout
        for p in running:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
