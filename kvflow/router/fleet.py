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

`Fleet` holds what does not depend on where an instance runs (growing, retiring, the restart budget, closing);
`LocalFleet` runs each instance as a process of this machine, `kvflow.router.ray_fleet.RayFleet` as a process that a
Ray actor starts on its node.
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
    moved_from: str | None = None  # started again at a new URL (a Ray fleet's, on another node): the URL it replaces


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


class Fleet:
    """The instances a router keeps running. A subclass says where one runs: `_place` (its port and URL, before its
    first start), `_spawn` (start it; again on the same port after it exited), `_exit_code` (None while it runs),
    `_stop` (SIGTERM, or SIGKILL with `kill`), `_wait`, and `tail` (its log's last lines)."""

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
        new = []
        for _ in range(k):
            i = len(self.instances)
            inst = LocalInstance(i, 0, "", self.log_dir / f"instance-{i}.log")
            self._place(inst)
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
        if self._exit_code(inst) is None:
            self._stop(inst)
        log.info("instance %d (%s) retired", inst.index, inst.url)

    def supervise(self) -> list[str]:
        """Start again every instance whose process exited (within its restart budget); the URLs started again."""
        restarted = []
        now = time.monotonic()
        for inst in self.instances:
            if inst.given_up or inst.retired or (code := self._exit_code(inst)) is None:
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

    def close(self, timeout: float = 15.0) -> None:
        """Stop every instance: SIGTERM (they drain), then SIGKILL after `timeout` seconds."""
        running = [i for i in self.instances if self._exit_code(i) is None]
        for i in running:
            self._stop(i)
        deadline = time.monotonic() + timeout
        for i in running:
            if not self._wait(i, max(0.0, deadline - time.monotonic())):
                self._stop(i, kill=True)
                self._wait(i, timeout)

    def command(self, inst: LocalInstance, host: str) -> list[str]:
        return [sys.executable, "-m", "kvflow.cli.main", "serve", *self.config.serve_args,
                "--host", host, "--port", str(inst.port)]

    # ------------------------------------------------------------------ where an instance runs
    def _place(self, inst: LocalInstance) -> None:
        raise NotImplementedError

    def _spawn(self, inst: LocalInstance) -> None:
        raise NotImplementedError

    def _exit_code(self, inst: LocalInstance) -> int | None:
        raise NotImplementedError

    def _stop(self, inst: LocalInstance, kill: bool = False) -> None:
        raise NotImplementedError

    def _wait(self, inst: LocalInstance, timeout: float) -> bool:
        """Whether it exited within `timeout` seconds."""
        raise NotImplementedError

    def tail(self, inst: LocalInstance, lines: int = 15) -> str:
        raise NotImplementedError


class LocalFleet(Fleet):
    """The instances as processes of this machine, on free ports of `FleetConfig.host`."""

    def _place(self, inst: LocalInstance) -> None:
        host = self.config.host
        inst.port = free_port(host)
        inst.url = f"http://{f'[{host}]' if ':' in host else host}:{inst.port}"

    def env(self, inst: LocalInstance) -> dict[str, str]:
        """This process's environment; with several GPUs, only the instance's own one visible (a restarted instance
        keeps it)."""
        env = dict(os.environ)
        if self.config.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.config.gpus[inst.index % len(self.config.gpus)]
        return env

    def _spawn(self, inst: LocalInstance) -> None:
        cmd = self.command(inst, self.config.host)
        with open(inst.log_path, "ab") as out:
            out.write(f"--- start {inst.starts + 1}: {' '.join(cmd)}\n".encode())
            out.flush()
            inst.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env(inst), preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        inst.starts += 1
        log.info("instance %d started on %s (pid %d, log %s)", inst.index, inst.url, inst.proc.pid, inst.log_path)

    def _exit_code(self, inst: LocalInstance) -> int | None:
        return None if inst.proc is None else inst.proc.poll()

    def _stop(self, inst: LocalInstance, kill: bool = False) -> None:
        inst.proc.kill() if kill else inst.proc.terminate()

    def _wait(self, inst: LocalInstance, timeout: float) -> bool:
        try:
            inst.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def tail(self, inst: LocalInstance, lines: int = 15) -> str:
        try:
            return "\n".join(inst.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
