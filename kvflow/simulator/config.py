"""What is simulated: the serving layout (colocated / data-parallel / disaggregated), swapping,
dispatch, and injected worker failures with their recovery mode."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.sched.config import POLICIES, SchedulerConfig, SwapLayout, pipeline_scheduler

BLOCK_SIZE = 16  # KV block size of simulated pools (the engine's default)


@dataclass(frozen=True)
class PipelineGroup:
    """`count` identical pipelines of `depth` machines each, running batches of up to `microbatch`
    requests with up to `depth` batches in flight (one per stage). (`kvflow.config.PipelineSpec` is
    one pipeline of a real cluster: its name, role, depth and microbatch size.)"""

    depth: int
    microbatch: int
    count: int = 1

    def __post_init__(self) -> None:
        if min(self.depth, self.microbatch, self.count) < 1:
            raise ValueError(f"pipeline depth, microbatch and count must be >= 1: {self}")

    @property
    def machines(self) -> int:
        return self.depth * self.count

    def label(self) -> str:
        return f"({self.count}d, {self.depth}p, {self.microbatch}b)" if self.count > 1 else \
            f"({self.depth}p, {self.microbatch}b)"



@dataclass(frozen=True)
class Layout:
    """Colocated (`token` is None: `prompt` pipelines do both phases; count > 1 is Baseline-DP)
    or disaggregated (`prompt` pipelines prefill and stream KV to `token` pipelines)."""

    prompt: PipelineGroup
    token: PipelineGroup | None = None

    @property
    def disaggregated(self) -> bool:
        return self.token is not None

    @property
    def machines(self) -> int:
        return self.prompt.machines + (self.token.machines if self.token else 0)

    @property
    def kind(self) -> str:
        if self.token is not None:
            return "disaggregated"
        return "baseline-dp" if self.prompt.count > 1 else "baseline"

    def label(self) -> str:
        if self.token is None:
            return self.prompt.label()
        return f"({self.prompt.label()}, {self.token.label()})"


@dataclass(frozen=True)
class Failure:
    """Worker `stage` of pipeline `pipeline` in group `role` ('prompt' or 'token'; a colocated
    layout has only 'prompt') dies at `time` seconds."""

    time: float
    role: str = "prompt"
    pipeline: int = 0
    stage: int = 0

    def __post_init__(self) -> None:
        if self.time < 0 or self.pipeline < 0 or self.stage < 0:
            raise ValueError(f"invalid failure {self}")
        if self.role not in ("prompt", "token"):
            raise ValueError("failure role must be 'prompt' or 'token'")


@dataclass(frozen=True)
class Recovery:
    """How a pipeline comes back after a failure, and what each step of it costs.

    'restart': every request in flight on the pipeline loses its progress and is recomputed
    (prompt + tokens produced so far; the server's `--replication none`). 'resume': the replacement
    worker restores the lost stage's KV from its replica (DéjàVu §4.2.3) and in-flight microbatches
    continue from their last replicated token. Prompts in flight are redone in both modes (their KV
    was not yet replicated).

    The pipeline is down for detect_s + restart_s (+ restore_s when resuming): replacing the one
    failed worker. Restart mode may instead restart the whole pipeline (`pipeline_restart_s`, e.g.
    FasterTransformer, DéjàVu's baseline, where every worker restarts and reloads its weights);
    None keeps the replacement of one worker (the kvflow server's `--replication none`). After
    that, restart mode pays again for every recomputed token through the scheduler (one prefill of
    prompt + tokens produced; with `from_scratch` the requests start over and every token is
    generated again, as FasterTransformer restarts them), resume mode only for the passes that
    were in flight. `restore_s` None models the restore as moving the lost stage's KV
    over the link (`PerfModel.kv_transfer_time`). `measured` takes the costs a real run recorded
    (`benchmarks/fault_tolerance.py`, the controller's `recovery.log`), so the two modes differ by
    what they measurably cost rather than sharing one constant.

    `fence`: which pipelines a failure stops. 'pipeline': only the failed one (independent
    deployments side by side). 'all': every pipeline of the deployment, as one kvflow controller
    does (one epoch voids every batch in flight; its loop is busy with the replacement until it is
    back); `SimConfig.from_cluster` sets it.
    """

    mode: str = "resume"
    detect_s: float = 1.0  # heartbeat timeout (process exit: the controller's next liveness check)
    restart_s: float = 10.0  # start a replacement worker: spawn, load its weights, handshake
    restore_s: float | None = None  # resume only: replica -> replacement (None: modelled from the KV size)
    pipeline_restart_s: float | None = None  # restart only: restart every worker (None: replace one, restart_s)
    from_scratch: bool = False  # restart only: in-flight requests lose their tokens too (FasterTransformer)
    fence: str = "pipeline"

    def __post_init__(self) -> None:
        if self.mode not in ("restart", "resume"):
            raise ValueError("recovery mode must be 'restart' or 'resume'")
        if self.fence not in ("pipeline", "all"):
            raise ValueError("recovery fence must be 'pipeline' or 'all'")
        if self.detect_s < 0 or self.restart_s < 0 or any(x is not None and x < 0 for x in (
                self.restore_s, self.pipeline_restart_s)):
            raise ValueError("recovery times must be non-negative")

    @property
    def down_s(self) -> float:
        """Seconds from detection to a working pipeline, before any restore."""
        if self.mode == "restart" and self.pipeline_restart_s is not None:
            return self.pipeline_restart_s
        return self.restart_s

    @classmethod
    def measured(cls, mode: str, costs: dict) -> "Recovery":
        """From measured medians {'detect_s', 'replace_s', 'restore_s'} (seconds)."""
        return cls(mode, float(costs["detect_s"]), float(costs["replace_s"]),
                   float(costs["restore_s"]) if mode == "resume" else None)


@dataclass(frozen=True)
class SimConfig:
    """Everything the simulator needs besides the performance model and the workload.

    Each pipeline runs the real scheduling core, `kvflow.sched.Scheduler`, with
    `scheduler` (token budget, chunk size, running cap) and `policy`: "microbatch" (DéjàVu's
    microbatch-level pipelines, the default of the planner and the Appendix B sweeps) or
    "continuous" (the server's default). `microbatch_size` and `max_in_flight` come from the
    layout's pipeline groups, exactly as `ClusterConfig.scheduler_for` derives them.
    `kv_blocks`: blocks of `block_size` tokens each stage's device holds (as the engine's
    `num_kv_blocks`): a pipeline's pool, or with swapping its device regions (`SwapLayout.of_device`);
    None sizes the pool from the performance model's memory (`PerfModel.kv_capacity_tokens`).
    `max_model_len`: the context limit the scheduler enforces (None: unlimited).
    `dispatch`: 'shared' (any pipeline with a free slot takes the next request) or
    'round_robin' (requests are bound to pipelines i mod count at arrival).
    `swapping`: KV of microbatches not computing lives in host memory (DéjàVu §4.2.2); a token
    step then lasts max(compute, swap-in of the next microbatch) and the pool holds depth/2 times more.
    `prefix_caching`: the block pools keep full blocks for reuse (`kvflow.kv`, on by default as in
    the server). Simulated requests carry no text: each gets token ids of its own, so a request only
    ever hits its own blocks (recomputed after a preemption), never another's.
    `rigid_rounds`: original FasterTransformer — a pipeline admits new microbatches only once all
    in flight have finished (the setting of DéjàVu eq. 4).
    `shared_host`: every stage of every pipeline runs on one host (a local cluster of worker
    processes): a stage's step that starts while another stage computes is slowed by the
    performance model's `co_run_factor` for as long as they overlap.
    `decode_ahead`: token and colocated pipelines (of at most `decode_ahead_depth` stages) run greedy decodes one batch ahead
    (`ClusterConfig.decode_ahead`: the same scheduling; no step time is modelled for the controller,
    so it changes which batches run, and a decode-ahead pass starts on stage 0 no earlier than the
    passes it takes its input from have left the last stage, plus a hop).
    """

    layout: Layout
    dispatch: str = "shared"
    swapping: bool = False
    rigid_rounds: bool = False
    failures: tuple[Failure, ...] = field(default_factory=tuple)
    recovery: Recovery = field(default_factory=Recovery)
    policy: str = "microbatch"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_blocks: int | None = None
    block_size: int = BLOCK_SIZE
    max_model_len: int | None = None
    prefix_caching: bool = True
    shared_host: bool = False
    decode_ahead: bool = False
    decode_ahead_depth: int = 1

    def __post_init__(self) -> None:
        if self.dispatch not in ("shared", "round_robin"):
            raise ValueError("dispatch must be 'shared' or 'round_robin'")
        if self.dispatch == "round_robin" and self.layout.disaggregated:
            raise ValueError("round_robin dispatch applies to colocated layouts only")
        if self.rigid_rounds and (self.layout.disaggregated or self.policy != "microbatch"):
            raise ValueError("rigid_rounds applies to colocated layouts with the microbatch policy only")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.kv_blocks is not None and self.kv_blocks < 1 or self.block_size < 1:
            raise ValueError("kv_blocks and block_size must be positive")
        for f in self.failures:
            group = self.layout.token if f.role == "token" else self.layout.prompt
            if group is None or f.pipeline >= group.count or f.stage >= group.depth:
                raise ValueError(f"failure {f} names a worker the layout does not have")

    def swap_layout(self, spec: PipelineGroup, role: str, pool_blocks: int) -> SwapLayout:
        """Where a pipeline's pool of `pool_blocks` blocks lives: with `swapping`, colocated and token
        pipelines compute in min(2, depth) device regions of depth regions' worth of host memory
        (`ClusterConfig.swap_layout`'s layout); prompt pipelines never swap."""
        if not self.swapping or role == "prompt":
            return SwapLayout(0, 0, pool_blocks)
        return SwapLayout.of_pool(pool_blocks, spec.depth)

    def scheduler_for(self, spec: PipelineGroup, role: str | None = None, pool_blocks: int = 0) -> SchedulerConfig:
        """A pipeline's scheduler config, derived as `ClusterConfig.scheduler_for` derives it. With
        `role` and its pool's `pool_blocks`, a swapping pipeline's batches fit its device regions as
        the controller's do (`swap_layout`); without them it has none."""
        swap = self.swap_layout(spec, role, pool_blocks) if role is not None else None
        return pipeline_scheduler(self.scheduler, self.policy, spec.depth, spec.microbatch, swap,
                                  self.decode_ahead and role != "prompt" and spec.depth <= self.decode_ahead_depth)

    @classmethod
    def from_cluster(cls, cluster, max_model_len: int | None = None, **kw) -> "SimConfig":
        """The simulated twin of a `kvflow.config.ClusterConfig`: same layout, policy, scheduler
        settings, block pool per pipeline and recovery policy."""
        if cluster.mode == "colocated":
            layout = Layout(PipelineGroup(cluster.depth, cluster.token_microbatch))
        else:
            layout = Layout(PipelineGroup(cluster.prompt_depth, cluster.prompt_microbatch_size),
                            PipelineGroup(cluster.token_depth, cluster.token_microbatch))
        eng = cluster.engine
        kw.setdefault("swapping", cluster.swapping)
        kw.setdefault("decode_ahead", cluster.decode_ahead)
        kw.setdefault("decode_ahead_depth", cluster.decode_ahead_depth)
        # one controller: a failure voids every pipeline's batches; without replication it recomputes
        kw.setdefault("recovery", Recovery("restart" if cluster.replication == "none" else "resume", fence="all"))
        return cls(layout, policy=cluster.policy, scheduler=eng.scheduler, kv_blocks=eng.num_kv_blocks,
                   block_size=eng.block_size, max_model_len=max_model_len, prefix_caching=eng.enable_prefix_caching, **kw)
