"""Cluster configuration and one pipeline of worker processes as the controller sees it."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field

from kvflow.kv.manager import KVCacheManager

MODES = ("colocated", "disaggregated")


@dataclass(frozen=True)
class ClusterConfig:
    """How to lay the model out over worker processes.

    colocated: one pipeline of `depth` stages doing prompts and tokens (the DéjàVu baseline), with
    `depth` microbatches of up to `microbatch_size` requests in flight.
    disaggregated: a prompt pipeline (`prompt_depth` stages, microbatches of `prompt_microbatch_size`)
    streaming each prompt's KV layer by layer into a token pipeline (`token_depth` stages,
    microbatches of `microbatch_size`).
    """

    mode: str = "colocated"
    depth: int = 1
    prompt_depth: int = 1
    token_depth: int = 1
    microbatch_size: int = 8
    prompt_microbatch_size: int = 4
    model: str | None = None
    num_kv_blocks: int = 2048
    block_size: int = 16
    max_model_len: int | None = None
    threads_per_worker: int = 1
    host: str = "127.0.0.1"
    heartbeat_timeout_s: float = 3.0
    start_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for key in ("depth", "prompt_depth", "token_depth", "microbatch_size", "prompt_microbatch_size",
                    "num_kv_blocks", "block_size", "threads_per_worker"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be positive, got {getattr(self, key)}")
        if self.heartbeat_timeout_s <= 0 or self.start_timeout_s <= 0:
            raise ValueError("timeouts must be positive")

    def pipelines(self) -> list[tuple[str, str, int, int]]:
        """(name, role, depth, microbatch size) of each pipeline."""
        if self.mode == "colocated":
            return [("colocated", "both", self.depth, self.microbatch_size)]
        return [("prompt", "prompt", self.prompt_depth, self.prompt_microbatch_size),
                ("token", "token", self.token_depth, self.microbatch_size)]


def even_split(num_layers: int, depth: int) -> list[tuple[int, int]]:
    """Layer ranges of `depth` stages differing by at most one layer (earlier stages get the extra)."""
    from kvflow.streaming.topology import PipelineTopology  # the same split stream_out/stream_in plan with

    bounds = PipelineTopology.even(num_layers, depth, [1]).layer_bounds
    return list(zip(bounds, bounds[1:]))


@dataclass
class StageHandle:
    name: str
    layers: tuple[int, int]
    process: subprocess.Popen | None = None  # None for a worker started by hand on another host
    step_addr: str = ""
    kv_addr: str = ""
    last_heartbeat: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0
    kv_bytes_sent: int = 0
    alive: bool = True


@dataclass
class Pipeline:
    name: str
    role: str
    microbatch_size: int
    stages: list[StageHandle]
    kv: KVCacheManager
    max_in_flight: int  # microbatches circulating at once (= depth, one per stage)

    @property
    def depth(self) -> int:
        return len(self.stages)

    @property
    def alive(self) -> bool:
        return all(s.alive for s in self.stages)


def spawn_stage(cfg: ClusterConfig, controller_addr: str, name: str, role: str, layers: tuple[int, int]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvflow.worker", "--controller", controller_addr, "--name", name,
           "--layers", f"{layers[0]}:{layers[1]}", "--role", role, "--num-kv-blocks", str(cfg.num_kv_blocks),
           "--block-size", str(cfg.block_size), "--host", cfg.host, "--threads", str(cfg.threads_per_worker)]
    if cfg.model is not None:
        cmd += ["--model", str(cfg.model)]
    return subprocess.Popen(cmd)
