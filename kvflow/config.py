"""The one config tree every process's settings derive from (frozen, validated dataclasses).

    ClusterConfig                       a serving layout (pipeline modes)
      ├── engine: EngineConfig          model, dtype, device, KV (block size, blocks or a memory
      │     │                           budget), max_model_len, threads
      │     └── scheduler: SchedulerConfig
      └── topology fields               mode, depths, microbatch sizes, host, timeouts

The single-process engine takes an `EngineConfig`; the controller takes a `ClusterConfig` and hands
each worker its `WorkerSpec` (name, layers, role) plus the engine subtree in the start-up handshake,
so nothing is rebuilt from command-line flags on the worker side. `to_dict`/`from_dict` carry the
tree over the wire (msgpack-friendly).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvflow.sched.config import POLICIES, ROLES, SchedulerConfig, SwapLayout, pipeline_scheduler

DTYPES = ("auto", "float32", "bfloat16", "float16")
MODES = ("colocated", "disaggregated")
KV_SEND_MODES = ("naive", "buffered", "overlap")
RECOVERY = ("recompute", "none")
REPLICATION = ("ring", "store", "none")


def native_bf16(device: str = "cpu") -> str | None:
    """Why `device` computes bfloat16 natively (a short reason), or None: on CPU the AVX512-BF16 or AMX-BF16
    instructions (/proc/cpuinfo flags), on CUDA `torch.cuda.is_bf16_supported()`."""
    import torch

    if device.startswith("cuda"):
        return "CUDA bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else None
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        pass
    found = sorted(flags & {"avx512_bf16", "amx_bf16"})
    return f"CPU has {'+'.join(found)} ({torch.backends.cpu.get_cpu_capability()})" if found else None


def resolve_dtype(dtype: str, device: str = "cpu") -> tuple[str, str]:
    """(concrete dtype, why): "auto" is bfloat16 where the device has native bf16, float32 elsewhere."""
    if dtype != "auto":
        return dtype, "requested"
    why = native_bf16(device)
    return ("bfloat16", f"auto: {why}") if why else ("float32", "auto: no native bf16 on this device")


def default_block_size(device: str = "cpu") -> int:
    """The KV block size the user-facing entry points (`kvflow serve/generate/chat`, `LLM`) use when
    none is given: 128 tokens on CPU (vLLM's CPU default too), 16 elsewhere. On CPU a sequence's
    blocks lie scattered in memory and every block is a new stream for the prefetcher and new pages
    for the TLB, so bigger blocks read KV faster, and a step's block tables are shorter
    (docs/results.md, 2026-11-24 kernels). The price is coarser prefix sharing (whole blocks only)
    and up to a block of unused KV per sequence."""
    return 16 if device.startswith("cuda") else 128


@dataclass(frozen=True)
class EngineConfig:
    """How to build a model and its KV cache. `model` None means the embedded default
    (SmolLM2-135M-Instruct); `max_model_len` None means the checkpoint's context length. The KV cache
    gets `num_kv_blocks` blocks of `block_size` tokens, or, when that is None, as many as fit in
    `kv_cache_memory_gb`. `dtype="auto"` is resolved here, once, to bfloat16 where the device has
    native bf16 and float32 elsewhere (`resolve_dtype`), so every process of a cluster gets the same
    concrete dtype; the user-facing entry points (`kvflow serve/generate/chat`, `LLM`) default to it.
    The field's default stays float32 for code that builds a model by hand and passes its config;
    likewise `block_size` (16 here; the entry points use `default_block_size`, 128 on CPU).
    `enable_prefix_caching`: full KV blocks are kept after their request ends and shared by later
    requests whose tokens start the same way (`kvflow.kv`), on by default as in vLLM.
    `host_kv_bytes` / `disk_kv_bytes`: byte budgets of the prefix cache's lower tiers (0: off, the
    default): blocks evicted from the device pool are kept in host memory, and below it in chunk
    files under `disk_kv_path` (a fresh temporary directory when None; a disk tier needs a host
    tier). Each budget counts the KV of every layer (a pipeline's stages share it by their layers).
    `deterministic`: build the model batch-invariant (`kvflow.model.llama.LlamaModel`): a request's
    tokens do not depend on what else shares its steps, in every dtype, so greedy and seeded outputs
    are the same alone, batched, chunked, preempted and recovered. Off by default: it cost more than
    5% of throughput on prefill-heavy and long-context work where measured (docs/results.md,
    2026-11-26 determinism); off takes the fastest kernel per batch shape.
    `enforce_eager`: on CUDA, run decode steps op by op instead of replaying a CUDA graph captured per
    batch-size bucket (`kvflow.model.cuda_graphs`; vLLM's flag of the same name). No effect on CPU.
    `decode_ahead` (default on; the single-process engine): where decode steps replay CUDA graphs (not
    `enforce_eager`, the continuous policy), greedy decodes run one step ahead: the engine launches
    the next step, its input ids taken on the device from the step in flight, before it reads that
    step's ids back, so its host work (scheduling, packing, outputs) overlaps the device's
    (`kvflow.engine.engine.LLMEngine`; vLLM v1's async scheduling); off: one step at a time. On the
    CPU there are no graphs and it does nothing (the forward is compute-bound there, and the host work
    would compete for the same cores). Pipelines have their own (`ClusterConfig.decode_ahead`).
    `gpu_memory_utilization` (CUDA only, instead of `kv_cache_memory_gb`): the KV cache gets what is
    left of this fraction of the device's memory once the weights are loaded and a step of the token
    budget has been measured (`kvflow.engine.memory`; vLLM's flag of the same name). In a cluster
    (`ClusterConfig`, instead of `num_kv_blocks`) every stage measures over its layers and each
    pipeline's pool is the fewest blocks any of its stages has room for (`engine.memory.pipeline_pools`),
    cut where the replicas of the replicated pipelines would not fit in /dev/shm
    (`controller.replica_store.fit_replicas`)."""

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    max_model_len: int | None = None
    num_threads: int | None = None
    enable_prefix_caching: bool = True
    host_kv_bytes: int = 0
    disk_kv_bytes: int = 0
    disk_kv_path: str | None = None
    deterministic: bool = False
    enforce_eager: bool = False
    decode_ahead: bool = True
    gpu_memory_utilization: float | None = None
    scheduler: SchedulerConfig = SchedulerConfig()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", resolve_dtype("auto", self.device)[0])
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks <= 0):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb!r}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        for key in ("deterministic", "enforce_eager", "decode_ahead"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be a bool, got {getattr(self, key)!r}")
        for key in ("host_kv_bytes", "disk_kv_bytes"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{key} must be a non-negative integer, got {v!r}")
        if self.disk_kv_bytes and not self.host_kv_bytes:
            raise ValueError("a disk KV tier (disk_kv_bytes) needs a host tier above it (host_kv_bytes)")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        if self.gpu_memory_utilization is not None:
            u = self.gpu_memory_utilization
            if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
                raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")
            if not self.device.startswith("cuda"):
                raise ValueError("gpu_memory_utilization sizes the KV cache from GPU memory: it needs a CUDA device "
                                 "(on CPU, give kv_cache_memory_gb)")
            if self.num_kv_blocks is not None:
                raise ValueError("give either num_kv_blocks or gpu_memory_utilization, not both")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r} requested but CUDA is not available")

    def model_len(self, max_positions: int) -> int:
        """The longest request (prompt + output tokens): `max_model_len`, within the model's positions."""
        return min(self.max_model_len or max_positions, max_positions)

    def kv_blocks(self, bytes_per_block: int) -> int:
        """The number of KV blocks: `num_kv_blocks`, or as many as fit in the memory budget."""
        return self.num_kv_blocks or max(1, int(self.kv_cache_memory_gb * 2**30 // bytes_per_block))

    def tier_sizes(self, block_bytes: int, stages: int = 1):
        """The prefix cache's host and disk tiers for blocks of `block_bytes` (all layers) over `stages`."""
        from kvflow.kv.tiers import TierSizes

        if not self.enable_prefix_caching:
            return TierSizes()
        return TierSizes.from_budgets(self.host_kv_bytes, self.disk_kv_bytes, block_bytes, stages)

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class PipelineSpec:
    """One pipeline of the cluster: its name, role, depth and microbatch size."""

    name: str
    role: str
    depth: int
    microbatch_size: int

    def stage_name(self, i: int) -> str:
        """The worker name of stage `i` ("colocated-0", "prompt-1", "token-0", ...)."""
        return f"{self.name}-{i}"


def pipeline_specs(mode: str, depth: int, prompt_depth: int, token_depth: int, microbatch_size: int,
                   prompt_microbatch_size: int) -> list[PipelineSpec]:
    """The pipelines of a cluster: one colocated pipeline, or a prompt and a token pipeline."""
    if mode == "colocated":
        return [PipelineSpec("colocated", "both", depth, microbatch_size)]
    return [PipelineSpec("prompt", "prompt", prompt_depth, prompt_microbatch_size),
            PipelineSpec("token", "token", token_depth, microbatch_size)]


@dataclass(frozen=True)
class ClusterConfig:
    """How to lay the model out over worker processes.

    colocated: one pipeline of `depth` stages doing prompts and tokens, up to `depth` batches in
    flight of up to `microbatch_size` requests each. disaggregated: a prompt pipeline (`prompt_depth`
    stages, batches of `prompt_microbatch_size`) streaming each layer's KV into a token pipeline
    (`token_depth` stages, batches of `microbatch_size`). `microbatch_size` None (the default): the
    running requests (`engine.scheduler.max_num_seqs`) spread over the decoding pipeline's batches in
    flight, ceil(max_num_seqs / its depth) each, so that every running request is in a batch
    (`token_microbatch`). `policy` is the scheduling policy of every pipeline: "continuous" (chunked
    prefill, preemption) or "microbatch" (DéjàVu's baseline).
    `kv_send_mode`: how prompt workers send KV ("overlap": packed per layer, sent by a background
    thread; "buffered"/"naive": sent on the compute thread — DéjàVu's Fig. 7 comparison).
    `host` is the interface the internal (ZeroMQ) sockets bind, independent of the HTTP server's.
    `recovery`: what a worker's death (exit, or no heartbeat for `heartbeat_timeout_s`) does —
    "recompute": fence it, start a replacement through the launcher, and bring back every request
    that lost KV (clients see only a delay): with `replication="ring"` each stage of a colocated or
    token pipeline of depth >= 2 streams the KV it appends at every step to the next stage (x+1 mod
    depth) in the background (depth 1, or `replication="store"`: to a host store in the controller
    process); the replacement gets its KV back from that replica and requests resume from their
    replicated tokens, recomputing only the rest. Without a replica (prompt pipelines,
    `replication="none"`) requests are recomputed from their prompt and the tokens they already
    produced;
    after `max_restarts` failed replacements in a row the controller gives up. "none": fail-stop,
    every request fails with the worker's name and the backend stays unhealthy.
    `swapping` (colocated and token pipelines; DéjàVu §4.2.2): `engine.num_kv_blocks` is each stage's
    device budget, split into min(2, depth) regions; only the batch computing on a stage and the next
    one keep their KV on its device, the others' lives in host memory, so the pipeline's pool holds
    depth / min(2, depth) times the blocks (`swap_layout`).
    `decode_ahead` (default on): a token or colocated pipeline (continuous policy, no swapping) of at
    most `decode_ahead_depth` stages (default 1) decodes one batch ahead of the controller: greedy
    decodes are sent again before their token comes back, the first stage feeding in the id the last
    one sampled (its own with one stage, else sent to it by the last), so the stages compute while
    the controller applies the previous step (`SchedulerConfig.decode_ahead`); elsewhere it does
    nothing. Deeper pipelines decode ahead only when asked: on the 2-CPU stand-in a depth-2 one ran
    slower ahead than serial (docs/results.md, 2026-11-28), and no GPU has measured it yet.
    The pools: `engine.num_kv_blocks` blocks per stage's device for every pipeline, or, with
    `engine.gpu_memory_utilization`, what the stages measure at start-up (the controller's
    `pool_blocks` per pipeline, passed to `swap_layout` and `scheduler_for`).
    """

    engine: EngineConfig = EngineConfig(num_kv_blocks=2048)
    mode: str = "colocated"
    depth: int = 1
    prompt_depth: int = 1
    token_depth: int = 1
    microbatch_size: int | None = None
    prompt_microbatch_size: int = 4
    policy: str = "continuous"
    kv_send_mode: str = "overlap"
    threads_per_worker: int = 1
    host: str = "127.0.0.1"
    heartbeat_timeout_s: float = 3.0
    start_timeout_s: float = 180.0
    recovery: str = "recompute"
    max_restarts: int = 3
    replication: str = "ring"
    swapping: bool = False
    decode_ahead: bool = True
    decode_ahead_depth: int = 1

    def replicates(self, p: "PipelineSpec") -> str | None:
        """Where `p`'s stages replicate the KV they append: "ring" (to the next stage; depth >= 2),
        "store" (to the controller's host store: `replication="store"`, or "ring" with depth 1,
        where there is no other stage), None (prompt pipelines, `replication="none"`, fail-stop)."""
        if self.replication == "none" or self.recovery == "none" or p.role == "prompt":
            return None
        return "ring" if self.replication == "ring" and p.depth >= 2 else "store"

    def swap_layout(self, p: "PipelineSpec", blocks: int | None = None) -> SwapLayout:
        """(device regions, blocks per region, blocks of the pipeline's pool) of pipeline `p` with
        `blocks` blocks on each stage's device (None: `engine.num_kv_blocks`): with swapping min(2,
        depth) regions sharing them and depth regions' worth of blocks in host memory, else (0, 0, blocks)."""
        n = self.engine.num_kv_blocks if blocks is None else blocks
        if not self.swapping or p.role == "prompt":  # (a prompt pipeline's KV leaves after one pass)
            return SwapLayout(0, 0, n)
        return SwapLayout.of_device(n, p.depth)

    def __post_init__(self) -> None:
        if self.swapping and self.mode == "disaggregated" and self.policy == "microbatch":
            raise ValueError("swapping a token pipeline needs the continuous policy (the microbatch policy does not "
                             "grow a token request's blocks)")
        if self.replication not in REPLICATION:
            raise ValueError(f"replication must be one of {REPLICATION}, got {self.replication!r}")
        if self.recovery not in RECOVERY:
            raise ValueError(f"recovery must be one of {RECOVERY}, got {self.recovery!r}")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 1:
            raise ValueError(f"max_restarts must be a positive integer, got {self.max_restarts!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for key in ("depth", "prompt_depth", "token_depth", "microbatch_size", "prompt_microbatch_size", "threads_per_worker",
                    "decode_ahead_depth"):
            v = getattr(self, key)
            if key == "microbatch_size" and v is None:
                continue
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{key} must be a positive integer, got {v!r}")
        if self.engine.num_kv_blocks is None and self.engine.gpu_memory_utilization is None:
            raise ValueError("pipeline modes need an explicit engine.num_kv_blocks (the controller accounts blocks), "
                             "or engine.gpu_memory_utilization (the stages measure them)")
        if self.heartbeat_timeout_s <= 0 or self.start_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.kv_send_mode not in KV_SEND_MODES:
            raise ValueError(f"kv_send_mode must be one of {KV_SEND_MODES}, got {self.kv_send_mode!r}")

    @property
    def token_microbatch(self) -> int:
        """The colocated or token pipeline's microbatch: `microbatch_size`, or by default the running
        requests over its batches in flight (a microbatch of 8 left 48 of 64 running requests waiting
        in a depth-2 pipeline; on a GPU a decode step's time hardly grows with its rows)."""
        if self.microbatch_size is not None:
            return self.microbatch_size
        return -(-self.engine.scheduler.max_num_seqs // (self.depth if self.mode == "colocated" else self.token_depth))

    def pipelines(self) -> list[PipelineSpec]:
        return pipeline_specs(self.mode, self.depth, self.prompt_depth, self.token_depth, self.token_microbatch,
                              self.prompt_microbatch_size)

    def stage_names(self) -> list[str]:
        """Every worker's name, pipeline by pipeline, stage by stage (what launchers and placements use)."""
        return [p.stage_name(i) for p in self.pipelines() for i in range(p.depth)]

    def scheduler_for(self, p: PipelineSpec, blocks: int | None = None) -> SchedulerConfig:
        """A pipeline's scheduler: `depth` batches in flight of at most `microbatch_size` requests
        (`blocks`: as `swap_layout`'s)."""
        return pipeline_scheduler(self.engine.scheduler, self.policy, p.depth, p.microbatch_size, self.swap_layout(p, blocks),
                                  self.decode_ahead and p.role != "prompt" and p.depth <= self.decode_ahead_depth)


@dataclass(frozen=True)
class WorkerSpec:
    """What one stage process is: sent by the controller in the handshake with the engine subtree."""

    name: str
    stage: int
    layer_start: int
    layer_end: int
    role: str = "both"
    threads: int = 1
    kv_send_mode: str = "overlap"
    heartbeat_s: float = 0.25
    replica_layer_start: int = -1  # layers of the previous stage whose KV replica this stage holds
    replica_layer_end: int = -1  # (-1: none)
    replica_shm: str = ""  # that replica's shared-memory segment (the controller's), to map ("": none)
    hidden_shm: str = ""  # the ring its input hidden states arrive in (the controller's), to map ("": none)
    replicated: bool = False  # this stage's KV is replicated: it can have it restored after a failure
    host_kv_slots: int = 0  # the prefix cache's lower tiers: slots (blocks) in host memory and on disk,
    disk_kv_slots: int = 0  # each holding this stage's layers of a block (its pipeline's pools decide)
    swap_regions: int = 0  # microbatch swapping: device regions of `swap_region_blocks` blocks each,
    swap_region_blocks: int = 0  # and the KV of the pool's `pool_blocks` blocks in host memory
    pool_blocks: int = 0  # blocks of the pipeline's pool (0: engine.num_kv_blocks, or not sized yet: measure)
    small_paths: list[str] = dataclasses.field(default_factory=list)  # a replacement: its predecessor's CPU linear paths ([]: measure)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"bad layer range [{self.layer_start}, {self.layer_end})")
        if self.threads <= 0 or self.heartbeat_s <= 0:
            raise ValueError("threads and heartbeat_s must be positive")


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def engine_from_dict(d: dict) -> EngineConfig:
    d = dict(d)
    d["scheduler"] = SchedulerConfig(**d["scheduler"])
    return EngineConfig(**d)


__all__ = ["ClusterConfig", "EngineConfig", "PipelineSpec", "SchedulerConfig", "WorkerSpec", "engine_from_dict",
           "to_dict"]
