"""`kvflow serve` (or a script that ends in kvflow's CLI) as a real process on a free port, for the tests
that need one: its output read line by line on a thread of its own (so the pipe never fills, and a test
can wait for a line: an event, not a timer), readiness when it announces its address, and a stop that
leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

KVFLOW = (sys.executable, "-m", "kvflow.cli.main")
# The line `kvflow serve` prints once the model is loaded, the workers started and the socket accepts
# connections (kvflow/cli/serve.py): the first request after it needs no retry.
READY = re.compile(r"\[kvflow\] serving .* on (http://\S+)/v1")
# `kvflow serve`'s KV cache for the tiny test checkpoints: 64 MiB holds 131k tokens or more of theirs, far
# more than any test sends one instance, where the default (1 GiB) takes 1.5 s to zero at every start.
SMALL_KV = ("--kv-cache-gb", "0.0625")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`command` + `args` + `--port <free port>`, stdout and stderr together; `env` is added to this
    process's environment. Use as a context manager: leaving it stops the process if it still runs."""

    def __init__(self, *args: str, command: tuple[str, ...] = KVFLOW, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([*command, *args, "--port", str(self.port)], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        self._lines: list[str] = []
        self._seen = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._seen:
                self._lines.append(line)
                self._seen.notify_all()
        with self._seen:  # EOF: the process has closed its output (it exited)
            self._lines.append("")
            self._seen.notify_all()

    @property
    def log(self) -> str:
        """Everything it printed so far (all of it once `wait` returned)."""
        with self._seen:
            return "".join(self._lines)

    def wait_for(self, pattern: str | re.Pattern, timeout: float = 120.0) -> re.Match:
        """The first line matching `pattern` (searched from the start of the output): waits until it is
        printed; the process exiting first, or `timeout` seconds passing, fails with its output."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        checked = 0
        with self._seen:  # (a re-entrant lock: `log` takes it again)
            while True:
                for line in self._lines[checked:]:
                    if line == "":
                        raise AssertionError(f"exited ({self.proc.wait()}) before printing {regex.pattern!r}:\n{self.log}")
                    if m := regex.search(line):
                        return m
                checked = len(self._lines)
                if not self._seen.wait(deadline - time.monotonic()):
                    raise AssertionError(f"no line {regex.pattern!r} within {timeout:g} s:\n{self.log}")

    def wait_ready(self, timeout: float = 120.0) -> "ServeProcess":
        """Until it announces its address; then /health answers 200 at once (listening and started)."""
        m = self.wait_for(READY, timeout)
        assert m.group(1) == self.url, m.group(0)
        assert httpx.get(f"{self.url}/health", timeout=10).status_code == 200
        return self

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        """Its exit code, once it exited and its output is read to the end."""
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        return code

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """`sig`, then its exit code (SIGKILL if it has not exited within `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self._reap(timeout)

    def _reap(self, timeout: float) -> int:
        """Its exit code once it exited, SIGKILLed if that takes longer than `timeout`."""
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.wait(timeout)

    def __enter__(self) -> "ServeProcess":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:  # a test that failed half-way: let it shut down (release what it holds)
            self.stop(timeout=20)
        self.wait()


def stop_all(procs: list[ServeProcess], timeout: float = 60.0) -> list[int]:
    """`ServeProcess.stop` of several: SIGTERM to every one still running first, then their exit codes, so
    their shutdowns (about a second each, most of it the interpreter's exit) overlap."""
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    return [p._reap(timeout) for p in procs]
