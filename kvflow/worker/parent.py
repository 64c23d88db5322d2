"""Whether the controller that started a worker is still there: a worker must not outlive it."""

from __future__ import annotations

import os


class Parent:
    """The local controller process `controller_pid` (a worker forked by the launcher's fork server),
    or, with None, the process that started this one (its parent at construction)."""

    def __init__(self, controller_pid: int | None) -> None:
        self.controller_pid = controller_pid
        self.ppid = os.getppid()

    def gone(self) -> bool:
        if self.controller_pid is None:
            return os.getppid() != self.ppid
        try:
            os.kill(self.controller_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        try:  # an exited controller not yet reaped by its parent is a zombie
            with open(f"/proc/{self.controller_pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return False
