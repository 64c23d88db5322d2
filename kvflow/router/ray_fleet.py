"""The router's own instances on a Ray cluster (`kvflow router --launch N --launcher ray`): each `kvflow serve` is a
process that a Ray actor starts on its node, bound on that node's IP and a free port there.

Ray places the actors (one CPU each by default, `num_cpus`), carries their control calls, and tells the router when an
actor is gone; the instance itself is the same `kvflow serve` process a `LocalFleet` starts, reached over HTTP at the
URL its actor reports, its output in a log file on its node (`tail` reads it through the actor). `Fleet` keeps the
rest: restarts within a budget, retiring, closing. An instance whose process exited is started again by its actor on
the same port, so its URL stays; one whose actor died (its node lost, or `ray.kill`) is started by a new actor,
wherever Ray puts it, at a new URL: `moved_from` says which URL it replaces, for the router's pool.

Ray is imported only here, and only when a `RayFleet` is built.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvflow.router.fleet import Fleet, FleetConfig, LocalInstance, free_port

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0  # an actor's answer to a control call


class ServeActor:
    """The body of an instance's actor (wrapped by `ray.remote` at run time): one `kvflow serve` process on its node."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.cmd: list[str] = []
        self.log_path = ""

    def place(self, serve_args: list[str], index: int) -> tuple[str, int, str]:
        """Choose this node's IP and a free port there for the instance: (its URL, port, log file on this node)."""
        import ray

        ip = ray.util.get_node_ip_address()
        port = free_port(ip)
        self.cmd = [sys.executable, "-m", "kvflow.cli.main", "serve", *serve_args, "--host", ip, "--port", str(port)]
        self.log_path = str(Path(tempfile.mkdtemp(prefix="kvflow-fleet-")) / f"instance-{index}.log")
        return f"http://{f'[{ip}]' if ':' in ip else ip}:{port}", port, self.log_path

    def restart(self) -> int:
        """Start the instance (again, on the same port); its pid."""
        with open(self.log_path, "ab") as out:
            out.write(f"--- start: {' '.join(self.cmd)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=dict(os.environ))
        return self.proc.pid

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, kill: bool) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def tail(self, lines: int) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid


class RayFleet(Fleet):
    """`config.count` instances of `kvflow serve <config.serve_args>` on a Ray cluster (`address`: as `ray.init`'s,
    None: $RAY_ADDRESS, else a running local cluster, else a new one), each actor asking `num_cpus` CPUs
    (`num_gpus` GPUs: then Ray sets its CUDA_VISIBLE_DEVICES). `FleetConfig.host` and `gpus` are not used."""

    def __init__(self, config: FleetConfig, address: str | None = None, num_cpus: float = 1.0,
                 num_gpus: float = 0.0) -> None:
        import ray

        super().__init__(config)
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        self._ray = ray
        self._actor_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0)(ServeActor)
        self.actors: dict[int, object] = {}

    def _call(self, inst: LocalInstance, method: str, *args):
        return self._ray.get(getattr(self.actors[inst.index], method).remote(*args), timeout=CALL_TIMEOUT_S)

    def _place(self, inst: LocalInstance) -> None:
        self.actors[inst.index] = actor = self._actor_cls.remote()
        url, inst.port, log_path = self._ray.get(actor.place.remote(list(self.config.serve_args), inst.index),
                                                 timeout=CALL_TIMEOUT_S)
        if inst.url and url != inst.url:
            inst.moved_from = inst.url
        inst.url, inst.log_path = url, Path(log_path)

    def _spawn(self, inst: LocalInstance) -> None:
        try:
            pid = self._call(inst, "restart")
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
            self._place(inst)  # its actor is gone: a new one, wherever Ray puts it
            pid = self._call(inst, "restart")
        inst.starts += 1
        log.info("instance %d started on %s by a Ray actor (pid %d there, log %s on its node)", inst.index, inst.url,
                 pid, inst.log_path)

    def _exit_code(self, inst: LocalInstance) -> int | None:
        try:
            return self._call(inst, "exit_code")
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
            return -1  # the actor (or its node) is gone

    def _stop(self, inst: LocalInstance, kill: bool = False) -> None:
        try:
            self._call(inst, "stop", kill)
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
            pass

    def _wait(self, inst: LocalInstance, timeout: float) -> bool:
        try:
            return self._ray.get(self.actors[inst.index].wait.remote(timeout), timeout=timeout + CALL_TIMEOUT_S)
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
            return True

    def tail(self, inst: LocalInstance, lines: int = 15) -> str:
        try:
            return self._call(inst, "tail", lines)
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
            return "(its Ray actor is gone)"

    def close(self, timeout: float = 15.0) -> None:
        super().close(timeout)
        for actor in self.actors.values():
            self._ray.kill(actor)
