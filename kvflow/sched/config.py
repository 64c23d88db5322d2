"""A scheduler's settings (`SchedulerConfig`) and the one derivation of a pipeline's from them
(`pipeline_scheduler`, with microbatch swapping's device regions, `SwapLayout`), used by the
cluster config, the controller and the simulator alike."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

POLICIES = ("continuous", "microbatch")
# The prompt tokens one step may carry, server and engine (`SchedulerConfig.prefill_chunk_size`), and the
# offline `LLM`'s budget: vLLM's CPU backend's defaults (2,048 for its server, 4,096 for its LLM class).
# A burst of prompts starts in ceil(total / budget) steps, so a small budget pays TTFT at saturation
# once per 256 tokens queued (64 prompts of 256: 64 steps at the old 256, 8 at 2,048); a step of a
# whole budget of prompt tokens delays the running decodes by its prefill time (docs/results.md,
# 2026-11-26 batched sampling and batch filling).
DEFAULT_PREFILL_CHUNK = 2048
OFFLINE_TOKEN_BUDGET = 4096
ROLES = ("both", "prompt", "token")


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


@dataclass(frozen=True)
class SchedulerConfig:
    """policy: "continuous" (iteration-level batching with chunked prefill, as vLLM) or "microbatch"
    (DéjàVu's baseline: fixed microbatches of up to `microbatch_size` requests, KV reserved for
    prompt + max_tokens at admission, a new microbatch only when one of the `max_in_flight` slots is
    free). max_num_batched_tokens: tokens one batch may process; prefill_chunk_size: most prompt
    tokens one request gets per batch; max_num_seqs: running requests at once (continuous);
    microbatch_size: requests per batch (required by "microbatch"; a per-batch cap for "continuous",
    where a pipeline's `max_in_flight` batches share the running requests).
    swap_regions > 0: microbatch swapping (DéjàVu §4.2.2): the pool's block ids are KV in host memory,
    and each stage's device holds `swap_regions` regions of `swap_region_blocks` blocks; a batch takes
    only requests whose blocks fit one region together, batch n computes in region n mod
    swap_regions, into which its KV is swapped in before the step (while the previous batch
    computes) and out of which the KV the step appended is written back
    (`ScheduledSeq.device_block_ids`, `SchedulerOutput.swap_region`).
    Stall-free batching (Sarathi-Serve): "continuous" fills a batch with the running requests' decode
    tokens first, then prompt chunks up to the token budget, so a prompt never stalls the decodes
    for longer than `max_num_batched_tokens` tokens of compute. The budget trades TTFT (a prompt
    needs ceil(len / budget) steps) against TPOT (every step carries up to a budget of prompt
    tokens). Its default is `prefill_chunk_size + max_num_seqs` (`DEFAULT_PREFILL_CHUNK` + 64): room
    for a whole prompt chunk beside every running request's decode token, so the decodes never split
    a prompt that fits one chunk into a long step and a short tail step (a 256-token prompt took two
    steps beside any decode at a budget of 256; docs/serving.md, "Token budget").
    `reserve_kv` (continuous, role "both"): a concurrency cap derived from the KV budget — a waiting
    request is admitted only while the blocks every running request may still need (prompt +
    max_tokens, capped at the context) plus its own fit in the pool, so a running request never
    has to be preempted and recomputed (on a CPU a recompute costs a whole prefill). Off: admit
    while the next chunk fits and preempt the newest request when blocks run out (vLLM's way).
    `decode_ahead` (continuous, no swapping): up to `max_in_flight` batches more may be in flight (one
    after each batch: its successor), and a plain greedy decode already in flight is scheduled again
    at the next position
    (`ScheduledSeq.ahead`): its input token is the one its in-flight batch samples, which the
    pipeline's first stage feeds in itself (`output.AHEAD`; the last stage sends it the ids it
    sampled), so the workers compute the next step while the executor applies the previous one
    (vLLM v1's async scheduling). A request that finishes
    in its in-flight batch has the extra token discarded and keeps its blocks until that returns."""

    policy: str = "continuous"
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: prefill_chunk_size + max_num_seqs
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK
    microbatch_size: int | None = None
    max_in_flight: int = 1
    swap_regions: int = 0
    swap_region_blocks: int = 0
    reserve_kv: bool = True
    decode_ahead: bool = False

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None and _positive_int(self.prefill_chunk_size) and _positive_int(self.max_num_seqs):
            object.__setattr__(self, "max_num_batched_tokens", self.prefill_chunk_size + self.max_num_seqs)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.swap_regions:
            if self.swap_regions < 0 or self.swap_region_blocks <= 0:
                raise ValueError(f"bad swap regions ({self.swap_regions} of {self.swap_region_blocks} blocks)")
        keys = ["max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size", "max_in_flight"]
        if self.policy == "microbatch" or self.microbatch_size is not None:
            keys.append("microbatch_size")
        for key in keys:
            v = getattr(self, key)
            if not _positive_int(v):
                raise ValueError(f"SchedulerConfig.{key} must be a positive integer, got {v!r}")
        if not isinstance(self.reserve_kv, bool):
            raise ValueError(f"SchedulerConfig.reserve_kv must be a bool, got {self.reserve_kv!r}")
        if self.decode_ahead and (self.policy != "continuous" or self.swap_regions):
            raise ValueError("SchedulerConfig.decode_ahead needs the continuous policy without swapping")


class SwapLayout(NamedTuple):
    """Where one pipeline's KV lives (DéjàVu §4.2.2): each stage's device holds `regions` regions of
    `region_blocks` blocks, and the pipeline's pool of `pool_blocks` blocks lives in host memory. No
    swapping: `regions` 0 and the pool is the device's."""

    regions: int
    region_blocks: int
    pool_blocks: int

    @classmethod
    def of_device(cls, device_blocks: int, depth: int) -> "SwapLayout":
        """Swapping with `device_blocks` blocks per stage's device: min(2, depth) regions share them
        (the batch computing and the next one), and the pool holds depth regions' worth."""
        regions = min(2, depth)
        per = device_blocks // regions
        return cls(regions, per, per * depth)

    @classmethod
    def of_pool(cls, pool_blocks: int, depth: int) -> "SwapLayout":
        """Swapping over a pool of `pool_blocks` blocks: one region per batch in flight's share of
        it, min(2, depth) of them on each device (`of_device`'s inverse)."""
        return cls(min(2, depth), pool_blocks // depth, pool_blocks)


def pipeline_scheduler(base: SchedulerConfig, policy: str, depth: int, microbatch_size: int,
                       swap: SwapLayout | None = None, decode_ahead: bool = False) -> SchedulerConfig:
    """The scheduler of a pipeline of `depth` stages: `base`'s budgets with `policy`, up to `depth`
    batches in flight (one per stage) of at most `microbatch_size` requests, and `swap`'s device
    regions (None: no swapping). `decode_ahead` is asked for; it applies only where it can (the
    continuous policy, no swapping: the first stage takes in the ids the last one sampled, from
    itself in a pipeline of one stage, else sent to it by the last)."""
    regions, per = (swap.regions, swap.region_blocks) if swap is not None else (0, 0)
    ahead = decode_ahead and policy == "continuous" and not regions
    return replace(base, policy=policy, microbatch_size=microbatch_size, max_in_flight=depth, swap_regions=regions,
                   swap_region_blocks=per, decode_ahead=ahead)
