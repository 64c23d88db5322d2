"""Finding the vLLM peer tool wherever the checkout is, and the serving harness refusing to start without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.bench.peer import TOOL_ENV, PeerMissing, find_tool, require

ROOT = Path(__file__).resolve().parents[1]


def tool_at(folder: Path) -> Path:
    path = folder / "shared" / "tools" / "vllm-cpu-peer.sh"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    return path


def test_the_tool_is_found_in_any_folder_above_the_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv(TOOL_ENV, raising=False)
    checkout = tmp_path / "deep" / "er" / "checkout"
    checkout.mkdir(parents=True)
    with pytest.raises(PeerMissing, match="--peer-tool"):
        find_tool(None, checkout)
    far = tool_at(tmp_path)
    assert find_tool(None, checkout) == far.resolve()
    near = tool_at(tmp_path / "deep")
    assert find_tool(None, checkout) == near.resolve()  # the nearest one wins


def test_an_explicit_path_or_the_environment_comes_first(tmp_path, monkeypatch):
    tool_at(tmp_path)
    other = tool_at(tmp_path / "elsewhere")
    monkeypatch.setenv(TOOL_ENV, str(other))
    assert find_tool(None, tmp_path) == other.resolve()
    mine = tool_at(tmp_path / "mine")
    assert find_tool(mine, tmp_path) == mine.resolve()
    with pytest.raises(PeerMissing, match="--peer-tool"):
        find_tool(tmp_path / "nothing.sh", tmp_path)
    monkeypatch.setenv(TOOL_ENV, str(tmp_path / "gone.sh"))
    with pytest.raises(PeerMissing, match=TOOL_ENV):
        find_tool(None, tmp_path)


def test_a_tool_without_its_venv_is_not_a_peer(tmp_path, monkeypatch):
    tool = tool_at(tmp_path)
    monkeypatch.setenv("VLLM_PEER_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(PeerMissing, match="install"):
        require(tool, tmp_path)
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("")
    monkeypatch.setenv("VLLM_PEER_VENV", str(tmp_path / "venv"))
    assert require(tool, tmp_path) == (tool.resolve(), py)


def test_the_serving_harness_stops_before_starting_a_server_without_the_peer(tmp_path):
    # the peer is checked before any server starts: the run ends at once with the reason, no kvflow
    # server left behind (it used to exit 127 from the peer script with its kvflow server paused)
    env = {**os.environ, TOOL_ENV: "", "VLLM_PEER_VENV": str(tmp_path / "no-venv")}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--peer-tool", str(tmp_path / "none.sh")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1 and "does not exist" in p.stderr, p.stderr
    tool = tool_at(tmp_path)
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--peer-tool", str(tool)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1 and "not installed" in p.stderr, p.stderr
    assert "ready in" not in p.stdout  # no server was started
