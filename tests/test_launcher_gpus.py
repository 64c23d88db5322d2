"""Local workers on a machine with several GPUs: each sees one (CUDA_VISIBLE_DEVICES), in turn, and a
restarted worker the one its name had; with one GPU, or a device named with its index, nothing changes."""

from __future__ import annotations

from kvflow.controller.launcher import SubprocessLauncher, local_gpus


def test_workers_take_the_gpus_in_turn_and_keep_theirs():
    launcher = SubprocessLauncher(["2", "5"])
    seen = [launcher.worker_env(n)["CUDA_VISIBLE_DEVICES"] for n in ("prompt-0", "token-0", "token-1", "token-0")]
    assert seen == ["2", "5", "2", "5"]  # the fourth is token-0 replaced: its GPU again


def test_one_gpu_or_none_leaves_the_environment_alone(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert SubprocessLauncher([]).worker_env("w")["CUDA_VISIBLE_DEVICES"] == "3"
    assert local_gpus("cuda") == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0, 1,2")
    assert local_gpus("cuda") == ["0", "1", "2"]
    assert local_gpus("cuda:1") == [] and local_gpus("cpu") == []
